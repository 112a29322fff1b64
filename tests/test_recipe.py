"""recipes/smollm2/build.sh --smoke: every stage of the built-in drafter's recipe (records,
features, train, convert, compare) runs on a tiny slice, and the drafter it writes loads and keeps
the target's greedy output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_recipe_smoke_mode_runs_every_stage(tmp_path):
    scratch = tmp_path / "smoke"
    env = dict(os.environ, SMOKE_DIR=str(scratch))
    p = subprocess.run(["bash", "recipes/smollm2/build.sh", "--smoke"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "done: records features train convert compare" in p.stderr
    restored = (scratch / "data" / "gen-math" / "gen-restored.jsonl").read_text().splitlines()
    assert len(restored) == 4  # the smoke slice, not the whole record set
    run, sixbit = scratch / "runs" / "final-v4", scratch / "drafts" / "final-v4-6bit"
    assert (run / "config.json").is_file() and (run / "train").is_dir()
    assert "quantization" in json.loads((sixbit / "config.json").read_text())
    tau = json.loads((scratch / "runs" / "final-v4-compare" / "tau.json").read_text())
    assert len(tau["drafters"]) == 3 and tau["identical"] is True
    assert "outputs identical across drafters: True" in p.stdout


def test_the_recipe_refuses_an_unknown_stage_or_drafter():
    p = subprocess.run(["bash", "recipes/smollm2/build.sh", "bake"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "unknown argument bake" in p.stderr
    p = subprocess.run(["bash", "recipes/smollm2/build.sh", "records"], cwd=ROOT,
                       env=dict(os.environ, DRAFTER="nope"), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "DRAFTER=nope" in p.stderr


def test_the_manifest_matches_the_kept_files():
    import hashlib

    folder = ROOT / "datasets" / "smollm2"
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    records = {p.name for p in folder.glob("*.jsonl.gz")}
    assert records and records <= set(manifest["files"])  # every token record is listed
    for name, entry in manifest["files"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == entry["sha256"], name
    assert manifest["checkpoint"]["commit"].startswith("10a87ce")


@pytest.mark.slow
def test_final_v4s_checkpoint_comes_back_from_git_history(tmp_path):
    commit = json.loads((ROOT / "datasets/smollm2/MANIFEST.json").read_text())["checkpoint"]
    if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", commit["commit"]],
                      capture_output=True).returncode != 0:
        pytest.skip("a clone without the history that holds the checkpoint")
    p = subprocess.run([sys.executable, "recipes/smollm2/carry_checkpoint.py", str(tmp_path / "run"),
                        "--restore", "--from-commit", "--home", str(tmp_path / "home"),
                        "--export", str(tmp_path / "drafter")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    step = tmp_path / "run" / "train" / f"step-{commit['step']:07d}"
    state = json.loads((step / "state.json").read_text())
    assert state["step"] == commit["step"] and str(tmp_path / "home") in state["options"][
        "feature_cache"]
    import mlx.core as mx

    assert all(v.dtype == mx.float32 for v in mx.load(str(step / "draft.safetensors")).values())
    # ... and as a drafter folder that --init-from reads: the checkpoint's weights (bf16) and
    # its training vocabulary as the ids it may propose
    from mlx.utils import tree_flatten

    from dflash.drafter import load_draft
    from dflash.training.initialise import read_v1_drafter

    draft = load_draft(str(tmp_path / "drafter"))
    assert draft.config.draft_vocab_ids is not None
    assert sorted(int(i) for i in draft.config.draft_vocab_ids) == sorted(state["vocab_ids"])
    kept = mx.load(str(step / "draft.safetensors"))
    mine = dict(tree_flatten(draft.parameters()))
    assert set(kept) <= set(mine)
    for name, value in kept.items():
        assert mx.array_equal(mine[name].astype(mx.bfloat16), value.astype(mx.bfloat16)), name
    cfg, _ = read_v1_drafter(str(tmp_path / "drafter"))
    assert cfg["num_hidden_layers"] == state["draft_config"]["num_hidden_layers"]
