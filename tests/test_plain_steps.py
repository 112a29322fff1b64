"""Plain target steps (the ``auto`` policy stepping aside) stay exact, and cheap.

A drafter that never agrees, on a "machine" (a cost model written where the calibration is cached)
where such a drafter always loses to a plain step: after its first two, verified, losing cycles
the policy takes plain stretches of 2, 4, 8 ... steps, and each probe between them drafts but
verifies nothing. Output must be the target's own: greedy (pipelined plain steps) and sampled with a
truncation that leaves one token (plain steps drawn on the host), with ``max_tokens``, stop ids and
stop strings landing inside stretches; and when the drafter turns right after a stretch,
speculation comes back and stays exact. The drafter's context, caught up in one pass after a
stretch, proposes what a context fed step by step proposes.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors
from test_engine import chat_prompt, reference
from tiny_models import OracleDrafter

from dflash import cost_model as costs
from dflash import speculative as sp
from dflash.model_mlx import generate
from dflash.policy import (
    MAX_BACKOFF,
    MIN_DRAFT_ROWS,
    AutoPolicy,
    Chain,
    Outcome,
    PairMemory,
    Unverified,
    make_policy,
)
from dflash.request import build_request
from dflash.settings import GenerationSettings
from dflash.target import forward, make_cache, target_parts

N = 160
KINDS = ("qwen3", "qwen3_5")  # attention caches; GatedDeltaNet state (nothing to trim)


def cost(verify_ms: list[float], key: str = "t") -> costs.CostModel:
    rows = [1, 2, 4, 8, 16, 32]
    return costs.CostModel(key=key, machine=costs.machine_id(), rows=rows, contexts=[128, 1024],
                           verify_ms=[verify_ms, verify_ms], draft_rows=[2, 4, 8, 16],
                           draft_ms=[1.0, 1.0, 1.2, 1.5])


# Every verify row costs a plain step: speculation can only lose after its first cycle.
ROWS_COST = [10.0, 20.0, 40.0, 80.0, 160.0, 320.0]
# A verify pass costs about one step whatever its rows: a right drafter wins.
FLAT_COST = [10.0, 10.5, 11.0, 12.0, 14.0, 18.0]
# 9 ms a pass plus 1 ms a row, exactly (the points are on the line): a right drafter wins.
LINEAR_COST = [9.0 + rows for rows in (1, 2, 4, 8, 16, 32)]


@pytest.fixture(scope="module")
def pairs(loaded_pair):
    """Loaded (and references computed) before any test moves DFLASH_HOME."""
    out = {}
    for kind in KINDS:
        model, tokenizer, draft = loaded_pair(kind)
        prompt = chat_prompt(tokenizer)
        out[kind] = model, tokenizer, draft, prompt, reference(model, prompt, n=N)
    return out


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """``machine(pair, verify_ms)``: this pair's calibration, as if measured so, in a fresh
    DFLASH_HOME (read through the cache file like a real one)."""
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(costs, "_memory", {})

    def write(model, draft, verify_ms):
        key = costs.cost_key(target_parts(model), draft)
        path = costs.calibration_file(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(costs.to_json(cost(verify_ms, key)))
        costs._memory.clear()

    return write


class WrongUntil(OracleDrafter):
    """Confidently wrong (every proposal) while the anchor sits before position ``until``, then
    the target's own continuation."""

    def __init__(self, draft, reference: list[int], until: int):
        super().__init__(draft, reference, lambda cycle, j: self.wrong)
        self.until = until
        self.wrong = True

    def block_logits(self, target, anchor: int, block_len: int, cache) -> mx.array:
        self.wrong = cache[0].offset < self.until
        return super().block_logits(target, anchor, block_len, cache)


def never_right(draft, prompt, ref):
    return WrongUntil(draft, prompt + ref + [0] * 32, until=10**9)


