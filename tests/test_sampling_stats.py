"""Statistical exactness of speculative sampling against mlx-lm's target-only sampling.

Reference: the *exact* joint distribution of the first ``K`` generated tokens under mlx-lm's
target-only sampling (``generate_step`` with ``make_sampler`` and ``make_logits_processors``),
computed by enumerating every prefix over a tiny vocabulary with the target model and mlx-lm's own
processors and filters. No sampling noise on the reference side.

dflash side: ``N`` independent generations (seeds 0..N-1) through the real ``stream_generate`` loop
(drafter, verify, roll-back, acceptance), ``max_tokens=K`` and block size 4, so one cycle verifies up
to 3 proposals: accept-all, partial, none and (``sample`` mode) residual resampling all occur.

Test: Pearson chi-square of the ``N`` sampled sequences against the exact joint, cells with an
expected count below 5 pooled into one cell, false-alarm rate ``ALPHA`` = 1e-3 per case (chi-square
approximation; ``test_chi_square_false_alarm_rate`` checks it by simulation from the exact
reference). With N = 2000 and 40-60 degrees of freedom the test has 90% power against any
deviation whose chi-square divergence over the pooled cells is >= ~0.03 (e.g. 2.7% of probability
moved between two 5% cells); ``-s`` prints the figure per case. Power is shown on deliberately
broken samplers (penalties that do not see the proposals; a rejection resampled from p instead of
the residual), which must fail the same test; their non-central chi-square power at the observed
effect is printed.

Seeds 0..N-1 make every run deterministic: the outcome of each case is fixed, and the false-alarm
rate is the chance that a correct sampler would have failed it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
)
from scipy import stats as sps
from tiny_models import write_drafter, write_target

from dflash import request as request_module
from dflash import speculative
from dflash.cost_model import cost_model
from dflash.drafter import load_draft
from dflash.sampling import BlockSampler
from dflash.speculative import stream_generate
from dflash.target import target_parts
from dflash.tree import DraftTree

pytestmark = pytest.mark.slow  # every test here runs the models for many seconds

V = 8  # vocabulary
K = 4  # generated tokens compared (the joint has V**K cells)
BLOCK = 4
N = 2000  # dflash samples per case
ALPHA = 1e-3  # false-alarm rate per case
PROMPT = [3, 1, 3, 5]
LOGIT_SCALE = 3.5  # sharpens the random target's head, like a trained model's

CASES = {
    "temperature": dict(temperature=0.8),
    "filters": dict(temperature=1.0, top_p=0.9, top_k=4, min_p=0.05),
    "penalties": dict(temperature=1.0, repetition_penalty=1.3, repetition_context_size=3,
                      presence_penalty=0.7, frequency_penalty=0.4, frequency_context_size=5,
                      logit_bias={2: 1.0, 6: -0.5}),
    # The model card's settings.
    "card": dict(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, repetition_penalty=1.05,
                 presence_penalty=1.5),
}


# ---------------------------------------------------------------------------------------------
# Models


def sharp_target(root):
    """The tiny target (its folder, and the model with the sharpened head) and a v1 drafter."""
    from mlx_lm.utils import load_model

    tpath = write_target(root / "target", "qwen3", vocab_size=V, with_tokenizer=False,
                         hidden=32, layers=1, seed=3)
    dpath = write_drafter(root / "draft", tpath, layers=1, taps=(0,), block_size=BLOCK)
    model, _ = load_model(tpath)
    model.lm_head.weight = model.lm_head.weight * LOGIT_SCALE
    mx.eval(model.parameters())
    return model, dpath


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model, dpath = sharp_target(tmp_path_factory.mktemp("stats"))
    return model, load_draft(dpath)


def target_logits(model, prefixes: list[tuple[int, ...]]) -> dict[tuple[int, ...], np.ndarray]:
    """Raw next-token logits ``(V,)`` of the target after ``PROMPT + prefix``, batched by length."""
    out = {}
    by_len: dict[int, list] = {}
    for p in prefixes:
        by_len.setdefault(len(p), []).append(p)
    for _, group in sorted(by_len.items()):
        logits = np.array(model(mx.array([PROMPT + list(p) for p in group]))[:, -1])
        for i, p in enumerate(group):
            out[p] = logits[i]
    return out


def all_prefixes(depth: int) -> list[tuple[int, ...]]:
    return [p for n in range(depth + 1) for p in itertools.product(range(V), repeat=n)]


@pytest.fixture(scope="module")
def raw_table(pair):
    model, _ = pair
    return target_logits(model, all_prefixes(K - 1))


def reference_next(raw_table, settings: dict,
                   allowed=None) -> dict[tuple[int, ...], np.ndarray]:
    """mlx-lm target-only next-token distribution after every prefix (float64, exact processors).
    ``allowed(prefix)``: a grammar's mask ``(V,)`` applied after the processors, as a last
    logits processor would (``where(allowed, logits, -inf)``)."""
    s = dict(settings)
    procs = make_logits_processors(
        s.get("logit_bias"), s.get("repetition_penalty"), s.get("repetition_context_size", 20),
        s.get("presence_penalty"), s.get("presence_context_size", 20),
        s.get("frequency_penalty"), s.get("frequency_context_size", 20))
    temp, top_p = s.get("temperature", 0.0), s.get("top_p", 1.0)
    min_p, top_k = s.get("min_p", 0.0), s.get("top_k", 0)
    keys, rows = [], []
    for prefix, raw in raw_table.items():
        # A fresh array per row: mlx-lm's repetition processor assigns into its input in place.
        logits = mx.array(raw[None])
        tokens = mx.array(PROMPT + list(prefix))
        for proc in procs:  # generate_step: processors in list order, history = prompt + output
            logits = proc(tokens, logits)
        if allowed is not None:
            logits = mx.where(mx.array(allowed(prefix))[None], logits, -np.inf)
        keys.append(prefix)
        rows.append(logits)
    logits = mx.concatenate(rows)
    # make_sampler's chain, in its order, on log-probabilities.
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p != 0.0:
        logprobs = apply_min_p(logprobs, min_p)
    if top_k > 0:
        logprobs = apply_top_k(logprobs, top_k) if top_k < V else logprobs
    scaled = np.array((logprobs * (1.0 / temp)).astype(mx.float32), dtype=np.float64)
    scaled -= scaled.max(axis=-1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=-1, keepdims=True)
    return {k: probs[i] for i, k in enumerate(keys)}


def exact_joint(next_dist) -> np.ndarray:
    """``P[t1, ..., tK]`` from the conditionals."""
    joint = np.ones((1,))
    for depth in range(K):
        cond = np.stack([next_dist[p] for p in itertools.product(range(V), repeat=depth)])
        joint = (joint.reshape(-1, 1) * cond).reshape(-1)
    return joint.reshape((V,) * K)


# ---------------------------------------------------------------------------------------------
# A drafter that agrees often, but not always


class TableDrafter:
    """Proposes from the target's own (unprocessed) logits for a *guessed* prefix, plus noise.

    Row ``j`` of a block gets ``SCALE * target_logits(prefix + own guesses) + noise``, the prefix
    being the generated tokens as far as the drafter can tell (the anchors it was given; accepted
    proposals it never sees are filled with its own earlier guesses). Its ``q`` is close to but not
    the target's ``p``, so every acceptance path runs. The real drafter's cache still receives
    every context row through the loop.
    """

    SCALE = 0.8
    NOISE = 0.6

    def __init__(self, draft, raw_np: dict[tuple[int, ...], np.ndarray]):
        self.inner = draft
        self.raw = raw_np
        self.known: dict[int, int] = {}
        self.noise: dict[tuple, np.ndarray] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _noise(self, key) -> np.ndarray:
        if key not in self.noise:
            rng = np.random.default_rng([len(key[0]), *key[0], key[1]])
            self.noise[key] = rng.normal(0.0, self.NOISE, V)
        return self.noise[key]

    def block_scores(self, target, anchor: int, block_len: int, cache):
        return self.block_logits(target, anchor, block_len, cache), None  # the whole vocabulary

    def block_logits(self, target, anchor: int, block_len: int, cache) -> mx.array:
        pos = cache[0].offset  # absolute position of the anchor
        self.known[pos] = anchor
        n0 = len(PROMPT)
        prefix = [self.known.get(i, 0) for i in range(n0, pos + 1)]
        rows = []
        for j in range(1, block_len):
            key = (tuple(prefix), j)
            raw = self.raw.get(key[0])
            row = (self.SCALE * raw if raw is not None else np.zeros(V)) + self._noise(key)
            rows.append(row)
            guess = int(np.argmax(row))
            self.known.setdefault(pos + j, guess)
            prefix.append(guess)
        return mx.array(np.stack(rows).astype(np.float32))


@pytest.fixture(scope="module")
def raw_np(raw_table):
    return {k: v.astype(np.float64) for k, v in raw_table.items()}


# ---------------------------------------------------------------------------------------------
# Sampling through the real loop


@dataclass
class Run:
    sequences: np.ndarray  # (N, K) token ids
    paths: dict[str, int]  # acceptance paths over all cycles
    accepted_at: np.ndarray  # cycles whose proposal at block position j was accepted
    proposed_at: np.ndarray  # cycles that proposed a token at block position j
    stats_mismatches: int  # runs whose reported statistics disagree with their cycles
    verified: int = 0  # proposals sent to the target, all runs
    possible: int = 0  # proposals a full-block verify would have sent
    cycles: int = 0  # cycles that proposed


def run_dflash(pair, raw_np, settings: dict, proposal: str, n: int = N, seed0: int = 0,
               min_confidence: float = 0.0) -> Run:
    """``n`` generations of ``K`` tokens (seeds ``seed0...``) through the real loop."""
    model, draft = pair
    seqs = np.zeros((n, K), dtype=np.int64)
    paths = {"all": 0, "partial": 0, "none": 0, "plain": 0}
    acc_total = np.zeros(BLOCK - 1)
    prop_total = np.zeros(BLOCK - 1)
    mismatches = 0
    verified = possible = proposing = 0
    for s in range(n):
        tokens, generated, cycles, last, verified_before = [], 0, 0, None, 0
        acc = np.zeros(BLOCK - 1)
        prop = np.zeros(BLOCK - 1)
        for r in stream_generate(model, TableDrafter(draft, raw_np), None, PROMPT,
                                 block_size=BLOCK, max_tokens=K, seed=seed0 + s,
                                 proposal=proposal, min_confidence=min_confidence, **settings):
            if r.cycles != cycles:  # this response closes one cycle
                n_prop = r.verified_tokens - verified_before
                verified_before = r.verified_tokens
                mismatches += not (min(n_prop, 1) <= n_prop <= min(BLOCK, K - generated) - 1)
                possible += min(BLOCK, K - generated) - 1
                proposing += n_prop > 0
                if min_confidence == 0:
                    mismatches += n_prop != min(BLOCK, K - generated) - 1
                a = r.accepted
                if n_prop == 0:
                    paths["plain"] += 1
                else:
                    paths["all" if a == n_prop else "partial" if a else "none"] += 1
                prop[:n_prop] += 1
                acc[:a] += 1
                mismatches += r.cycle_tau != a + 1 or len(r.tokens) > a + 1
            tokens += r.tokens
            generated, cycles, last = r.generation_tokens, r.cycles, r
        seqs[s] = tokens
        expect = np.where(prop > 0, acc / np.maximum(prop, 1), 0.0)
        mismatches += not np.allclose(last.acceptance_by_position, expect)
        mismatches += not np.isclose(last.mean_tau, (acc.sum() + cycles) / max(cycles, 1))
        acc_total += acc
        prop_total += prop
        verified += last.verified_tokens
    return Run(seqs, paths, acc_total, prop_total, mismatches, verified, possible, proposing)


def chi_square(samples: np.ndarray, joint: np.ndarray) -> tuple[float, int, float]:
    """Pearson chi-square of samples ``(n, K)`` against the exact joint, small cells pooled.

    Returns ``(statistic, degrees of freedom, p-value)``.
    """
    n = len(samples)
    flat = joint.reshape(-1)
    idx = np.ravel_multi_index(samples.T, joint.shape)
    observed = np.bincount(idx, minlength=flat.size)
    return _pooled_chi_square(observed, flat, n)


def _pooled_chi_square(observed: np.ndarray, probs: np.ndarray, n: int):
    expected = n * probs
    big = expected >= 5
    obs = list(observed[big]) + [observed[~big].sum()]
    exp = list(expected[big]) + [expected[~big].sum()]
    obs, exp = np.array(obs, dtype=np.float64), np.array(exp)
    if exp[-1] < 5:  # too small to stand alone: fold into the smallest regular cell
        j = int(np.argmin(exp[:-1]))
        obs[j] += obs[-1]
        exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    # Mass outside the support of the reference is an immediate, infinite discrepancy.
    impossible = observed[probs == 0].sum()
    stat = float(((obs - exp) ** 2 / exp).sum()) + (np.inf if impossible else 0.0)
    df = len(exp) - 1
    return stat, df, float(sps.chi2.sf(stat, df))


def detectable(df: int, n: int = N, alpha: float = ALPHA, target: float = 0.9) -> float:
    """Chi-square divergence sum((q - p)^2 / p) over the pooled cells that the test catches
    with probability ``target``."""
    from scipy.optimize import brentq

    crit = sps.chi2.isf(alpha, df)
    return brentq(lambda lam: sps.ncx2.sf(crit, df, lam) - target, 1e-6, 1e5) / n


def power(stat: float, df: int, alpha: float = ALPHA) -> float:
    """Power of the test at the effect size the statistic shows (non-central chi-square)."""
    crit = sps.chi2.isf(alpha, df)
    lam = max(stat - df, 0.0)
    return float(sps.ncx2.sf(crit, df, lam)) if lam > 0 else alpha


# ---------------------------------------------------------------------------------------------
# The reference itself


def test_reference_matches_mlx_lm_generate_step(pair, raw_table):
    """The enumerated reference is mlx-lm's: compare with generate_step's own logprobs on paths."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    model, _ = pair
    s = CASES["penalties"]
    ref = reference_next(raw_table, s)
    procs = make_logits_processors(
        s["logit_bias"], s["repetition_penalty"], s["repetition_context_size"],
        s["presence_penalty"], 20, s["frequency_penalty"], s["frequency_context_size"])
    mx.random.seed(0)
    for _ in range(3):
        sampler = make_sampler(s["temperature"])
        out = list(generate_step(mx.array(PROMPT), model, max_tokens=K, sampler=sampler,
                                 logits_processors=procs))
        toks = [int(t) for t, _ in out]
        for depth, (_, logprobs) in enumerate(out):
            expect = ref[tuple(toks[:depth])]
            got = np.exp(np.array(logprobs, dtype=np.float64))
            np.testing.assert_allclose(got / got.sum(), expect, atol=2e-5)


