"""The verify policy as pure functions: given calibration, pass costs and history, the plan.

No model is loaded: the costs are a small table (``Costs``), the drafter's block is its top
probabilities, and the history is the outcomes reported before. The engines that run these plans
exactly are covered end to end in tests/test_plain_steps.py, test_tree_decode.py, test_batch.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from dflash.errors import GenerationConfigError
from dflash.lookup import Match
from dflash.policy import (
    BATCHED_POLICIES,
    MAX_BACKOFF,
    MIN_DRAFT_ROWS,
    POLICIES,
    Backoff,
    BatchPolicy,
    Chain,
    Continuation,
    FixedBatchPolicy,
    Outcome,
    Plain,
    PolicyStats,
    Tree,
    Unverified,
    make_batch_policy,
    make_policy,
    policy_class,
)
from dflash.policy.backoff import draft_rows
from dflash.policy.stats import price


@dataclass
class Costs:
    """Pass costs in ms: a target pass of ``r`` rows costs ``base + per_row * r``; a plain step
    ``step`` (pipelined) or a lone one-row pass; a drafter pass ``draft_ms`` whatever its rows."""

    base: float = 10.0
    per_row: float = 0.1
    step_ms: float | None = None
    draft_ms: float = 1.0
    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32)

    def verify(self, rows: int, context: int = 256) -> float:
        return self.base + self.per_row * rows

    def step(self, context: int = 256, pipelined: bool = True) -> float:
        lone = self.verify(1, context)
        return min(lone, self.step_ms) if pipelined and self.step_ms is not None else lone

    def draft(self, rows: int, context: int = 256) -> float:
        return 0.0 if rows <= 1 else self.draft_ms


FLAT = Costs()  # a verify pass costs about one step whatever its rows: a right drafter wins
STEEP = Costs(base=0.0, per_row=10.0)  # every row costs a step: speculation can only lose


def block(conf: list[float], runner_up: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A drafted block's candidates: each row's top probability (and a runner-up's)."""
    rows = len(conf)
    cols = [np.log(conf)] + ([np.log(np.full(rows, runner_up))] if runner_up else [])
    return np.stack(cols, axis=1), np.arange(rows * len(cols)).reshape(len(cols), rows).T


def auto(costs: Costs = FLAT, *, losses: int = 0, agreed: bool = False, trees: bool = False,
         stretch: int = 0, context: int = 128, **kw):
    policy = make_policy("auto", 16, costs, trees=trees, **kw)
    policy.backoff.losses, policy.backoff.agreed, policy.backoff.stretch = losses, agreed, stretch
    policy.context = context
    return policy


# ---------------------------------------------------------------------------------------------
# After drafting: calibration and costs -> plan

AFTER_DRAFT = [
    # (case, policy settings, drafter's block, expected plan kind, expected rows or None)
    ("confident block, flat costs: the whole chain", dict(), block([0.999] * 3), Chain, 3),
    ("unsure tail: the chain stops early", dict(), block([0.999, 0.999, 0.02]), Chain, 2),
    ("steep costs, fresh: a probe is verified", dict(costs=STEEP), block([0.97] * 3), Chain, None),
    ("steep costs, third loss, never agreed: not verified",
     dict(costs=STEEP, losses=2), block([0.97] * 3), Unverified, None),
    ("steep costs, the drafter agreed once in the streak: verified",
     dict(costs=STEEP, losses=2, agreed=True), block([0.97] * 3), Chain, None),
    ("steep costs, stretches at their longest: verified again",
     dict(costs=STEEP, losses=6), block([0.97] * 3), Chain, None),
    ("close runner-ups on a tree target: a tree",
     dict(trees=True), block([0.5] * 3, runner_up=0.45), Tree, None),
    ("the same on a chain-only target: a chain",
     dict(trees=False), block([0.5] * 3, runner_up=0.45), Chain, None),
]


@pytest.mark.parametrize("case,settings,candidates,kind,rows", AFTER_DRAFT,
                         ids=[c[0] for c in AFTER_DRAFT])
