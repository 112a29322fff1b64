"""Log-probabilities through ``dflash serve``: chat, completions (``echo`` included) and the
Responses API, streamed and not, on the single-sequence and the batched engine.

A real server on localhost with the tiny Llama pair and the official ``openai`` client; every value
must equal mlx-lm's model run on the same ids (the prompt and the tokens the library generates
for the request alone) within 1e-4, and every token's text and bytes must be its own. Bad fields
get a 400 naming them.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_logprobs import TOLERANCE, mlx_lm_logprobs
from test_server import KIND, MODEL_NAME, chat, launch_server

from dflash.logprobs import MAX_TOP_LOGPROBS, TokenText
from dflash.prompts import encode_prompt

pytestmark = pytest.mark.slow  # a server per engine, the models run for seconds

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

N = 24


@pytest.fixture(scope="module", params=["single", "batched"])
def server(request, tiny_pair, tmp_path_factory):
    target, draft = tiny_pair(KIND)
    concurrency = "1" if request.param == "single" else "4"
    with launch_server(target, draft, tmp_path_factory.mktemp("server") / "server.log",
                       "--max-concurrency", concurrency) as s:
        yield s


@pytest.fixture(scope="module")
def pair(loaded_pair):
    model, tokenizer, _ = loaded_pair(KIND)
    return model, tokenizer, TokenText(tokenizer)


def chat_gap(content, ids: list[int], start: int, reference: np.ndarray, top: int,
             texts: TokenText) -> float:
    """The largest gap between chat-shaped entries (scoring ``ids[start:]``) and mlx-lm's."""
    assert len(content) == len(ids) - start
    worst = 0.0
    for j, e in enumerate(content):
        token, row = ids[start + j], reference[start + j - 1]
        assert e.token == texts.text(token) and e.bytes == list(texts.bytes(token))
        worst = max(worst, abs(e.logprob - row[token]))
        values = np.array([t.logprob for t in e.top_logprobs])
        assert len(values) == top and list(values) == sorted(values, reverse=True)
        if top:
            worst = max(worst, float(np.abs(values - np.sort(row)[::-1][:top]).max()))
    return worst


def legacy_gap(logprobs, ids: list[int], start: int, reference: np.ndarray, top: int,
               texts: TokenText) -> float:
    """The same for the legacy shape, covering ``ids[start:]``, or with ``start`` 1 (echo) all
    of ``ids``, the first unscored."""
    first = 0 if start == 1 else start
    assert logprobs.tokens == [texts.text(t) for t in ids[first:]]
    scored = logprobs.token_logprobs[start - first:]
    tops = logprobs.top_logprobs[start - first:]
    assert len(scored) == len(ids) - start
    worst = 0.0
    for j, (value, alternatives) in enumerate(zip(scored, tops)):
        token, row = ids[start + j], reference[start + j - 1]
        worst = max(worst, abs(value - row[token]))
        assert texts.text(token) in alternatives  # the chosen token, as OpenAI adds it
        assert len(alternatives) in (top, top + 1)
        if top:
            worst = max(worst, abs(max(alternatives.values()) - np.sort(row)[::-1][0]))
    return worst


def test_chat_logprobs_streamed_and_not(server, client, reference, pair):
    model, tokenizer, texts = pair
    messages = chat("Tell me about the sea.")
    _, tokens, _ = reference(messages, max_tokens=N)
    ids = encode_prompt(tokenizer, {"messages": messages})
    ref = mlx_lm_logprobs(model, ids + tokens)
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=N,
                                       temperature=0, logprobs=True,
                                       top_logprobs=MAX_TOP_LOGPROBS)
    gap = chat_gap(r.choices[0].logprobs.content, ids + tokens, len(ids), ref,
                   MAX_TOP_LOGPROBS, texts)
    assert gap < TOLERANCE, gap
    content = []
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                max_tokens=N, temperature=0, logprobs=True,
                                                top_logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            content += chunk.choices[0].logprobs.content
    assert chat_gap(content, ids + tokens, len(ids), ref, 2, texts) < TOLERANCE
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4,
                                           temperature=0)
    assert plain.choices[0].logprobs is None  # not asked, not computed


