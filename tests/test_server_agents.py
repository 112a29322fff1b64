"""Agents against the real server: tool calls (OpenAI client), the Anthropic Messages API (official
``anthropic`` client), admission (FIFO, 429, ``--max-concurrency``), the shared-prefix cache across
requests, latency metrics, and a client that leaves mid-stream while another request goes on.

The tiny random target cannot write a tool call by itself, so the end-to-end calls are forced the
way a client can: ``tool_choice`` names the function (the prompt then holds the call's start) and
``logit_bias`` makes every answer token ``}``, which closes the JSON. Without the bias the model
writes garbage after the start: the broken call comes back as text, exactly the library's output.
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
from test_server import (
    KIND,
    MODEL_NAME,
    _eos_bias,
    _parse_prometheus,
    chat,
    launch_server,
)

pytestmark = pytest.mark.slow  # every test here runs the models

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "The weather in a city.",
                     "input_schema": WEATHER["function"]["parameters"]}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
QUEUE, CONCURRENCY = 2, 1  # one at a time: the queue tests need a queue


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair(KIND)
    with launch_server(target, draft, tmp_path_factory.mktemp("agents") / "server.log",
                       "--max-queue", str(QUEUE), "--max-concurrency", str(CONCURRENCY)) as s:
        yield s


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server["base"], api_key="unused", max_retries=0,
                               timeout=120)


@pytest.fixture(scope="module")
def encode(loaded_pair):
    """Prompt ids the server builds for a chat with tools (the same code, in this process)."""
    from dflash.serving.requests import ServedModel, chat_messages, chat_request
    from dflash.serving.tools import parse_tools, tool_format

    _, tokenizer, _ = loaded_pair(KIND)
    served = ServedModel(name=MODEL_NAME, path="", vocab_size=0, max_context=None,
                         tool_format=tool_format(tokenizer))

    def ids(messages, tools=None, tool_choice=None):
        req = chat_request(chat_messages({"messages": messages}),
                           parse_tools(tools, tool_choice), {}, tokenizer, served)
        return req.prompt_ids, req.answer_prefix

    return ids


@pytest.fixture(scope="module")
def brace_bias(loaded_pair):
    _, tokenizer, _ = loaded_pair(KIND)
    (brace,) = tokenizer.encode("}", add_special_tokens=False)
    return {str(brace): 100}


def _stream_calls(stream):
    """Content, tool calls (merged by index, as clients do) and the finish reason of a stream."""
    content, calls, finish = [], {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = tc.id or call["id"]
            if tc.function is not None:
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return "".join(content), [calls[k] for k in sorted(calls)], finish


def test_forced_tool_call_streamed_and_not(client, encode, reference, brace_bias):
    messages = chat("What is the weather in Paris?")
    ids, prefix = encode(messages, [WEATHER], NAMED)
    text, _, _ = reference(prompt=ids, max_tokens=2, logit_bias=brace_bias)
    assert prefix.endswith('"arguments": {') and text == "}}"  # the setup closes the JSON
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER],
                                       tool_choice=NAMED, max_tokens=2,
                                       extra_body={"logit_bias": brace_bias})
    message = r.choices[0].message
    assert message.content is None
    assert [(c.type, c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls] == [("function", "get_weather", {})]
    assert message.tool_calls[0].id.startswith("call_")
    assert r.choices[0].finish_reason == "length"  # cut by max_tokens, not ended by the model
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 2
    content, calls, finish = _stream_calls(client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=[WEATHER], tool_choice=NAMED, max_tokens=2,
        stream=True, extra_body={"logit_bias": brace_bias}))
    assert content == "" and finish == "length"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {})]
    assert calls[0]["id"].startswith("call_")


def test_broken_tool_call_is_returned_as_text(client, encode, reference):
    messages = chat("What is the weather in Oslo?")
    for choice in (NAMED, "required"):
        ids, prefix = encode(messages, [WEATHER], choice)
        text, _, _ = reference(prompt=ids, max_tokens=12)
        r = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                           tools=[WEATHER], tool_choice=choice, max_tokens=12)
        assert r.choices[0].message.tool_calls is None
        assert r.choices[0].message.content == prefix + text  # the model's own words, kept
        assert r.choices[0].finish_reason == "length"
        content, calls, finish = _stream_calls(client.chat.completions.create(
            model=MODEL_NAME, messages=messages, tools=[WEATHER], tool_choice=choice,
            max_tokens=12, stream=True))
        assert (content, calls, finish) == (prefix + text, [], "length")


def test_tool_history_is_rendered_and_answered_exactly(client, encode, reference):
    messages = [
        {"role": "user", "content": "What is the weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    ids, _ = encode(messages, [WEATHER])
    text, tokens, _ = reference(prompt=ids, max_tokens=16)
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER],
                                       max_tokens=16)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == text  # no call in the answer: all of it is content
    assert r.usage.completion_tokens == len(tokens)


def test_bad_tools_get_400s_naming_the_field(server, client):
    url = server["base"] + "/v1/chat/completions"
    ok = {"model": MODEL_NAME, "messages": chat("Hi"), "max_tokens": 4}
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=chat("Hi"), max_tokens=4,
                                       tools=[bad_schema])
    assert e.value.body["param"] == "tools[0].function.parameters.type"
    for fields, param in [({"tools": [{"type": "function", "function": {"name": ""}}]},
                           "tools[0].function.name"),
                          ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
                          ({"tools": [WEATHER], "stream": True, "tool_choice": {
                              "type": "function", "function": {"name": "nope"}}},
                           "tool_choice.function.name"),
                          ({"messages": [{"role": "assistant", "tool_calls": [
                              {"function": {"name": "f", "arguments": "{oops"}}]}]},
                           "messages[0].tool_calls[0].function.arguments")]:
        resp = httpx.post(url, json={**ok, **fields}, timeout=60)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param
    assert httpx.post(url, json=ok, timeout=60).status_code == 200  # and it keeps serving


def test_anthropic_messages_equal_the_library(claude, reference):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Tell me about the sea."}]
    text, tokens, n_prompt = reference(messages, max_tokens=20)
    r = claude.messages.create(model=MODEL_NAME, max_tokens=20, extra_body={"temperature": 0},
                               system="You are terse.",
                               messages=[{"role": "user", "content": "Tell me about the sea."}])
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == text
    assert r.stop_reason == ("max_tokens" if len(tokens) == 20 else "end_turn")
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == n_prompt
    assert r.usage.output_tokens == len(tokens)
    assert r.model_extra["dflash"]["cycles"] >= 1


def test_anthropic_stream_has_the_official_event_sequence(claude, reference):
    messages = [{"role": "user", "content": "Count to ten."}]
    text, tokens, n_prompt = reference(messages, max_tokens=20)
    events = list(claude.messages.create(model=MODEL_NAME, max_tokens=20,
                                         messages=messages, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    blocks = kinds[1:-2]
    assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
    assert set(blocks[1:-1]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text
    assert events[-2].usage.output_tokens == len(tokens)
    assert events[-2].delta.stop_reason == ("max_tokens" if len(tokens) == 20 else "end_turn")
    start = events[0].message.usage
    assert start.input_tokens + start.cache_read_input_tokens == n_prompt
    with claude.messages.stream(model=MODEL_NAME, max_tokens=20,
                                messages=messages) as stream:
        assert "".join(stream.text_stream) == text
        final = stream.get_final_message()
    assert final.content[0].text == text and final.usage.output_tokens == len(tokens)


def test_anthropic_tool_use_and_stop_sequences(claude, encode, reference, brace_bias):
    question = "What is the weather in Paris?"
    kwargs = dict(model=MODEL_NAME, max_tokens=2, tools=[ANTHROPIC_WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"},
                  messages=[{"role": "user", "content": question}],
                  extra_body={"logit_bias": brace_bias})
    r = claude.messages.create(**kwargs)
    assert [(b.type, b.name, b.input) for b in r.content] == [("tool_use", "get_weather", {})]
    assert r.content[0].id.startswith("toolu_") and r.stop_reason == "max_tokens"
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "get_weather", {})]
    # A broken call (no bias): text, the forced start included.
    ids, prefix = encode(chat(question), [WEATHER], NAMED)
    text, _, _ = reference(prompt=ids, max_tokens=8)
    r = claude.messages.create(**{**kwargs, "max_tokens": 8, "extra_body": None})
    assert [(b.type, b.text) for b in r.content] == [("text", prefix + text)]
    # A stop sequence ends the answer and is reported.
    messages = [{"role": "user", "content": "Say something."}]
    full, _, _ = reference(messages, max_tokens=24)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    r = claude.messages.create(model=MODEL_NAME, max_tokens=24,
                               messages=messages, stop_sequences=[stop])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert r.content[0].text == full[:full.find(stop)]
    events = list(claude.messages.create(model=MODEL_NAME, max_tokens=24,
                                         messages=messages, stop_sequences=[stop],
                                         stream=True))
    assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == (
        "stop_sequence", stop)


def test_anthropic_errors_have_anthropics_shape(server, claude):
    url = server["base"] + "/v1/messages"
    ok = {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    # A field this server does not implement is ignored (and logged once), as vLLM does.
    assert claude.messages.create(**ok, extra_body={"frobnicate": True}).content
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(**{**ok, "model": "some-other-model"})
    assert e.value.body["error"]["type"] == "not_found_error"
    for body, words in [({k: v for k, v in ok.items() if k != "max_tokens"}, "max_tokens"),
                        ({**ok, "temperature": 2}, "temperature"),
                        ({**ok, "tools": [{"name": "f", "input_schema": {"type": "string"}}]},
                         "tools.0.input_schema.type"),
                        ({**ok, "messages": [{"role": "user", "content": [
                            {"type": "image", "source": {}}]}]}, "messages.0.content.0")]:
        resp = httpx.post(url, json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        err = resp.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert words in err["error"]["message"]
    from dflash.serving.app import MAX_BODY_BYTES

    huge = json.dumps({**ok, "system": "x" * MAX_BODY_BYTES}).encode()
    for endpoint, shape in [(url, "anthropic"), (server["base"] + "/v1/chat/completions",
                                                 "openai")]:
        resp = httpx.post(endpoint, content=huge, timeout=60,
                          headers={"content-type": "application/json"})
        assert resp.status_code == 413
        err = resp.json()["error"]
        assert err["type"] == "request_too_large" and str(MAX_BODY_BYTES) in err["message"]
        assert ("param" in err) == (shape == "openai")
    assert claude.messages.create(**ok).content[0].type == "text"  # and it keeps serving


def test_anthropic_count_tokens(claude, reference):
    messages = [{"role": "system", "content": "Be brief."}, *chat("How long is this?")]
    _, _, n_prompt = reference(messages, max_tokens=1)
    count = claude.messages.count_tokens(model=MODEL_NAME, system="Be brief.",
                                         messages=messages[1:])
    assert count.input_tokens == n_prompt
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model=MODEL_NAME, messages=[])


def _metric(base: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", httpx.get(base + "/metrics").text, re.M)
    return float(m.group(1))


def test_shared_system_prompt_is_reused_across_requests(server, client, claude, loaded_pair,
                                                        reference):
    from dflash.prompts import encode_prompt

    _, tokenizer, _ = loaded_pair(KIND)
    system = {"role": "system", "content": "You are a helpful assistant for a shipping company. "
              "Answer questions about parcels, tracking numbers and delivery times politely."}
    first, second = [system, *chat("Where is my parcel?")], [system, *chat("How much is it?")]
    third = [system, *chat("Is it insured?")]
    p1, p2, p3 = (encode_prompt(tokenizer, {"messages": m}) for m in (first, second, third))
    common = _common_prefix(p1, p2)
    assert common > 20  # the system prompt and the user turn's start
    before = _metric(server["base"], "dflash_reused_prompt_tokens_total")
    client.chat.completions.create(model=MODEL_NAME, messages=first, max_tokens=4)
    text, _, _ = reference(second, max_tokens=12)
    r = client.chat.completions.create(model=MODEL_NAME, messages=second, max_tokens=12)
    assert r.usage.prompt_tokens_details.cached_tokens == common
    assert r.model_extra["dflash"]["reused_prompt_tokens"] == common
    assert r.choices[0].message.content == text  # reuse never changes the output
    assert r.usage.model_extra["dflash"]["tau"] >= 1.0
    assert _metric(server["base"], "dflash_reused_prompt_tokens_total") >= before + common
    # The Anthropic endpoint shares the cache: the same system prompt, a third user turn.
    a = claude.messages.create(model=MODEL_NAME, max_tokens=4, system=system["content"],
                               messages=[{"role": "user", "content": "Is it insured?"}])
    assert a.usage.cache_read_input_tokens == _common_prefix(p2, p3) > 20
    assert a.usage.input_tokens == len(p3) - a.usage.cache_read_input_tokens


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_fifo_admission_queue_limit_and_max_concurrency(server, client):
    base = server["base"]
    health = httpx.get(base + "/health").json()
    assert (health["max_concurrency"], health["max_queue"]) == (CONCURRENCY, QUEUE)
    assert _metric(base, "dflash_max_concurrency") == CONCURRENCY
    long = {"model": MODEL_NAME, "messages": chat("Keep talking."), "max_tokens": 3000,
            "stream": True, "logit_bias": _eos_bias(base)}
    done, errors = [], []

    def ask(name):
        try:
            r = client.chat.completions.create(model=MODEL_NAME, messages=chat(name),
                                               max_tokens=4)
            done.append((name, r.model_extra["dflash"]["queue_time"]))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def wait_depth(n):
        deadline = time.time() + 30
        while httpx.get(base + "/health").json()["queue_depth"] != n:
            assert time.time() < deadline, f"queue depth never reached {n}"
            time.sleep(0.05)

    threads = []
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", base + "/v1/chat/completions", json=long) as resp:
            lines = resp.iter_lines()  # kept: a dropped iterator closes the connection
            for line in lines:
                if line.startswith("data: "):
                    break  # the long generation holds the worker
            for i, name in enumerate(("first", "second")):
                threads.append(threading.Thread(target=ask, args=(name,)))
                threads[-1].start()
                wait_depth(i + 1)
            assert _metric(base, "dflash_queue_depth") == QUEUE
            assert _metric(base, "dflash_batch_size") == 1
            with pytest.raises(openai.RateLimitError) as e:
                client.chat.completions.create(model=MODEL_NAME, messages=chat("third"),
                                               max_tokens=4)
            assert e.value.body["code"] == "queue_full"
        # The long stream's client left: the queued requests run, in arrival order.
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [name for name, _ in done] == ["first", "second"]
    assert all(queue_time > 0 for _, queue_time in done)  # both waited for the worker


def test_client_leaving_mid_stream_while_another_request_goes_on(server, claude, reference):
    base = server["base"]
    before = _metric(base, "dflash_cancelled_total")
    messages = [{"role": "user", "content": "Write a poem about rain."}]
    text, tokens, _ = reference(messages, max_tokens=32)
    result, errors = {}, []

    def other():
        try:
            with claude.messages.stream(model=MODEL_NAME, max_tokens=32,
                                        messages=messages) as stream:
                result["text"] = "".join(stream.text_stream)
                result["final"] = stream.get_final_message()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    long = {"model": MODEL_NAME, "messages": chat("Go on forever."), "max_tokens": 3000,
            "stream": True, "logit_bias": _eos_bias(base)}
    thread = threading.Thread(target=other)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", base + "/v1/chat/completions", json=long) as resp:
            seen, lines = 0, resp.iter_lines()
            for line in lines:
                seen += line.startswith("data: ")
                if seen == 2 and thread.ident is None:  # not started yet
                    thread.start()  # the other request arrives while this one streams
                    deadline = time.time() + 30
                    while httpx.get(base + "/health").json()["queue_depth"] != 1:
                        assert time.time() < deadline, "the other request never queued"
                        time.sleep(0.05)
                if seen >= 6:
                    break
        # This client is gone, mid-stream.
    thread.join(timeout=120)
    assert not errors, errors
    assert result["text"] == text
    assert result["final"].usage.output_tokens == len(tokens)
    deadline = time.time() + 10
    while _metric(base, "dflash_cancelled_total") < before + 1 and time.time() < deadline:
        time.sleep(0.2)
    assert _metric(base, "dflash_cancelled_total") == before + 1
    assert httpx.get(base + "/health").json()["busy"] is False


def test_latency_histograms_and_rows_per_pass_in_metrics(server, client):
    client.chat.completions.create(model=MODEL_NAME, messages=chat("Hello"), max_tokens=8)
    text = httpx.get(server["base"] + "/metrics").text
    samples = _parse_prometheus(text)
    for name in ("dflash_time_to_first_token_seconds", "dflash_time_per_output_token_seconds"):
        buckets = [v for labels, v in samples[name + "_bucket"]]
        assert buckets == sorted(buckets) and buckets[-1] == samples[name + "_count"][0][1] >= 1
        assert samples[name + "_sum"][0][1] > 0
    assert samples["dflash_rows_per_pass"][0][1] >= 1.0
    assert samples["dflash_batch_size"][0][1] in (0.0, 1.0)
    parser = pytest.importorskip("prometheus_client.parser")
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    assert families["dflash_time_to_first_token_seconds"].type == "histogram"
