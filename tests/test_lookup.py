"""Continuations of text already seen (dflash.lookup): the sequence's own n-gram index and the
bounded index across requests find what a brute-force scan finds, within their budget; competing
continuations merge into one tree, and verified as a tree on an attention-only target the greedy
output stays the target's own (a hybrid target verifies chains).
(Greedy decoding with chains: tests/test_plain_steps.py and tests/test_engine.py; sampled output
with continuation chains and trees: tests/test_sampling_stats.py, ``lookup``.)
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from test_engine import references  # noqa: F401  (a fixture)

from dflash.errors import GenerationConfigError
from dflash.lookup import (
    COMPETING,
    KEY,
    MAX_MATCH,
    ContextLookup,
    ContinuationIndex,
    Match,
    best_match,
    continuations,
)
from dflash.tree import continuation_tree, node_kinds


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
    """Traced by tracemalloc: what 1,000 requests of 64 tokens cost is the fixed arrays
    (``12 * budget + 8 * table`` bytes, docs/how-it-works.md) and a little bookkeeping; once the
    ring has been filled, adding more requests allocates nothing that stays."""
    budget, table_bits, requests = 4096, 12, 1000
    ring_full = budget // 65 + 1  # requests (64 tokens and a separator each) that fill the ring
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        index = ContinuationIndex(budget=budget, table_bits=table_bits)
        rng = np.random.default_rng(1)
        for i in range(requests):
            index.add(rng.integers(0, 50_000, 64).tolist())
            index.find(rng.integers(0, 50_000, 8).tolist(), 16)
            if i == ring_full:
                full = tracemalloc.take_snapshot()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()

    def grown(since) -> int:
        return sum(s.size_diff for s in after.compare_to(since, "filename"))

    documented = 12 * budget + 8 * (1 << table_bits)
    assert index.tokens == budget and index.documents == requests
    assert index.nbytes == documented
    assert grown(before) <= documented + 16 * 1024  # the arrays and a little bookkeeping
    assert abs(grown(full)) <= 2 * 1024  # after the first full ring: no growth
    # The default table size stays within the formula too.
    default = ContinuationIndex(budget=16_384)
    assert default.nbytes <= 12 * 16_384 + 8 * (1 << 16_384 .bit_length())


@pytest.mark.parametrize("budget", [0, -5, 2.5, True, "1k"])
def test_a_budget_that_is_not_a_positive_token_count_is_refused(budget):
    with pytest.raises(GenerationConfigError, match="index budget"):
        ContinuationIndex(budget=budget)


# ---------------------------------------------------------------------------------------------
# Competing continuations and their tree


def test_the_sequence_offers_each_earlier_occurrence_latest_first():
    history = [1, 2, 3, 9, 9, 1, 2, 3, 8, 8, 5, 1, 2, 3, 7, 1, 2, 3]
    lookup = ContextLookup()
    found = lookup.candidates(history, 3)
    assert found[0] == lookup.find(history, 3)  # the latest: what a chain verifies
    assert [m.tokens for m in found] == [(7, 1, 2), (8, 8, 5), (9, 9, 1)]
    assert lookup.candidates([1, 2], 3) == []


def test_competing_continuations_come_with_the_best_one():
    history = [1, 2, 3, 9, 9, 1, 2, 3, 8, 8, 1, 2, 3, 8, 8, 6, 1, 2, 3]
    found = continuations(history, 4, ContextLookup(), None)
    assert found == best_match(history, 4, ContextLookup(), None)
    # (8, 8, 6, 1) is the first; (8, 8, 1, 2) differs only later; (9, 9, 1, 2) at once.
    assert [m.tokens for m in found.alternatives] == [(8, 8, 1, 2), (9, 9, 1, 2)]
    # The index's rivals join the sequence's (at most COMPETING in all, longest match first).
    index = ContinuationIndex(budget=4096)
    prompt = list(range(100, 120))
    for k in range(6):
        index.add(prompt + [500 + k, 600])
    found = continuations(prompt, 2, ContextLookup(), index)
    assert found.tokens == (505, 600) and found.source == "index"
    assert [m.tokens[0] for m in found.alternatives] == [504, 503, 502][:COMPETING - 1]
    # A continuation that is a prefix of the first adds nothing.
    index.add(prompt + [505])
    assert all(m.tokens != (505,) for m in continuations(prompt, 2, ContextLookup(),
                                                          index).alternatives)


def test_the_continuation_tree_is_a_best_first_trie():
    tree = continuation_tree(7, [(1, 2, 3, 4), (1, 2, 5), (6, 2)],
                             [[0.8, 0.8, 0.5, 0.5], [0.8, 0.8, 0.6], [0.5, 0.9]], most=10)
    assert tree.tokens[0] == 7 and len(tree) == 1 + 4 + 1 + 2  # shared nodes merged
    probs = np.exp(tree.scores[1:])
    assert list(probs) == sorted(probs, reverse=True)  # pop order: most likely path first
    assert all(tree.parents[i] < i for i in range(1, len(tree)))  # a parent before its children
    by_path = {tuple(tree.tokens[j] for j in tree.path_to(i)): i for i in range(1, len(tree))}
    kinds = node_kinds(tree)
    assert [kinds[by_path[p]] for p in [(1,), (1, 2), (1, 2, 3), (1, 2, 5), (6,), (6, 2)]] == \
        ["spine", "spine", "spine", "sibling", "sibling", "branch"]
    # A rival's first own node: its chance times what its earlier siblings leave.
    assert np.exp(tree.scores[by_path[(1, 2, 5)]]) == pytest.approx(0.8 * 0.8 * 0.5 * 0.6)
    assert np.exp(tree.scores[by_path[(6,)]]) == pytest.approx(0.2 * 0.5)
    assert np.exp(tree.scores[by_path[(6, 2)]]) == pytest.approx(0.2 * 0.5 * 0.9)
    # Cut to fewer nodes: still a tree (every parent kept), the most likely nodes.
    small = tree.prefix(4)
    assert all(0 <= small.parents[i] < i for i in range(1, len(small)))
    assert continuation_tree(7, [(1, 2, 3, 4), (6, 2)], [[0.8] * 4, [0.5] * 2], most=3) \
        .tokens == [7, 1, 2, 3]


# ---------------------------------------------------------------------------------------------
# Greedy decoding with trees of competing continuations (float32 tiny targets)


# A machine made for the test: a verify pass costs ~a step whatever its rows (a tree of rivals
# always pays), a drafter pass ten (continuations are verified before drafting).
RIVAL_VERIFY = [10.0, 10.01, 10.02, 10.04, 10.08, 10.16]


def rival_machine(model, draft, monkeypatch):
    from dflash import cost_model as costs
    from dflash import speculative
    from dflash.target import target_parts

    key = costs.cost_key(target_parts(model), draft)
    table = costs.CostModel(key=key, machine=costs.machine_id(), rows=[1, 2, 4, 8, 16, 32],
                            contexts=[128, 1024], verify_ms=[RIVAL_VERIFY, RIVAL_VERIFY],
                            draft_rows=[2, 4, 8, 16], draft_ms=[100.0] * 4)
    monkeypatch.setattr(speculative, "cost_model", lambda *a, **k: table)


@pytest.mark.parametrize("kind,trees", [("llama", True), ("qwen3_5", False)])
def test_rival_continuations_verified_as_a_tree_keep_the_target_greedy(
        kind, trees, loaded_pair, references, monkeypatch):  # noqa: F811
    """The index holds the target's own answer and, added later (so found first), copies of it
    that go wrong at a few places: where they compete, the first continuation is wrong and a
    rival is right. An attention-only target verifies them as one tree and accepts through the
    rival; a hybrid target verifies chains; both give the target's greedy output."""
    from dflash import speculative
    from dflash.model_mlx import generate
    from dflash.policy import Continuation
    from dflash.target import target_parts

    model, tokenizer, draft = loaded_pair(kind)
    prompt, ref = references(kind)
    rival_machine(model, draft, monkeypatch)
    vocab = target_parts(model).vocab_size
    index = ContinuationIndex(budget=4096)
    index.add(prompt[-8:] + ref)
    for k in (40, 20, 0):  # the most recent (wrong at the first token) is found first
        index.add(prompt[-8:] + ref[:k] + [(ref[k] + 1) % vocab] + ref[k + 1:])
    trees_verified: list[tuple] = []  # (tree, accepted path) of each continuation tree
    verify_tree, walk = speculative.verify_tree, speculative.walk

    def watched(parts, draft, request, state, plan, block, context):
        def walked(tree, targets):
            path, bonus = walk(tree, targets)
            if isinstance(plan, Continuation):
                trees_verified.append((tree, path))
            return path, bonus

        monkeypatch.setattr(speculative, "walk", walked)
        return verify_tree(parts, draft, request, state, plan, block, context)

    monkeypatch.setattr(speculative, "verify_tree", watched)
    out = generate(model, draft, tokenizer, prompt, max_tokens=len(ref), index=index)
    assert out.tokens == ref
    through_rivals = sum(any(node_kinds(tree)[i] != "spine" for i in path)
                         for tree, path in trees_verified)
    if trees:
        assert trees_verified and through_rivals >= 1, (len(trees_verified), through_rivals)
        assert out.stats.tree_cycles == 0  # counted as continuations (lookup and index cycles)
        assert out.stats.index_cycles >= len(trees_verified)
    else:
        assert not trees_verified
    assert out.stats.index_cycles > 0
