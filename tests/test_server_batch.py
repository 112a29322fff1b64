"""The batched server (``--max-concurrency 4``): several clients decode together, each exactly.

A real ``dflash serve`` on localhost with the tiny Llama pair, the official ``openai`` client from
several threads at once; every answer must equal the library's own greedy answer for that request
alone, while ``/metrics`` shows more than one sequence decoding at a time.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
from test_server import KIND, MODEL_NAME, chat, launch_server

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

QUESTIONS = ["Tell me about the sea.", "Count to ten.", "Why is the sky blue?",
             "Write a short poem about cats and dogs.", "What is 12 times 7?", "Name three colours."]


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair(KIND)
    with launch_server(target, draft, tmp_path_factory.mktemp("server") / "server.log",
                       "--max-concurrency", "4") as s:
        yield s


def _batch_size(base: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    return float(re.search(r"^dflash_batch_size ([0-9.]+)$", text, re.M).group(1))


def test_concurrent_clients_are_batched_and_exact(server, client, reference):
    assert httpx.get(server["base"] + "/health").json()["max_concurrency"] == 4
    lengths = [40, 24, 48, 32, 16, 40]
    answers: dict[int, object] = {}
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            if i % 2:  # half of them streamed
                stream = client.chat.completions.create(
                    model=MODEL_NAME, messages=chat(QUESTIONS[i]), max_tokens=lengths[i],
                    temperature=0, stream=True)
                answers[i] = "".join(c.choices[0].delta.content or "" for c in stream
                                     if c.choices)
            else:
                r = client.chat.completions.create(
                    model=MODEL_NAME, messages=chat(QUESTIONS[i]), max_tokens=lengths[i],
                    temperature=0)
                answers[i] = r.choices[0].message.content
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    widest = 0.0
    while any(t.is_alive() for t in threads):
        widest = max(widest, _batch_size(server["base"]))
        time.sleep(0.05)
    assert not errors, errors
    for i, question in enumerate(QUESTIONS):
        text, _, _ = reference(chat(question), max_tokens=lengths[i])
        assert answers[i] == text, (i, question)
    assert widest >= 2  # the sequences really decoded together


def test_a_client_that_leaves_does_not_disturb_the_others(server, client, reference):
    kept = {}

    def ask(i: int) -> None:
        r = client.chat.completions.create(model=MODEL_NAME, messages=chat(QUESTIONS[i]),
                                           max_tokens=40, temperature=0)
        kept[i] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in (0, 2)]
    for t in threads:
        t.start()
    leaving = client.chat.completions.create(model=MODEL_NAME, messages=chat(QUESTIONS[3]),
                                             max_tokens=200, temperature=0, stream=True)
    for n, _ in enumerate(leaving):
        if n == 2:
            break
    leaving.close()
    for t in threads:
        t.join()
    for i in (0, 2):
        assert kept[i] == reference(chat(QUESTIONS[i]), max_tokens=40)[0]
    deadline = time.time() + 60
    while _batch_size(server["base"]) and time.time() < deadline:
        time.sleep(0.1)
    assert _batch_size(server["base"]) == 0  # the one that left is gone too


def test_own_verify_settings_run_alone_and_exact(server, client, reference):
    text, _, _ = reference(chat(QUESTIONS[1]), max_tokens=24)
    for extra in ({"policy": "fixed", "block_size": 4}, {"min_confidence": 0.5}):
        r = client.chat.completions.create(model=MODEL_NAME, messages=chat(QUESTIONS[1]),
                                           max_tokens=24, temperature=0, extra_body=extra)
        assert r.choices[0].message.content == text, extra