def test_auto_after_draft(case, settings, candidates, kind, rows):
    policy = auto(**settings)
    plan = policy.after_draft(candidates, anchor=0, draft_rows=len(candidates[0]) + 1)
    assert isinstance(plan, kind), plan
    if rows is not None:
        assert plan.rows == rows


@pytest.mark.parametrize("name,settings,kind,rows", [
    ("fixed", {}, Chain, 4),
    ("confidence", {"min_confidence": 0.5}, Chain, 2),  # 0.9 * 0.8 > 0.5 > 0.9 * 0.8 * 0.3
    ("tree", {"tree_budget": 3, "trees": True}, Tree, 3),
])
def test_the_simple_policies_verify_the_same_way_every_cycle(name, settings, kind, rows):
    policy = make_policy(name, 16, FLAT if name == "tree" else None, **settings)
    candidates = block([0.9, 0.8, 0.3, 0.9], runner_up=0.05)
    plan = policy.after_draft(candidates if policy.reads_candidates else None, 0, 5)
    assert isinstance(plan, kind) and plan.rows == rows
    assert policy.draft_rows(16) == 16 and policy.before_draft(128, 64) is None


# ---------------------------------------------------------------------------------------------
# Before drafting: the back-off and the context's continuation

CONTINUATION = Match((5, 6, 7, 8, 9), 3)  # matched on a 3-gram

BEFORE_DRAFT = [
    # (case, policy settings, continuation, expected plan, stretch left after)
    ("fresh, nothing to look up: draft", dict(), None, None, 0),
    ("in a plain stretch: take it, up to most", dict(losses=2, stretch=4), None, Plain(4), 0),
    ("a stretch and a continuation worth a pass: the continuation, the stretch kept",
     dict(losses=2, stretch=4), CONTINUATION, Continuation, 4),
    ("no stretch, an untried drafter could beat the continuation: draft", dict(), CONTINUATION,
     None, 0),
    ("a losing streak's probe: the continuation goes first", dict(losses=1), CONTINUATION,
     Continuation, 0),
    ("looking up turned off: the stretch", dict(losses=2, stretch=4, lookup=False),
     CONTINUATION, Plain(4), 0),
    ("a continuation on steep costs never pays: the stretch",
     dict(costs=STEEP, losses=2, stretch=4), CONTINUATION, Plain(4), 0),
]


@pytest.mark.parametrize("case,settings,continuation,expected,left", BEFORE_DRAFT,
                         ids=[c[0] for c in BEFORE_DRAFT])
def test_auto_before_draft(case, settings, continuation, expected, left):
    policy = auto(**settings)
    plan = policy.before_draft(128, MAX_BACKOFF, continuation)
    if isinstance(expected, type):
        assert isinstance(plan, expected), plan
        assert plan.tokens == continuation.tokens[:plan.rows] and plan.match == 3
    else:
        assert plan == expected
    assert policy.backoff.stretch == left


def test_a_stretch_is_taken_in_pieces_of_at_most_most():
    policy = auto(losses=3, stretch=8)
    assert [policy.before_draft(128, 3) for _ in range(4)] == [Plain(3), Plain(3), Plain(2), None]


@pytest.mark.parametrize("block_rows,depths,losing,rows", [
    (16, [], False, MIN_DRAFT_ROWS),  # nothing known yet: the smallest pass
    (16, [5, 2], False, 8),  # the deepest recent plan and three more
    (16, [5, 2], True, MIN_DRAFT_ROWS),  # a probe in a losing streak
    (16, [15], False, 16),  # at most the block
    (3, [], False, 3),
    (16, [0], False, MIN_DRAFT_ROWS),  # at least the smallest pass
])
def test_draft_rows(block_rows, depths, losing, rows):
    assert draft_rows(block_rows, depths, losing) == rows


# ---------------------------------------------------------------------------------------------
# After verifying: the outcome -> the back-off

