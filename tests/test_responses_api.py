"""OpenAI's Responses API (``/v1/responses``): its request checks and event shapes on their own
(fast), then the real server with the official ``openai`` client (slow).

The event and response shapes are validated against the ``openai`` SDK's own pydantic types, so
that what the server writes is what the official client (and Codex, which follows the same API)
parses. Greedy answers must equal the library's own greedy output for the prompt the request
builds. The tiny random target cannot decide to call a tool, so tool calls are tested two ways:
a forced call on the tiny pair (``tool_choice`` names the function, the server's own
``logit_bias`` extension closes the JSON: the event sequence of a call, deterministically), and
the built-in pair (real weights) continuing a conversation that shows one call round trip, which
it answers with a real call that is then fed back as a ``function_call_output``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dflash.errors import APIError
from dflash.serving.requests import ServedModel
from dflash.serving.responses_format import (
    ResponseStore,
    ResponseStream,
    input_messages,
    parse_response_tools,
    parse_responses_request,
    response_body,
)
from dflash.serving.tools import AnswerSplitter, ToolCallSplitter, tool_format

openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

KIND = "llama"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
NAMED = {"type": "function", "name": "get_weather"}
EVENTS = TypeAdapter(ResponseStreamEvent)


def rejected(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args, **kwargs)
    assert e.value.status == 400
    return e.value


# ---------------------------------------------------------------------------------------------
# Request checks (no model)


def test_input_items_become_chat_messages_and_outputs_must_name_a_call():
    items = [{"type": "message", "role": "developer",
              "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": "Weather in Oslo and Rome?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather",
              "arguments": "{\"city\": \"Oslo\"}"},
             {"type": "function_call", "call_id": "c2", "name": "get_weather",
              "arguments": "{\"city\": \"Rome\"}"},
             {"type": "function_call_output", "call_id": "c1", "output": "3 C"},
             {"type": "function_call_output", "call_id": "c2",
              "output": [{"type": "input_text", "text": "19 C"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Cold, then warm."}]}]
    known: set[str] = set()
    assert input_messages(items, known) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "19 C"},
        {"role": "assistant", "content": "Cold, then warm."}]
    assert known == {"c1", "c2"}
    assert input_messages("Hi", set()) == [{"role": "user", "content": "Hi"}]
    e = rejected(input_messages, [{"role": "user", "content": "x"},
                                  {"type": "function_call_output", "call_id": "nope",
                                   "output": "1"}], set())
    assert e.param == "input[1].call_id" and "'nope' names no earlier function_call" in e.message
    assert input_messages([{"type": "function_call_output", "call_id": "old", "output": "1"}],
                          {"old"})[0]["tool_call_id"] == "old"  # a call of the earlier turns
    for bad, param in [([], "input"), ([{"role": "robot", "content": "x"}], "input[0].role"),
                       ([{"role": "user", "content": [{"type": "input_image"}]}],
                        "input[0].content[0].type"),
                       ([{"type": "function_call", "name": "f", "arguments": "{}"}],
                        "input[0].call_id"),
                       ([{"type": "function_call", "call_id": "c", "name": "f",
                          "arguments": "not json"}], "input[0].arguments"),
                       ([{"type": "computer_call_output", "call_id": "c"}], "input[0].type")]:
        assert rejected(input_messages, bad, set()).param == param, bad


def test_function_tools_are_checked_and_hosted_tools_ignored():
    # What Codex sends besides its functions: a hosted tool and a namespace of sub-agent tools.
    codex = [WEATHER, {"type": "web_search", "external_web_access": False},
             {"type": "namespace", "name": "multi_agent_v1", "tools": []},
             {**WEATHER, "name": "get_time", "strict": False}]
    spec, echo = parse_response_tools(codex, "auto")
    assert [t["function"]["name"] for t in spec.tools] == ["get_weather", "get_time"]
    # Constrained only when a tool says strict: true (the echo says what ran).
    assert [(t["name"], t["strict"]) for t in echo] == [("get_weather", False),
                                                        ("get_time", False)]
    strict, _ = parse_response_tools([{**WEATHER, "strict": True}], "auto")
    assert strict.strict == ("get_weather",) and strict.constrained
    assert spec.strict == () and not spec.constrained
    assert parse_response_tools(codex, NAMED)[0].choice == "get_weather"
    assert parse_response_tools([{"type": "web_search"}], None) == (None, [])
    for tools, choice, param in [
            ([{"type": "web_search"}, {**WEATHER, "parameters": {"type": "array"}}], "auto",
             "tools[1].parameters.type"),
            ([{"type": "web_search"}, {**WEATHER, "parameters": {
                "type": "object", "properties": {"city": {"type": 5}}}}], "auto",
             "tools[1].parameters"),
            ([{**WEATHER, "name": "bad name"}], "auto", "tools[0].name"),
            ([WEATHER, WEATHER], "auto", "tools[1].name"),
            ([{**WEATHER, "strict": "yes"}], "auto", "tools[0].strict"),
            ([{"name": "x"}], "auto", "tools[0].type"),
            ([WEATHER], {"type": "function", "name": "other"}, "tool_choice.name"),
            ([WEATHER], {"type": "web_search"}, "tool_choice.type"),
            ([WEATHER], "sometimes", "tool_choice")]:
        assert rejected(parse_response_tools, tools, choice).param == param, (tools, choice)


@pytest.fixture(scope="module")
def tokenizer(loaded_pair):
    return loaded_pair(KIND)[1]


@pytest.fixture(scope="module")
def served(tokenizer):
    return ServedModel(name="tiny", path="/models/tiny", vocab_size=tokenizer.vocab_size,
                       max_context=512, default_max_tokens=16,
                       tool_format=tool_format(tokenizer))


def test_requests_are_read_like_chats_and_bad_fields_named(tokenizer, served):
    from dflash.serving.requests import chat_request

    body = {"model": "tiny", "instructions": "Answer in French.",
            "input": [{"role": "developer", "content": "Be brief."},
                      {"role": "user", "content": "Hi"}],
            "max_output_tokens": 5, "store": False, "stream": True,
            # What Codex sends besides: accepted, ignored.
            "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "k", "client_metadata": {"a": "b"}, "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [{"type": "web_search"}],
            "a_field_from_the_future": 1}
    req = parse_responses_request(body, tokenizer, served, ResponseStore())
    same = chat_request([{"role": "system", "content": "Answer in French.\n\nBe brief."},
                         {"role": "user", "content": "Hi"}], None, {}, tokenizer, served)
    assert req.prompt_ids == same.prompt_ids and req.tools is None
    assert req.settings.max_tokens == 5 and req.stream and req.store is None
    body.pop("max_output_tokens")  # none: to the end of the context, as OpenAI's API does
    assert parse_responses_request(body, tokenizer, served).settings.max_tokens == \
        served.max_context - len(same.prompt_ids)
    assert req.echo["instructions"] == "Answer in French." and req.echo["store"] is False
    base = {"model": "tiny", "input": "Hi"}
    for extra, param in [({"max_output_tokens": 0}, "max_output_tokens"),
                         ({"temperature": 3}, "temperature"),
                         ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
                         ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
                         ({"truncation": "auto"}, "truncation"),
                         ({"background": True}, "background"),
                         ({"conversation": "conv_1"}, "conversation"),
                         ({"store": "yes"}, "store"),
                         ({"instructions": ["x"]}, "instructions"),
                         ({"top_logprobs": 21}, "top_logprobs"),
                         ({"include": "message.output_text.logprobs"}, "include")]:
        e = rejected(parse_responses_request, {**base, **extra}, tokenizer, served,
                     ResponseStore())
        assert e.param == param, (extra, e.message)
    assert rejected(parse_responses_request, {"model": "tiny"}, tokenizer, served).param == "input"


def _last(finish: str, n: int = 3):
    return SimpleNamespace(generation_tokens=n, reused_prompt_tokens=0, mean_tau=1.0, cycles=1,
                           rows_per_pass=1.0, finish_reason=finish)


def _parse_sse(text: str) -> list[dict]:
    out = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        out.append(payload)
    return out


def test_stream_events_are_what_the_sdk_parses(tokenizer, served):
    """Reasoning, text and a call streamed: every event validates as the SDK's event type, the
    numbers run on, and the final response equals the non-streamed body's output."""
    req = parse_responses_request({"model": "tiny", "input": "Weather?", "tools": [WEATHER]},
                                  tokenizer, served, ResponseStore())
    fmt = tool_format(tokenizer)

    def splitter():
        from dflash.serving.reasoning import ThinkSplitter

        return AnswerSplitter(ThinkSplitter("<think>", "</think>"),
                              ToolCallSplitter(fmt, req.tools.tools))

    pieces = ["<think>Look it", " up.</think>", "Let me ", "check.\n", fmt.start,
              '\n{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}\n', fmt.end]
    stream = ResponseStream(req, "tiny", splitter(), tokenizer)
    text = stream.opening(4, None)
    for k, piece in enumerate(pieces):
        text += "".join(stream.add(SimpleNamespace(
            text=piece, finish_reason="stop" if k == len(pieces) - 1 else None)))
    text += "".join(stream.closing(4, _last("stop"), {"x": 1}))
    events = _parse_sse(text)
    for e in events:
        EVENTS.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" in kinds
    assert kinds.count("response.output_item.added") == kinds.count(
        "response.output_item.done") == 3
    final = Response.model_validate(events[-1]["response"])
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Let me check."
    call = final.output[2]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert json.loads(done[0]["arguments"]) == {"city": "Oslo"}
    body = response_body(req, "tiny", "".join(pieces), _last("stop"), {}, splitter(), tokenizer)
    whole = Response.model_validate(body)
    assert [o.type for o in whole.output] == ["reasoning", "message", "function_call"]
    assert whole.output_text == final.output_text and whole.status == "completed"
    assert whole.usage.output_tokens_details.reasoning_tokens > 0

    # Cut by max_output_tokens: response.incomplete, and an empty answer is one empty message.
    stream = ResponseStream(req, "tiny", AnswerSplitter(), tokenizer)
    events = _parse_sse(stream.opening(4, None) + "".join(stream.closing(4, _last("length"), {})))
    for e in events:
        EVENTS.validate_python(e)
    final = Response.model_validate(events[-1]["response"])
    assert events[-1]["type"] == "response.incomplete" and final.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in final.output] == ["message"] and final.output_text == ""
    error = _parse_sse(stream.error(APIError(503, "cancelled", code="cancelled")))
    assert [e["type"] for e in error] == ["error", "response.failed"]
    for e in error:
        EVENTS.validate_python(e)


