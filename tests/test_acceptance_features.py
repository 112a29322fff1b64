"""scripts/acceptance_features.py: the offline replay of proposal sources on recorded cycles."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "acceptance_features.py"
spec = importlib.util.spec_from_file_location("acceptance_features", SCRIPT)
features = importlib.util.module_from_spec(spec)
spec.loader.exec_module(features)

COST = {"rows": list(range(1, 33)), "verify": [10.0 + 0.3 * r for r in range(1, 33)],
        "draft": [0.0] + [2.0] * 31, "step": 10.3}


def recorded(history: list[int], n_prompt: int, drafter_right: bool) -> dict:
    """Whole-block cycles over ``history``: the drafter proposes the truth (or its opposite)
    with confidence 0.9, 15 rows, anchors where whole-block verification put them."""
    cycles, pos = [], n_prompt
    while pos < len(history) - 1:
        truth = history[pos + 1:pos + 16]
        ids = truth if drafter_right else [t + 1000 for t in truth]
        accepted = len(truth) if drafter_right else 0
        cycles.append({"conf": [0.9] * len(ids), "ids": ids, "context": pos,
                       "accepted": accepted})
        pos += accepted + 1
    return {"id": "gsm8k-0", "prompt_ids": history[:n_prompt], "history": history,
            "cycles": cycles}


def test_a_text_that_repeats_itself_pays_for_lookup_not_for_a_wrong_drafter():
    history = [5, 6, 7, 8, 9] * 30
    data = {"cost": COST, "prompts": [recorded(history, 10, drafter_right=False)]}
    r = features.simulate(data, None)
    assert r["conf"] == pytest.approx(1.0, abs=0.02)  # the wrong drafter is stepped aside from
    assert r["lookup"] > 3 and r["drafter|lookup"] > 3 and r["drafter+lookup"] > 3
    assert r["oracle|lookup"] >= max(r["drafter|lookup"], r["drafter+lookup"]) - 1e-9


def test_fresh_text_pays_for_a_right_drafter_not_for_lookup():
    history = list(range(200))
    data = {"cost": COST, "prompts": [recorded(history, 10, drafter_right=True)]}
    r = features.simulate(data, None)
    assert r["lookup"] == pytest.approx(1.0)  # nothing repeats: plain steps
    assert r["conf"] > 3 and r["oracle"] >= r["conf"] - 1e-9


def test_the_script_looks_up_what_the_engine_looks_up():
    from dflash.lookup import ContextLookup

    history = [1, 2, 3, 1, 2, 4, 1, 2, 9, 9, 1, 2]
    assert features.lookup(history, n=2, length=3) == [9, 9, 1]
    assert ContextLookup(orders=(2,)).continuation(history, 3) == ([9, 9, 1], 2)
    assert features.agreed([1, 2, 3], [1, 2, 4]) == 2
