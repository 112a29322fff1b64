"""Continuations of text already seen (dflash.lookup): the sequence's own n-gram index and the
bounded index across requests find what a brute-force scan finds, within their budget.
(Greedy decoding with them: tests/test_plain_steps.py and tests/test_engine.py; sampled output
with continuation chains: tests/test_sampling_stats.py, ``lookup``.)
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from dflash.errors import GenerationConfigError
from dflash.lookup import (
    KEY,
    MAX_MATCH,
    ContextLookup,
    ContinuationIndex,
    Match,
    best_match,
)


def matched_back(history: list[int], text: list[int], begin: int) -> int:
    """How many tokens before ``text[begin]`` equal the history's last ones (capped)."""
    n = 0
    while n < MAX_MATCH and n < len(history) and begin - 1 - n >= 0 \
            and text[begin - 1 - n] == history[-1 - n]:
        n += 1
    return n


def brute_force(history: list[int], orders, length: int) -> Match | None:
    for n in orders:
        if len(history) <= n:
            continue
        key = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == key:
                begin = start + n
                return Match(tuple(history[begin:begin + length]),
                             max(n, matched_back(history, history, begin)))
    return None


@pytest.mark.parametrize("vocab", [3, 8, 50])
def test_the_incremental_index_finds_the_latest_earlier_occurrence(vocab):
    rng = np.random.default_rng(vocab)
    history = rng.integers(0, vocab, 20).tolist()
    lookup = ContextLookup()
    found = long = 0
    for _ in range(300):  # the history grows by 1-3 tokens between lookups, as decoding does
        expected = brute_force(history, lookup.orders, 6)
        assert lookup.find(history, 6) == expected
        found += expected is not None
        long += expected is not None and expected.length > 3
        history += rng.integers(0, vocab, rng.integers(1, 4)).tolist()
    assert found > 10
    assert long > 0 or vocab > 8  # a small vocabulary repeats longer stretches


def test_the_longest_order_wins_and_the_match_reaches_back():
    lookup = ContextLookup()
    assert lookup.find([1, 2, 3, 4], 5) is None
    #            a 2-gram match (2, 3) -> 9 ... and a 3-gram match (1, 2, 3) -> 4
    history = [1, 2, 3, 4, 5, 7, 2, 3, 9, 1, 2, 3]
    assert lookup.find(history, 2) == Match((4, 5), 3)
    assert ContextLookup(orders=(2,)).find(history, 2) == Match((9, 1), 2)
    # A copy of a long passage: the match reaches back over all of it.
    passage = list(range(100, 140))
    found = ContextLookup().find([7] + passage + [8] + passage[:30], 8)
    assert found == Match(tuple(passage[30:38]), 30)


def brute_index(documents: list[list[int]], history: list[int], length: int) -> Match | None:
    """The longest match of the history's tail (at least KEY tokens) in any document, the most
    recent on ties; its count: occurrences of at least KEY tokens agreeing on the first token."""
    best, firsts = None, {}
    for doc in documents:
        for begin in range(KEY, len(doc)):
            n = matched_back(history, doc, begin)
            if n < KEY:
                continue
            firsts[doc[begin]] = firsts.get(doc[begin], 0) + 1
            if best is None or n >= best[0]:
                best = (n, doc[begin:begin + length])
    if best is None:
        return None
    return Match(tuple(best[1]), best[0], firsts[best[1][0]], "index")


def test_the_index_finds_what_a_scan_of_earlier_requests_finds():
    rng = np.random.default_rng(0)
    phrases = [rng.integers(0, 500, 12).tolist() for _ in range(6)]
    index, documents, checked = ContinuationIndex(budget=100_000), [], 0
    for _ in range(20):  # requests that reuse a few phrases, as agents and retries do
        doc = []
        for _ in range(4):
            doc += phrases[rng.integers(0, 6)] + rng.integers(0, 500, 3).tolist()
        history = doc[:rng.integers(KEY, len(doc))]
        expected = brute_index(documents, history, 10)
        found = index.find(history, 10)
        if expected is None:
            assert found is None
        else:  # same continuation and reach (the scan weighs every occurrence: count >= found's)
            assert found is not None and found.tokens == expected.tokens
            assert found.length == expected.length and 1 <= found.count <= expected.count
            checked += 1
        index.add(doc)
        documents.append(doc)
    assert checked > 10


def test_a_request_sent_again_finds_its_whole_answer():
    index = ContinuationIndex(budget=4096)
    prompt, answer = list(range(1000, 1200)), list(range(2000, 2100))
    index.add(prompt + answer)
    found = index.find(prompt, 64)
    assert found == Match(tuple(answer[:64]), MAX_MATCH, 1, "index")
    # Half-way through the answer: the rest of it, up to the document's end (no separator).
    assert index.find(prompt + answer[:80], 64).tokens == tuple(answer[80:])
    # The sequence's own continuation wins a tie; the index's longer match wins otherwise.
    own = ContextLookup()
    assert best_match(prompt, 64, own, index).source == "index"
    assert best_match(prompt, 64, own, None) is None


def test_the_ring_drops_the_oldest_requests_and_its_memory_is_fixed():
    index = ContinuationIndex(budget=1000)
    first = list(range(5000, 5100))
    index.add(first)
    size = index.nbytes
    assert index.find(first[:50], 10).tokens == tuple(first[50:60])
    for i in range(30):  # 30 x 101 positions: the first request is overwritten
        index.add(list(range(10_000 + 100 * i, 10_100 + 100 * i)))
    assert index.find(first[:50], 10) is None
    assert index.nbytes == size and index.tokens == 1000
    # Nothing of an overwritten request leaks into another's continuation.
    last = list(range(10_000 + 100 * 29, 10_100 + 100 * 29))
    assert index.find(last[:50], 100).tokens == tuple(last[50:])


def test_index_memory_stays_within_its_budget_after_a_thousand_requests():
    budget = 16_384
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        index = ContinuationIndex(budget=budget)
        rng = np.random.default_rng(1)
        for _ in range(1000):
            index.add(rng.integers(0, 50_000, 64).tolist())
            index.find(rng.integers(0, 50_000, 8).tolist(), 16)
        grown = sum(s.size_diff for s in
                    tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert index.tokens == budget
    assert grown <= index.nbytes + 64 * 1024  # the arrays, and no more than a little bookkeeping
    assert index.nbytes <= 12 * budget + 8 * (1 << budget.bit_length())


@pytest.mark.parametrize("budget", [0, -5, 2.5, True, "1k"])
def test_a_budget_that_is_not_a_positive_token_count_is_refused(budget):
    with pytest.raises(GenerationConfigError, match="index budget"):
        ContinuationIndex(budget=budget)
