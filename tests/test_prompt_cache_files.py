"""Conversations kept on disk (``PromptCache(directory=...)``, ``--prompt-cache-dir``): a restart
finds the previous turn's caches, every answer stays a fresh run's, and bad files never change
one."""

from __future__ import annotations

import re
import time
import warnings

import pytest
from dflash2_fixtures import write_dflash2_drafter

from dflash.cache_files import SUFFIX
from dflash.drafter import load_draft
from dflash.errors import PromptCacheDirError
from dflash.model_mlx import PromptCache, generate


def files(folder) -> list:
    return sorted(folder.rglob(f"*{SUFFIX}"))


def turns(tokenizer):
    prompt = tokenizer.encode("Write a function that reverses a list, then explain it.")
    return prompt, tokenizer.encode(" Now make it return a copy.")


def run(model, draft, tokenizer, prompt, pc=None, n=16):
    return generate(model, draft, tokenizer, prompt, max_tokens=n, block_size=4, prompt_cache=pc)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "llama"])
def test_a_restart_finds_the_previous_turn(kind, loaded_pair, tmp_path):
    """A new cache on the same folder (a restarted server) serves turn 2 from turn 1's file:
    prompt and reply (on Qwen3.5 from its snapshot at the end), the output a fresh run's."""
    model, tokenizer, draft = loaded_pair(kind)
    prompt, follow = turns(tokenizer)
    before = PromptCache(directory=tmp_path)
    first = run(model, draft, tokenizer, prompt, before)
    before.flush()
    assert len(files(tmp_path)) == 1
    second = prompt + first.tokens + follow
    after = PromptCache(directory=tmp_path)
    cached = run(model, draft, tokenizer, second, after)
    assert cached.stats.reused_prompt_tokens == len(prompt) + len(first.tokens) - 1
    assert cached.tokens == run(model, draft, tokenizer, second).tokens
    after.flush()
    # turn 2's file serves every prefix turn 1's did (attention caches): turn 1's is gone
    held = files(tmp_path)
    assert len(held) == (2 if kind == "qwen3_5" else 1)


def test_a_windowed_dflash2_drafter_round_trips(tiny_pair, loaded_pair, tmp_path):
    """The drafter's own caches (a DFlash2 drafter with a draft window: WindowCache rows in a
    DFlash2Cache) come back as they were saved."""
    model, tokenizer, _ = loaded_pair("qwen3")
    _, v1 = tiny_pair("qwen3")
    draft = load_draft(str(write_dflash2_drafter(tmp_path / "v2", v1, sliding_window=None)),
                       sliding_window_size=8)
    prompt, follow = turns(tokenizer)
    pc = PromptCache()
    first = run(model, draft, tokenizer, prompt, pc)
    pc.save(tmp_path / "cache")
    again = PromptCache.load(tmp_path / "cache")
    second = prompt + first.tokens + follow
    cached = run(model, draft, tokenizer, second, again)
    assert cached.stats.reused_prompt_tokens == len(prompt) + len(first.tokens) - 1
    assert cached.tokens == run(model, draft, tokenizer, second).tokens
    saved, loaded = pc.entries()[0].draft, again.entries()[0].draft
    assert type(saved) is type(loaded) and [type(c) for c in saved] == [type(c) for c in loaded]


