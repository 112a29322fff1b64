"""Unit tests of dflash.sampling: processors against mlx-lm's row by row, settings, seeds, errors."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)
from tiny_models import OracleDrafter, write_drafter, write_target

from dflash.errors import GenerationConfigError
from dflash.sampling import BlockSampler, SamplingConfig, check_decode_settings
from dflash.speculative import generate, stream_generate

V = 16

CARD = dict(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, repetition_penalty=1.05,
            presence_penalty=1.5)


def mlx_lm_rows(logits, history, proposals, **settings):
    """mlx-lm's processors applied one row at a time, row ``i`` seeing history + proposals[:i]."""
    procs = make_logits_processors(
        settings.get("logit_bias"), settings.get("repetition_penalty"),
        settings.get("repetition_context_size", 20), settings.get("presence_penalty"),
        settings.get("presence_context_size", 20), settings.get("frequency_penalty"),
        settings.get("frequency_context_size", 20))
    procs += list(settings.get("logits_processors") or [])
    out = []
    for i in range(logits.shape[0]):
        seen = history + (list(proposals[:i]) if proposals is not None else [])
        row = logits[i:i + 1]
        for proc in procs:  # generate_step's loop
            row = proc(mx.array(seen), row)
        out.append(row)
    return mx.concatenate(out)


def dflash_rows(logits, history, proposals, **settings):
    cfg = SamplingConfig(**{k: v for k, v in settings.items()}, temperature=1.0, seed=0)
    cfg.validate(logits.shape[-1])
    return BlockSampler(cfg).process(logits, history, proposals)


SETTINGS = {
    "repetition": dict(repetition_penalty=1.3),
    "repetition-ctx3": dict(repetition_penalty=0.7, repetition_context_size=3),
    "presence": dict(presence_penalty=0.9),
    "presence-ctx1": dict(presence_penalty=-0.4, presence_context_size=1),
    "frequency": dict(frequency_penalty=0.35),
    "frequency-ctx4": dict(frequency_penalty=1.1, frequency_context_size=4),
    "bias": dict(logit_bias={0: 2.5, 7: -1.25, 15: -math.inf}),
    "all": dict(logit_bias={3: 1.5, 4: -0.5}, repetition_penalty=1.2, repetition_context_size=5,
                presence_penalty=0.6, presence_context_size=7, frequency_penalty=0.3,
                frequency_context_size=9),
    "card": dict(repetition_penalty=1.05, presence_penalty=1.5),
}

HISTORIES = {
    "long-with-duplicates": [3, 5, 5, 9, 1, 3, 3, 3, 12, 0, 5, 7, 7, 2, 9, 9, 4, 11, 3, 6, 6, 1,
                             5, 5, 8],
    "shorter-than-window": [4, 4],
    "one-token": [9],
}