def test_chi_square_false_alarm_rate(pair, raw_table):
    """Sampling the exact reference itself, the pooled test rejects at about ALPHA (here <= 2%)."""
    joint = exact_joint(reference_next(raw_table, CASES["card"])).reshape(-1)
    rng = np.random.default_rng(0)
    trials, rejections = 2000, 0
    for _ in range(trials):
        counts = rng.multinomial(N, joint)
        rejections += _pooled_chi_square(counts, joint, N)[2] < ALPHA
    # ALPHA = 1e-3: expect ~2 of 2000; 10 would be a 5x miscalibration.
    assert rejections <= 10, rejections


# ---------------------------------------------------------------------------------------------
# The exactness tests


def _report(name, run: Run, stat, df, p):
    rates = run.accepted_at / np.maximum(run.proposed_at, 1)
    print(f"\n{name}: chi2={stat:.1f} df={df} p={p:.3g} (90% power against chi-square "
          f"divergence >= {detectable(df):.3f}) paths={run.paths} "
          f"acceptance by position={np.round(rates[:K - 2], 3).tolist()}")


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
@pytest.mark.parametrize("case", list(CASES))
def test_dflash_matches_target_only_distribution(case, proposal, pair, raw_table, raw_np):
    settings = CASES[case]
    joint = exact_joint(reference_next(raw_table, settings))
    run = run_dflash(pair, raw_np, settings, proposal)
    stat, df, p = chi_square(run.sequences, joint)
    _report(f"{case}/{proposal}", run, stat, df, p)
    assert p >= ALPHA, f"{case}/{proposal}: chi2={stat:.1f} on {df} df, p={p:.2e}"
    # Every acceptance path ran (in `sample` mode every rejection resamples the residual).
    proposing = run.paths["all"] + run.paths["partial"] + run.paths["none"]
    for path in ("all", "partial", "none"):
        assert run.paths[path] >= 0.02 * proposing, run.paths
    # Statistics per cycle and per block position agree with what the cycles did.
    assert run.stats_mismatches == 0