def test_bad_files_are_skipped_and_never_change_an_answer(loaded_pair, tmp_path):
    """A truncated file, a file of garbage and one written for other weights: a warning each,
    no reuse from them, the answer a fresh run's."""
    model, tokenizer, draft = loaded_pair("llama")
    prompt, follow = turns(tokenizer)
    pc = PromptCache(directory=tmp_path)
    first = run(model, draft, tokenizer, prompt, pc)
    pc.flush()
    (saved,) = files(tmp_path)
    second = prompt + first.tokens + follow
    fresh = run(model, draft, tokenizer, second).tokens

    saved.write_bytes(saved.read_bytes()[: saved.stat().st_size // 2])  # truncated
    with pytest.warns(UserWarning, match="does not read back"):
        out = run(model, draft, tokenizer, second, restarted := PromptCache(directory=tmp_path))
    restarted.flush()
    assert out.stats.reused_prompt_tokens == 0 and out.tokens == fresh
    assert not saved.exists()

    (saved.parent / f"junk{SUFFIX}").write_bytes(b"\x00garbage" * 10)
    with pytest.warns(UserWarning, match="junk.*skipped"):
        out = run(model, draft, tokenizer, second, restarted := PromptCache(directory=tmp_path))
    restarted.flush()
    assert out.tokens == fresh

    # Another pair's files live under its own fingerprint: never read for this one.
    for f in files(tmp_path):
        f.unlink()
    other_model, other_tok, other_draft = loaded_pair("qwen3")
    other = PromptCache(directory=tmp_path)
    run(other_model, other_draft, other_tok, prompt, other)
    other.flush()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the junk file again
        out = run(model, draft, tokenizer, second, PromptCache(directory=tmp_path))
    assert out.stats.reused_prompt_tokens == 0 and out.tokens == fresh


def test_the_folder_stays_within_its_byte_budget(loaded_pair, tmp_path):
    model, tokenizer, draft = loaded_pair("llama")
    prompts = [[7 + i] + tokenizer.encode(f" conversation {i} about boats and the sea")
               for i in range(4)]
    probe = PromptCache(directory=tmp_path / "probe")
    run(model, draft, tokenizer, prompts[0], probe, n=8)
    probe.flush()
    one = files(tmp_path / "probe")[0].stat().st_size
    budget = int(one * 2.5)
    pc = PromptCache(directory=tmp_path / "kept", directory_bytes=budget)
    for p in prompts:
        run(model, draft, tokenizer, p, pc, n=8)
        pc.flush()
    held = files(tmp_path / "kept")
    assert len(held) == 2 and sum(f.stat().st_size for f in held) <= budget
    # the newest two: a new cache on the folder serves the last conversation, not the first
    again = PromptCache(directory=tmp_path / "kept")
    assert run(model, draft, tokenizer, prompts[3] + [5], again, n=4) \
        .stats.reused_prompt_tokens == len(prompts[3])
    assert run(model, draft, tokenizer, prompts[0] + [5], again, n=4) \
        .stats.reused_prompt_tokens == 0


def test_deferred_writes_wait_for_the_owner_and_keep_the_newest_turn(loaded_pair, tmp_path):
    """``defer_writes`` (the server's): a stored reply is written only when the owner says so,
    a later turn of the same conversation replaces the queued one, and an entry memory lets go
    of is written at once (never lost) unless an entry held serves all of it."""
    model, tokenizer, draft = loaded_pair("llama")
    prompt, follow = turns(tokenizer)
    pc = PromptCache(directory=tmp_path / "a", defer_writes=True)
    first = run(model, draft, tokenizer, prompt, pc)
    second = prompt + first.tokens + follow
    out = run(model, draft, tokenizer, second, pc)
    assert files(tmp_path / "a") == [] and pc.folder.queued == 1
    pc.write_deferred()
    pc.flush()
    assert len(files(tmp_path / "a")) == 1 and pc.folder.queued == 0
    again = PromptCache(directory=tmp_path / "a")
    longer = second + out.tokens + follow
    assert run(model, draft, tokenizer, longer, again).stats.reused_prompt_tokens \
        == len(second) + len(out.tokens) - 1

    small = PromptCache(max_entries=1, directory=tmp_path / "b", defer_writes=True)
    run(model, draft, tokenizer, prompt, small, n=4)
    assert files(tmp_path / "b") == []
    run(model, draft, tokenizer, [9] + follow, small, n=4)  # evicts the first from memory
    small.folder._writer.submit(lambda: None).result()  # the write started has ended
    assert len(files(tmp_path / "b")) == 1 and small.folder.queued == 1
    small.flush()  # what a server's shutdown does
    assert len(files(tmp_path / "b")) == 2 and small.folder.queued == 0


def test_the_batched_engine_defers_to_the_end_of_a_conversation(loaded_pair, tmp_path):
    """The server's engine stores each prompt before its reply (memory lets the previous
    turn's entry go then): nothing is written while the conversation goes on, and its last
    turn, prompt and reply, once the owner writes."""
    from dflash.batch import BatchGenerator

    model, tokenizer, draft = loaded_pair("llama")
    prompt, follow = turns(tokenizer)
    pc = PromptCache(directory=tmp_path, defer_writes=True)
    engine = BatchGenerator(model, draft, tokenizer, max_batch=2, block_size=4, prompt_cache=pc)

    def answer(ids):
        uid, out = engine.insert(ids, max_tokens=12), []
        while engine.active or engine.pending:
            out += [t for e in engine.step() if e.uid == uid for t in e.tokens]
        return out

    history = prompt
    for _ in range(3):
        history = history + answer(history) + follow
        assert files(tmp_path) == [] and pc.folder.queued == 1
    pc.flush()
    (saved,) = files(tmp_path)
    again = PromptCache(directory=tmp_path)
    reply = run(model, draft, tokenizer, history, again)
    assert reply.stats.reused_prompt_tokens == len(history) - len(follow) - 1  # last one unfed
    assert reply.tokens == run(model, draft, tokenizer, history).tokens


def test_a_folder_that_cannot_be_written_is_named(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(PromptCacheDirError, match="a-file"):
        PromptCache(directory=blocker / "cache")
    with pytest.raises(Exception, match="directory_bytes"):
        PromptCache(directory=tmp_path, directory_bytes=0)


KEY_A, KEY_B = "sk-alpha-0123456789", "sk-bravo-9876543210"


def _chat(httpx, base: str, key: str, messages: list[dict]) -> dict:
    r = httpx.post(base + "/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": "tiny-target", "max_tokens": 24, "temperature": 0,
                         "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", ["1", "2"])
def test_a_restarted_server_serves_the_next_turn_from_disk(tiny_pair, tmp_path, concurrency):
    """``dflash serve --prompt-cache-dir``: turn 1 on one server, turn 2 on a new one (keys
    listed in the other order): the same cached tokens as a server never restarted, the same
    answer; another key finds nothing of it."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from test_server import KIND, launch_server

    target, draft = tiny_pair(KIND)
    folder = tmp_path / "cache"
    first = [{"role": "user", "content": "Write a function that reverses a list."}]

    def second(reply: dict) -> list[dict]:
        return first + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                        {"role": "user", "content": "Now make it return a copy."}]

    common = ("--max-concurrency", concurrency)
    with launch_server(target, draft, tmp_path / "warm.log", "--api-key", KEY_A, *common) as s:
        reply = _chat(httpx, s["base"], KEY_A, first)
        warm = _chat(httpx, s["base"], KEY_A, second(reply))
    with launch_server(target, draft, tmp_path / "one.log", "--api-key", KEY_A,
                       "--api-key", KEY_B, "--prompt-cache-dir", str(folder), *common,
                       "--record", str(tmp_path / "rec")) as s:
        again = _chat(httpx, s["base"], KEY_A, first)
        # written once the server has been idle a moment, not only when it stops
        for _ in range(300):
            if list(folder.rglob(f"*{SUFFIX}")):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the reply was not written while the server was idle")
    assert again["choices"][0]["message"] == reply["choices"][0]["message"]
    from dflash.serving.record import read_session
    from dflash.serving.scopes import scope_name

    (recorded,) = read_session(tmp_path / "rec")  # what a replay sends, the key never written
    assert recorded["body"]["messages"] == first and recorded["scope"] == scope_name(KEY_A)
    assert KEY_A not in (tmp_path / "rec" / "requests.jsonl").read_text()
    assert list(folder.rglob(f"*{SUFFIX}")), "turn 1 was not written"
    with launch_server(target, draft, tmp_path / "two.log", "--api-key", KEY_B,
                       "--api-key", KEY_A, "--prompt-cache-dir", str(folder), *common) as s:
        other = _chat(httpx, s["base"], KEY_B, second(reply))
        restarted = _chat(httpx, s["base"], KEY_A, second(reply))
    # stopped by SIGTERM, it wrote what it held back before exiting (uvicorn's re-raised
    # signal used to end the process first)
    assert re.search(r"prompt cache: \d+ conversations? written to .* at shutdown",
                     (tmp_path / "two.log").read_text())
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > reply["usage"]["prompt_tokens"]  # the reply too, not only turn 1's prompt
    assert restarted["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert restarted["choices"][0]["message"] == warm["choices"][0]["message"]
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert other["choices"][0]["message"] == warm["choices"][0]["message"]
