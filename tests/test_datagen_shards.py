"""dflash records: sealed shards with a manifest, resumable and deduplicated generation, prompt
sources with held-out splits that no training prompt overlaps."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import write_target

import dflash
from dflash.errors import DataSetError
from dflash.prompts import PromptFileError
from dflash.training import sources as S
from dflash.training.records import run_records, seal_now
from dflash.training.shards import ShardStore, compress, iter_records, publish, read_manifest


def rec(i: int, domain: str = "chat", prompt: list[int] | None = None) -> dict:
    return {"id": f"{domain}-{i}", "domain": domain, "prompt_ids": prompt or [1, 2, i],
            "response_ids": [5, 6, 2], "finish_reason": "stop"}


def all_ids(work: Path) -> list[str]:
    return [r["id"] for r in iter_records(work)]


# ---------------------------------------------------------------------------------------------
# The shard store


def test_shards_seal_with_checksums_and_publish_once(tmp_path):
    work, repo = tmp_path / "work", tmp_path / "repo"
    store = ShardStore(work, "fp1", repo, {"*": 3})
    sealed = [store.append(rec(i)) for i in range(7)]
    store.close()
    assert [p.name for p in sealed if p] == ["chat-0001.jsonl.gz", "chat-0002.jsonl.gz"]
    manifest = read_manifest(work)
    assert manifest["target_fingerprint"] == "fp1"
    for name, entry in manifest["shards"].items():
        data = (work / "sealed" / f"{name}.jsonl.gz").read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert entry["count"] == 3 and entry["domain"] == "chat"
    # Reproducible bytes: the same records compress to the same shard.
    first = [json.loads(x) for x in gzip.decompress(
        (work / "sealed" / "chat-0001.jsonl.gz").read_bytes()).splitlines()]
    assert compress(first) == (work / "sealed" / "chat-0001.jsonl.gz").read_bytes()
    assert all_ids(work) == [f"chat-{i}" for i in range(7)]

    new = publish(work, repo)
    assert [p.name for p in new] == ["chat-0001.jsonl.gz", "chat-0002.jsonl.gz"]
    assert publish(work, repo) == []  # each sealed shard is copied (and committed) once
    assert read_manifest(repo)["shards"] == manifest["shards"]

    # A new machine: only the repository's shards. Numbering and done ids continue from them.
    other = ShardStore(tmp_path / "work2", "fp1", repo, {"*": 3})
    assert other.is_done("chat-5") and not other.is_done("chat-6")
    other.append(rec(9))
    other.close()
    assert (tmp_path / "work2" / "open" / "chat-0003.jsonl").is_file()

    # A sealed shard is never rewritten: other bytes under a published name are refused.
    (work / "sealed" / "chat-0001.jsonl.gz").write_bytes(compress([rec(100)]))
    m = read_manifest(work)
    m["shards"]["chat-0001"].update(sha256=hashlib.sha256(compress([rec(100)])).hexdigest(),
                                    count=1)
    (work / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataSetError, match="never rewritten"):
        publish(work, repo)


def test_shards_checksum_mismatch_is_an_error(tmp_path):
    work = tmp_path / "work"
    store = ShardStore(work, "fp1", None, {"*": 2})
    for i in range(2):
        store.append(rec(i))
    path = work / "sealed" / "chat-0001.jsonl.gz"
    path.write_bytes(path.read_bytes()[:-3])  # cut short
    with pytest.raises(DataSetError, match="sha256"):
        ShardStore(work, "fp1")


def test_shards_refuse_another_target(tmp_path):
    store = ShardStore(tmp_path / "work", "fp1", None)
    store.append(rec(0))
    store.close()
    with pytest.raises(DataSetError, match="target_fingerprint"):
        ShardStore(tmp_path / "work", "fp2")
    publish(tmp_path / "work", tmp_path / "repo")
    with pytest.raises(DataSetError, match="must not mix"):  # the repository's target counts too
        ShardStore(tmp_path / "new", "fp2", tmp_path / "repo")


def test_shards_dedup_by_id_and_prompt_tokens(tmp_path):
    store = ShardStore(tmp_path / "w", "fp", None)
    store.append(rec(0, prompt=[1, 2, 3]))
    store.append(rec(0, prompt=[9, 9, 9]))  # the same id again
    store.append({**rec(1), "prompt_ids": [1, 2, 3]})  # the same prompt under another id
    store.close()
    assert all_ids(tmp_path / "w") == ["chat-0"]


def test_shards_cut_line_and_interrupted_seal_recover(tmp_path):
    work = tmp_path / "w"
    store = ShardStore(work, "fp", None, {"*": 3})
    store.append(rec(0))
    store.append(rec(1))
    store.close()
    with (work / "open" / "chat-0001.jsonl").open("a") as f:
        f.write('{"id": "chat-2", "prompt_ids": [1, 2')  # killed mid-line
    store = ShardStore(work, "fp", None, {"*": 3})
    assert store.done_ids == {"chat-0", "chat-1"}  # the cut record is not done
    store.append(rec(2))  # so it is written again, on a line of its own; the shard seals
    store.close()
    assert all_ids(work) == ["chat-0", "chat-1", "chat-2"]
    assert read_manifest(work)["shards"]["chat-0001"]["count"] == 3

    # Killed between the sealed file and the manifest: the leftover goes, the open shard stays.
    store = ShardStore(work, "fp", None, {"*": 2})
    store.append(rec(3))
    store.close()
    (work / "sealed" / "chat-0002.jsonl.gz").write_bytes(compress([rec(3)]))
    store = ShardStore(work, "fp", None, {"*": 2})
    assert not (work / "sealed" / "chat-0002.jsonl.gz").exists()
    assert store.is_done("chat-3")
    store.close()
    # Killed between the manifest and removing the open shard: the open copy goes.
    (work / "open" / "chat-0001.jsonl").write_text(json.dumps(rec(0)) + "\n")
    ShardStore(work, "fp", None, {"*": 2}).close()
    assert not (work / "open" / "chat-0001.jsonl").exists()
    assert sorted(all_ids(work)) == ["chat-0", "chat-1", "chat-2", "chat-3"]


# ---------------------------------------------------------------------------------------------
# Prompt sources


def test_overlap_filter_drops_humaneval_and_heldout_text():
    he = S.humaneval_texts()
    assert len(he) == 164
    f = S.OverlapFilter(he)
    problem = he[0].split("\n", 1)[1][:400]
    items = [{"id": "a", "messages": [{"role": "user", "content": "Complete:\n" + problem}]},
             {"id": "b", "messages": [{"role": "user", "content": "def read_config(path):\n"
                                                               "    '''Read an INI file.'''"}]}]
    kept, dropped = f.keep(items)
    assert [it["id"] for it in kept] == ["b"] and [it["id"] for it in dropped] == ["a"]
    # System prompts are not compared (every tool-call prompt shares one).
    sys_only = {"id": "c", "messages": [{"role": "system", "content": problem},
                                        {"role": "user", "content": "hi there"}]}
    assert f.keep([sys_only])[0] == [sys_only]


def test_sources_hold_out_files_and_split_prompts(tmp_path):
    from transformers import AutoTokenizer

    from dflash.default_pair import default_target_path

    tok = AutoTokenizer.from_pretrained(str(default_target_path()))
    body = "\n".join(f"    x = x + {i}" for i in range(12))
    text = (f'def public_fn(x):\n    """Add the numbers one to twelve to x and return it, slowly '
            f'and carefully."""\n{body}\n    return x\n')
    names = [f"pkg/mod{i}.py" for i in range(200)]
    held = next(n for n in names if S.heldout_file(n, text))
    train = next(n for n in names if not S.heldout_file(n, text))
    files = [(held, text), (train, text)]
    code = S.code_sources(files)
    assert any(it["id"].startswith("code-doc-pkg.mod") for it in code)
    assert all(held[:-3].replace("/", ".") not in it["id"] for it in code)
    agent_held = S.agent_sources(files, tok, heldout=True, n_tool=60)
    agent_train = S.agent_sources(files, tok, heldout=False, n_tool=60)
    assert {it["id"] for it in agent_held}.isdisjoint(it["id"] for it in agent_train)
    assert any(held in it["id"] for it in agent_held if it["source"] == "edit-file")
    assert not any(held in it["id"] for it in agent_train)

    # A training prompt whose user text equals a held-out split's is dropped.
    split = tmp_path / "agent.jsonl"
    split.write_text("".join(json.dumps(it) + "\n" for it in agent_held))
    dup = dict(agent_held[0], id="agent-copy")
    out = S.build_sources(tok, gsm8k=None, domains=["agent"], files=files, split_files=[split])
    assert "agent-copy" not in {it["id"] for it in out["agent"]}
    extra = tmp_path / "mine.jsonl"
    extra.write_text(json.dumps({"id": "x", "messages": dup["messages"]}) + "\n"
                     + json.dumps({"id": "y", "prompt": "Tell me a joke about owls."}) + "\n")
    out = S.build_sources(tok, gsm8k=None, domains=["agent"], files=files, split_files=[split],
                          prompt_files=[("mine", extra)])
    assert [it["id"] for it in out["mine"]] == ["mine-file-y"]