def test_completions_logprobs_and_echo(server, client, reference, pair):
    model, tokenizer, texts = pair
    prompt = tokenizer.encode(" the sea, the sky and the long road home")
    _, tokens, _ = reference(prompt=prompt, max_tokens=N)
    ref = mlx_lm_logprobs(model, prompt + tokens)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=N, temperature=0,
                                  logprobs=5)
    lp = r.choices[0].logprobs
    assert lp.tokens == [texts.text(t) for t in tokens]
    assert legacy_gap(lp, prompt + tokens, len(prompt), ref, 5, texts) < TOLERANCE
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    text = r.choices[0].text
    for token, at in list(zip(lp.tokens, lp.text_offset))[1:]:  # (the first: its space dropped)
        assert text[at:at + len(token)] == token
    # echo: the prompt's own log-probabilities first (its first token's null), then the answer's
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0,
                                  logprobs=3, echo=True)
    choice = r.choices[0]
    assert choice.text.startswith(tokenizer.decode(prompt))
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(prompt) + 3
    assert legacy_gap(lp, prompt + tokens[:3], 1, ref, 3, texts) < TOLERANCE
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # the whole prompt was scored
    # max_tokens 0 with echo: the prompt scored alone (lm-evaluation-harness' log-likelihood)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, logprobs=1,
                                  echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) and r.usage.completion_tokens == 0
    assert legacy_gap(lp, prompt, 1, ref, 1, texts) < TOLERANCE
    # streamed, echo included
    streamed_values, streamed_tokens = [], []
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=N,
                                           temperature=0, logprobs=2, echo=True, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed_values += chunk.choices[0].logprobs.token_logprobs
            streamed_tokens += chunk.choices[0].logprobs.tokens
    assert streamed_tokens == [texts.text(t) for t in prompt + tokens]
    assert streamed_values[0] is None
    gap = max(abs(v - ref[i - 1][t]) for i, (v, t) in
              enumerate(zip(streamed_values, prompt + tokens)) if i)
    assert gap < TOLERANCE, gap


def test_a_log_likelihood_request_as_lm_evaluation_harness_sends_it(server, pair):
    """``local-completions``' loglikelihood request: token ids in a batch of one, ``echo``,
    ``max_tokens`` 1, ``logprobs`` 1; it sums ``token_logprobs[ctxlen:-1]`` and calls the
    continuation greedy where each token's value is the top of its ``top_logprobs``."""
    model, tokenizer, texts = pair
    context = tokenizer.encode(" the sea, the sky and")
    continuation = tokenizer.encode(" the long road home")
    ids = context + continuation
    body = {"model": MODEL_NAME, "prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True,
            "temperature": 0, "seed": 1234}
    choice = httpx.post(server["base"] + "/v1/completions", json=body, timeout=60).json()[
        "choices"][0]
    values = choice["logprobs"]["token_logprobs"][len(context):-1]
    tops = choice["logprobs"]["top_logprobs"][len(context):-1]
    ref = mlx_lm_logprobs(model, ids)
    expected = [ref[i - 1][ids[i]] for i in range(len(context), len(ids))]
    assert len(values) == len(continuation)
    assert abs(sum(values) - sum(expected)) < TOLERANCE * len(values)
    greedy = [bool(ref[i - 1].argmax() == ids[i]) for i in range(len(context), len(ids))]
    assert [v == max(t.values()) for v, t in zip(values, tops)] == greedy


def test_responses_logprobs(server, client, reference, pair):
    model, tokenizer, texts = pair
    messages = chat("Count to ten.")
    _, tokens, _ = reference(messages, max_tokens=N)
    ids = encode_prompt(tokenizer, {"messages": messages})
    ref = mlx_lm_logprobs(model, ids + tokens)
    r = client.responses.create(model=MODEL_NAME, input="Count to ten.", max_output_tokens=N,
                                temperature=0, include=["message.output_text.logprobs"],
                                top_logprobs=4)
    part = r.output[-1].content[0]
    assert chat_gap(part.logprobs, ids + tokens, len(ids), ref, 4, texts) < TOLERANCE
    content = []
    with client.responses.stream(model=MODEL_NAME, input="Count to ten.", max_output_tokens=N,
                                 temperature=0, include=["message.output_text.logprobs"],
                                 top_logprobs=1) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                content += event.logprobs
    assert chat_gap(content, ids + tokens, len(ids), ref, 1, texts) < TOLERANCE


def test_concurrent_requests_each_scored_alone(server, client, reference, pair):
    """Several requests at once (batched on the batched server), each equal to mlx-lm's."""
    model, tokenizer, texts = pair
    questions = ["Why is the sky blue?", "Name three colours.", "What is 12 times 7?"]
    gaps, errors = {}, []

    def ask(i: int) -> None:
        try:
            r = client.chat.completions.create(model=MODEL_NAME, messages=chat(questions[i]),
                                               max_tokens=N, temperature=0, logprobs=True,
                                               top_logprobs=3)
            gaps[i] = r.choices[0].logprobs.content
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, question in enumerate(questions):
        _, tokens, _ = reference(chat(question), max_tokens=N)
        ids = encode_prompt(tokenizer, {"messages": chat(question)})
        ref = mlx_lm_logprobs(model, ids + tokens)
        assert chat_gap(gaps[i], ids + tokens, len(ids), ref, 3, texts) < TOLERANCE


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": chat("Hi"), "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": chat("Hi"), "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": chat("Hi"), "logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"messages": chat("Hi"), "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "echo": "yes"}, "echo"),
    ("/v1/responses", {"input": "Hi", "top_logprobs": 30}, "top_logprobs"),
])
def test_bad_fields_are_400s_naming_them(server, path, body, param):
    r = httpx.post(server["base"] + path, json={"model": MODEL_NAME, "max_tokens": 4, **body},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
