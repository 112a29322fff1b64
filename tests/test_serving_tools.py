"""Function calling and the Anthropic request format on their own: no model, no HTTP server.

Tools checks, the tool-call splitter on whole and streamed text (the Hermes JSON form, mlx-lm's
Qwen3-Coder XML form, broken calls), the prompt renderings (a planted tool-aware chat template on
the real tokenizer, and the system-prompt rendering), Anthropic bodies, the latency histograms and
the memory rule of ``--max-concurrency``.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from types import SimpleNamespace

import pytest

from dflash.errors import APIError
from dflash.serving.reasoning import ThinkSplitter
from dflash.serving.requests import ServedModel, parse_request
from dflash.serving.tools import (
    HERMES_END,
    HERMES_START,
    AnswerSplitter,
    ToolCallSplitter,
    ToolFormat,
    call_grammar,
    parse_tools,
    render_messages,
    tool_format,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
HERMES = ToolFormat(HERMES_START, HERMES_END, lambda text, tools=None: json.loads(text),
                    native=False, json_form=True)

def admits(tokenizer, fmt: ToolFormat, spec, text: str) -> bool:
    """Whether the call grammar of ``spec`` in ``fmt`` accepts ``text`` as a whole answer."""
    import llguidance

    bound = call_grammar(spec, fmt).bind(tokenizer, len(tokenizer.vocab))
    m = llguidance.LLMatcher(bound.tokenizer, bound.grammar.spec)
    return m.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()



def rejected(tools, choice=None) -> APIError:
    with pytest.raises(APIError) as e:
        parse_tools(tools, choice)
    assert e.value.status == 400
    return e.value


def test_malformed_tools_are_400s_naming_the_field():
    fn = WEATHER["function"]
    cases = [
        ("not a list", "tools"),
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {**fn, "parameters": "x"}}],
         "tools[0].function.parameters"),
        ([{"type": "function", "function": {**fn, "parameters": {"type": "string"}}}],
         "tools[0].function.parameters.type"),
        ([{"type": "function", "function": {**fn, "parameters": {"properties": [1]}}}],
         "tools[0].function.parameters.properties"),
        ([{"type": "function", "function": {**fn, "parameters": {"required": "city"}}}],
         "tools[0].function.parameters.required"),
        ([{"type": "function", "function": {**fn, "description": 3}}],
         "tools[0].function.description"),
        ([WEATHER, WEATHER], "tools[1].function.name"),
    ]
    for tools, param in cases:
        assert rejected(tools).param == param, tools
    assert rejected([WEATHER], "sometimes").param == "tool_choice"
    assert rejected([WEATHER], {"type": "function", "function": {"name": "other"}}).param == \
        "tool_choice.function.name"
    assert rejected(None, "required").param == "tool_choice"


def test_tool_choice_selects_what_the_prompt_shows_and_how_the_answer_starts():
    other = {"type": "function", "function": {"name": "get_time"}}
    assert parse_tools(None, None) is None and parse_tools([], "auto") is None
    auto = parse_tools([WEATHER, other], None)
    assert auto.choice == "auto" and len(auto.rendered) == 2
    assert auto.tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert parse_tools([WEATHER], "none").rendered == []
    named = parse_tools([WEATHER, other], {"type": "function", "function": {"name": "get_time"}})
    assert [t["function"]["name"] for t in named.rendered] == ["get_time"]
    assert HERMES.prefix(auto) == ""
    assert HERMES.prefix(parse_tools([WEATHER], "required")) == "<tool_call>\n"
    assert HERMES.prefix(named) == '<tool_call>\n{"name": "get_time", "arguments": {'
    xml = ToolFormat("<tool_call>", "</tool_call>", None, native=True, json_form=False)
    assert xml.prefix(named) == "<tool_call>\n"  # not the JSON form: the tag only


def _feed(splitter, text: str, step: int | None):
    """Whole, or in pieces of ``step`` characters, as a stream arrives."""
    pieces = [text] if step is None else [text[i:i + step] for i in range(0, len(text), step)]
    out = [splitter.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return "".join(o[0] for o in out), [c for o in out for c in o[1]]


@pytest.mark.parametrize("step", [None, 1, 3, 7])
def test_splitter_parses_hermes_calls_streamed_or_whole(step):
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo"}}\n</tool_call>')
    content, calls = _feed(ToolCallSplitter(HERMES), text, step)
    assert content == "Let me look."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("step", [None, 1, 5])
def test_broken_calls_come_back_as_text(step):
    for text in ['<tool_call>\n{"name": "get_weather", "arguments": {"city": Par}}\n</tool_call>',
                 '<tool_call>\n{"arguments": {}}\n</tool_call> and more',
                 '<tool_call>\n{"name": "get_weather", "arguments": "not json"}\n</tool_call>',
                 'Sure <tool_call>\n{"name": "get_weather", "argu',  # cut off
                 "a < b <tool_ca"]:  # a partial tag at the end is text too
        splitter = ToolCallSplitter(HERMES)
        content, calls = _feed(splitter, text, step)
        assert (content, calls) == (text, []), text
        assert splitter.calls_made == 0
    # An unclosed call whose JSON is complete counts (models that stop right after it).
    content, calls = _feed(ToolCallSplitter(HERMES),
                           '<tool_call>\n{"name": "f", "arguments": {}}', step)
    assert content == "" and [c["name"] for c in calls] == ["f"]


def test_splitter_reads_mlx_lm_parsers_such_as_qwen3_coder():
    qwen3_coder = pytest.importorskip("mlx_lm.tool_parsers.qwen3_coder")
    fmt = ToolFormat(qwen3_coder.tool_call_start, qwen3_coder.tool_call_end,
                     qwen3_coder.parse_tool_call, native=True, json_form=False)
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "</function>\n</tool_call>")
    content, calls = _feed(ToolCallSplitter(fmt, [WEATHER]), text, 4)
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]


def test_splitter_reads_calls_without_a_closing_tag_such_as_mistrals():
    mistral = pytest.importorskip("mlx_lm.tool_parsers.mistral")
    fmt = ToolFormat(mistral.tool_call_start, mistral.tool_call_end, mistral.parse_tool_call,
                     native=True, json_form=False)
    text = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    content, calls = _feed(ToolCallSplitter(fmt, [WEATHER]), text, 3)
    assert content == "Sure."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]


def test_answer_splitter_reasoning_then_calls_and_the_finish_reason():
    text = ('<think>I should call it.</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Rome"}}\n</tool_call>')
    answer = AnswerSplitter(ThinkSplitter(), ToolCallSplitter(HERMES))
    reasoning, content, calls = answer.feed(text, final=True)
    assert (reasoning, content) == ("I should call it.", "")
    assert json.loads(calls[0]["arguments"]) == {"city": "Rome"}
    assert answer.finish_reason("stop") == "tool_calls"
    assert answer.finish_reason("length") == "length"
    # A forced call: the prompt holds the start of the answer, the splitter reads it first.
    forced = AnswerSplitter(None, ToolCallSplitter(HERMES),
                            prefix='<tool_call>\n{"name": "get_weather", "arguments": {')
    assert forced.feed('"city": "Rome"}}\n', final=False) == ("", "", [])
    _, content, calls = forced.feed("</tool_call>", final=True)
    assert content == "" and calls[0]["name"] == "get_weather"
    plain = AnswerSplitter(None, None)
    assert plain.feed("<tool_call>x</tool_call>", final=True) == (
        "", "<tool_call>x</tool_call>", [])
    assert plain.finish_reason("stop") == "stop"


def test_full_response_and_stream_carry_tool_calls():
    from dflash.serving.openai_format import StreamFormat, full_response

    last = SimpleNamespace(generation_tokens=20, finish_reason="stop", reused_prompt_tokens=3,
                           mean_tau=2.5, cycles=8, rows_per_pass=4.0)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    body = full_response("chat", "m", 10, text, last, {}, AnswerSplitter(
        None, ToolCallSplitter(HERMES)))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    assert body["usage"]["dflash"]["tau"] == 2.5 and body["usage"]["total_tokens"] == 30
    fmt = StreamFormat("chat", "m", AnswerSplitter(None, ToolCallSplitter(HERMES)))
    chunks = [json.loads(line[len("data: "):]) for line in
              fmt.add(SimpleNamespace(text=text, finish_reason="stop"))
              + fmt.closing(10, last, {})[:-1]]
    deltas = [c["choices"][0]["delta"].get("tool_calls") for c in chunks[:-1]]
    assert deltas[0][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[0][0]["index"] == 0 and deltas[0][0]["id"].startswith("call_")
    assert json.loads(deltas[1][0]["function"]["arguments"]) == {"city": "Rome"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_system_prompt_rendering_for_templates_without_tools():
    spec = parse_tools([WEATHER], None)
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    messages, kwargs = render_messages(history, spec, HERMES)
    assert kwargs == {}
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert json.dumps(WEATHER) in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", '
                           '"arguments": {"city": "Rome"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    none, _ = render_messages(history[1:2], parse_tools([WEATHER], "none"), HERMES)
    assert none == history[1:2]  # tool_choice "none": the prompt shows no tools


# A Qwen2.5-like template (Hermes JSON calls) planted on the real test tokenizer.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}"
    "{{ messages[0].content }}\n\n{% endif %}# Tools\n<tools>{% for tool in tools %}\n"
    "{{ tool | tojson }}{% endfor %}\n</tools>\nCall with <tool_call>{\"name\": ..., "
    "\"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}"
    "<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": "
    "{{ tool_call.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif not (message.role == 'system' and tools) %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory):
    import tiny_models
    from mlx_lm.tokenizer_utils import load

    folder = tmp_path_factory.mktemp("tool-tokenizer")
    for name in tiny_models.TOKENIZER_FILES:
        shutil.copy(tiny_models.tokenizer_source() / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return load(folder)


def test_tool_aware_templates_render_tools_and_history_natively(tool_tokenizer):
    fmt = tool_format(tool_tokenizer)
    assert fmt.native and fmt.json_form and (fmt.start, fmt.end) == (HERMES_START, HERMES_END)
    served = ServedModel(name="m", path="/m", vocab_size=len(tool_tokenizer.get_vocab()),
                         max_context=4096, tool_format=fmt)
    body = {"model": "m", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}
    req = parse_request("chat", body, tool_tokenizer, served)
    prompt = tool_tokenizer.decode(req.prompt_ids)
    assert '"name": "get_weather"' in prompt.split("</tools>")[0]  # the template's tool list
    # The history's arguments (a JSON string in OpenAI's API) reach the template as an object.
    assert '{"name": "get_weather", "arguments": {"city": "Rome"}}' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    assert req.parses_tools and req.answer_prefix == ""
    named = parse_request("chat", {**body, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, tool_tokenizer, served)
    assert tool_tokenizer.decode(named.prompt_ids).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {')
    assert named.answer_prefix.startswith("<tool_call>")
    for bad, param in [({"tools": "x"}, "tools"),
                       ({"messages": [{"role": "assistant", "tool_calls": [
                           {"function": {"name": "f", "arguments": "[1"}}]}]},
                        "messages[0].tool_calls[0].function.arguments")]:
        with pytest.raises(APIError) as e:
            parse_request("chat", {**body, **bad}, tool_tokenizer, served)
        assert (e.value.status, e.value.param) == (400, param)


def test_anthropic_bodies_translate_to_chat_requests(tool_tokenizer):
    from dflash.serving.anthropic_format import error_body, parse_messages_request

    served = ServedModel(name="m", path="/m", vocab_size=len(tool_tokenizer.get_vocab()),
                         max_context=4096, tool_format=tool_format(tool_tokenizer))
    body = {"model": "m", "max_tokens": 16, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["END"], "temperature": 0.5, "top_k": 5, "metadata": {"user_id": "u"},
            "tools": [{"name": "get_weather", "description": "Weather.",
                       "input_schema": WEATHER["function"]["parameters"]}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather in Rome?"}]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Rome"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1",
                     "content": [{"type": "text", "text": "sunny"}]}]}]}
    req = parse_messages_request(body, tool_tokenizer, served)
    prompt = tool_tokenizer.decode(req.prompt_ids)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '{"name": "get_weather", "arguments": {"city": "Rome"}}' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    s = req.settings
    assert (s.max_tokens, s.stop, s.temperature, s.top_k) == (
        16, ["END"], 0.5, 5)
    ignored = {"speed": "fast", "cache_control": {"type": "ephemeral"}, "service_tier": "auto"}
    assert parse_messages_request({**body, **ignored}, tool_tokenizer,
                                  served).prompt_ids == req.prompt_ids
    forced = parse_messages_request({**body, "tool_choice": {"type": "tool", "name":
                                                             "get_weather"}},
                                    tool_tokenizer, served)
    assert forced.tools.choice == "get_weather"
    assert parse_messages_request({**body, "tool_choice": {"type": "any"}}, tool_tokenizer,
                                  served).tools.choice == "required"
    # A field this server does not implement is ignored (logged once), not a 400.
    assert parse_messages_request({**body, "frobnicate": 1}, tool_tokenizer, served).prompt_ids
    for bad, words in [({"max_tokens": None}, "max_tokens"),
                       ({"temperature": 1.5}, "temperature"),
                       ({"stop_sequences": [""]}, "stop_sequences"),
                       ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
                       ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]},
                        "tools.0.input_schema.type"),
                       ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
                        "tools.0.type"),
                       ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
                       ({"messages": [{"role": "user", "content": [{"type": "image"}]}]},
                        "messages.0.content.0"),
                       ({"messages": [{"role": "user", "content": "Hi"},
                                      {"role": "assistant", "content": "The"}]}, "prefill"),
                       ({"output_config": {"format": {"type": "json_schema"}}},
                        "output_config.format"),
                       ({"thinking": {"type": "sometimes"}}, "thinking.type")]:
        with pytest.raises(APIError) as e:
            parse_messages_request({k: v for k, v in {**body, **bad}.items() if v is not None},
                                   tool_tokenizer, served)
        assert e.value.status == 400 and words in e.value.message, (bad, e.value.message)
        assert error_body(e.value) == {"type": "error", "error": {
            "type": "invalid_request_error", "message": e.value.message}}
    with pytest.raises(APIError) as e:
        parse_messages_request({**body, "model": "claude-x"}, tool_tokenizer, served)
    assert error_body(e.value)["error"]["type"] == "not_found_error"


def test_latency_histograms_and_gauges():
    from dflash.serving.metrics import Metrics

    m = Metrics()
    m.watch({"model": "a", "draft": "d"}, queue_depth=lambda: 0, busy=lambda: True,
            batch_size=lambda: 1, max_concurrency=4)
    r = SimpleNamespace(prompt_tokens=5, generation_tokens=9, cycles=3, mean_tau=3.0,
                        generation_tps=30.0, prompt_tps=50.0, draft_time=0.1, verify_time=0.2,
                        acceptance_by_position=[1.0], plain_steps=1, rows_per_pass=6.0,
                        reused_prompt_tokens=4)
    m.generation(r, ttft=0.3, tpot=0.02)
    m.generation(r, ttft=20.0)
    text = m.render().decode()
    for line in ['dflash_time_to_first_token_seconds_bucket{le="0.25"} 0.0',
                 'dflash_time_to_first_token_seconds_bucket{le="0.5"} 1.0',
                 'dflash_time_to_first_token_seconds_bucket{le="+Inf"} 2.0',
                 "dflash_time_to_first_token_seconds_count 2.0",
                 "dflash_time_to_first_token_seconds_sum 20.3",
                 'dflash_time_per_output_token_seconds_bucket{le="0.025"} 1.0',
                 "dflash_time_per_output_token_seconds_count 1.0",
                 "dflash_batch_size 1.0", "dflash_max_concurrency 4.0",
                 "dflash_rows_per_pass 6.0", "dflash_reused_prompt_tokens_total 8.0"]:
        assert re.search("^" + re.escape(line) + "$", text, re.M), line
    assert "_created" not in text


def test_default_max_concurrency_follows_the_memory_rule(loaded_pair, monkeypatch):
    from mlx.utils import tree_flatten

    from dflash.serving import worker

    model, _, draft = loaded_pair("llama")
    pair = SimpleNamespace(model=model, draft=draft)
    per_token = worker.kv_bytes_per_token(model)
    assert per_token == 4 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head dim x float32
    weights = sum(v.nbytes for m in (model, draft) for _, v in tree_flatten(m.parameters()))
    for free_sequences, expected in [(3, 3), (0.5, 1), (100, 16)]:
        memory = weights + int(free_sequences * per_token * 1000 / worker.KV_MEMORY_SHARE)
        monkeypatch.setattr(worker, "_memory_bytes", lambda memory=memory: memory)
        assert worker.default_max_concurrency(pair, 1000) == expected


def test_anthropic_answers_end_with_tool_use_and_stream_their_blocks():
    from dflash.serving.anthropic_format import MessageStream, message_response

    last = SimpleNamespace(generation_tokens=30, finish_reason="stop", reused_prompt_tokens=4,
                           mean_tau=3.0, cycles=10, rows_per_pass=4.0, text="", tokens=[])
    text = ('<think>Weather needed.</think>Checking.\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Rome"}}\n</tool_call>')

    def splitter():
        return AnswerSplitter(ThinkSplitter(), ToolCallSplitter(HERMES))

    body = message_response("m", 12, text, last, {}, splitter(), stop_sequence=None)
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use"]
    assert body["content"][1]["text"] == "Checking."
    use = body["content"][2]
    assert (use["name"], use["input"]) == ("get_weather", {"city": "Rome"})
    assert use["id"].startswith("toolu_") and body["stop_reason"] == "tool_use"
    assert body["usage"]["input_tokens"] == 8 and body["usage"]["cache_read_input_tokens"] == 4
    stream = MessageStream("m", splitter(), tokenizer=None, stops=None)
    lines = [stream.opening(12, last)]
    for i in range(0, len(text), 9):  # streamed in pieces
        piece = SimpleNamespace(text=text[i:i + 9], tokens=[],
                                finish_reason="stop" if i + 9 >= len(text) else None)
        lines += stream.add(piece)
    lines += stream.closing(12, last, {})
    events = [(line.split("\n")[0][len("event: "):], json.loads(line.split("\n")[1][6:]))
              for line in lines]
    assert all(kind == data["type"] for kind, data in events)
    starts = [d["content_block"]["type"] for k, d in events if k == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    kinds = [k for k, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3
    partial = [d["delta"]["partial_json"] for k, d in events
               if k == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert [json.loads(p) for p in partial] == [{"city": "Rome"}]
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_strict_tools_grammar_admits_text_and_valid_calls_only(tool_tokenizer):
    """The call grammar of ``strict`` tools over a real tokenizer: free text and valid calls
    match, a call of an unknown tool or with arguments off the schema does not; non-JSON call
    forms and tools without ``strict`` get no grammar."""

    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    good = json.dumps({"name": "get_weather", "arguments": {"city": "Rome"}})

    matches = functools.partial(admits, tool_tokenizer, HERMES)

    auto = parse_tools([strict], "auto")
    assert matches(auto, "No call needed.")
    assert matches(auto, f"Checking.\n{HERMES_START}\n{good}\n{HERMES_END}")
    assert not matches(auto, f"{HERMES_START}\n" + json.dumps({"name": "other", "arguments": {}}))
    assert not matches(auto, f"{HERMES_START}\n" + json.dumps(
        {"name": "get_weather", "arguments": {"city": 5}}))
    required = parse_tools([strict], "required")  # the prompt ends with the opening tag
    assert matches(required, f"{good}\n{HERMES_END}")
    assert not matches(required, "Sure.")
    assert HERMES.prefix(parse_tools([strict], {"type": "function", "function": {
        "name": "get_weather"}})) == HERMES_START + "\n"  # the grammar forces the name
    assert call_grammar(parse_tools([WEATHER], "auto"), HERMES) is None
    assert call_grammar(parse_tools([strict], "none"), HERMES) is None
    other = ToolFormat("<function=", "</function>", None, native=True, json_form=False)
    with pytest.raises(APIError) as e:
        call_grammar(auto, other)
    assert e.value.param == "tools[0].function.strict" and "get_weather" in e.value.message
    assert rejected([{**strict, "function": {**strict["function"], "strict": "yes"}}]).param == \
        "tools[0].function.strict"


def test_strict_tools_in_the_xml_form_of_qwen3_5(tool_tokenizer):
    """Qwen3-Coder's and Qwen3.5's call form (``<function=NAME>`` and ``<parameter=P>`` blocks,
    mlx-lm's qwen3_coder parser): with ``strict``, only calls of offered tools match, with the
    required parameters, values the parser reads back as the schema's types, and every call
    the grammar admits parses into arguments that validate; a parameter whose text the parser
    would read back differently is a 400 naming it."""
    import jsonschema

    qwen3_coder = pytest.importorskip("mlx_lm.tool_parsers.qwen3_coder")
    xml = ToolFormat(qwen3_coder.tool_call_start, qwen3_coder.tool_call_end,
                     qwen3_coder.parse_tool_call, native=True, json_form=False, xml_form=True)
    schema = {"type": "object", "properties": {
        "path": {"type": "string", "description": "a file"},
        "mode": {"type": "string", "enum": ["read", "write"]},
        "lines": {"type": "integer", "minimum": 1},
        "options": {"type": "object", "properties": {"force": {"type": "boolean"}},
                    "required": ["force"], "additionalProperties": False}},
        "required": ["path", "lines"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "open_file", "parameters": schema,
                                             "strict": True}}

    def block(name, value):
        return f"<parameter={name}>\n{value}\n</parameter>\n"

    def call(*blocks, name="open_file"):
        return f"<function={name}>\n" + "".join(blocks) + "</function>"

    matches = functools.partial(admits, tool_tokenizer, xml)

    auto = parse_tools([tool, WEATHER], "auto")
    good = [call(block("path", "a b.py"), block("lines", 3)),
            call(block("path", "multi\nline </parameter text"), block("mode", "write"),
                 block("lines", 12), block("options", '{"force": true}')),
            call(block("city", "Rome"), name="get_weather")]  # not strict: any parameters
    for c in good:
        text = f"Let me.\n<tool_call>\n{c}\n</tool_call>"
        assert matches(auto, text), text
        parsed = qwen3_coder.parse_tool_call(f"\n{c}\n", auto.rendered)
        if parsed["name"] == "open_file":
            jsonschema.validate(parsed["arguments"], schema)
            assert parsed["arguments"]["path"] in ("a b.py", "multi\nline </parameter text")
    assert matches(auto, "No call needed.")
    bad = [call(block("lines", 3)),  # a required parameter missing
           call(block("path", "x"), block("lines", "three")),
           call(block("path", "x"), block("lines", 0)),  # below the minimum
           call(block("path", "x"), block("mode", "append"), block("lines", 1)),
           call(block("path", "x"), block("lines", 1), block("options", '{"force": 1}')),
           call(block("path", "x"), block("lines", 1), block("extra", "y")),
           call(block("x", "y"), name="delete_all")]
    for c in bad:
        assert not matches(auto, f"<tool_call>\n{c}\n</tool_call>"), c
    required = parse_tools([tool], "required")  # the prompt ends with the opening tag
    assert xml.prefix(required) == "<tool_call>\n"
    assert matches(required, f"{good[0]}\n</tool_call>")
    assert not matches(required, "Sure.")
    loose = {**tool, "function": {**tool["function"], "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "pattern": "^/"}}}}}
    with pytest.raises(APIError) as e:
        call_grammar(parse_tools([loose], "auto"), xml)
    assert e.value.param == "tools[0].function.parameters.properties.path"


def test_strict_tools_in_mistral_s_call_form(tool_tokenizer):
    """Mistral's call form (``[TOOL_CALLS]NAME[ARGS]{...}``, no closing tag; mlx-lm's
    ``mistral`` parser): with ``strict``, only calls of offered tools match, a strict tool's
    arguments on its schema, once a call has begun nothing but calls follow, and every call the
    grammar admits parses into arguments that validate."""
    import jsonschema

    mistral = pytest.importorskip("mlx_lm.tool_parsers.mistral")
    fmt = ToolFormat(mistral.tool_call_start, mistral.tool_call_end, mistral.parse_tool_call,
                     native=True, json_form=False, header_form=True)
    schema = {"type": "object", "properties": {
        "path": {"type": "string"}, "lines": {"type": "integer", "minimum": 1}},
        "required": ["path", "lines"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "open_file", "parameters": schema,
                                             "strict": True}}

    matches = functools.partial(admits, tool_tokenizer, fmt)

    auto = parse_tools([tool, WEATHER], "auto")
    one = 'open_file[ARGS]{"path": "a b.py", "lines": 3}'
    two = 'get_weather[ARGS]{"city": "Rome", "when": "now"}'  # not strict: any object
    for calls in ([one], [two], [one, two]):
        text = "Let me look." + "".join("[TOOL_CALLS]" + c for c in calls)
        assert matches(auto, text), text
        splitter = ToolCallSplitter(fmt, auto.rendered)
        content, parsed = splitter.feed(text, final=True)
        assert content == "Let me look." and [c["name"] for c in parsed] == \
            [c.split("[")[0] for c in calls]
        for c in parsed:
            if c["name"] == "open_file":
                jsonschema.validate(json.loads(c["arguments"]), schema)
    # an answer cut inside its second call (no closing tag): the first call still counts
    cut = '[TOOL_CALLS]get_weather[ARGS]{"city": "Ro'
    content, parsed = ToolCallSplitter(fmt, auto.rendered).feed("[TOOL_CALLS]" + one + cut,
                                                                final=True)
    assert [c["name"] for c in parsed] == ["open_file"] and content == cut
    assert matches(auto, "No call needed.")
    bad = ['open_file[ARGS]{"lines": 3}',  # a required argument missing
           'open_file[ARGS]{"path": "x", "lines": 0}',  # below the minimum
           'open_file[ARGS]{"path": "x", "lines": 1, "extra": 2}',
           'delete_all[ARGS]{}',
           one + " and some text after it"]  # no closing tag: nothing but calls follows
    for c in bad:
        assert not matches(auto, "[TOOL_CALLS]" + c), c
    required = parse_tools([tool], "required")  # the prompt ends with the opening tag
    assert fmt.prefix(required) == "[TOOL_CALLS]"
    assert matches(required, one)
    assert not matches(required, "Sure.")


def test_strict_tools_in_glm_s_call_form(tool_tokenizer):
    """GLM-4.5's and GLM-4.7's call form (``<tool_call>NAME`` then ``<arg_key>K</arg_key>``
    ``<arg_value>V</arg_value>`` pairs, mlx-lm's ``glm47`` parser): with ``strict``, only calls
    of offered tools match, with the required arguments and values the parser reads back as the
    schema's types, and every call the grammar admits parses into arguments that validate."""
    import jsonschema

    glm47 = pytest.importorskip("mlx_lm.tool_parsers.glm47")
    fmt = ToolFormat(glm47.tool_call_start, glm47.tool_call_end, glm47.parse_tool_call,
                     native=True, json_form=False, arg_key_form=True)
    schema = {"type": "object", "properties": {
        "path": {"type": "string"},
        "mode": {"type": "string", "enum": ["read", "write"]},
        "lines": {"type": "integer", "minimum": 1},
        "options": {"type": "object", "properties": {"force": {"type": "boolean"}},
                    "required": ["force"], "additionalProperties": False}},
        "required": ["path", "lines"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "open_file", "parameters": schema,
                                             "strict": True}}

    def arg(name, value):
        return f"<arg_key>{name}</arg_key>\n<arg_value>{value}</arg_value>\n"

    def call(*args, name="open_file"):
        return f"{name}\n" + "".join(args)

    matches = functools.partial(admits, tool_tokenizer, fmt)

    auto = parse_tools([tool, WEATHER], "auto")
    good = [call(arg("path", "a b.py"), arg("lines", 3)),
            call(arg("path", "multi\nline text"), arg("mode", "write"), arg("lines", 12),
                 arg("options", '{"force": true}')),
            call(arg("city", "Rome"), name="get_weather")]  # not strict: any arguments
    for c in good:
        text = f"Let me.\n<tool_call>{c}</tool_call>"
        assert matches(auto, text), text
        splitter = ToolCallSplitter(fmt, auto.rendered)
        content, (parsed,) = splitter.feed(text, final=True)
        assert content == "Let me." and parsed["name"] == c.split("\n")[0]
        if parsed["name"] == "open_file":
            arguments = json.loads(parsed["arguments"])
            jsonschema.validate(arguments, schema)
            assert arguments["path"] in ("a b.py", "multi\nline text")
    assert matches(auto, "No call needed.")
    bad = [call(arg("lines", 3)),  # a required argument missing
           call(arg("path", "x"), arg("lines", "three")),
           call(arg("path", "x"), arg("lines", 0)),  # below the minimum
           call(arg("path", "x"), arg("mode", "append"), arg("lines", 1)),
           call(arg("path", "x"), arg("lines", 1), arg("options", '{"force": 1}')),
           call(arg("path", "x"), arg("lines", 1), arg("extra", "y")),
           call(arg("x", "y"), name="delete_all")]
    for c in bad:
        assert not matches(auto, f"<tool_call>{c}</tool_call>"), c
    required = parse_tools([tool], "required")  # the prompt ends with the opening tag
    assert fmt.prefix(required) == "<tool_call>"
    assert matches(required, f"{good[0]}</tool_call>")
    assert not matches(required, "Sure.")


def test_strict_tools_are_refused_where_the_call_tags_are_special_tokens(tool_tokenizer):
    """A grammar's quoted text never matches a special token, so a form whose tags the model
    writes as special tokens (Mistral's tekken [TOOL_CALLS], say) would have its calls spelled
    out in plain text: refused with a 400 naming the tool instead."""
    from dflash.serving.tools import special_tags

    assert special_tags(tool_tokenizer, {"<|im_start|>", "<tool_call>", ""}) == {"<|im_start|>"}
    mistral = pytest.importorskip("mlx_lm.tool_parsers.mistral")
    fmt = ToolFormat("<|im_start|>", "", mistral.parse_tool_call, native=True, json_form=False,
                     header_form=True, special=frozenset({"<|im_start|>"}))
    tool = {"type": "function", "function": {"name": "open_file", "strict": True,
                                             "parameters": {"type": "object"}}}
    with pytest.raises(APIError) as e:
        call_grammar(parse_tools([WEATHER, tool], "auto"), fmt)
    assert e.value.param == "tools[1].function.strict" and "<|im_start|>" in str(e.value)
    assert call_grammar(parse_tools([WEATHER], "auto"), fmt) is None  # nothing strict: no grammar