@pytest.mark.parametrize("kind", KINDS)
def test_plain_stretches_are_the_target_greedy(kind, pairs, machine):
    model, tokenizer, draft, prompt, ref = pairs[kind]
    machine(model, draft, ROWS_COST)
    # Ends inside stretches and probes: stretches cover tokens 3-4, 6-9, 10-18, 19-35, 36-68 ...
    first = None  # proposals verified by the first cycle
    for n in (1, 2, 3, 7, 14, 36, 50, 100, 133, N):
        out = generate(model, never_right(draft, prompt, ref), tokenizer, prompt, max_tokens=n)
        assert out.tokens == ref[:n], n
        s = out.stats
        # Every token after the prefill's came from a one-token cycle or a plain step (a last
        # token alone is a cycle that verifies nothing).
        assert s.cycles + s.plain_steps == n - 1, (n, s.cycles, s.plain_steps)
        if n >= 7:  # the first two cycles lost; the probes after them verified nothing ...
            assert s.plain_steps >= n - 4, n
        if n > 8:  # (a first cycle with a whole block left: the same one every time)
            first = first or s.verified_tokens
            assert s.verified_tokens == first or n == N, n
    # ... until the stretches reached MAX_BACKOFF: tokens 2 and 5 came from verified cycles,
    # tokens 3-4, 6-9, 10-133 from stretches of 2, 4, 1 + 8, ..., 1 + 64; the probe at token 134
    # was verified again.
    assert out.stats.verified_tokens > first and out.stats.cycles >= 2


@pytest.mark.parametrize("kind", KINDS)
def test_stops_inside_plain_stretches(kind, pairs, machine):
    model, tokenizer, draft, prompt, ref = pairs[kind]
    machine(model, draft, ROWS_COST)
    full = generate(model, never_right(draft, prompt, ref), tokenizer, prompt, max_tokens=N)
    for at in (6, 12, 27, 60, 120):
        stop = ref[at]
        first = ref.index(stop)
        out = generate(model, never_right(draft, prompt, ref), tokenizer, prompt,
                       max_tokens=N, stop_token_ids=[stop])
        assert out.tokens == ref[:first] and out.finish_reason == "stop", at
        needle = full.text[4 * at: 4 * at + 6]
        if needle.strip():
            out = generate(model, never_right(draft, prompt, ref), tokenizer, prompt,
                           max_tokens=N, stop=[needle])
            assert out.text == full.text[: full.text.index(needle)]
            assert out.finish_reason == "stop"


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_plain_stretches_with_penalties_are_the_target(kind, pairs, machine):
    """Temperature 1 with ``top_k=1`` samples on the host (no pipelining) and leaves one token:
    mlx-lm's processors, then argmax. The penalties see each stretch's own earlier tokens."""
    model, tokenizer, draft, prompt, _ = pairs[kind]
    machine(model, draft, ROWS_COST)
    penalties = dict(repetition_penalty=1.3, repetition_context_size=6, presence_penalty=0.4,
                     frequency_penalty=0.3, frequency_context_size=8)
    procs = make_logits_processors(None, 1.3, 6, 0.4, 20, 0.3, 8)
    ref = reference(model, prompt, n=N, logits_processors=procs)
    for n in (9, 40, N):
        out = generate(model, never_right(draft, prompt, ref), tokenizer, prompt, max_tokens=n,
                       temperature=1.0, top_k=1, seed=3, **penalties)
        assert out.tokens == ref[:n], n
        assert out.stats.plain_steps >= n - 4


@pytest.mark.parametrize("kind", KINDS)
def test_speculation_after_plain_stretches_stays_exact(kind, pairs, machine):
    model, tokenizer, draft, prompt, ref = pairs[kind]
    machine(model, draft, FLAT_COST)
    until = len(prompt) + 30
    oracle = WrongUntil(draft, prompt + ref + [0] * 32, until)
    out = generate(model, oracle, tokenizer, prompt, max_tokens=N)
    assert out.tokens == ref
    s = out.stats
    assert s.plain_steps > 0  # the wrong drafter was stepped aside from
    # ... and the right one speculates again: every proposal accepted was made after ``until``.
    assert round(s.mean_tau * s.cycles) - s.cycles >= 8