def test_bad_prompt_files_name_the_line(tmp_path):
    bad = tmp_path / "magpie-0001.jsonl"
    bad.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\nnot json\n')
    with pytest.raises(DataSetError, match=r"magpie-0001.jsonl:2"):
        S.magpie_prompts([bad])
    with pytest.raises(PromptFileError, match=r"magpie-0001.jsonl:2"):
        S.file_prompts(bad, "chat")
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text('{"question": "1+1?"}\n{"answer": "2"}\n')
    with pytest.raises(DataSetError, match=r"gsm.jsonl:2"):
        S.math_sources(gsm)


def test_interleave_follows_the_weights():
    by = {d: [{"id": f"{d}-{i}"} for i in range(1000)] for d in ("a", "b", "c")}
    q = S.interleave(by, {"a": 0.5, "b": 0.3, "c": 0.2})
    head = [it["id"].split("-")[0] for it in q[:100]]
    assert (head.count("a"), head.count("b"), head.count("c")) == (50, 30, 20)
    assert len(q) == 3000 and len({it["id"] for it in q}) == 3000  # all, once


# ---------------------------------------------------------------------------------------------
# The job


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return write_target(tmp_path_factory.mktemp("rec") / "target", "llama", layers=2, hidden=32)


QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Count to three.", "Say hello.",
             "What is the capital of France?", "Write a haiku about rain.", "Why is the sky blue?"]