PROPOSALS = {
    "first-token-row": [],
    "duplicates": [5, 5, 3, 14, 5, 8, 8],
    "fresh": [10, 13, 2],
    "history-only": None,
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("proposals", list(PROPOSALS))
@pytest.mark.parametrize("history", list(HISTORIES))
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_process_is_mlx_lm_row_by_row(setting, history, proposals, dtype):
    """Bit-identical to mlx-lm's processors, duplicates, short windows and the first row included."""
    hist, props = HISTORIES[history], PROPOSALS[proposals]
    rows = len(props) + 1 if props is not None else 4
    logits = (mx.random.normal((rows, V), key=mx.random.key(7)) * 3).astype(getattr(mx, dtype))
    ours = dflash_rows(logits, hist, props, **SETTINGS[setting])
    ref = mlx_lm_rows(logits, hist, props, **SETTINGS[setting])
    assert ours.dtype == ref.dtype
    assert ours.shape == ref.shape
    assert mx.array_equal(ours, ref, equal_nan=True).item(), (ours - ref).abs().max()


def test_custom_processors_follow_builtins_row_by_row():
    seen = []

    def spy(tokens, logits):
        seen.append((tokens.tolist(), logits))
        return logits - 0.5 * (mx.arange(V) == tokens[-1])

    hist, props = [1, 2, 2, 7], [7, 3, 1]
    logits = mx.random.normal((4, V), key=mx.random.key(3))
    settings = dict(presence_penalty=1.0, logits_processors=[spy])
    ours = dflash_rows(logits, hist, props, **settings)
    assert [t for t, _ in seen] == [hist, hist + [7], hist + [7, 3], hist + [7, 3, 1]]
    # The custom processor saw logits the built-in penalty had already processed.
    assert seen[0][1][0, 2].item() == pytest.approx(logits[0, 2].item() - 1.0)
    seen.clear()
    ref = mlx_lm_rows(logits, hist, props, **settings)
    assert mx.array_equal(ours, ref).item()


def test_history_only_rows():
    """``proposals=None``: every row sees the committed history (the drafter side)."""
    logits = mx.random.normal((3, V), key=mx.random.key(1))
    ours = dflash_rows(logits, [2, 2, 5], None, repetition_penalty=1.5, frequency_penalty=0.2)
    one = dflash_rows(logits[:1], [2, 2, 5], [], repetition_penalty=1.5, frequency_penalty=0.2)
    for i in range(3):
        row = dflash_rows(logits[i:i + 1], [2, 2, 5], [], repetition_penalty=1.5,
                          frequency_penalty=0.2)
        assert mx.array_equal(ours[i], row[0]).item()
    assert mx.array_equal(ours[0], one[0]).item()


def test_probs_are_mlx_lm_make_sampler_distribution():
    """probs() is what make_sampler draws from: check by sampling it (one row, 20k draws)."""
    logits = mx.random.normal((1, 6), key=mx.random.key(5)) * 2
    cfg = SamplingConfig(temperature=0.7, top_p=0.9, top_k=4, min_p=0.05, seed=0)
    cfg.validate(6)
    p = np.array(BlockSampler(cfg).probs(logits)[0], dtype=np.float64)
    sampler = make_sampler(0.7, 0.9, 0.05, top_k=4)
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    mx.random.seed(0)
    draws = np.array(sampler(mx.broadcast_to(logprobs, (20000, 6))))
    counts = np.bincount(draws, minlength=6)
    assert (counts[p == 0] == 0).all()
    from scipy import stats

    keep = p > 0
    assert stats.chisquare(counts[keep], 20000 * p[keep] / p[keep].sum()).pvalue > 1e-3


def mlx_lm_probs(logits, temperature, top_p=1.0, min_p=0.0, top_k=0):
    """make_sampler's distribution, densely: its filters in its order, then softmax(x / temp)."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < top_p < 1:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p:
        logprobs = apply_min_p(logprobs, min_p)
    if top_k:
        logprobs = apply_top_k(logprobs, top_k)
    return np.array(mx.softmax(logprobs * (1 / temperature), axis=-1), dtype=np.float64)


FILTERS = {
    "temperature": dict(temperature=0.7),
    "card": dict(temperature=1.0, top_p=0.95, top_k=20),
    "top_p-flat": dict(temperature=1.0, top_p=0.9),  # nucleus far past the first candidates
    "top_p-peaked": dict(temperature=0.6, top_p=0.8),
    "min_p-flat": dict(temperature=1.3, min_p=0.01),
    "min_p-peaked": dict(temperature=1.0, min_p=0.2),
    "all": dict(temperature=0.9, top_p=0.97, min_p=0.02, top_k=40),
}


@pytest.mark.parametrize("case", list(FILTERS))
def test_large_vocab_distribution_is_mlx_lm(case):
    """Candidates + fallback over a 5000-token vocabulary give make_sampler's distribution."""
    s = FILTERS[case]
    scale = 0.3 if "flat" in case else 4.0
    logits = mx.random.normal((3, 5000), key=mx.random.key(2)) * scale
    cfg = SamplingConfig(seed=0, **s)
    cfg.validate(5000)
    ours = np.array(BlockSampler(cfg).probs(logits), dtype=np.float64)
    ref = mlx_lm_probs(logits, **s)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-7)  # float32 log-probs ~1e-6 abs
    assert ((ours > 0) == (ref > 0)).all()


# ---------------------------------------------------------------------------------------------
# Through the loop, on a tiny target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mlx_lm.utils import load_model

    from dflash.drafter import load_draft

    root = tmp_path_factory.mktemp("units")
    tpath = write_target(root / "t", "qwen3", vocab_size=64, with_tokenizer=False, hidden=32,
                         layers=2, seed=11)
    dpath = write_drafter(root / "d", tpath, layers=1, taps=(0, 1), block_size=8)
    model, _ = load_model(tpath)
    return model, load_draft(dpath)


PROMPT = [5, 9, 9, 31, 2, 17, 5]

GREEDY_SETTINGS = {
    "penalties": dict(repetition_penalty=1.4, repetition_context_size=6, presence_penalty=0.5,
                      presence_context_size=4, frequency_penalty=0.3, frequency_context_size=10,
                      logit_bias={7: 0.8, 40: -2.0}),
    "card-greedy": dict(repetition_penalty=1.05, presence_penalty=1.5),
}