@pytest.mark.parametrize(("case", "proposal"), [("card", "sample"), ("penalties", "argmax"),
                                                ("temperature", "sample")])
def test_shorter_verify_keeps_the_target_distribution(case, proposal, pair, raw_table, raw_np):
    """``min_confidence`` picks how many proposals the target sees from the drafter's own
    probabilities; the law of the output must not move."""
    settings = CASES[case]
    joint = exact_joint(reference_next(raw_table, settings))
    run = run_dflash(pair, raw_np, settings, proposal, min_confidence=0.1)
    stat, df, p = chi_square(run.sequences, joint)
    _report(f"{case}/{proposal}/min_confidence=0.1", run, stat, df, p)
    assert p >= ALPHA, f"{case}/{proposal}: chi2={stat:.1f} on {df} df, p={p:.2e}"
    assert run.stats_mismatches == 0
    assert run.verified == run.proposed_at.sum()
    # Some cycles were cut short, and some verified more than one proposal.
    assert run.cycles < run.verified < run.possible, (run.cycles, run.verified, run.possible)


class HistoryWithoutProposals(BlockSampler):
    """Broken on purpose: every verify row's penalties see the committed history only."""

    def process(self, logits, history, proposals):
        return super().process(logits, history, None)


class ResidualFromP(BlockSampler):
    """Broken on purpose: a rejected proposal is replaced by a fresh draw from ``p``."""

    def _residual(self, p, q):
        return self._draw(p)


