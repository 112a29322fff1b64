"""The server's parts on their own: request parsing, metrics, the worker's queue, in-process apps.

Request parsing and metrics need neither a model nor an HTTP client; the in-process tests use
FastAPI's ``TestClient`` (httpx) on the tiny models.
"""

from __future__ import annotations

import re

import pytest

from dflash.errors import APIError, QueueFull
from dflash.serving.requests import ServedModel, parse_request

SERVED = ServedModel(name="tiny", path="/models/tiny", vocab_size=100, max_context=64,
                     default_max_tokens=16)


def completion(**fields):
    return parse_request("completions", {"model": "tiny", "prompt": [1, 2, 3], **fields},
                         tokenizer=None, served=SERVED)


def rejected(**fields) -> APIError:
    with pytest.raises(APIError) as e:
        completion(**fields)
    return e.value


def test_requests_are_checked_by_the_engine_rules_and_the_api_limits():
    req = completion(temperature=0.5, top_k=40.0, repetition_penalty=1.0,
                     logit_bias={"5": -100}, seed=3, stream=True,
                     stream_options={"include_usage": True})
    s = req.settings
    assert s.top_k == 40 and isinstance(s.top_k, int)
    assert s.repetition_penalty is None  # 1.0 is no penalty
    assert s.logit_bias == {5: -100.0}
    assert s.max_tokens == 16 and s.proposal == "sample"
    assert req.stream and req.include_usage and req.prompt_ids == [1, 2, 3]
    for fields, param in [({"temperature": -0.5}, "temperature"),  # the engine's rule
                          ({"temperature": 3}, "temperature"),  # OpenAI's limit
                          ({"presence_penalty": 2.5}, "presence_penalty"),
                          ({"top_p": 0}, "top_p"), ({"top_k": -1}, "top_k"),
                          ({"top_k": 1.5}, "top_k"), ({"seed": "x"}, "seed"),
                          ({"logit_bias": {"1000": 1}}, "logit_bias"),
                          ({"max_tokens": 0}, "max_tokens"), ({"n": 2}, "n"),
                          ({"stop": [3]}, "stop"), ({"logprobs": True}, "logprobs")]:
        e = rejected(**fields)
        assert (e.status, e.param) == (400, param), (fields, e.message)
    # Beyond the room the 3-token prompt leaves in 64 positions: clamped to it, no error.
    assert completion(max_tokens=62).settings.max_tokens == 61
    assert rejected(model="gpt-4").status == 404
    assert rejected(prompt=[100]).param == "prompt"


def test_metrics_registries_are_per_server():
    from types import SimpleNamespace

    from dflash.serving.metrics import Metrics

    a, b = Metrics(), Metrics()
    a.watch({"model": "a", "draft": "d"}, queue_depth=lambda: 2, busy=lambda: True)
    b.watch({"model": "b", "draft": "d"}, queue_depth=lambda: 0, busy=lambda: False)
    a.request("chat", "ok")
    a.generation(SimpleNamespace(prompt_tokens=5, generation_tokens=9, cycles=3, mean_tau=3.0,
                                 generation_tps=30.0, prompt_tps=50.0, draft_time=0.1,
                                 verify_time=0.2, acceptance_by_position=[1.0, 0.5],
                                 plain_steps=1, rows_per_pass=5.0, reused_prompt_tokens=2))
    text_a, text_b = a.render().decode(), b.render().decode()
    assert re.search(r'^dflash_requests_total\{endpoint="chat",status="ok"\} 1\.0$', text_a, re.M)
    assert re.search(r"^dflash_generation_tokens_total 9\.0$", text_a, re.M)
    assert re.search(r'^dflash_acceptance_by_position\{position="2"\} 0\.5$', text_a, re.M)
    assert re.search(r"^dflash_busy 1\.0$", text_a, re.M)
    assert re.search(r"^dflash_generation_tokens_total 0\.0$", text_b, re.M)
    assert 'model="b"' in text_b and 'model="a"' not in text_b
    assert "_created" not in text_a  # the same families as before prometheus_client


def test_full_worker_queue_raises_queue_full():
    from dflash.serving.worker import Job, Worker

    worker = Worker(loader=lambda: None, metrics=None, max_queue=0)
    with pytest.raises(QueueFull, match="0 requests are already waiting"):
        worker.submit(Job([1], {}, loop=None, out=None))


def test_a_failed_load_ends_the_worker_thread_and_its_mlx_streams(monkeypatch):
    # MLX gives the worker thread a stream of its own; left alive it aborts the process at exit
    # (exit 134), so start() must not return the load error before the thread released it.
    import threading

    import mlx.core as mx

    from dflash.serving import worker as worker_module

    released, real_release = [], worker_module.release_thread_streams

    def release():
        real_release()
        released.append(threading.current_thread().name)

    monkeypatch.setattr(worker_module, "release_thread_streams", release)

    def loader():
        mx.eval(mx.random.uniform(shape=(8, 8)))  # the target loaded, then the drafter failed
        raise ValueError("drafter does not fit")

    worker = worker_module.Worker(loader=loader, metrics=None)
    with pytest.raises(ValueError, match="does not fit"):
        worker.start()
    assert released == ["dflash-engine"]
    assert not worker.thread.is_alive()


@pytest.fixture(scope="module")
def app_client(tiny_pair):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from dflash.serving import create_server

    target, draft = tiny_pair("llama")
    servers = [create_server(str(target), str(draft), served_model_name=name, max_queue=queue,
                             quiet=True) for name, queue in (("open", 64), ("full", 0))]
    yield [TestClient(s.app) for s in servers]
    for s in servers:
        s.worker.stop()


@pytest.mark.slow
def test_full_queue_is_429_and_two_servers_keep_their_own_metrics(app_client):
    open_, full = app_client
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    r = full.post("/v1/chat/completions", json=body)
    assert r.status_code == 429
    assert r.json()["error"] == {"message": "0 requests are already waiting; retry later",
                                 "type": "rate_limit_error", "param": None, "code": "queue_full"}
    assert open_.post("/v1/chat/completions", json=body).status_code == 200
    assert 'status="429"' in full.get("/metrics").text
    assert 'status="429"' not in open_.get("/metrics").text
    assert open_.get("/health").json()["model"] == "open"


@pytest.mark.slow
def test_run_on_a_taken_port_raises_server_start_error(tiny_pair):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import socket

    from dflash.errors import ServerStartError
    from dflash.serving import create_server, run

    target, draft = tiny_pair("llama")
    server = create_server(str(target), str(draft), quiet=True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServerStartError, match=f"could not listen on 127.0.0.1:{port}"):
            run(server, "127.0.0.1", port, log_level="critical")
    assert not server.worker.thread.is_alive()  # run() stopped the worker either way