def test_store_is_bounded_and_scoped():
    store = ResponseStore(max_responses=2, max_chars=10_000)
    for k in range(3):
        store.put(f"r{k}", [{"role": "user", "content": str(k)}], scope="a")
    assert len(store) == 2 and store.get("r0", "a") is None
    assert store.get("r2", "a") == [{"role": "user", "content": "2"}]
    assert store.get("r2", "b") is None  # another key's conversation is not found
    store.put("big", [{"role": "user", "content": "x" * 20_000}], scope="a")
    assert store.get("big", "a") is None and len(store) == 2
    small = ResponseStore(max_responses=10, max_chars=100)
    for k in range(5):
        small.put(f"r{k}", [{"role": "user", "content": "y" * 20}])
    assert len(small) < 5 and small.get("r4") is not None


# ---------------------------------------------------------------------------------------------
# The real server and the official client (slow)


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    from test_server import launch_server

    target, draft = tiny_pair(KIND)
    with launch_server(target, draft, tmp_path_factory.mktemp("responses") / "server.log",
                       "--max-concurrency", "1") as s:
        yield s


@pytest.fixture(scope="module")
def chat_ids(tokenizer):
    """Prompt ids the server builds for chat messages (and chat-form tools), in this process."""
    from dflash.serving.requests import chat_request
    from dflash.serving.tools import parse_tools

    served = ServedModel(name="tiny", path="", vocab_size=0, max_context=None,
                         tool_format=tool_format(tokenizer))

    def ids(messages, tools=None, tool_choice=None):
        req = chat_request(messages, parse_tools(tools, tool_choice), {}, tokenizer, served)
        return req.prompt_ids

    return ids


