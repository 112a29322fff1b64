"""Draft trees: best-first construction, the tree verify pass, the walk, cache compaction."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from dflash.target import (
    commit_tree_path,
    forward,
    make_cache,
    target_parts,
    tree_forward,
    tree_supported,
)
from dflash.tree import DraftTree, build_tree, top_candidates, walk

ATTENTION_KINDS = ("qwen3", "llama")


def brute_force_best(log_probs: np.ndarray, budget: int) -> float:
    """Sum of path probabilities of the best prefix-closed set of ``budget`` prefixes, by
    enumerating every prefix of the (small) grid."""
    rows, vocab = log_probs.shape
    scores = []
    for depth in range(1, rows + 1):
        for seq in itertools.product(range(vocab), repeat=depth):
            scores.append(sum(log_probs[d, t] for d, t in enumerate(seq)))
    return float(np.sort(np.exp(scores))[::-1][:budget].sum())


def test_build_tree_is_the_most_probable_prefix_set_in_topological_order():
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.normal(size=(3, 4)) * 2
        lp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
        vals, ids = top_candidates(lp, 4)
        assert (np.diff(vals, axis=1) <= 0).all()
        assert np.allclose(np.take_along_axis(lp, ids, axis=1), vals)
        for budget in (1, 3, 6, 10):
            tree = build_tree(vals, ids, budget, anchor=99)
            assert len(tree) == budget + 1 and tree.tokens[0] == 99 and tree.parents[0] == -1
            assert all(tree.parents[i] < i for i in range(1, len(tree)))  # parents first
            assert all(tree.depths[i] == tree.depths[tree.parents[i]] + 1
                       for i in range(1, len(tree)))
            # Path scores: each node adds its row's log-probability of its token.
            for i in range(1, len(tree)):
                parent_score = tree.scores[tree.parents[i]]
                assert tree.scores[i] == pytest.approx(
                    parent_score + lp[tree.depths[i] - 1, tree.tokens[i]])
            total = float(np.exp(tree.scores[1:]).sum())
            assert total == pytest.approx(brute_force_best(lp, budget), rel=1e-9)
            # Siblings never repeat a token.
            kids = [(tree.parents[i], tree.tokens[i]) for i in range(1, len(tree))]
            assert len(kids) == len(set(kids))
            # The first b nodes of the tree are the best b-node tree.
            assert tree.prefix(min(2, budget)).tokens == \
                build_tree(vals, ids, min(2, budget), 99).tokens


def test_walk_follows_the_targets_tokens():
    #        0(anchor)
    #       /    \
    #     1:a     2:b
    #     |        |
    #     3:c     4:d
    tree = DraftTree([9, 10, 11, 12, 13], [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2], [0.0] * 5)
    assert walk(tree, [11, 0, 13, 0, 7]) == ([2, 4], 7)  # second branch, both deep
    assert walk(tree, [10, 12, 0, 5, 0]) == ([1, 3], 5)
    assert walk(tree, [10, 99, 0, 0, 0]) == ([1], 99)
    assert walk(tree, [42, 0, 0, 0, 0]) == ([], 42)


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_tree_pass_equals_each_path_fed_alone_and_compaction_restores_the_cache(kind,
                                                                               loaded_pair):
    model, _, draft = loaded_pair(kind)
    parts = target_parts(model)
    taps = draft.target_layer_ids
    prompt = list(range(3, 40))
    cache = make_cache(parts)
    assert tree_supported(parts, cache)
    forward(parts, mx.array(prompt)[None], cache, taps)
    start = cache[0].offset
    #       0
    #     / | \
    #    1  2  3
    #   / \     \
    #  4   5     6
    #  |
    #  7
    tree = DraftTree([50, 61, 62, 63, 64, 65, 66, 67], [-1, 0, 0, 0, 1, 1, 3, 4],
                     [0, 1, 1, 1, 2, 2, 2, 3], [0.0] * 8)
    logits, tree_taps = tree_forward(parts, tree, cache, taps)
    assert cache[0].offset == start + len(tree)
    for node in range(len(tree)):
        path = [0] + tree.path_to(node)
        alone = make_cache(parts)
        ref_logits, ref_taps = forward(parts, mx.array(prompt + [tree.tokens[i] for i in path])[None],
                                       alone, taps)
        np.testing.assert_allclose(np.array(logits[0, node]), np.array(ref_logits[0, -1]),
                                   atol=2e-4, rtol=2e-4)
        np.testing.assert_allclose(np.array(tree_taps[0, node]), np.array(ref_taps[0, -1]),
                                   atol=2e-4, rtol=2e-4)
    # Keep the path 0 -> 1 -> 4 -> 7 (not the first rows): the cache must equal the path fed alone.
    keep = [0, 1, 4, 7]
    commit_tree_path(cache, start, keep, len(tree))
    alone = make_cache(parts)
    forward(parts, mx.array(prompt + [tree.tokens[i] for i in keep])[None], alone, taps)
    for c, ref in zip(cache, alone):
        assert c.offset == ref.offset
        n = c.offset
        np.testing.assert_allclose(np.array(c.keys[..., :n, :]), np.array(ref.keys[..., :n, :]),
                                   atol=2e-4, rtol=2e-4)
        np.testing.assert_allclose(np.array(c.values[..., :n, :]),
                                   np.array(ref.values[..., :n, :]), atol=2e-4, rtol=2e-4)
    # And the next token from the compacted cache is what the path alone gives.
    nxt, _ = forward(parts, mx.array([[5]]), cache, taps)
    ref, _ = forward(parts, mx.array([[5]]), alone, taps)
    np.testing.assert_allclose(np.array(nxt), np.array(ref), atol=2e-4, rtol=2e-4)


def test_hybrid_targets_are_not_offered_trees(loaded_pair):
    model, _, _ = loaded_pair("qwen3_5")
    parts = target_parts(model)
    assert not tree_supported(parts, make_cache(parts))
