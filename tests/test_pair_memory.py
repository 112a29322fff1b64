"""A loaded pair remembers what its generations taught the ``auto`` policy (PairMemory).

Without it every generation relearned its drafter from the raw confidence: a never-agreeing
drafter verified its first two cycles and probed six times in each 96-token generation. With it,
the next generation starts calibrated and behind the losing streak (at most INHERITED_LOSSES
long), a winning pair starts drafting as deep as it verified, the memory is capped so new text
re-steers it, it belongs to one (target, drafter) pair, and a running generation never sees
another's updates. (With a real pair and the target's output: tests/test_plain_steps.py.)
"""

from __future__ import annotations

# isort: off
import dflash  # noqa: F401  (OpenBLAS before mlx)
# isort: on
import gc
import threading

import numpy as np
import pytest
from test_plain_steps import FLAT_COST, ROWS_COST, confident, cost

from dflash import verify_policy
from dflash.verify_policy import (
    INHERITED_LOSSES,
    MEMORY_CAP,
    MIN_DRAFT_ROWS,
    PairMemory,
    VerifyPolicy,
    pair_memory,
)


def lose(policy: VerifyPolicy, cycles: int) -> None:
    """``cycles`` verified cycles in which the confident drafter's first proposal is wrong."""
    for _ in range(cycles):
        policy.plain_stretch(128)
        log_probs, ids = confident(3)
        policy.record(log_probs[:, 0], policy.plan(log_probs, ids, 0, 4), 0, None, 4)


def win(policy: VerifyPolicy, cycles: int, rows: int = 3) -> None:
    for _ in range(cycles):
        policy.plain_stretch(128)
        log_probs = np.log(np.full((rows, 1), 0.999))
        plan = policy.plan(log_probs, np.arange(rows)[:, None], 0, rows + 1)
        policy.record(log_probs[:, 0], plan, plan.rows, None, rows + 1)


def test_a_losing_pair_starts_its_next_generation_calibrated_and_behind_the_streak():
    memory = PairMemory(15)
    first = VerifyPolicy("auto", 16, cost(ROWS_COST), memory=memory)
    fresh = VerifyPolicy("auto", 16, cost(ROWS_COST))
    conf = np.full(3, 0.97)
    assert fresh.acceptance.predict(conf)[0] > 0.9  # the raw confidence, before any evidence
    lose(first, 6)
    assert memory.losses == first.losses == 6
    second = VerifyPolicy("auto", 16, cost(ROWS_COST), memory=memory)
    assert second.losses == INHERITED_LOSSES and not second.agreed
    assert second.acceptance.predict(conf)[0] < 0.3  # what the first generation measured
    assert second.plain_stretch(128) == 0  # it probes first (the text may suit the drafter) ...
    assert second.draft_rows(16) == MIN_DRAFT_ROWS  # ... with the smallest draft ...
    plan = second.plan(*confident(3), anchor=0, draft_rows=MIN_DRAFT_ROWS)
    assert plan.plain  # ... and verifies nothing it expects to lose
    second.record(None, plan, 0, None, MIN_DRAFT_ROWS)
    assert second.plain_stretch(128) == 2 ** (INHERITED_LOSSES + 1)


def test_a_winning_pair_starts_drafting_as_deep_as_it_verified():
    memory = PairMemory(15)
    first = VerifyPolicy("auto", 16, cost(FLAT_COST), memory=memory)
    assert first.draft_rows(16) == MIN_DRAFT_ROWS  # nothing known yet
    win(first, 4, rows=5)
    assert memory.losses == 0
    second = VerifyPolicy("auto", 16, cost(FLAT_COST), memory=memory)
    assert second.losses == 0 and second.draft_rows(16) == 5 + 3
    assert second.acceptance.predict(np.full(5, 0.999))[4] > 0.9


def test_the_memory_is_capped_so_new_text_steers_it():
    memory = PairMemory(15)
    lose(VerifyPolicy("auto", 16, cost(ROWS_COST), memory=memory), 200)
    assert memory.acceptance.tried.max() == pytest.approx(MEMORY_CAP)
    later = VerifyPolicy("auto", 16, cost(FLAT_COST), memory=memory)
    conf = np.full(3, 0.97)
    assert later.acceptance.predict(conf)[0] < 0.1
    win(later, int(MEMORY_CAP) * 2)  # a prompt on which the drafter is right
    assert later.acceptance.predict(conf)[0] > 0.6
    assert memory.acceptance.predict(conf)[0] > 0.6  # and the pair remembers that now


def test_a_running_generation_never_sees_another_generations_updates():
    memory = PairMemory(15)
    running = VerifyPolicy("auto", 16, cost(ROWS_COST), memory=memory)
    before = running.acceptance.tried.copy(), running.acceptance.accepted.copy()
    other = threading.Thread(
        target=lose, args=(VerifyPolicy("auto", 16, cost(ROWS_COST), memory=memory), 20))
    other.start()
    other.join()
    assert memory.acceptance.tried.sum() > 0
    np.testing.assert_array_equal(running.acceptance.tried, before[0])
    np.testing.assert_array_equal(running.acceptance.accepted, before[1])
    assert running.losses == 0


def test_the_memory_belongs_to_one_loaded_pair_and_only_to_auto():
    class Loaded:  # stands for a loaded model or drafter (only its identity matters here)
        pass

    target, other, a, b = Loaded(), Loaded(), Loaded(), Loaded()
    memory = pair_memory(target, a, 15)
    assert pair_memory(target, a, 15) is memory
    assert pair_memory(target, b, 15) is not memory
    assert pair_memory(other, a, 15) is not memory
    lose(VerifyPolicy("auto", 16, cost(ROWS_COST), memory=memory), 3)
    fixed = VerifyPolicy("fixed", 16, memory=memory)
    assert fixed.memory is None and fixed.losses == 0
    gone = id(a)
    del a
    gc.collect()
    assert all(drafter != gone for _, drafter in verify_policy._memories)
    assert (id(target), id(b)) in verify_policy._memories
    gone = id(target)
    del target
    gc.collect()
    assert all(model != gone for model, _ in verify_policy._memories)