CHAT_WEATHER = {"type": "function", "function": {
    k: WEATHER[k] for k in ("name", "description", "parameters")}}


def _collect(stream) -> tuple[list, str]:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return events, text


@pytest.mark.slow
def test_greedy_answers_equal_the_library_streamed_and_not(client, reference, chat_ids):
    from test_server import MODEL_NAME

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    text, tokens, _ = reference(prompt=chat_ids(messages), max_tokens=12)
    r = client.responses.create(model=MODEL_NAME, instructions="Be brief.", input="Hello",
                                max_output_tokens=12)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.output_text == text
    assert r.usage.input_tokens == len(chat_ids(messages))
    assert r.usage.output_tokens == len(tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    cut = len(tokens) == 12
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details.reason if cut else None) == ("max_output_tokens" if cut
                                                              else None)
    events, streamed = _collect(client.responses.create(
        model=MODEL_NAME, instructions="Be brief.", input="Hello", max_output_tokens=12,
        stream=True))
    assert streamed == text
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          "response.incomplete" if cut else "response.completed"]
    assert events[-1].response.output_text == text
    assert events[-1].response.id == events[0].response.id


@pytest.mark.slow
def test_the_stream_helper_gets_its_final_response(client):
    """``client.responses.stream`` accumulates the events and needs ``response.completed``: an
    answer the model ends itself (the end-of-turn token biased first)."""
    from test_server import MODEL_NAME, _eos_bias

    end = {k: 100 for k in _eos_bias(None)}
    with client.responses.stream(model=MODEL_NAME, input="Hi", max_output_tokens=8,
                                 extra_body={"logit_bias": end}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and final.status == "completed"
    assert final.output_text == "" and final.usage.output_tokens <= 1


@pytest.mark.slow
def test_function_call_outputs_are_answered_exactly(client, reference, chat_ids, server):
    from test_server import MODEL_NAME

    items = [{"role": "user", "content": "What is the weather in Rome?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 24 C"}]
    messages = [items[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    ids = chat_ids(messages, [CHAT_WEATHER])
    text, tokens, _ = reference(prompt=ids, max_tokens=16)
    r = client.responses.create(model=MODEL_NAME, input=items, tools=[WEATHER],
                                max_output_tokens=16)
    assert r.usage.input_tokens == len(ids) and r.output_text == text
    assert [o.type for o in r.output] == ["message"]  # no call in the answer: all of it is text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_NAME, input=[items[0], {
            "type": "function_call_output", "call_id": "call_9", "output": "?"}],
            tools=[WEATHER], max_output_tokens=4)
    assert e.value.body["param"] == "input[1].call_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4,
                                tools=[{**WEATHER, "parameters": {"type": "array"}}])
    assert e.value.body["param"] == "tools[0].parameters.type"
    assert "Traceback" not in server["log"].read_text()