def tiny_sources() -> dict[str, list[dict]]:
    chat = [S._item(f"chat-t{i}", "chat", "t", S._user(q), max_tokens=6)
            for i, q in enumerate(QUESTIONS)]
    chat.append(S._item("chat-dup", "chat", "t", S._user(QUESTIONS[0]), max_tokens=6))
    code = [S._item(f"code-t{i}", "code", "t", S._user(f"def f{i}(x):"), max_tokens=5)
            for i in range(4)]
    return {"chat": chat, "code": code}


def test_run_records_resumes_without_loss_or_repeat(target, tmp_path):
    from dflash.target import load_target

    work = tmp_path / "work"
    kw = dict(sources=tiny_sources(), legacy=[], home=tmp_path, pid_file=False, chunk=4)
    one = run_records(str(target), work, None, max_records=3, **kw)
    first = list(iter_records(work))
    assert len(first) == 3
    (tmp_path / "SEAL").touch()  # the job seals its open shards, full or not, between records
    two = run_records(str(target), work, None, max_records=2, **kw)
    # status.json keeps the totals over runs (the CPU-hours a data budget counts)
    assert two["made_all_runs"] == 5 and two["made"] == 2
    assert abs(two["cpu_s_all_runs"] - (one["cpu_s"] + two["cpu_s"])) <= 0.15  # each rounded
    assert not (tmp_path / "SEAL").exists()
    assert sum(e["count"] for e in read_manifest(work)["shards"].values()) == 3
    stats = run_records(str(target), work, None, **kw)
    assert stats["finished"]
    rows = list(iter_records(work))
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 11  # 12 prompts, one a copy of another's tokens
    assert stats["made_all_runs"] == 11
    assert "chat-dup" not in ids or "chat-t0" not in ids
    assert all(r in rows for r in first)  # what was written stays as it was
    _, tok = load_target(str(target))
    for r in rows:
        assert r["finish_reason"] in ("stop", "length")
        assert 1 <= len(r["response_ids"]) <= (6 if r["domain"] == "chat" else 5)
        if r["domain"] == "chat":
            assert r["prompt_ids"] == tok.apply_chat_template(r["messages"],
                                                             add_generation_prompt=True)
    assert run_records(str(target), work, None, **kw)["made"] == 0  # nothing left