def play(policy, history: list[tuple[list[float], int]]) -> list[int]:
    """Plan and report each drafted block of ``history`` (top probabilities, tokens accepted);
    the plain stretch taken after each."""
    stretches = []
    for conf, accepted in history:
        candidates = block(conf)
        plan = policy.after_draft(candidates, 0, len(conf) + 1)
        policy.observe(Outcome(plan, 0 if isinstance(plan, Unverified) else accepted,
                               log_conf=candidates[0][:, 0], draft_rows=len(conf) + 1,
                               context=128))
        stretches.append(policy.plain_stretch(128, MAX_BACKOFF))
    return stretches


def test_a_losing_drafter_backs_off_doubling_and_a_winning_one_does_not():
    wrong = [([0.97] * 3, 0)] * 9
    assert play(auto(STEEP), wrong) == [2, 4, 8, 16, 32, 64, 64, 64, 64]
    right = [([0.999] * 3, 3)] * 5
    assert play(auto(FLAT), right) == [0] * 5
    # Flat costs: one wrong cycle is half excused by what the calibration expected. Wrong for a
    # while, then right: the probes verify nothing until the stretches are MAX_BACKOFF long,
    # then the first verified probe wins and ends the streak.
    policy = auto(FLAT)
    stretches = play(policy, [([0.97] * 3, 0)] * 3 + [([0.999] * 3, 3)] * 8)
    assert stretches == [0, 2, 4, 8, 16, 32, 64, 0, 0, 0, 0] and policy.backoff.losses == 0
    assert policy.stats.unverified_probes == 4  # losses 2 to 5: their probes not verified


def test_a_verified_continuation_is_judged_by_the_block_it_won_over():
    policy = auto(FLAT, losses=3)
    policy.observe(Outcome(Continuation((1, 2, 3), 3, drafter_value=1.0), 3, context=128))
    assert policy.backoff.losses == 0  # the drafted block it beat was worth a pass
    policy = auto(FLAT, losses=3)
    policy.observe(Outcome(Continuation((1, 2, 3), 3, drafter_value=1e-3), 3, context=128))
    assert policy.backoff.losses == 4 and policy.backoff.stretch == 16
    policy = auto(FLAT, losses=3)
    policy.observe(Outcome(Continuation((1, 2, 3), 3), 3, context=128))  # none drafted
    assert policy.backoff.losses == 3
    assert policy.calibration.continuation.tried.sum() == 3  # its rows were calibrated


def test_a_shared_outcome_teaches_calibration_but_is_judged_by_the_batch():
    policy = auto(STEEP)
    policy.after_draft(block([0.97] * 3), 0, 4)
    conf = block([0.97] * 3)[0][:, 0]
    policy.observe(Outcome(Chain(3), 0, log_conf=conf, draft_rows=4, context=128, shared=True))
    assert policy.backoff.losses == 0 and policy.calibration.drafter.tried.sum() == 1


@pytest.mark.parametrize("losses,agreed,hopeless", [
    (0, False, False), (1, False, False), (2, False, True), (2, True, False), (5, False, True),
    (6, False, False),  # 2**6 == MAX_BACKOFF: probes are verified again
])
def test_when_a_probe_is_hopeless(losses, agreed, hopeless):
    assert Backoff(losses=losses, agreed=agreed).hopeless is hopeless


def test_the_backoff_state_machine():
    b = Backoff()
    assert b.take(10) == 0
    seen = []
    for _ in range(8):
        b.lost()
        seen.append(b.stretch)
        assert b.probe and b.rate is None
    assert seen == [2, 4, 8, 16, 32, 64, 64, 64] and seen[-1] == MAX_BACKOFF
    assert b.take(10) == 10 and b.stretch == 54
    b.give_back(6)
    assert b.take(100) == 60 and b.take(100) == 0
    assert b.probing() and not b.probing()  # asked once
    assert not b.judge(2.0, 1.0)  # a win ends the streak
    assert b.losses == 0 and b.rate == 2.0
    # Smoothed: one lucky cycle does not hide a trend ...
    assert b.judge(0.5, 1.0, agreed=True) and b.agreed and b.losses == 1
    b.won()
    b.rate = 0.2
    assert b.judge(1.5, 1.0)  # ... the running rate (0.2 -> 0.85) still loses
    assert b.rate is None  # a loss: the probe after the stretch decides afresh