@pytest.mark.slow
def test_previous_response_id_continues_a_stored_conversation(client, reference, chat_ids):
    from test_server import MODEL_NAME

    first = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=6)
    second = client.responses.create(model=MODEL_NAME, previous_response_id=first.id,
                                     input="And then?", max_output_tokens=6)
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And then?"}]
    text, _, _ = reference(prompt=chat_ids(messages), max_tokens=6)
    assert second.previous_response_id == first.id and second.output_text == text
    assert second.usage.input_tokens == len(chat_ids(messages))
    kept_not = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_NAME, previous_response_id=kept_not.id,
                                input="Again", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.slow
def test_forced_function_call_streamed_and_not(client, loaded_pair):
    """The call's events in order, on the tiny pair: ``tool_choice`` names the function (the
    prompt holds the call's start) and the server's ``logit_bias`` extension writes ``}}``."""
    from test_server import MODEL_NAME

    tokenizer = loaded_pair(KIND)[1]
    (brace,) = tokenizer.encode("}", add_special_tokens=False)
    kwargs = dict(model=MODEL_NAME, input="What is the weather in Paris?", tools=[WEATHER],
                  tool_choice=NAMED, max_output_tokens=2,
                  extra_body={"logit_bias": {str(brace): 100}})
    r = client.responses.create(**kwargs)
    assert [(o.type, o.name, json.loads(o.arguments)) for o in r.output] == [
        ("function_call", "get_weather", {})]
    assert r.output[0].call_id.startswith("call_") and r.output[0].id.startswith("fc_")
    assert r.status == "incomplete"  # cut by max_output_tokens, not ended by the model
    events, text = _collect(client.responses.create(**kwargs, stream=True))
    assert text == ""
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.incomplete"]
    call = events[-1].response.output[0]
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call",
                                                                  "get_weather", {})
    assert events[2].item.call_id == call.call_id