BROKEN = {
    "history-without-proposals/argmax": (HistoryWithoutProposals, "penalties", "argmax"),
    "history-without-proposals/sample": (HistoryWithoutProposals, "penalties", "sample"),
    "residual-from-p/sample": (ResidualFromP, "temperature", "sample"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_sampler_fails_the_same_test(name, pair, raw_table, raw_np, monkeypatch):
    cls, case, proposal = BROKEN[name]
    monkeypatch.setattr(request_module, "BlockSampler", cls)  # what build_request makes
    settings = CASES[case]
    joint = exact_joint(reference_next(raw_table, settings))
    run = run_dflash(pair, raw_np, settings, proposal)
    stat, df, p = chi_square(run.sequences, joint)
    _report(f"BROKEN {name}", run, stat, df, p)
    impossible = joint.reshape(-1)[np.ravel_multi_index(run.sequences.T, joint.shape)] == 0
    if impossible.any():  # outputs the target can never produce: power 1 - (1 - f)^N
        print(f"{impossible.mean():.3%} of outputs impossible under the target; power at N={N}: "
              f"{1 - (1 - impossible.mean()) ** N:.6f}")
    else:
        print(f"power at this effect (alpha={ALPHA}, N={N}): {power(stat, df):.6f}")
    assert p < ALPHA, f"the test missed {name}: p={p:.3g}"


# ---------------------------------------------------------------------------------------------
# Draft trees: one draw per node from the target given the node's own path, then the walk


TREE_BUDGET = 6  # of at most 3 rows x 8 candidates: runner-up branches at every depth
TREE_CASES = ("temperature", "filters", "penalties", "card")


@dataclass
class TreeRun:
    sequences: np.ndarray  # (N, K) token ids
    tree_cycles: int
    cycles: int
    accepted: int  # drafted tokens accepted over all cycles
    off_spine: int  # of those, nodes that were not their row's best candidate


def run_tree(pair, raw_np, settings: dict, monkeypatch, n: int = N) -> TreeRun:
    """``n`` generations of ``K`` tokens with ``policy="tree"``; the walk is watched."""
    model, draft = pair
    walk = speculative.walk
    seen = {"accepted": 0, "off_spine": 0}

    def watched(tree, targets):
        path, bonus = walk(tree, targets)
        seen["accepted"] += len(path)
        seen["off_spine"] += sum(tree.ranks[i] > 0 for i in path)
        return path, bonus

    monkeypatch.setattr(speculative, "walk", watched)
    seqs = np.zeros((n, K), dtype=np.int64)
    tree_cycles = cycles = 0
    for s in range(n):
        tokens, last = [], None
        for r in stream_generate(model, TableDrafter(draft, raw_np), None, PROMPT,
                                 block_size=BLOCK, max_tokens=K, seed=s, policy="tree",
                                 tree_budget=TREE_BUDGET, **settings):
            tokens += r.tokens
            last = r
        seqs[s] = tokens
        tree_cycles += last.tree_cycles
        cycles += last.cycles
    return TreeRun(seqs, tree_cycles, cycles, seen["accepted"], seen["off_spine"])


def _tree_report(name: str, run: TreeRun, stat, df, p):
    print(f"\n{name}: chi2={stat:.1f} df={df} p={p:.3g} (90% power against chi-square "
          f"divergence >= {detectable(df):.3f}) tree cycles={run.tree_cycles}/{run.cycles} "
          f"accepted={run.accepted} (off the spine: {run.off_spine})")


def tree_chi_square(name: str, case: str, pair, raw_table, raw_np, monkeypatch):
    """``run_tree`` on ``CASES[case]`` and its chi-square against the exact joint (reported)."""
    settings = CASES[case]
    joint = exact_joint(reference_next(raw_table, settings))
    run = run_tree(pair, raw_np, settings, monkeypatch)
    stat, df, p = chi_square(run.sequences, joint)
    _tree_report(name, run, stat, df, p)
    return run, stat, df, p


@pytest.mark.parametrize("case", TREE_CASES)
def test_tree_walk_matches_target_only_distribution(case, pair, raw_table, raw_np, monkeypatch):
    """Sample-and-walk through trees: penalties see each node's own path, filters apply per node."""
    run, stat, df, p = tree_chi_square(f"tree/{case}", case, pair, raw_table, raw_np,
                                       monkeypatch)
    assert p >= ALPHA, f"tree/{case}: chi2={stat:.1f} on {df} df, p={p:.2e}"
    # Trees were verified, accepted often, and often through runner-up branches.
    assert run.tree_cycles >= N and run.accepted >= 0.5 * run.tree_cycles
    assert run.off_spine >= 0.1 * run.accepted, (run.off_spine, run.accepted)


def _bonus_from_the_root(walk):
    def broken(tree, targets):
        path, _ = walk(tree, targets)
        return path, targets[0]

    return broken


TREE_BROKEN = {
    # Every node's penalties see the committed history only, not the node's own path.
    "path-blind-processors/penalties": ("penalties", lambda m: m.setattr(
        DraftTree, "path_to", lambda self, node: [])),
    # The token after the accepted path is drawn from the root's row, not the last node's.
    "bonus-from-the-root/temperature": ("temperature", lambda m: m.setattr(
        speculative, "walk", _bonus_from_the_root(speculative.walk))),
}


@pytest.mark.parametrize("name", list(TREE_BROKEN))
def test_broken_tree_walk_fails_the_same_test(name, pair, raw_table, raw_np, monkeypatch):
    case, breaks = TREE_BROKEN[name]
    cost_model(target_parts(pair[0]), pair[1])  # measured (if at all) before anything breaks
    breaks(monkeypatch)
    _, stat, df, p = tree_chi_square(f"BROKEN tree {name}", case, pair, raw_table, raw_np,
                                     monkeypatch)
    print(f"power at this effect (alpha={ALPHA}, N={N}): {power(stat, df):.6f}")
    assert p < ALPHA, f"the test missed {name}: p={p:.3g}"


# ---------------------------------------------------------------------------------------------
# Chains of the context's own continuation (dflash.lookup) under the auto policy


# A machine made for the test: a verify pass of 2+ rows costs half a plain step, so a
# continuation always pays, however rarely it is right; a drafter pass costs five steps, so not
# even a block accepted whole would beat it: continuations from the first cycle.
LOOKUP_VERIFY = [1.0, 0.5, 0.5, 0.5, 0.5, 0.5]
LOOKUP_DRAFT = [5.0, 5.0]


def run_lookup(pair, raw_np, settings: dict, monkeypatch, n: int = N,
               source: str = "stand-in") -> tuple[np.ndarray, int]:
    """``n`` generations under ``policy="auto"`` on a machine where verifying is cheap and
    drafting dear: drafted chains, continuation chains and plain steps occur. ``source``
    ``"stand-in"``: a continuation that always exists (the history's last tokens, reversed: a
    function of the history, as a real continuation is, and right now and then); ``"index"``:
    one real cross-request index shared by the ``n`` generations (each proposes what earlier
    samples wrote after the same prompt, as a sampled retry does); ``"rivals"``: three stand-ins
    that compete, each a function of the history (the history reversed first, then the target's
    own best and second-best next token, each followed by the target's best ones: rivals that
    are often right), verified together as a tree (the tiny target is attention-only).
    The sequences and the number of continuation chains (``"rivals"``: trees) verified."""
    from dflash import cost_model as costs
    from dflash.lookup import ContextLookup, ContinuationIndex, Match
    from dflash.policy import Continuation

    model, draft = pair
    flat = costs.CostModel(key="flat", machine=costs.machine_id(), rows=[1, 2, 4, 8, 16, 32],
                           contexts=[4, 64], verify_ms=[LOOKUP_VERIFY, LOOKUP_VERIFY],
                           draft_rows=[2, 4], draft_ms=LOOKUP_DRAFT)
    monkeypatch.setattr(speculative, "cost_model", lambda *a, **k: flat)
    index = ContinuationIndex(4096) if source == "index" else None
    if source == "stand-in":  # (an attention-only target asks for the candidates)
        monkeypatch.setattr(ContextLookup, "find", lambda self, history, length:
                            Match(tuple(history[::-1][:length]), 2))
        monkeypatch.setattr(ContextLookup, "candidates", lambda self, history, length:
                            [Match(tuple(history[::-1][:length]), 2)])
    trees = through_rivals = 0
    if source == "rivals":
        def guess(history, length: int, rank: int) -> tuple[int, ...]:
            prefix, out = list(history[len(PROMPT):]), []
            while len(out) < length and tuple(prefix) in raw_np:
                out.append(int(np.argsort(-raw_np[tuple(prefix)])[0 if out else rank]))
                prefix.append(out[-1])
            return tuple(out)

        def rivals(self, history, length):
            return [Match(tuple(history[::-1][:length]), 2),
                    Match(guess(history, length, 0), 2), Match(guess(history, length, 1), 2)]

        monkeypatch.setattr(ContextLookup, "candidates", rivals)
        monkeypatch.setattr(ContextLookup, "find", lambda self, h, n: rivals(self, h, n)[0])
        verify_tree = speculative.verify_tree

        def counted(parts, draft, request, state, plan, block, context):
            nonlocal trees, through_rivals
            trees += isinstance(plan, Continuation)  # a tree of rivals, not a drafted one
            hits = state.policy.calibration.rivals.hits
            before = sum(hits.values())
            step = verify_tree(parts, draft, request, state, plan, block, context)
            through_rivals += sum(hits.values()) > before  # accepted a rival's node
            return step

        monkeypatch.setattr(speculative, "verify_tree", counted)
    seqs = np.zeros((n, K), dtype=np.int64)
    lookups = 0
    for s in range(n):
        tokens, last = [], None
        for r in stream_generate(model, TableDrafter(draft, raw_np), None, PROMPT,
                                 block_size=BLOCK, max_tokens=K, seed=s, policy="auto",
                                 index=index, **settings):
            tokens += r.tokens
            last = r
        seqs[s] = tokens
        lookups += last.index_cycles if index is not None else last.lookup_cycles
    if source == "rivals":
        print(f"\n{trees} trees of rivals, {through_rivals} accepted through a rival's node")
        assert through_rivals >= N // 10
        return seqs, trees
    return seqs, lookups


@pytest.mark.parametrize("case,source", [("temperature", "stand-in"),
                                         ("penalties", "stand-in"),
                                         ("temperature", "index"),
                                         ("temperature", "rivals"),
                                         ("penalties", "rivals")])
def test_lookup_chains_keep_the_target_distribution(case, source, pair, raw_table, raw_np,
                                                    monkeypatch):
    """A continuation is a proposal without a q: each token is accepted with the target's
    probability of it and the first rejection draws from the target's row without it; also when
    it is what earlier samples wrote (the cross-request index)."""
    settings = CASES[case]
    joint = exact_joint(reference_next(raw_table, settings))
    seqs, lookups = run_lookup(pair, raw_np, settings, monkeypatch, source=source)
    stat, df, p = chi_square(seqs, joint)
    print(f"\nlookup/{case}/{source}: chi2={stat:.1f} df={df} p={p:.3g} (90% power against chi-square "
          f"divergence >= {detectable(df):.3f}) continuation "
          f"{'trees' if source == 'rivals' else 'chains'}={lookups} in {N} runs")
    assert lookups >= N // 2  # the continuation was verified, often
    assert p >= ALPHA, f"lookup/{case}: chi2={stat:.1f} on {df} df, p={p:.2e}"


def test_lookup_chains_accepted_as_if_greedy_fail_the_same_test(pair, raw_table, raw_np,
                                                                monkeypatch):
    """Power: half of the continuation's rejections turned into acceptances (a continuation
    trusted more than the target's probability of it) must be caught."""
    accept = BlockSampler.accept

    def broken(self, target_logits, proposals, q, history, allowed=None):
        if q is not None or self.greedy or allowed is not None:
            return accept(self, target_logits, proposals, q, history, allowed)
        a, bonus = accept(self, target_logits, proposals, q, history)
        if a < len(proposals) and self.rng.random() < 0.5:  # a rejection turned into acceptance
            return a + 1, accept(self, target_logits[a + 1:], [], None, history)[1]
        return a, bonus

    settings = CASES["temperature"]
    cost_model(target_parts(pair[0]), pair[1])
    monkeypatch.setattr(BlockSampler, "accept", broken)
    joint = exact_joint(reference_next(raw_table, settings))
    seqs, lookups = run_lookup(pair, raw_np, settings, monkeypatch)
    stat, df, p = chi_square(seqs, joint)
    print(f"\nBROKEN lookup acceptance: chi2={stat:.1f} df={df} p={p:.3g}; power at this "
          f"effect (alpha={ALPHA}, N={N}): {power(stat, df):.6f}")
    assert p < ALPHA, f"the test missed a broken continuation acceptance: p={p:.3g}"


def test_rival_trees_that_trust_a_continuation_fail_the_same_test(pair, raw_table, raw_np,
                                                                  monkeypatch):
    """Power for trees of competing continuations: half the time the walk steps into a child the
    target did not draw (a continuation trusted more than the target's probability of it)."""
    walk, rng = speculative.walk, np.random.default_rng(0)

    def trusting(tree, targets):
        path, bonus = walk(tree, targets)
        node = path[-1] if path else 0
        kids = [i for i in range(1, len(tree)) if tree.parents[i] == node]
        if kids and rng.random() < 0.5:
            path, bonus = path + [kids[0]], targets[kids[0]]
        return path, bonus

    settings = CASES["temperature"]
    cost_model(target_parts(pair[0]), pair[1])
    monkeypatch.setattr(speculative, "walk", trusting)
    joint = exact_joint(reference_next(raw_table, settings))
    seqs, trees = run_lookup(pair, raw_np, settings, monkeypatch, source="rivals")
    stat, df, p = chi_square(seqs, joint)
    print(f"\nBROKEN rival-tree walk: chi2={stat:.1f} df={df} p={p:.3g} trees={trees}; power at "
          f"this effect (alpha={ALPHA}, N={N}): {power(stat, df):.6f}")
    assert trees >= N // 2
    assert p < ALPHA, f"the test missed a walk that trusts a continuation: p={p:.3g}"


# ---------------------------------------------------------------------------------------------
# A grammar: the target's distribution restricted to it (dflash.grammar)

# One byte per token over the tiny vocabulary (7 is the end of text), and a grammar whose masks
# differ at every position: {a,b,d}, then "c" forced (proposed by the grammar, not the drafter),
# then {a,b,d,e}, then the same or the end (accepting).
GRAMMAR_TOKENS = [b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"<eos>"]
GRAMMAR = 'start: ("a"|"b"|"d") "c" ("a"|"b"|"d"|"e")+'
GRAMMAR_CASES = [("temperature", "argmax"), ("temperature", "sample"), ("card", "sample"),
                 ("filters", "argmax")]


class ByteTokens:
    """llguidance's view of the tiny vocabulary (a TokenizerWrapper's fields)."""

    eos_token_id = 7
    bos_token_id = None
    tokens = GRAMMAR_TOKENS
    special_token_ids = [7]

    def __call__(self, text) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        return [GRAMMAR_TOKENS.index(bytes([b])) for b in data if bytes([b]) in GRAMMAR_TOKENS]


def tiny_grammar():
    import llguidance as llg

    from dflash.grammar import Grammar

    tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(ByteTokens()))
    return Grammar.lark(GRAMMAR).bind(tokenizer, V)


def grammar_allowed(bound):
    """``allowed(prefix)``: the mask after ``prefix`` (everything where the grammar rejects the
    prefix itself: such prefixes have probability 0 and their rows are never reached)."""

    def allowed(prefix) -> np.ndarray:
        state = bound.start()
        for t in prefix:
            if not state.matcher.consume_token(int(t)):
                return np.ones(V, dtype=bool)
        return np.array(state.allowed([state.bits()]))[0]

    return allowed


@pytest.mark.parametrize(("case", "proposal"), GRAMMAR_CASES)
def test_grammar_keeps_the_restricted_target_distribution(case, proposal, pair, raw_table,
                                                          raw_np):
    """Proposals cut or redrawn where the grammar rejects them, forced tokens proposed for free:
    the output's law is the target's distribution restricted to the grammar (mlx-lm with the
    grammar's mask as a last logits processor). Same test, same power as the cases above (90%
    against a chi-square divergence printed with ``-s``, ~0.03 at these degrees of freedom)."""
    bound = tiny_grammar()
    settings = CASES[case]
    joint = exact_joint(reference_next(raw_table, settings, grammar_allowed(bound)))
    model, draft = pair
    seqs = np.zeros((N, K), dtype=np.int64)
    forced = cycles = 0
    for s in range(N):
        tokens, last = [], None
        for r in stream_generate(model, TableDrafter(draft, raw_np), None, PROMPT,
                                 block_size=BLOCK, max_tokens=K, seed=s, proposal=proposal,
                                 grammar=bound, **settings):
            tokens += r.tokens
            last = r
        seqs[s] = tokens
        forced += last.forced_tokens
        cycles += last.cycles
    stat, df, p = chi_square(seqs, joint)
    print(f"\ngrammar/{case}/{proposal}: chi2={stat:.1f} df={df} p={p:.3g} (90% power against "
          f"chi-square divergence >= {detectable(df):.3f}) cycles={cycles} forced={forced}")
    assert p >= ALPHA, f"grammar/{case}/{proposal}: chi2={stat:.1f} on {df} df, p={p:.2e}"
    assert forced >= N // 2  # the forced "c" went out as a free proposal


def _path_blind_masks(tree_masks):
    def broken(self, tree):
        kept, bits = tree_masks(self, tree)
        return kept, [bits[0]] * len(bits)  # every node masked with the root's state

    return broken


@pytest.mark.parametrize(("case", "broken"), [("temperature", False), ("card", False),
                                              ("temperature", True)])
def test_grammar_trees_keep_the_restricted_target_distribution(case, broken, pair, raw_table,
                                                               raw_np, monkeypatch):
    """``policy="tree"`` under a grammar: nodes the grammar rejects are cut before the pass and
    each node's row is masked with the state after its own path; the output's law is still the
    target's distribution restricted to the grammar (same test, same power as above). Broken on
    purpose (every node masked with the root's state), the same test fails."""
    from dflash.grammar import GrammarState

    if broken:
        monkeypatch.setattr(GrammarState, "tree", _path_blind_masks(GrammarState.tree))
    bound = tiny_grammar()
    settings = CASES[case]
    joint = exact_joint(reference_next(raw_table, settings, grammar_allowed(bound)))
    model, draft = pair
    seqs = np.zeros((N, K), dtype=np.int64)
    tree_cycles = cycles = impossible = 0
    for s in range(N):
        tokens, last = [], None
        for r in stream_generate(model, TableDrafter(draft, raw_np), None, PROMPT,
                                 block_size=BLOCK, max_tokens=K, seed=s, policy="tree",
                                 tree_budget=TREE_BUDGET, grammar=bound, **settings):
            tokens += r.tokens
            last = r
        if len(tokens) != K:  # an answer the grammar cannot end there: impossible
            assert broken, tokens
            impossible += 1
            continue
        seqs[s] = tokens
        tree_cycles += last.tree_cycles
        cycles += last.cycles
    if broken and impossible:
        print(f"\ngrammar-tree broken: {impossible} of {N} answers impossible under the grammar")
        return
    stat, df, p = chi_square(seqs, joint)
    print(f"\ngrammar-tree/{case}: chi2={stat:.1f} df={df} p={p:.3g} (90% power against "
          f"chi-square divergence >= {detectable(df):.3f}) tree cycles={tree_cycles}/{cycles}")
    if broken:
        assert p < ALPHA, f"the test missed path-blind tree masks: p={p:.3g}"
        return
    assert p >= ALPHA, f"grammar-tree/{case}: chi2={stat:.1f} on {df} df, p={p:.2e}"
    assert tree_cycles >= N // 2  # trees were verified