def test_the_unsmoothed_judge_looks_at_this_cycle_only():
    b = Backoff(rate=0.1)
    assert not b.judge(2.0, 1.0, smooth=False) and b.rate == 0.1
    assert b.judge(0.5, 1.0, smooth=False) and b.losses == 1 and b.stretch == 2


# ---------------------------------------------------------------------------------------------
# The batched engine's back-off is the same machine

class Row:
    """A batched row's policy, as the batch sees it: a calibrated acceptance per drafted row."""

    def __init__(self, p: float):
        self.p = p

    def predict(self, conf: np.ndarray) -> np.ndarray:
        return np.full(len(conf), self.p)


def test_the_batch_backs_off_with_the_same_stretches_and_probes():
    batch = BatchPolicy(STEEP)
    rows = [(Row(0.9), np.full(7, 0.9)), (Row(0.9), np.full(7, 0.9))]
    looked = [None, None]
    probes = []
    for cycle in range(40):
        if batch.want_draft(rows, looked, 128, 8):  # as the engine: a drafted pass is sized
            probes.append(cycle)
            assert batch.width_after_draft(rows, looked, 128, 4) == (1, [False, False])
    # Steep costs: every estimate loses, so the batch drafts only to probe, after stretches
    # of 2, 4, 8, 16 plain steps (as one sequence's back-off).
    gaps = [b - a - 1 for a, b in zip([0] + probes, probes)]
    assert gaps[:4] == [2, 4, 8, 16] and batch.backoff.losses == 5
    single = Backoff()
    for expected in (2, 4, 8, 16):
        single.lost()
        assert single.stretch == expected


def test_the_batch_judges_a_drafted_pass_half_expected_half_committed():
    batch = BatchPolicy(FLAT)
    rows = [(Row(0.99), np.full(3, 0.99))] * 2
    batch.judge(rows, [False, False], [None, None], committed=8, context=128, drafted_rows=4,
                width=4)
    assert batch.backoff.losses == 0 and list(batch.depths) == [3]
    bad = BatchPolicy(STEEP)
    bad.judge(rows, [False, False], [None, None], committed=2, context=128, drafted_rows=4,
              width=4)
    assert bad.backoff.losses == 1 and bad.backoff.stretch == 2
    assert bad.draft_rows(16) == 3 + 3  # the deepest recent width's proposals and three more


def test_the_batch_width_prefers_continuations_that_beat_the_drafted_blocks():
    batch = BatchPolicy(FLAT)
    rows = [(Row(0.1), np.full(7, 0.1)), (Row(0.1), np.full(7, 0.1))]
    width, use_look = batch.width_after_draft(rows, [np.full(7, 0.95), None], 128, 8)
    assert width > 1 and use_look == [True, False]
    width, use_look = batch.width_without_draft([None, None], 128)
    assert width == 1 and use_look == [False, False]


def test_the_fixed_batch_verifies_the_whole_block():
    batch = make_batch_policy("fixed", None)
    assert isinstance(batch, FixedBatchPolicy)
    assert batch.want_draft([], [], 128, 8) and batch.draft_rows(8) == 8
    assert batch.width_after_draft([(None, None)] * 3, [None] * 3, 128, 8) == (8, [False] * 3)
    with pytest.raises(GenerationConfigError, match="batched engine"):
        make_batch_policy("tree", FLAT)


# ---------------------------------------------------------------------------------------------
# Counting and pricing, the names and their capabilities

