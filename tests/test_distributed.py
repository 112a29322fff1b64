"""Data-parallel training and datagen over ``mx.distributed``: 2 ranks on localhost (ring backend).

Each test starts ``mlx.launch -n 2 --backend ring`` on a random port (other runs may share the
machine) and checks what the ranks leave behind: identical weights, one checkpoint per step
written once, every prompt generated exactly once, and a dead rank that hangs nobody.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest
from test_train import write_pattern_data
from tiny_models import write_target

import dflash
from dflash.ranks import Ranks, init_ranks

pytestmark = pytest.mark.slow

REPO = Path(dflash.__file__).parent.parent

# Runs one training under the launcher; rank 1 dies before step DIE_AT (-1: never); each rank
# dumps its final weights so that the test can compare them.
TRAIN_SCRIPT = """
import json, os, sys
import dflash
import mlx.core as mx
from mlx.utils import tree_flatten
from dflash.training.options import TrainOptions
from dflash.training.trainer import Trainer

kw, dump, die_at = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
tr = Trainer(TrainOptions(**kw))
real_step = tr.train_step

def step(batch):
    if tr.ranks.rank == 1 and tr.step == die_at:
        os._exit(3)
    return real_step(batch)

tr.train_step = step
tr.run()
weights = dict(tree_flatten(tr.draft.parameters()))
mx.save_safetensors(os.path.join(dump, f"rank{tr.ranks.rank}.safetensors"), weights)
print(json.dumps({"rank": tr.ranks.rank, "step": tr.step, "cursor": tr.cursor}), flush=True)
"""


def assert_ranks_agree(dump: Path) -> None:
    """Both ranks ended with bit-identical weights."""
    a = mx.load(str(dump / "rank0.safetensors"))
    b = mx.load(str(dump / "rank1.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert mx.array_equal(a[k], b[k]).item(), k


def launcher() -> list[str]:
    found = Path(sys.executable).parent / "mlx.launch"
    path = str(found) if found.is_file() else shutil.which("mlx.launch")
    if path is None:
        pytest.skip("mlx.launch is not installed")
    return [path, "-n", "2", "--backend", "ring",
            "--starting-port", str(random.randint(20000, 60000))]


def launch(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1")
    return subprocess.run([*launcher(), sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(REPO))


@pytest.fixture(scope="module")
def pattern(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    _, data = write_pattern_data(root, 32)
    return {"root": root, "target": root / "target", "data": data}


def train_kwargs(pattern, out: Path, **kw) -> dict:
    base = dict(target=str(pattern["target"]), data=str(pattern["data"]), out=str(out),
                layers=1, block_size=8, taps="0,2", steps=6, batch_seqs=2, anchors=8, lr=3e-3,
                checkpoint_every=2, keep_checkpoints=10, progress=False, val_percent=0,
                soft_weight=0.0, mine_every=2)
    base.update(kw)
    return base


def run_training(pattern, tmp_path, out, die_at=-1, **kw):
    dump = Path(tempfile.mkdtemp(prefix="weights-", dir=tmp_path))
    script = tmp_path / "train_ranks.py"
    script.write_text(TRAIN_SCRIPT)
    proc = launch([str(script), json.dumps(train_kwargs(pattern, out, **kw)), str(dump),
                   str(die_at)])
    return proc, dump


def test_one_process_is_one_rank():
    ranks = init_ranks()
    assert (ranks.rank, ranks.size, ranks.distributed) == (0, 1, False)
    assert ranks.shard([1, 2, 3]) == [1, 2, 3] and ranks.any(True) and ranks.from_main(5) == 5
    assert Ranks(1, 3).shard(list(range(7))) == [1, 4]


def test_two_ranks_train_identically_and_rank_0_writes_once(pattern, tmp_path):
    out = tmp_path / "draft"
    proc, dump = run_training(pattern, tmp_path, out, steps=4)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    ends = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(e["rank"] for e in ends) == [0, 1]
    assert {(e["step"], e["cursor"]) for e in ends} == {(4, 16)}  # 4 steps x 2 ranks x 2 seqs
    assert_ranks_agree(dump)
    ckpts = sorted(p.name for p in (out / "train").iterdir() if p.name.startswith(("step", ".")))
    assert ckpts == ["step-0000002", "step-0000004"]  # no temporary folders left behind
    steps = [json.loads(line)["step"]
             for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4]  # logged once, by rank 0
    training = json.loads((out / "config.json").read_text())["dflash_training"]
    assert training["ranks"] == 2 and training["step"] == 4
    # both ranks resume from rank 0's checkpoint and continue in step
    proc, dump = run_training(pattern, tmp_path, out, steps=6, resume=True)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "resumed from" in proc.stderr and "step 4" in proc.stderr
    ends = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {(e["step"], e["cursor"]) for e in ends} == {(6, 24)}
    assert_ranks_agree(dump)


def test_a_rank_that_dies_hangs_nobody_and_the_run_resumes(pattern, tmp_path):
    out = tmp_path / "draft"
    proc, dump = run_training(pattern, tmp_path, out, die_at=3)  # rank 1 dies before step 4
    assert "rank 1 exited with code 3" in proc.stderr, proc.stderr
    assert not (dump / "rank0.safetensors").exists()  # rank 0 was stopped, not finished
    saved = sorted(p.name for p in (out / "train").glob("step-*"))
    assert saved == ["step-0000002"]
    proc, dump = run_training(pattern, tmp_path, out, resume=True)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    ends = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {e["step"] for e in ends} == {6}
    assert_ranks_agree(dump)


def test_datagen_shards_prompts_across_ranks_each_exactly_once(tmp_path):
    target = write_target(tmp_path / "target", "llama", layers=2, hidden=32)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "question": f"Question {i}?"}) + "\n"
                               for i in range(7)))
    out = tmp_path / "data"
    args = ["-m", "dflash", "datagen", "--target", str(target), "--prompts", str(prompts),
            "--out", str(out), "--max-tokens", "4", "--batch-size", "2", "--no-progress"]
    proc = launch([*args, "--limit", "5"])
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    files = sorted(out.glob("gen-*.jsonl"))
    assert len(files) == 2 and {f.name.split("-")[2] for f in files} == {"r0", "r1"}
    assert (out / "dataset.json").is_file() and not list(out.glob("dataset.tmp*"))
    proc = launch(args)  # the rest: 2 prompts left, one per rank
    assert proc.returncode == 0, proc.stderr
    assert "5 already done, 2 to go" in proc.stderr
    ids = [json.loads(line)["id"] for f in out.glob("gen-*.jsonl")
           for line in f.read_text().splitlines() if line.strip()]
    assert sorted(ids) == [f"q{i}" for i in range(7)]