@pytest.mark.parametrize("kind", KINDS)
def test_a_never_agreeing_drafter_is_not_verified_in_the_next_generation(kind, pairs, machine):
    """Given a pair memory (the drafter's own, here), the next generation starts from the
    drafter's calibration: it verifies less of a drafter it knows is wrong; one that also
    inherits the losing streak verifies nothing. Without one, every generation starts fresh."""
    model, tokenizer, draft, prompt, ref = pairs[kind]
    machine(model, draft, ROWS_COST)
    wrong = never_right(draft, prompt, ref)  # one loaded drafter, used twice
    wrong.policy_memory = PairMemory()
    n = 40
    first = generate(model, wrong, tokenizer, prompt, max_tokens=n)
    second = generate(model, wrong, tokenizer, prompt, max_tokens=n)
    assert first.tokens == second.tokens == ref[:n]
    assert first.stats.verified_tokens > 0  # its first two cycles were verified
    assert second.stats.verified_tokens < first.stats.verified_tokens  # calibrated: less verified
    assert second.stats.cycles <= first.stats.cycles
    streak = PairMemory(inherit_streak=True)
    generate(model, wrong, tokenizer, prompt, max_tokens=n, memory=streak)
    behind = generate(model, wrong, tokenizer, prompt, max_tokens=n, memory=streak)
    assert behind.tokens == ref[:n]
    assert behind.stats.verified_tokens == 0  # behind the streak: no verified loss
    other = generate(model, never_right(draft, prompt, ref), tokenizer, prompt, max_tokens=n)
    assert other.stats.verified_tokens == first.stats.verified_tokens  # another drafter: fresh
    again = generate(model, wrong, tokenizer, prompt, max_tokens=n, memory=PairMemory())
    assert again.stats.verified_tokens == first.stats.verified_tokens  # a memory of its own


@pytest.mark.parametrize("kind", KINDS)
def test_continuations_in_plain_stretches_are_the_target_greedy(kind, pairs, machine):
    """A drafter that never agrees, on a machine where a verify pass costs about a step: the
    drafter is stepped aside from, and the text's own continuations (tiny random targets
    repeat themselves) end plain stretches and are verified."""
    model, tokenizer, draft, prompt, ref = pairs[kind]
    machine(model, draft, FLAT_COST)
    out = generate(model, never_right(draft, prompt, ref), tokenizer, prompt, max_tokens=N)
    assert out.tokens == ref
    s = out.stats
    assert s.lookup_cycles > 0 and s.plain_steps > 0
    assert round(s.mean_tau * s.cycles) > s.cycles  # continuations were accepted
    off = generate(model, never_right(draft, prompt, ref), tokenizer, prompt, max_tokens=N,
                   lookup=False)
    assert off.tokens == ref and off.stats.lookup_cycles == 0


@pytest.mark.parametrize("kind", KINDS)
def test_drafter_context_caught_up_after_a_stretch_proposes_the_same(kind, pairs):
    """The taps of a plain stretch reach the drafter in one pass when it drafts next; its block
    scores equal those of a context fed one token at a time."""
    model, tokenizer, draft, prompt, ref = pairs[kind]
    parts = target_parts(model)
    request = build_request(parts, draft, tokenizer, prompt,
                            GenerationSettings(max_tokens=N, policy="fixed"))

    def state():
        s = sp.DecodeState(make_cache(parts), draft.make_cache(), history=list(prompt),
                           fed=list(prompt), policy=make_policy("fixed", request.block_size))
        s.history.append(sp.first_token(request, s, sp._prefill(parts, draft, request, s, 0)))
        return s

    lazy, eager = state(), state()
    out = sp.plain_steps(parts, draft, request, lazy, 12)
    for _ in range(12):
        step = sp.plain_steps(parts, draft, request, eager, 1)
        eager.history += step.tokens
        eager.sync_drafter(draft)  # fed at once, every step
    assert out.tokens == eager.history[len(lazy.history):] == ref[1:13]
    assert lazy.pending_rows == 12 and lazy.fed == eager.fed
    lazy.sync_drafter(draft)
    anchor = out.tokens[-1]
    a = np.array(draft.block_scores(parts, anchor, 8, lazy.dcache)[0])
    b = np.array(draft.block_scores(parts, anchor, 8, eager.dcache)[0])
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert (a.argmax(-1) == b.argmax(-1)).all()