@pytest.mark.slow
def test_records_job_pauses_and_resumes_after_a_kill(target, tmp_path):
    """The background job: sleeps while PAUSE exists, killed with SIGKILL loses and repeats
    nothing, and a rerun continues (built-in sources, a tiny target)."""
    home, work, repo = tmp_path / "home", tmp_path / "work", tmp_path / "repo"
    home.mkdir()
    (home / "PAUSE").touch()
    env = dict(os.environ, DFLASH_HOME=str(home), OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=str(Path(dflash.__file__).parent.parent))
    cmd = [sys.executable, "-m", "dflash.training.records", "run", "--target", str(target),
           "--work", str(work), "--repo", str(repo), "--domains", "chat,code", "--chunk", "16"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def count() -> int:
        return sum(1 for _ in iter_records(work)) if (work / "manifest.json").is_file() else 0

    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (home / "datagen.pid").is_file():
            time.sleep(0.2)
        assert int((home / "datagen.pid").read_text()) == proc.pid
        time.sleep(20)  # building sources takes a while; then it must wait
        assert count() == 0 and proc.poll() is None
        (home / "PAUSE").unlink()
        while time.time() < deadline and count() < 5 and proc.poll() is None:
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = list(iter_records(work))
    assert len(before) >= 5
    r = subprocess.run(cmd + ["--max-records", "8", "--no-pid-file"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    after = list(iter_records(work))
    ids = [x["id"] for x in after]
    assert len(ids) == len(set(ids)) >= len(before) + 8
    assert {x["id"] for x in before} <= set(ids)


def test_magpie_steering_shapes_turns_without_being_kept(target, tmp_path, monkeypatch):
    from dflash.training import magpie

    seen_headers = []
    real_header = magpie.user_header

    def spy(tokenizer, history=None):
        seen_headers.append(history)
        return real_header(tokenizer, history)

    monkeypatch.setattr(magpie, "user_header", spy)
    monkeypatch.setattr(magpie, "clean_turn", lambda text: f"turn {len(seen_headers)} {text!r}")
    from dflash.training.capture import RolloutEngine  # a random model never ends a turn
    monkeypatch.setattr(RolloutEngine, "_finished",
                        lambda self, seq: "stop" if len(seq.response) >= 3 else None)
    out, _ = magpie.write_user_turns(str(target), tmp_path / "m.jsonl", 4, max_tokens=4,
                                     batch_size=4, steer=["in French", "in German"],
                                     prefix="magpie", heldout_percent=0.0)
    assert {h[0]["content"] for h in seen_headers} == {"in French", "in German"}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all([m["role"] for m in r["messages"]] == ["user"] for r in rows)


def test_seal_now_without_a_job_seals_partial_shards(tmp_path):
    store = ShardStore(tmp_path / "w", "fp", None)
    for i in range(3):
        store.append(rec(i, domain="code" if i else "chat"))
    store.close()
    seal_now(tmp_path / "w", home=tmp_path / "home")
    shards = read_manifest(tmp_path / "w")["shards"]
    assert {k: v["count"] for k, v in shards.items()} == {"chat-0001": 1, "code-0001": 2}
    assert not list((tmp_path / "w" / "open").glob("*.jsonl"))
    store = ShardStore(tmp_path / "w", "fp", None)
    store.append(rec(7, domain="code"))  # the next records start the next shard
    store.close()
    assert (tmp_path / "w" / "open" / "code-0002.jsonl").is_file()


def test_training_reads_a_shard_folder(tmp_path):
    from dflash.training.data import read_samples

    store = ShardStore(tmp_path / "w", "fp", None, {"*": 2})
    for i in range(3):
        store.append({**rec(i), "response_ids": [5, 6, 7, 2]})
    store.close()
    samples = read_samples(tmp_path / "w")
    assert [s.id for s in samples] == ["chat-0", "chat-1", "chat-2"]
    assert samples[0].prompt_len == 3 and list(samples[0].ids) == [1, 2, 0, 5, 6, 7, 2]
    publish(tmp_path / "w", tmp_path / "repo")  # the repository folder: sealed shards only
    assert [s.id for s in read_samples(tmp_path / "repo")] == ["chat-0", "chat-1"]
