"""The context's own continuation (dflash.lookup): the index finds what a brute-force scan finds,
(Greedy decoding with it, ending plain stretches: tests/test_plain_steps.py; sampled output
with continuation chains: tests/test_sampling_stats.py, ``lookup``.)
"""

from __future__ import annotations

import numpy as np
import pytest

from dflash.lookup import ContextLookup


def brute_force(history: list[int], orders, length: int) -> tuple[list[int], int]:
    for n in orders:
        if len(history) <= n:
            continue
        key = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == key:
                return history[start + n:start + n + length], n
    return [], 0


@pytest.mark.parametrize("vocab", [3, 8, 50])
def test_the_incremental_index_finds_the_latest_earlier_occurrence(vocab):
    rng = np.random.default_rng(vocab)
    history = rng.integers(0, vocab, 20).tolist()
    lookup = ContextLookup()
    found = 0
    for _ in range(300):  # the history grows by 1-3 tokens between lookups, as decoding does
        expected = brute_force(history, lookup.orders, 6)
        assert lookup.continuation(history, 6) == expected
        found += bool(expected[0])
        history += rng.integers(0, vocab, rng.integers(1, 4)).tolist()
    assert found > 10


def test_the_longest_order_wins_and_nothing_is_found_in_fresh_text():
    lookup = ContextLookup()
    assert lookup.continuation([1, 2, 3, 4], 5) == ([], 0)
    #            a 2-gram match (2, 3) -> 9 ... and a 3-gram match (1, 2, 3) -> 4
    history = [1, 2, 3, 4, 5, 7, 2, 3, 9, 1, 2, 3]
    assert lookup.continuation(history, 2) == ([4, 5], 3)
    assert ContextLookup(orders=(2,)).continuation(history, 2) == ([9, 1], 2)