@pytest.mark.parametrize("kind", KINDS)
def test_a_stretch_keeps_one_piece_of_taps_per_step_joined_in_order(kind, pairs):
    """A stretch's taps, kept one piece per step and joined once when the drafter next drafts,
    are the taps one target pass over the same tokens gives (each row its token's, in order)."""
    model, tokenizer, draft, prompt, ref = pairs[kind]
    parts = target_parts(model)
    request = build_request(parts, draft, tokenizer, prompt,
                            GenerationSettings(max_tokens=N, policy="fixed"))
    state = sp.DecodeState(make_cache(parts), draft.make_cache(), history=list(prompt),
                           fed=list(prompt), policy=make_policy("fixed", request.block_size))
    state.history.append(sp.first_token(request, state, sp._prefill(parts, draft, request,
                                                                     state, 0)))
    n = 40
    out = sp.plain_steps(parts, draft, request, state, n)
    assert out.tokens == ref[1:n + 1]
    assert len(state.pending) == n and state.pending_rows == n
    taps = state.take_taps()
    assert state.pending == [] and state.take_taps() is None
    # The same tokens in one pass from the prompt: the fed tokens after it, row for row.
    once = make_cache(parts)
    forward(parts, mx.array(prompt)[None], once, draft.target_layer_ids)
    _, expected = forward(parts, mx.array(state.fed[len(prompt):])[None], once,
                          draft.target_layer_ids)
    assert taps.shape == expected.shape == (1, n, expected.shape[-1])
    np.testing.assert_allclose(np.array(taps), np.array(expected), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# The policy's side of it


def losing_policy() -> AutoPolicy:
    policy = make_policy("auto", 16, cost(ROWS_COST))
    policy.plain_stretch(128, MAX_BACKOFF)
    return policy


def confident(rows: int) -> tuple[np.ndarray, np.ndarray]:
    log_probs = np.log(np.full((rows, 1), 0.97))
    return log_probs, np.arange(rows)[:, None]


def observe(policy, plan, accepted: int = 0, log_conf=None, draft_rows: int = 4) -> None:
    """Report a cycle of ``plan`` to ``policy`` (at the context it planned at)."""
    policy.observe(Outcome(plan, accepted, log_conf=log_conf, draft_rows=draft_rows,
                           context=policy.context))


def test_a_losing_streak_drafts_little_and_stops_verifying_until_the_longest_stretch():
    policy = losing_policy()
    assert policy.draft_rows(16) == MIN_DRAFT_ROWS  # nothing known of the drafter yet
    plan = policy.after_draft(confident(3), anchor=0, draft_rows=4)
    assert not isinstance(plan, Unverified)  # the streak's first probe is verified, whatever
    observe(policy, plan, 0, confident(3)[0][:, 0])
    assert policy.backoff.losses == 1 and policy.plain_stretch(128, MAX_BACKOFF) == 2
    plan = policy.after_draft(confident(3), anchor=0, draft_rows=4)
    assert not isinstance(plan, Unverified)  # and so is its second: one unlucky cycle is no evidence
    observe(policy, plan, 0, confident(3)[0][:, 0])
    assert policy.backoff.losses == 2 and policy.plain_stretch(128, MAX_BACKOFF) == 4
    stretches = []
    while 2 ** policy.backoff.losses < MAX_BACKOFF:
        assert policy.draft_rows(16) == MIN_DRAFT_ROWS
        plan = policy.after_draft(confident(MIN_DRAFT_ROWS - 1), anchor=0,
                                  draft_rows=MIN_DRAFT_ROWS)
        assert isinstance(plan, Unverified)
        observe(policy, plan, draft_rows=MIN_DRAFT_ROWS)
        stretches.append(policy.plain_stretch(128, MAX_BACKOFF))
    assert stretches == [8, 16, 32, 64]
    assert policy.stats.unverified_probes == 4 and policy.stats.speculative_cycles == 2
    # At the longest stretch, probes are verified again: the calibration keeps learning.
    assert not isinstance(policy.after_draft(confident(3), anchor=0, draft_rows=4), Unverified)


def test_a_streak_where_the_drafter_agreed_keeps_verifying():
    policy = losing_policy()
    for accepted in (1, 0, 0):  # it lost, but it agreed once
        plan = policy.after_draft(confident(3), anchor=0, draft_rows=4)
        assert not isinstance(plan, Unverified)
        observe(policy, plan, accepted, confident(3)[0][:, 0])
        policy.plain_stretch(128, MAX_BACKOFF)
    assert policy.backoff.losses == 3 and policy.backoff.agreed


def test_a_probe_expected_to_win_is_verified_and_a_winning_cycle_drafts_deeper():
    policy = make_policy("auto", 16, cost(FLAT_COST))
    policy.backoff.lost()
    assert policy.plain_stretch(128, MAX_BACKOFF) == 2  # the stretch is taken; then the probe
    log_probs = np.log(np.full((3, 1), 0.999))
    plan = policy.after_draft((log_probs, np.arange(3)[:, None]), anchor=0, draft_rows=4)
    assert plan == Chain(3)
    observe(policy, plan, 3, log_probs[:, 0])  # all accepted: the streak is over
    assert policy.backoff.losses == 0 and policy.plain_stretch(128, MAX_BACKOFF) == 0
    assert policy.draft_rows(16) == 3 + 3  # the deepest recent plan and two more rows


def test_speculation_is_weighed_against_the_plain_step_it_would_really_take():
    """Greedy plain steps are pipelined (the host builds the next pass while this one runs), so a
    plain step costs less than a lone one-row pass; a cycle that beats the lone pass but not the
    pipelined step is a loss only where plain steps pipeline."""
    model = cost([10.0] * 6)  # any verify pass costs 10 ms, a lone plain step too
    model.step_ms = [2.0, 2.0]  # the pipelined plain step: 2 ms
    assert model.step(128) == 2.0 and model.step(128, pipelined=False) == 10.0
    losses = {}
    for pipelined in (False, True):
        policy = make_policy("auto", 16, model, pipelined=pipelined)
        policy.plain_stretch(128, MAX_BACKOFF)
        plan = policy.after_draft(confident(3), anchor=0, draft_rows=4)
        observe(policy, plan, 3, confident(3)[0][:, 0])  # 4 tokens in ~11 ms
        losses[pipelined] = policy.backoff.losses
    assert losses == {False: 0, True: 1}


@pytest.mark.parametrize("kind", KINDS)
def test_the_priced_time_is_every_pass_at_the_calibrated_cost(kind, pairs, machine):
    """Under LINEAR_COST a target pass of r rows costs 9 + r ms, so the target's share of
    ``priced_ms`` is 9 ms a pass plus 1 ms a row: (verify cycles + plain steps) passes, and rows
    = verified proposals + one anchor a pass. The rest is drafter passes (1-1.5 ms each): at most
    one a verify cycle and one a probe, and every probe that verified nothing began a plain
    stretch, and every verify cycle but the continuations' (and a last one-token cycle) drafted.
    A drafter that is wrong for 40 tokens, then right: plain stretches, probes,
    continuations and accepted chains all priced."""
    model, tokenizer, draft, prompt, ref = pairs[kind]
    machine(model, draft, LINEAR_COST)
    for until in (10**9, len(prompt) + 40):
        drafter = WrongUntil(draft, prompt + ref + [0] * 32, until=until)
        s = generate(model, drafter, tokenizer, prompt, max_tokens=N).stats
        passes = s.cycles + s.plain_steps
        target_ms = 9.0 * passes + (s.verified_tokens + passes)
        drafted = s.cycles - s.lookup_cycles - 1  # (a last one-token cycle drafts nothing)
        assert target_ms + 1.0 * drafted <= s.priced_ms <= target_ms + 1.5 * passes, until
    one = generate(model, never_right(draft, prompt, ref), tokenizer, prompt, max_tokens=1)
    assert one.stats.priced_ms == 0.0  # the prefill's token only: no pass priced, yet priced
    s = generate(model, never_right(draft, prompt, ref), tokenizer, prompt, max_tokens=8,
                 policy="fixed").stats
    assert s.priced_ms is None  # no cost model behind a fixed policy
