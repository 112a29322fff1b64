"""dflash datagen: resumable regeneration with the target, and prompt files that say what is wrong."""

from __future__ import annotations

import argparse
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
from dflash.errors import DataSetError, DFlashError
from dflash.prompts import PromptFileError, read_prompts
from dflash.training.data import load_samples
from dflash.training.datagen import add_datagen_args, datagen, done_ids, run_datagen

QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Count to three.", "Say hello.",
             "What is the capital of France?", "Write a haiku about rain."]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return write_target(tmp_path_factory.mktemp("dg") / "target", "llama", layers=2, hidden=32)


def write_prompts(path: Path, n: int = len(QUESTIONS)) -> Path:
    with path.open("w") as f:
        for i, q in enumerate(QUESTIONS[:n]):
            f.write(json.dumps({"id": f"q{i}", "question": q}) + "\n")
    return path


def records(out: Path) -> list[dict]:
    rows = []
    for path in sorted(out.glob("gen-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    rows.append(None)
    return rows


@pytest.mark.slow
def test_datagen_writes_records_and_resumes(target, tmp_path, capsys):
    from dflash.model_mlx import load

    prompts = write_prompts(tmp_path / "p.jsonl")
    out = tmp_path / "data"
    datagen(str(target), prompts, out, max_tokens=6, batch_size=4, limit=3, progress=False)
    first = records(out)
    assert sorted(r["id"] for r in first) == ["q0", "q1", "q2"]
    _, tok = load(str(target))
    for r in first:
        assert r["finish_reason"] in ("stop", "length")
        assert 1 <= len(r["response_ids"]) <= 6
        if r["finish_reason"] == "stop":
            assert r["response_ids"][-1] in tok.eos_token_ids  # the stop token is kept
        # the chat template was applied
        assert r["prompt_ids"] == tok.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[int(r["id"][1])]}], add_generation_prompt=True)

    # An interrupted run leaves a line cut short: it is ignored, and the rest resumes.
    with (out / "gen-00.jsonl").open("a") as f:
        f.write('{"id": "q3", "prompt_ids": [1, 2')
    assert done_ids(out) == {"q0", "q1", "q2"}
    capsys.readouterr()
    datagen(str(target), prompts, out, max_tokens=6, batch_size=4, progress=False)
    assert "3 already done, 3 to go" in capsys.readouterr().err
    rows = records(out)
    good = [r for r in rows if r is not None]
    assert sorted(r["id"] for r in good) == [f"q{i}" for i in range(6)]  # each id exactly once
    assert good[:3] == first  # done records untouched
    assert sum(r is None for r in rows) == 1  # only the cut line is unreadable
    assert [s["id"] for s in load_samples(out)] == [f"q{i}" for i in range(6)]

    capsys.readouterr()
    datagen(str(target), prompts, out, max_tokens=6, progress=False)  # nothing left to do
    assert "6 already done, 0 to go" in capsys.readouterr().err
    assert len(records(out)) == len(rows)


