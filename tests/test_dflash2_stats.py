"""Statistical exactness of sampling with a DFlash2 drafter: proposals walked by the candidate
selector and accepted against its ``q`` (softmax(score / T) over the candidates), while top-p,
top-k, min-p and penalties apply to the target side only.

Same reference and test as :mod:`test_sampling_stats` (the exact joint of the first ``K`` tokens
under mlx-lm's target-only sampling; pooled Pearson chi-square, false-alarm rate 1e-3, ``N`` = 2000
runs). The drafter is a real DFlash2 drafter (random convolution and codebooks strong enough to
reorder candidates) whose unary logits come from the same agreeing table as there, so every
acceptance path runs. Power: a drafter that draws from the selector's scores but reports the
unary softmax as ``q`` must fail the same test.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import test_sampling_stats as stats
from dflash2_fixtures import write_dflash2_drafter
from test_sampling_stats import (
    ALPHA,
    CASES,
    K,
    all_prefixes,
    chi_square,
    exact_joint,
    reference_next,
    run_dflash,
    sharp_target,
    target_logits,
)

from dflash.dflash2 import walk
from dflash.drafter import load_draft
from dflash.sampling import _row_dist

pytestmark = pytest.mark.slow  # chi-square runs: the full suite only


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("stats2")
    model, v1 = sharp_target(root)
    dpath = write_dflash2_drafter(root / "dflash2", v1, group=16, rank=8, top_k=5,
                                  sliding_window=None)
    return model, load_draft(dpath)


@pytest.fixture(scope="module")
def table(pair):
    return target_logits(pair[0], all_prefixes(K - 1))


@pytest.fixture(scope="module")
def table_np(table):
    return {k: v.astype(np.float64) for k, v in table.items()}


class SelectorTableDrafter(stats.TableDrafter):
    """The table's rows as the unary logits of a real DFlash2 drafter: the real block pass sets
    the hidden states the selector's transitions read."""

    def block_logits(self, target, anchor, block_len, cache):
        self.inner.block_logits(target, anchor, block_len, cache)
        return super().block_logits(target, anchor, block_len, cache)


class UnaryQ(SelectorTableDrafter):
    """Broken on purpose: draws along the selector's walk but reports softmax(U / T) as q."""

    def propose(self, draft_logits, anchor, cache, sampler, history):
        if not sampler.samples_proposals:
            return self.inner.propose(draft_logits, anchor, cache, sampler, history)
        ids, values, first, rest = self.inner.candidate_selector.lattice(
            cache.block_hidden[: draft_logits.shape[0]], draft_logits, anchor)
        qs = []

        def draw(candidates, scores):
            index, _ = sampler.draw_scores(candidates, scores)
            qs.append(_row_dist(candidates, values[len(qs)] / sampler.cfg.temperature))
            return index

        return mx.array(walk(ids, values, first, rest, draw)), qs


def run(monkeypatch, drafter_class, pair, table_np, settings, proposal):
    monkeypatch.setattr(stats, "TableDrafter", drafter_class)
    return run_dflash(pair, table_np, settings, proposal)


@pytest.mark.parametrize(("case", "proposal"), [("card", "sample"), ("temperature", "sample"),
                                                ("filters", "argmax")])
def test_selector_sampling_matches_target_only_distribution(case, proposal, pair, table,
                                                            table_np, monkeypatch):
    settings = CASES[case]
    joint = exact_joint(reference_next(table, settings))
    result = run(monkeypatch, SelectorTableDrafter, pair, table_np, settings, proposal)
    stat, df, p = chi_square(result.sequences, joint)
    stats._report(f"dflash2 {case}/{proposal}", result, stat, df, p)
    assert p >= ALPHA, f"{case}/{proposal}: chi2={stat:.1f} on {df} df, p={p:.2e}"
    proposing = result.paths["all"] + result.paths["partial"] + result.paths["none"]
    for path in ("all", "partial", "none"):
        assert result.paths[path] >= 0.02 * proposing, result.paths
    assert result.stats_mismatches == 0


def test_wrong_q_fails_the_same_test(pair, table, table_np, monkeypatch):
    settings = CASES["temperature"]
    joint = exact_joint(reference_next(table, settings))
    result = run(monkeypatch, UnaryQ, pair, table_np, settings, "sample")
    stat, df, p = chi_square(result.sequences, joint)
    print(f"\nunary q (broken): chi2={stat:.1f} df={df} p={p:.3g}")
    assert p < ALPHA