def target_only(model, n, temperature=0.0, **s):
    procs = make_logits_processors(
        s.get("logit_bias"), s.get("repetition_penalty"), s.get("repetition_context_size", 20),
        s.get("presence_penalty"), s.get("presence_context_size", 20),
        s.get("frequency_penalty"), s.get("frequency_context_size", 20))
    procs += list(s.get("logits_processors") or [])
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n,
                                             sampler=make_sampler(temperature),
                                             logits_processors=procs)]


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
@pytest.mark.parametrize("setting", list(GREEDY_SETTINGS))
def test_greedy_with_processors_equals_mlx_lm(setting, proposal, tiny):
    """Temperature 0 + penalties/bias: token for token mlx-lm's output, through partial accepts."""
    model, draft = tiny
    s = GREEDY_SETTINGS[setting]
    ref = target_only(model, 48, **s)
    out = generate(model, draft, None, PROMPT, max_tokens=48, block_size=8, proposal=proposal, **s)
    assert out.tokens == ref
    oracle = OracleDrafter(draft, PROMPT + ref + [0] * 16, lambda c, j: j == (c % 5))
    out = generate(model, oracle, None, PROMPT, max_tokens=48, block_size=8, **s)
    assert out.tokens == ref
    assert 1.5 < out.stats.mean_tau < 8


def test_custom_processor_and_sampler_in_mlx_lm_form(tiny):
    model, draft = tiny

    def no_immediate_repeat(tokens, logits):
        return logits.at[:, tokens[-1:]].add(-1e9)

    ref = target_only(model, 32, logits_processors=[no_immediate_repeat])
    oracle = OracleDrafter(draft, PROMPT + ref + [0] * 16, lambda c, j: j == 3)
    out = generate(model, oracle, None, PROMPT, max_tokens=32, block_size=8,
                   logits_processors=[no_immediate_repeat])
    assert out.tokens == ref
    # A custom sampler gets mlx-lm's input: one row of log-probabilities at a time.
    shapes = []

    def always_11(logprobs):
        shapes.append((logprobs.shape, round(mx.logsumexp(logprobs).item(), 4)))
        return mx.array([11])

    out = generate(model, OracleDrafter(draft, PROMPT + [11] * 40, lambda c, j: j == 2), None,
                   PROMPT, max_tokens=20, block_size=8, sampler=always_11)
    assert out.tokens == [11] * 20
    assert out.stats.mean_tau > 2
    assert set(shapes) == {((1, 64), 0.0)}


def test_logit_bias_can_ban_tokens(tiny):
    model, draft = tiny
    greedy = generate(model, draft, None, PROMPT, max_tokens=24).tokens
    banned = {greedy[0]: -math.inf, str(greedy[1]): -math.inf}
    for kwargs in (dict(), dict(temperature=1.0, seed=3), dict(temperature=1.0, seed=3,
                                                                proposal="sample")):
        out = generate(model, draft, None, PROMPT, max_tokens=24, logit_bias=banned, **kwargs)
        assert greedy[0] not in out.tokens and greedy[1] not in out.tokens


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_seeded_runs_reproduce(proposal, tiny):
    model, draft = tiny
    from dflash.cost_model import fresh_cost_model
    from dflash.target import target_parts

    # Pass costs that start from the prior and learn (a machine with nothing stored yet).
    costs = fresh_cost_model(target_parts(model), draft)

    def run(seed):
        return generate(model, draft, None, PROMPT, max_tokens=40, block_size=8, seed=seed,
                        proposal=proposal, **CARD).tokens

    runs = [run(seed) for seed in (1, 1, 2, 3)]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs}) >= 2  # different seeds, different samples
    # What the pair's pass costs learnt in between (here: long verify passes became nearly free,
    # which moves every learnt price) leaves a seeded run's plans, and so its samples, alone.
    for rows in (1, 2, 4, 8, 16):
        for _ in range(8):
            costs.observe("verify", rows, len(PROMPT), 1e-6 * (17 - rows))
    assert run(1) == runs[0]