@pytest.mark.slow
def test_datagen_killed_midway_resumes_without_duplicates(target, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl")
    out = tmp_path / "data"
    cmd = [sys.executable, "-m", "dflash", "datagen", "--target", str(target), "--prompts",
           str(prompts), "--out", str(out), "--max-tokens", "40", "--batch-size", "1",
           "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(Path(dflash.__file__).parent.parent))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    try:
        while time.time() < deadline and proc.poll() is None:
            if len([r for r in records(out) if r]) >= 1:
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = {r["id"] for r in records(out) if r}
    assert before, "datagen wrote nothing before the deadline"
    datagen(str(target), prompts, out, max_tokens=40, batch_size=1, progress=False)
    ids = [r["id"] for r in records(out) if r]
    assert sorted(ids) == [f"q{i}" for i in range(6)]


@pytest.mark.slow
def test_datagen_on_a_disk_that_fills_keeps_records_whole_and_resumes(target, tmp_path, small_disk):
    """The disk fills while datagen runs: it stops with the OS error, no record is corrupt or
    without its features, and once there is space again a rerun finishes every prompt once."""
    import numpy as np

    from dflash.training.data import Sample
    from dflash.training.features import FeatureStore

    prompts = tmp_path / "p.jsonl"
    with prompts.open("w") as f:
        for i in range(24):
            f.write(json.dumps({"id": f"q{i:02d}", "question": QUESTIONS[i % 6] + " " * i}) + "\n")
    out = small_disk.path / "data"
    cmd = [sys.executable, "-m", "dflash", "datagen", "--target", str(target), "--prompts",
           str(prompts), "--out", str(out), "--max-tokens", "40", "--batch-size", "1",
           "--taps", "0,1", "--topk", "4", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(Path(dflash.__file__).parent.parent))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not any(r for r in records(out)):
        time.sleep(0.02)
    small_disk.fill()
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode != 0, "datagen finished before the disk filled"
    assert "No space left on device" in err and "Traceback" not in err
    written = {r["id"] for r in records(out) if r}
    assert 1 <= len(written) < 24

    small_disk.free()
    datagen(str(target), prompts, out, max_tokens=40, batch_size=1, taps="0,1", topk=4,
            progress=False)
    rows = records(out)
    good = [r for r in rows if r is not None]
    assert sorted(r["id"] for r in good) == [f"q{i:02d}" for i in range(24)]  # each once
    assert len(rows) - len(good) <= 1  # at most the line the full disk cut short
    store = FeatureStore(None, [0, 1], 4, out / "features" / FeatureStore.signature([0, 1], 4))
    for r in good:  # every record's features read back whole (no silent recompute here)
        ids = np.asarray(r["prompt_ids"] + r["response_ids"], np.int32)
        with np.load(store.path(Sample(r["id"], ids, len(r["prompt_ids"])))) as z:
            assert z["feats"].shape[0] >= len(ids) - 1
            assert z["top_ids"].shape == (z["feats"].shape[0], 4)
    assert not list(out.rglob("*.tmp*"))  # no half-written temporary left behind


@pytest.mark.slow
def test_cli_entry(target, tmp_path):
    parser = add_datagen_args(argparse.ArgumentParser())
    args = parser.parse_args(["--target", str(target), "--prompts",
                              str(write_prompts(tmp_path / "p.jsonl", 2)), "--out",
                              str(tmp_path / "d"), "--max-tokens", "3", "--no-progress"])
    out = run_datagen(args)
    assert len(load_samples(out)) == 2
    # The same through the `dflash` command: exit status 0, one more prompt generated.
    p = subprocess.run([sys.executable, "-m", "dflash", "datagen", "--target", str(target),
                        "--prompts", str(write_prompts(tmp_path / "p3.jsonl", 3)), "--out",
                        str(out), "--max-tokens", "3", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert len(load_samples(out)) == 3


@pytest.mark.parametrize("lines, where, message", [
    (['{"question": "a"}', '{"question": "b"}', "not json"], ":3:", "not valid JSON"),
    (['{"question": "a"}', '{"answer": "b"}'], ":2:", "needs one of the fields"),
    (['["a list"]'], ":1:", "expected a JSON object"),
    (['{"messages": [{"role": "user"}]}'], ":1:", "messages"),
    (['{"id": 1, "prompt": "a"}', '{"id": 1, "prompt": "b"}'], ":2:", "repeats line 1"),
])
def test_bad_prompt_files_name_the_line(tmp_path, lines, where, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PromptFileError, match=message) as e:
        read_prompts(path)
    assert f"prompts.jsonl{where}" in str(e.value)
    assert isinstance(e.value, DFlashError) and isinstance(e.value, ValueError)


def test_empty_or_missing_prompt_files(tmp_path, target):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(PromptFileError, match="holds no prompts"):
        read_prompts(tmp_path / "empty.jsonl")
    with pytest.raises(PromptFileError, match="does not exist"):
        datagen(str(target), tmp_path / "missing.jsonl", tmp_path / "out")


def test_prompt_formats_read_as_they_are(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([
        json.dumps({"question": "gsm8k style", "answer": "#### 4"}),
        json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n"}),
        json.dumps({"instruction": "alpaca style"}),
        json.dumps({"id": "chat", "messages": [{"role": "user", "content": "hi"}]}),
    ]) + "\n")
    items = read_prompts(path)
    assert [i["id"] for i in items] == ["mixed-1", "HumanEval/0", "mixed-3", "chat"]
    assert items[1]["prompt"] == "def f():\n" and items[3]["messages"][0]["content"] == "hi"


def test_bad_data_sets(tmp_path):
    with pytest.raises(DataSetError, match="no such"):
        load_samples(tmp_path / "nothing")
    (tmp_path / "d").mkdir()
    with pytest.raises(DataSetError, match="holds no samples"):
        load_samples(tmp_path / "d")
    (tmp_path / "d" / "gen-00.jsonl").write_text('{"id": "a", "prompt_ids": [1]}\n')
    with pytest.raises(DataSetError, match=r"gen-00.jsonl:1: expected a record"):
        load_samples(tmp_path / "d")


@pytest.mark.slow
def test_token_snapshot_round_trip_resumes_on_a_new_machine(target, tmp_path, capsys):
    """recipes/smollm2/snapshot_training_data.py keeps the records (not the features) as gzip'd
    ids — the same bytes for the same records — and puts them back where datagen skips them."""
    import gzip

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes" / "smollm2"))
    import snapshot_training_data as snapshot

    prompts = write_prompts(tmp_path / "p.jsonl")
    root, store = tmp_path / "machine-1", tmp_path / "store"
    datagen(str(target), prompts, root / "gen-math", max_tokens=6, batch_size=4, limit=3,
            domain="math", progress=False)
    snapshot.main([str(root), "--store", str(store)])
    kept = (store / "math.jsonl.gz").read_bytes()
    time.sleep(1.1)  # gzip stamps seconds: a later snapshot of the same records
    snapshot.main([str(root), "--store", str(store)])
    assert (store / "math.jsonl.gz").read_bytes() == kept  # no churn in the repository
    # a prompt file kept beside the records is not restored as records
    (store / "chat-prompts.jsonl.gz").write_bytes(
        gzip.compress(b'{"id": "c0", "messages": [{"role": "user", "content": "hi"}]}\n'))

    new = tmp_path / "machine-2"
    snapshot.main([str(new), "--store", str(store), "--restore"])
    assert sorted(p.name for p in new.iterdir()) == ["gen-math"]
    def ids(folder):
        return [(r["id"], r["prompt_ids"], r["response_ids"]) for r in load_samples(folder)]

    assert ids(new / "gen-math") == ids(root / "gen-math") and len(ids(root / "gen-math")) == 3
    capsys.readouterr()
    datagen(str(target), prompts, new / "gen-math", max_tokens=6, batch_size=4, limit=3,
            domain="math", progress=False)
    assert "3 already done, 0 to go" in capsys.readouterr().err
