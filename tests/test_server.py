"""``dflash serve``: the real server (uvicorn, subprocess) on a free port, with tiny models.

Talks to it with the official ``openai`` client (streaming and not) and raw ``httpx`` for the error
cases; greedy outputs must equal the library's own greedy output.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here runs the models for many seconds

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[1]
KIND = "llama"  # = conftest.SERVER_KIND, the pair the `reference` fixture runs
MODEL_NAME = "tiny-target"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launch_server(target, draft, log: Path, *extra: str):
    """``dflash serve`` on a free port (``extra``: more options); yields its base URL and process.

    ``target`` None: no model arguments (the built-in pair under its own name, access log on)."""
    port = _free_port()
    env = dict(os.environ, PYTHONIOENCODING="utf-8", PYTHONUNBUFFERED="1")
    pair = [] if target is None else ["--model", str(target), "--draft", str(draft),
                                      "--served-model-name", MODEL_NAME, "--log-level", "warning"]
    with log.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dflash", "serve", *pair, "--port", str(port), *extra],
            cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"server did not start:\n{log.read_text()}")
        time.sleep(0.3)
    yield {"base": base, "proc": proc, "log": log}
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair(KIND)
    # One sequence at a time: these tests check the single-sequence engine's statistics, seeded
    # samples and queueing (the batched server: test_server_batch.py).
    with launch_server(target, draft, tmp_path_factory.mktemp("server") / "server.log",
                       "--max-concurrency", "1") as s:
        yield s


def chat(text):
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------------------------------------


def test_health_and_models(server, client):
    health = httpx.get(server["base"] + "/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL_NAME
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].model_extra["dflash"]["block_size"] == 8


def test_chat_greedy_equals_library(client, reference):
    text, tokens, n_prompt = reference(chat("Tell me about the sea."), max_tokens=24)
    r = client.chat.completions.create(model=MODEL_NAME, messages=chat("Tell me about the sea."),
                                       max_tokens=24, temperature=0)
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == len(tokens)
    assert r.usage.total_tokens == n_prompt + len(tokens)
    stats = r.model_extra["dflash"]
    assert stats["cycles"] >= 1 and stats["mean_tau"] >= 1.0
    assert len(stats["acceptance_by_position"]) == 7
    assert {"draft_time", "verify_time", "generation_tps", "block_size"} <= set(stats)


def test_min_confidence_shortens_verify_not_output(client, reference):
    text, _, _ = reference(chat("Tell me about the sea."), max_tokens=24)
    seen = {}
    for value in (0.0, 1.0):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=chat("Tell me about the sea."), max_tokens=24,
            temperature=0, extra_body={"min_confidence": value})
        assert r.choices[0].message.content == text
        stats = r.model_extra["dflash"]
        seen[value] = stats["verified_tokens"] / stats["cycles"]
    assert seen[1.0] <= 1.0 < seen[0.0]
    bad = httpx.post(str(client.base_url) + "chat/completions", json={
        "model": MODEL_NAME, "messages": chat("hi"), "min_confidence": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_confidence"


def test_lookup_field_turns_continuations_off_not_output(client, reference):
    prompt = chat("Repeat after me: one two three, one two three, one two three.")
    text, _, _ = reference(prompt, max_tokens=32)
    for lookup in (True, False):
        r = client.chat.completions.create(model=MODEL_NAME, messages=prompt, max_tokens=32,
                                           temperature=0, extra_body={"lookup": lookup})
        assert r.choices[0].message.content == text
        if not lookup:
            assert r.model_extra["dflash"]["lookup_cycles"] == 0
    bad = httpx.post(str(client.base_url) + "chat/completions", json={
        "model": MODEL_NAME, "messages": chat("hi"), "lookup": "no"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lookup"


def test_chat_stream_equals_library(client, reference):
    text, tokens, n_prompt = reference(chat("Count to ten."), max_tokens=20)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=chat("Count to ten."), max_tokens=20, temperature=0,
        stream=True, stream_options={"include_usage": True})
    parts, finish, stats, usage = [], None, None, None
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            if delta.content:
                parts.append(delta.content)
            if chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
                stats = chunk.model_extra.get("dflash")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(parts) == text
    assert finish in ("length", "stop")
    assert stats is not None and stats["cycles"] >= 1
    assert usage.prompt_tokens == n_prompt and usage.completion_tokens == len(tokens)


def test_completions_stream_and_not(client, reference):
    prompt = "Once upon a time"
    text, tokens, n_prompt = reference(prompt=prompt, max_tokens=16)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == text
    assert r.usage.completion_tokens == len(tokens) and r.usage.prompt_tokens == n_prompt
    assert r.model_extra["dflash"]["mean_tau"] >= 1.0
    parts, stats = [], None
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16,
                                           temperature=0, stream=True):
        parts.append(chunk.choices[0].text)
        if chunk.choices[0].finish_reason:
            stats = chunk.model_extra.get("dflash")
    assert "".join(parts) == text
    assert stats is not None


def test_sampling_settings_reach_the_engine(client, reference):
    settings = dict(temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.5,
                    frequency_penalty=0.3)
    extra = {"top_k": 40, "min_p": 0.02, "repetition_penalty": 1.2}
    text, _, _ = reference(chat("Name three colours."), max_tokens=16, **settings, **extra)
    r = client.chat.completions.create(model=MODEL_NAME, messages=chat("Name three colours."),
                                       max_tokens=16, extra_body=extra, **settings)
    assert r.choices[0].message.content == text
    greedy, _, _ = reference(chat("Name three colours."), max_tokens=16)
    assert text != greedy  # the settings changed the output, and the server applied them all


def test_stop_strings(client, reference):
    text, _, _ = reference(chat("Say something."), max_tokens=24)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop
    r = client.chat.completions.create(model=MODEL_NAME, messages=chat("Say something."),
                                       max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:text.find(stop)]


def test_two_concurrent_streams(client, reference):
    prompts = ["Write a poem about rain.", "What is the capital of France?"]
    expected = [reference(chat(p), max_tokens=32)[0] for p in prompts]
    results: dict[int, str] = {}
    errors = []

    def run(i):
        try:
            parts = []
            for chunk in client.chat.completions.create(
                    model=MODEL_NAME, messages=chat(prompts[i]), max_tokens=32, temperature=0,
                    stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
            results[i] = "".join(parts)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert results == {0: expected[0], 1: expected[1]}


def _eos_bias(server_base):
    import tiny_models

    cfg = json.loads((tiny_models.tokenizer_source() / "config.json").read_text())
    eos = cfg["eos_token_id"]
    return {str(e): -100 for e in (eos if isinstance(eos, list) else [eos])}


def test_disconnect_frees_the_worker(server, client):
    base = server["base"]
    body = {"model": MODEL_NAME, "messages": chat("Go on forever."), "max_tokens": 3000,
            "temperature": 0, "stream": True, "logit_bias": _eos_bias(base)}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", base + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            seen = 0
            for line in lines:
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break
        # The connection is closed here, mid-stream.
    tic = time.time()
    r = client.chat.completions.create(model=MODEL_NAME, messages=chat("Hi"), max_tokens=4,
                                       temperature=0)
    assert r.choices[0].message.content is not None
    assert time.time() - tic < 30
    # The long generation was stopped, not waited for: the next request hardly queued.
    assert r.model_extra["dflash"]["queue_time"] < 10
    deadline = time.time() + 10
    while time.time() < deadline:
        metrics = httpx.get(base + "/metrics").text
        if re.search(r"^dflash_cancelled_total [1-9]", metrics, re.M):
            break
        time.sleep(0.2)
    else:
        pytest.fail("no cancelled generation in /metrics:\n" + metrics)
    assert httpx.get(base + "/health").json()["busy"] is False


def _cancelled(base) -> float:
    m = re.search(r"^dflash_cancelled_total (\S+)$", httpx.get(base + "/metrics").text, re.M)
    return float(m.group(1))


def _requests_with_status(base, status: str) -> float:
    text = httpx.get(base + "/metrics").text
    return sum(float(v) for v in re.findall(
        rf'^dflash_requests_total{{[^}}]*status="{status}"[^}}]*}} (\S+)$', text, re.M))


def _generated_tokens(base) -> float:
    m = re.search(r"^dflash_generation_tokens_total (\S+)$", httpx.get(base + "/metrics").text,
                  re.M)
    return float(m.group(1))


def test_queued_client_that_leaves_is_dropped(server, reference):
    """A first client streams a long answer to its end; meanwhile a second request queues behind
    it and its client gives up. The queued job is dropped without running (no token generated
    for it) and the first answer is exactly the library's."""
    base = server["base"]
    bias = _eos_bias(base)
    messages, n = chat("Keep talking."), 400  # long enough to outlast the second client's wait
    expected, _, _ = reference(messages, max_tokens=n,
                               logit_bias={int(k): v for k, v in bias.items()})
    cancelled, left, generated = (_cancelled(base), _requests_with_status(base, "499"),
                                  _generated_tokens(base))
    long = {"model": MODEL_NAME, "messages": messages, "max_tokens": n, "temperature": 0,
            "stream": True, "logit_bias": bias}
    gave_up = []

    def queued_client_that_leaves():
        try:
            httpx.post(base + "/v1/chat/completions", timeout=0.5, json={
                "model": MODEL_NAME, "messages": chat("Hi"), "max_tokens": 8})
        except httpx.TimeoutException:
            gave_up.append(True)

    data = []
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", base + "/v1/chat/completions", json=long) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # kept: a dropped iterator closes the connection
            for line in lines:
                if line.startswith("data: "):
                    data.append(line)
                    break  # the long generation now holds the worker
            second = threading.Thread(target=queued_client_that_leaves)
            second.start()
            deadline = time.time() + 30
            while httpx.get(base + "/health").json()["queue_depth"] != 1:
                assert time.time() < deadline, "the second request never queued"
                time.sleep(0.05)
            second.join(timeout=30)
            assert gave_up == [True]
            while _requests_with_status(base, "499") < left + 1:  # the server saw it leave
                assert time.time() < deadline, "the server never noticed the client leave"
                time.sleep(0.05)
            health = httpx.get(base + "/health").json()
            assert health["busy"] and health["queue_depth"] == 1  # the first still generates
            data += [line for line in lines if line.startswith("data: ")]  # ... to its end
    assert data[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in data[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    deadline = time.time() + 10
    while _cancelled(base) < cancelled + 1 and time.time() < deadline:
        time.sleep(0.1)  # the worker takes the queued job and drops it
    assert _cancelled(base) == cancelled + 1
    assert _generated_tokens(base) == generated + n  # the first's tokens only: the other never ran
    health = httpx.get(base + "/health").json()
    assert (health["busy"], health["queue_depth"]) == (False, 0)


def _error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_bad_requests_get_openai_errors(server, client):
    base = server["base"]
    url = base + "/v1/chat/completions"
    ok = {"model": MODEL_NAME, "messages": chat("Hi"), "max_tokens": 4}
    with httpx.Client(timeout=60) as http:
        _error(http.post(url, content=b"{not json", headers={"content-type": "application/json"}),
               400, code="invalid_json")
        _error(http.post(url, content=b"[1, 2]"), 400, code="invalid_json")
        _error(http.post(url, json=dict(ok, model="no-such-model")), 404, param="model",
               code="model_not_found")
        _error(http.post(url, json=dict(ok, max_tokens=-5)), 400, param="max_tokens")
        _error(http.post(url, json=dict(ok, temperature=-0.5)), 400, param="temperature")
        _error(http.post(url, json=dict(ok, top_p=1.5)), 400, param="top_p")
        _error(http.post(url, json=dict(ok, top_p=0)), 400, param="top_p")
        _error(http.post(url, json=dict(ok, top_k=-1)), 400, param="top_k")
        _error(http.post(url, json=dict(ok, messages=[])), 400, param="messages")
        _error(http.post(url, json=dict(ok, messages="hello")), 400, param="messages")
        _error(http.post(url, json=dict(ok, stop=[3])), 400, param="stop")
        _error(http.post(url, json=dict(ok, n=2)), 400, param="n")
        long_prompt = "word " * 5000  # longer than the target's 4096 positions
        _error(http.post(url, json=dict(ok, messages=chat(long_prompt))), 400,
               param="messages", code="context_length_exceeded")
        _error(http.post(url, json=dict(ok, stream=True, temperature=-1)), 400,
               param="temperature")
        comp = base + "/v1/completions"
        _error(http.post(comp, json={"model": MODEL_NAME, "prompt": ""}), 400, param="prompt")
        _error(http.post(comp, json={"model": MODEL_NAME, "prompt": [10**9]}), 400,
               param="prompt")
        _error(http.post(comp, json={"model": MODEL_NAME, "prompt": long_prompt}), 400,
               param="prompt", code="context_length_exceeded")
        _error(http.get(base + "/v1/nothing-here"), 404)
        # ... and the server keeps serving.
        r = http.post(url, json=ok)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=chat("Hi"), temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=chat("Hi"))


def _parse_prometheus(text: str) -> dict[str, list[tuple[dict, float]]]:
    """A strict parser of the Prometheus text format (0.0.4) for what /metrics emits."""
    name_re = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
    sample_re = re.compile(
        rf'^({name_re})(\{{(?:{name_re}="(?:[^"\\\n]|\\.)*"(?:,{name_re}="(?:[^"\\\n]|\\.)*")*)?\}})?'
        r" ([-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|NaN|[+-]?Inf))$")
    label_re = re.compile(rf'({name_re})="((?:[^"\\\n]|\\.)*)"')
    types, samples = {}, {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped")
            assert name not in types, f"TYPE {name} twice"
            types[name] = kind
            continue
        m = sample_re.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        base = re.sub(r"_(bucket|sum|count)$", "", m.group(1))
        assert m.group(1) in types or types.get(base) == "histogram", \
            f"sample {m.group(1)} without a TYPE line"
        labels = dict(label_re.findall(m.group(2) or ""))
        samples.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return samples


def test_metrics_is_prometheus_text(server, client):
    client.chat.completions.create(model=MODEL_NAME, messages=chat("Hello"), max_tokens=8,
                                   temperature=0)
    resp = httpx.get(server["base"] + "/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    samples = _parse_prometheus(resp.text)
    for name in ("dflash_requests_total", "dflash_generation_tokens_total",
                 "dflash_prompt_tokens_total", "dflash_mean_tau", "dflash_tokens_per_second",
                 "dflash_draft_seconds_total", "dflash_verify_seconds_total",
                 "dflash_cycles_total", "dflash_acceptance_by_position"):
        assert name in samples, name
    ok = sum(v for labels, v in samples["dflash_requests_total"] if labels["status"] == "ok")
    assert ok >= 1
    assert samples["dflash_generation_tokens_total"][0][1] >= 8
    assert samples["dflash_mean_tau"][0][1] >= 1.0
    assert samples["dflash_verify_seconds_total"][0][1] > 0
    parser = pytest.importorskip("prometheus_client.parser")
    families = {f.name: f for f in parser.text_string_to_metric_families(resp.text)}
    assert families["dflash_requests"].type == "counter"
    assert families["dflash_mean_tau"].type == "gauge"