def test_seeded_custom_sampler_reproduces(tiny):
    model, draft = tiny
    sampler = make_sampler(1.0, top_p=0.9)
    runs = [generate(model, draft, None, PROMPT, max_tokens=24, seed=5, sampler=sampler).tokens
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_acceptance_by_position_is_what_the_cycles_did(tiny):
    """Greedy with planted errors: the statistics match a replay of the plant."""
    model, draft = tiny
    n, block = 60, 8
    ref = target_only(model, n)

    def plant(c, j):
        return j == (c * 2) % 9  # 7 and 8 are never proposed: those cycles accept all

    out = generate(model, OracleDrafter(draft, PROMPT + ref + [0] * 16, plant), None, PROMPT,
                   max_tokens=n, block_size=block, policy="fixed")
    assert out.tokens == ref
    accepted, proposed, generated, cycle, drafted, tokens = (
        [0] * (block - 1), [0] * (block - 1), 1, 0, 0, 0)
    while generated < n:
        bs = min(block, n - generated)
        a = 0
        if bs > 1:
            a = next((j for j in range(bs - 1) if plant(drafted, j)), bs - 1)
            drafted += 1
        for j in range(bs - 1):
            proposed[j] += 1
            accepted[j] += j < a
        generated += a + 1
        tokens += a + 1
        cycle += 1
    expect = [a / p if p else 0.0 for a, p in zip(accepted, proposed)]
    assert out.stats.acceptance_by_position == pytest.approx(expect)
    assert out.stats.cycles == cycle
    assert out.stats.mean_tau == pytest.approx(tokens / cycle)
    assert expect[0] < 1 and expect[-1] > 0  # both ends exercised


def test_proposals_see_penalties_of_earlier_proposals():
    """The drafter's row j is processed with history + proposals[:j] (argmax and sample)."""
    logits = mx.zeros((3, V)).at[:, 4].add(2.0).at[:, 6].add(1.0)  # 4, then 6, then the rest
    for proposal in ("argmax", "sample"):
        cfg = SamplingConfig(temperature=0.05, presence_penalty=5.0, proposal=proposal, seed=0)
        cfg.validate(V)
        tokens, q = BlockSampler(cfg).propose(logits, [1, 2])
        tokens = tokens.tolist()
        assert tokens[:2] == [4, 6] and tokens[2] not in (4, 6)
        if proposal == "sample":
            assert len(q) == 3
            for row, tok in zip(q, tokens):
                assert row.probs.sum() == pytest.approx(1.0) and row.prob(tok) > 0
            assert q[1].prob(4) < 1e-6 and q[1].prob(6) > 0.99


# ---------------------------------------------------------------------------------------------
# Bad input


BAD = [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", "hot"), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2),
    ("top_p", float("nan")), ("top_k", -1), ("top_k", 2.5), ("top_k", True), ("min_p", -0.1),
    ("min_p", 1.0), ("min_p", 1.5), ("repetition_penalty", 0.0), ("repetition_penalty", -1.05),
    ("repetition_penalty", float("nan")), ("repetition_penalty", float("inf")),
    ("repetition_context_size", 0), ("presence_penalty", float("nan")),
    ("frequency_penalty", "x"), ("logit_bias", [1, 2]), ("logit_bias", {"a": 1.0}),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {64: 1.0}), ("logit_bias", {1: "x"}),
    ("logit_bias", {1: float("nan")}), ("logit_bias", {1: float("inf")}),
    ("logit_bias", {1.5: 1.0}), ("logit_bias", {1: 1.0, "1": 2.0}), ("proposal", "beam"),
    ("seed", -1), ("seed", "x"), ("seed", 2**64), ("logits_processors", 5),
    ("logits_processors", [5]), ("sampler", 5),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_bad_settings_raise_before_generation(name, value, tiny):
    model, draft = tiny
    with pytest.raises(GenerationConfigError, match=name) as err:
        stream_generate(model, draft, None, PROMPT, **{name: value})  # no next(): not started
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("name,value", [
    ("block_size", 1), ("block_size", 2.0), ("max_tokens", -1), ("prefill_step_size", 0),
    ("min_confidence", 1.5), ("min_confidence", float("nan")), ("min_confidence", "x"),
])
def test_bad_decode_settings_raise_before_generation(name, value, tiny):
    model, draft = tiny
    with pytest.raises(GenerationConfigError, match=f"^{name}="):
        stream_generate(model, draft, None, PROMPT, **{name: value})
    settings = dict(block_size=4, max_tokens=8, prefill_step_size=16, min_confidence=0.0)
    check_decode_settings(**settings)
    with pytest.raises(GenerationConfigError, match=f"^{name}="):
        check_decode_settings(**{**settings, name: value})


def test_custom_sampler_needs_argmax_proposals(tiny):
    model, draft = tiny
    with pytest.raises(GenerationConfigError, match="proposal"):
        stream_generate(model, draft, None, PROMPT, sampler=make_sampler(1.0), proposal="sample")


def test_edge_values_are_accepted():
    cfg = SamplingConfig(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=None,
                         logit_bias={"5": -math.inf, np.int64(6): 1}, seed=0,
                         presence_penalty=np.float32(0.5))
    cfg.validate(V)
    assert cfg.logit_bias == {5: -math.inf, 6: 1.0}
    assert type(cfg.presence_penalty) is float