@pytest.mark.parametrize("outcome,ms", [
    (Outcome(Plain(3), context=128), 3 * FLAT.step(128, False)),
    (Outcome(Unverified(), draft_rows=4), FLAT.draft(4)),
    (Outcome(Chain(0), draft_rows=0), FLAT.verify(1)),
    (Outcome(Chain(3), draft_rows=4), FLAT.draft(4) + FLAT.verify(4)),
    (Outcome(Continuation((1, 2), 3)), FLAT.verify(3)),
])
def test_the_price_of_each_plan(outcome, ms):
    assert price(outcome, FLAT, pipelined=False) == pytest.approx(ms)


def test_stats_count_every_kind_of_plan():
    stats = PolicyStats()
    for outcome in [Outcome(Plain(2)), Outcome(Unverified(), draft_rows=4),
                    Outcome(Chain(3), 2, draft_rows=4), Outcome(Continuation((1, 2), 2), 1),
                    Outcome(Chain(0))]:
        stats.count(outcome, FLAT, pipelined=False)
    assert (stats.plain_steps, stats.unverified_probes, stats.speculative_cycles,
            stats.lookup_cycles, stats.rows_verified) == (2, 1, 2, 1, 2 + 4 + 3 + 1)
    assert stats.priced_ms == pytest.approx(2 * FLAT.step(0, False) + FLAT.draft(4) * 2
                                            + FLAT.verify(4) + FLAT.verify(3) + FLAT.verify(1))


def test_names_and_capabilities():
    assert POLICIES == ("auto", "confidence", "fixed", "tree")
    assert BATCHED_POLICIES == ("auto", "fixed")
    assert [policy_class(n).needs_cost for n in POLICIES] == [True, False, False, True]
    assert not policy_class("fixed").reads_candidates
    with pytest.raises(GenerationConfigError, match="policy='greedy'"):
        make_policy("greedy", 16)
    with pytest.raises(GenerationConfigError, match="needs a cost model"):
        make_policy("auto", 16)
    with pytest.raises(GenerationConfigError, match="cannot verify a tree"):
        make_policy("tree", 16, FLAT, trees=False)
    assert make_policy("auto", 16, FLAT, trees=True).candidates == 24  # up to the costs' 31
    assert make_policy("auto", 16, FLAT, trees=True, tree_budget=6).candidates == 6


# ---------------------------------------------------------------------------------------------
# Continuations scaled by their match

MODERATE = Costs(base=10.0, per_row=0.6)  # a row costs 6 % of a step: long chains must earn it


@pytest.mark.parametrize("longer,shorter", [(40, 2), (16, 4), (8, 3)])
def test_a_longer_match_earns_a_longer_chain(longer, shorter):
    tokens = tuple(range(100, 163))
    rows = {}
    for match in (longer, shorter):
        policy = auto(MODERATE, losses=1)  # a probe: the continuation goes first
        plan = policy.before_draft(128, MAX_BACKOFF, Match(tokens, match))
        assert isinstance(plan, Continuation) and plan.match == match
        rows[match] = plan.rows
    assert rows[longer] > rows[shorter]


def test_agreeing_occurrences_earn_a_longer_chain_and_verified_rows_teach_their_class():
    tokens = tuple(range(100, 163))
    once = auto(MODERATE, losses=1).before_draft(128, MAX_BACKOFF, Match(tokens, 4, 1, "index"))
    often = auto(MODERATE, losses=1).before_draft(128, MAX_BACKOFF, Match(tokens, 4, 5, "index"))
    assert often.rows > once.rows and often.source == "index"
    # A class whose chains keep failing early gets short chains; another class is untouched.
    policy = auto(MODERATE, losses=1)
    for _ in range(20):
        policy.observe(Outcome(Continuation(tokens[:30], 20), 1, context=128))
    assert policy.before_draft(128, MAX_BACKOFF, Match(tokens, 20)).rows < 8
    assert policy.before_draft(128, MAX_BACKOFF, Match(tokens, 5)).rows == once.rows


def test_index_chains_are_counted_apart_from_the_sequences_own():
    policy = auto()
    policy.observe(Outcome(Continuation((1, 2), 2), 2, context=128))
    policy.observe(Outcome(Continuation((1, 2), 9, 1, "index"), 2, context=128))
    assert policy.stats.lookup_cycles == 2 and policy.stats.index_cycles == 1


