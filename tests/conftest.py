"""Shared fixtures: tiny random models of each target family, built and loaded once per session.

Two tiers: `pytest -m "not slow"` (under 2 minutes: pure functions, CLI usage, sampling units and one
greedy-exactness run per target family) while changing code; plain `pytest` / `scripts/test.sh`
(what CI runs) runs everything, the `slow` tests included.
"""

# isort: off
import dflash  # noqa: F401  (routes OpenBLAS before anything imports mlx)
# isort: on
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tiny_models  # noqa: E402

KINDS = ("qwen3", "qwen3_5", "qwen3_5_wrapped", "llama")


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_pair(tiny_root):
    """``tiny_pair(kind)`` -> (target_path, draft_path), built once per session."""
    made = {}

    def make(kind: str):
        if kind not in made:
            target = tiny_models.write_target(tiny_root / kind / "target", kind)
            draft = tiny_models.write_drafter(tiny_root / kind / "draft", target, taps=(0, 2))
            made[kind] = (target, draft)
        return made[kind]

    return make


@pytest.fixture(scope="session")
def loaded_pair(tiny_pair):
    """``loaded_pair(kind)`` -> (model, tokenizer, draft), loaded once per session."""
    from dflash.model_mlx import load, load_draft

    loaded = {}

    def get(kind: str):
        if kind not in loaded:
            target, draft = tiny_pair(kind)
            model, tokenizer = load(str(target))
            loaded[kind] = (model, tokenizer, load_draft(str(draft)))
        return loaded[kind]

    return get