@pytest.mark.slow
def test_a_stored_response_is_found_only_with_the_key_that_made_it(tiny_pair, tmp_path):
    from test_server import MODEL_NAME, launch_server

    target, draft = tiny_pair(KIND)
    with launch_server(target, draft, tmp_path / "server.log", "--api-key", "key-a",
                       "--api-key", "key-b") as s:
        a, b = (openai.OpenAI(base_url=s["base"] + "/v1", api_key=k, max_retries=0,
                              timeout=120) for k in ("key-a", "key-b"))
        first = a.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2)
        assert a.responses.create(model=MODEL_NAME, previous_response_id=first.id,
                                  input="More", max_output_tokens=2).previous_response_id \
            == first.id
        with pytest.raises(openai.BadRequestError) as e:
            b.responses.create(model=MODEL_NAME, previous_response_id=first.id, input="More",
                               max_output_tokens=2)
        assert e.value.body["param"] == "previous_response_id"


# ---------------------------------------------------------------------------------------------
# The built-in pair (real weights) makes a real call, and answers its output


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    """``dflash serve`` with no model arguments: the built-in pair, its access log on."""
    from test_server import launch_server

    with launch_server(None, None, tmp_path_factory.mktemp("builtin") / "server.log") as s:
        yield s


# A conversation that shows one call round trip, then asks for another city's weather.
SHOWN = [{"role": "user", "content": "What is the weather in London?"},
         {"type": "function_call", "call_id": "call_1", "name": "get_weather",
          "arguments": '{"city": "London"}'},
         {"type": "function_call_output", "call_id": "call_1", "output": "12 C, rain"},
         {"role": "assistant", "content": "It is 12 C and raining in London."},
         {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.slow
def test_builtin_pair_calls_a_function_and_answers_its_output(builtin):
    """Real weights: the call comes from the model (the prompt holds only its name, as
    ``tool_choice`` asks), its output goes back by ``previous_response_id``, and the answer is a
    well-formed message; once more streamed, through the SDK's stream helper."""
    from test_agent_clis import refused

    client = openai.OpenAI(base_url=builtin["base"] + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    r = client.responses.create(model="dflash", input=SHOWN, tools=[WEATHER], tool_choice=NAMED,
                                max_output_tokens=40)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", r.output
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    back = [{"type": "function_call_output", "call_id": calls[0].call_id,
             "output": "25 C, sunny"}]
    answer = client.responses.create(model="dflash", previous_response_id=r.id, input=back,
                                     tools=[WEATHER], max_output_tokens=48)
    assert answer.status == "completed" and [o.type for o in answer.output] == ["message"]
    assert "25" in answer.output_text and "Paris" in answer.output_text
    with client.responses.stream(model="dflash", input=[*SHOWN, calls[0].model_dump(
            exclude_none=True), *back], tools=[WEATHER], max_output_tokens=48) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(deltas) == final.output_text
    assert final.output_text == answer.output_text  # the same conversation, greedy
    assert refused(builtin["log"].read_text()) == []


# ---------------------------------------------------------------------------------------------
# Keepalive comments while a long prompt is processed


def _long(tag: str) -> str:
    """A prompt of ~1,200 tokens that shares no prefix with another tag's (no prefix cache hit:
    every request processes its whole prompt)."""
    return f"Document {tag}. " + "Here is a long document to read before answering. " * 200


def test_keepalive_must_be_positive():
    from dflash.errors import ServerConfigError
    from dflash.serving import create_server

    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ServerConfigError, match="--keepalive"):
            create_server("no-such-model", keepalive=bad)  # refused before loading


def _raw_stream(base: str, path: str, body: dict) -> list[str]:
    """The SSE lines of one streamed request, as they come (blank lines dropped)."""
    import httpx

    with httpx.stream("POST", base + path, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line]


@pytest.mark.slow
def test_keepalives_arrive_before_the_first_output_and_every_sdk_takes_them(tiny_pair, tmp_path):
    """Long prompts (~2,000 tokens) with keepalives every 5 ms. Before the first output: ``keepalive`` events
    after the opening ones on the Responses API (what OpenAI's API sends, and what resets the
    Codex CLI's idle timeout), an SSE comment on chat completions, Anthropic's ``ping`` on
    messages; the official clients parse such streams, and answer as without them."""
    anthropic = pytest.importorskip("anthropic")
    from test_server import MODEL_NAME, _eos_bias, launch_server

    def chat(tag: str) -> list[dict]:
        return [{"role": "user", "content": _long(tag)}]

    target, draft = tiny_pair(KIND)
    with launch_server(target, draft, tmp_path / "server.log", "--max-concurrency", "1",
                       "--keepalive", "0.005") as s:
        base = s["base"]
        lines = _raw_stream(base, "/v1/responses", {"model": MODEL_NAME, "input": _long("A"),
                                                    "max_output_tokens": 4, "stream": True})
        names = [line.split(": ", 1)[1] for line in lines if line.startswith("event: ")]
        output = names.index("response.output_item.added")
        assert names[:3] == ["response.created", "response.in_progress", "keepalive"], names
        assert set(names[2:output]) == {"keepalive"} and "keepalive" not in names[output:]
        data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        assert data[2] == {"type": "keepalive", "sequence_number": 2}
        assert [d["sequence_number"] for d in data] == list(range(len(data)))
        for path, body, first, after in [
                ("/v1/chat/completions", {"messages": chat("B"), "max_tokens": 4}, ": keepalive",
                 "data: "),
                ("/v1/messages", {"messages": chat("C"), "max_tokens": 4}, "event: ping",
                 "event: message_start")]:
            lines = _raw_stream(base, path, {**body, "model": MODEL_NAME, "stream": True})
            start = next(i for i, line in enumerate(lines) if line.startswith(after))
            assert start >= 1 and lines[0] == first, (path, lines[:4])
            assert all(line == first or line == 'data: {"type": "ping"}'
                       for line in lines[:start]), (path, lines[:start])

        # The SDKs on fresh prompts (keepalives first), then the same requests not streamed.
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                               timeout=300)
        events, text = _collect(client.responses.create(
            model=MODEL_NAME, input=_long("D"), max_output_tokens=4, stream=True))
        whole = client.responses.create(model=MODEL_NAME, input=_long("D"),
                                        max_output_tokens=4)
        assert [e.type for e in events[:3]] == ["response.created", "response.in_progress",
                                                "keepalive"]
        assert text == whole.output_text == events[-1].response.output_text
        assert events[-1].response.usage.input_tokens == whole.usage.input_tokens
        end = {"logit_bias": {k: 100 for k in _eos_bias(None)}}  # the helper needs completed
        with client.responses.stream(model=MODEL_NAME, input=_long("E"), max_output_tokens=4,
                                     extra_body=end) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_response()
        assert "keepalive" in kinds and final.status == "completed"
        assert final.output_text == client.responses.create(
            model=MODEL_NAME, input=_long("E"), max_output_tokens=4, extra_body=end).output_text
        streamed = client.chat.completions.create(model=MODEL_NAME, messages=chat("F"),
                                                  max_tokens=4, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) \
            == client.chat.completions.create(model=MODEL_NAME, messages=chat("F"),
                                              max_tokens=4).choices[0].message.content
        claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0,
                                     timeout=300)
        with claude.messages.stream(model=MODEL_NAME, max_tokens=4,
                                    messages=chat("G")) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        alone = claude.messages.create(model=MODEL_NAME, max_tokens=4, messages=chat("G"))
        assert text == "".join(b.text for b in final.content if b.type == "text") \
            == "".join(b.text for b in alone.content if b.type == "text")