# ---------------------------------------------------------------------------------------------
# Competing continuations verified as one tree (attention-only targets)

CHEAP_ROWS = Costs(base=10.0, per_row=0.01)  # a row costs 0.1 % of a step: rivals are worth it


def rivals_match(match: int = 3) -> Match:
    """A continuation with two rivals: one wrong from the first token, one from the third."""
    first = tuple(range(100, 120))
    return Match(first, match, 1, "index", (
        Match((7,) + first[1:], match), Match(first[:2] + (9,) + first[3:], match)))


def test_rival_continuations_are_verified_as_a_tree_where_it_pays():
    match = rivals_match()
    chain = auto(CHEAP_ROWS, losses=1).before_draft(128, MAX_BACKOFF, match)
    policy = auto(CHEAP_ROWS, losses=1, trees=True)
    plan = policy.before_draft(128, MAX_BACKOFF, match)
    assert isinstance(plan, Continuation) and plan.tree is not None
    assert plan.tree.tokens[1:3] == [100, 101] and {7, 9} <= set(plan.tree.tokens)
    assert plan.tokens == match.tokens[:len(plan.tokens)]  # its spine: the first continuation
    assert plan.rows == len(plan.tree) - 1 > chain.rows - 1
    # Worth more than the chain alone, by the same prices.
    chain_policy = auto(CHEAP_ROWS, losses=1)
    chain_policy.before_draft(128, MAX_BACKOFF, match)
    assert policy.expected > chain_policy.expected
    # Hybrid targets (no trees), no rivals, or rows that cost a step each: no tree.
    assert auto(CHEAP_ROWS, losses=1).before_draft(128, MAX_BACKOFF, match).tree is None
    alone = Match(match.tokens, match.length, match.count, match.source)
    assert auto(CHEAP_ROWS, losses=1, trees=True).before_draft(128, MAX_BACKOFF, alone).tree \
        is None
    steep = auto(MODERATE, losses=1, trees=True).before_draft(128, MAX_BACKOFF, rivals_match(40))
    assert steep is None or steep.tree is None  # a long match's chain: its rivals not worth rows


def test_a_rival_tree_competes_with_the_drafted_block_after_drafting():
    policy = auto(CHEAP_ROWS, trees=True)
    assert policy.before_draft(128, MAX_BACKOFF, rivals_match()) is None  # the drafter drafts
    plan = policy.after_draft(block([0.3] * 15), 0, 16)
    assert isinstance(plan, Continuation) and plan.tree is not None
    assert plan.drafter_value is not None and plan.drafter_value < policy.expected


def test_a_rival_tree_teaches_its_spine_and_its_rivals_and_counts_as_a_continuation():
    policy = auto(CHEAP_ROWS, losses=1, trees=True)
    plan = policy.before_draft(128, MAX_BACKOFF, rivals_match())
    tree = plan.tree
    rival = next(i for i in range(1, len(tree)) if tree.tokens[i] == 7)  # right; the spine not
    below = [i for i in range(1, len(tree)) if tree.parents[i] == rival]
    path = (rival, *below[:1])
    before = dict(policy.calibration.rivals.hits)
    policy.observe(Outcome(plan, len(path), path, context=128))
    assert policy.calibration.rivals.hits["sibling"] == before["sibling"] + 1
    # The spine's first row was verified and rejected: its class learnt a failure.
    assert policy.calibration.continuation.tried[0].sum() == 1
    assert policy.calibration.continuation.accepted.sum() == 0
    stats = policy.stats
    assert (stats.lookup_cycles, stats.index_cycles, stats.tree_cycles,
            stats.speculative_cycles) == (1, 1, 0, 0)
    assert stats.rows_verified == len(tree)
    assert price(Outcome(plan, context=128), FLAT, False) == pytest.approx(FLAT.verify(len(tree)))
