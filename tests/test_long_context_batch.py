"""The batched engine's drafter context is bounded by the draft window, as one sequence's is.

A windowed drafter layer keeps a :class:`~dflash.ragged_cache.RaggedWindowCache` in the batched
engine: each row holds its last ``window - 1`` positions (plus the slack appends write into),
and what a block sees is what it sees over the unbounded ragged cache with the window's mask.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from dflash.batch import BatchGenerator
from dflash.dflash2 import WindowCache
from dflash.drafter import load_draft
from dflash.model_mlx import load
from dflash.ragged_cache import RaggedKVCache, RaggedWindowCache

HEADS, DIM = 2, 4


def rows(seed: int, batch: int, n: int) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    return mx.random.normal((batch, HEADS, n, DIM)), mx.random.normal((batch, HEADS, n, DIM))


def attend(cache, n_queries: int, window: int, seed: int) -> mx.array:
    """A block of queries at each row's next positions over the cache's context, windowed."""
    mx.random.seed(seed)
    q = mx.random.normal((cache.batch, HEADS, n_queries, DIM))
    keys, values = cache.keys_and_values()
    mask = cache.context_mask(n_queries, window)
    # A visible slot of the block's own keeps every row's softmax defined.
    keys = mx.concatenate([keys, mx.zeros((cache.batch, HEADS, 1, DIM))], axis=2)
    values = mx.concatenate([values, mx.zeros((cache.batch, HEADS, 1, DIM))], axis=2)
    mask = mx.concatenate([mask, mx.ones((*mask.shape[:3], 1), dtype=mx.bool_)], axis=-1)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=mask)


@pytest.mark.parametrize("window", [8, 40])
def test_window_cache_sees_what_the_windowed_mask_sees(window):
    """Ragged appends (each row keeping a different count, as the engine's padded appends do),
    rows joining from a WindowCache and leaving: attention over the bounded cache equals the
    unbounded one's with the window mask, and the buffer stays within the window's slots."""
    size = window - 1
    full, bounded = RaggedKVCache(), RaggedWindowCache(size)
    rng = np.random.default_rng(0)
    for b, length in enumerate((3, 30, 70)):
        k, v = rows(b, 1, length)
        full.add(k, v)
        one = WindowCache(size)
        one.update_and_fetch(k, v)
        bounded.add_cache(one)
    most_appended = 0
    for step in range(60):
        n = int(rng.integers(1, 12))
        counts = [int(c) for c in rng.integers(0, n + 1, size=full.batch)]
        counts[int(rng.integers(full.batch))] = n
        k, v = rows(100 + step, full.batch, n)
        for cache in (full, bounded):
            before = cache.lengths
            cache.update_and_fetch(k, v)
            cache.set_lengths([a + c for a, c in zip(before, counts)])
        most_appended = max(most_appended, n)
        assert bounded.lengths == full.lengths
        assert max(bounded.held) <= bounded.keys.shape[2]
        assert bounded.keys.shape[2] <= max(size + bounded.slack, size + most_appended)
        assert mx.allclose(attend(full, 8, window, step), attend(bounded, 8, window, step),
                           atol=1e-5)
        if step == 30:  # a row leaves; one joins from a long single-sequence context
            full.keep([0, 2])
            bounded.keep([0, 2])
            k, v = rows(999, 1, 90)
            full.add(k, v)
            one = WindowCache(size)
            one.update_and_fetch(k, v)
            bounded.add_cache(one)
    # The last row alone goes back to a single sequence's bounded cache, with the same window.
    bounded.keep([2])
    full.keep([2])
    one = bounded.only_row()
    assert isinstance(one, WindowCache) and one.offset == full.lengths[0]
    keys, _ = full.keys_and_values()
    assert mx.array_equal(one.keys, keys[..., full.lengths[0] - size:full.lengths[0], :])


@pytest.fixture(scope="module")
def pair(tiny_pair):
    target, draft = tiny_pair("qwen3")
    model, tokenizer = load(str(target))
    return model, tokenizer, draft


def prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(2, 400, size=n)]


def test_batched_drafter_memory_is_bounded_by_the_window(pair):
    """Three sequences decoded together with an 8-token draft window: output the target's own,
    the drafter's scores those of the window's mask over the whole context, and every drafter
    layer's buffer at most the window's slots per row (it grows with the context without one)."""
    model, tokenizer, draft_path = pair
    prompts = [prompt(n, s) for s, n in enumerate((90, 130, 170))]
    grown, chunks, scores = {}, {}, {}
    for window, bounded in ((None, False), (8, False), (8, True)):
        draft = load_draft(str(draft_path), sliding_window_size=window)
        engine = BatchGenerator(model, draft, tokenizer, max_batch=3, policy="fixed")
        if not bounded:  # the window as a mask only, over every row's whole context
            engine.dcache = [RaggedKVCache() for _ in draft.layers]
        drafted = scores[window, bounded] = []
        batch_scores = draft.block_scores_batch

        def spy(*args, _inner=batch_scores, _into=drafted, **kwargs):
            out = _inner(*args, **kwargs)
            _into.append(np.array(out[0]))
            return out

        draft.block_scores_batch = spy
        uids = [engine.insert(p, max_tokens=40) for p in prompts]
        tokens = {u: [] for u in uids}
        slots = 0
        while engine.active or engine.pending:
            for e in engine.step():
                tokens[e.uid].append(e.tokens)
            if engine.dcache[0].keys is not None:
                slots = max(slots, engine.dcache[0].keys.shape[2])
        for u, p in zip(uids, prompts):
            assert sum(tokens[u], []) == [int(t) for t, _ in
                                          generate_step(mx.array(p), model, max_tokens=40)]
        grown[window, bounded] = slots
        chunks[window, bounded] = tokens
    # The drafter's block scores in every batched pass are those of the window's mask over the
    # whole context (so the same proposals, the same tokens accepted in every cycle).
    assert chunks[8, True] == chunks[8, False]
    assert len(scores[8, True]) == len(scores[8, False]) > 20
    for a, b in zip(scores[8, True], scores[8, False]):
        assert a.shape == b.shape and np.allclose(a, b, atol=1e-4)
    assert not all(a.shape == b.shape and np.allclose(a, b, atol=1e-4)
                   for a, b in zip(scores[8, True], scores[None, False]))  # the window matters
    bounded = load_draft(str(draft_path), sliding_window_size=8).make_batch_cache()
    assert all(isinstance(c, RaggedWindowCache) and c.size == 7 for c in bounded)
    assert grown[None, False] >= 170  # the unbounded cache holds every position
    # The window's 7 positions, slack of 7, and one cycle's committed tokens
    assert grown[8, True] <= 7 + 7 + 8


def test_catching_up_after_a_plain_stretch_stays_within_the_window(pair):
    """Rows that take many plain steps together (the drafter's context is not fed meanwhile)
    and then draft again catch their features up in one go: the windowed drafter cache takes
    them in pieces, so every layer's buffer stays within the window's and the slack's slots per
    row through the catch-up (``nbytes`` after every write), and the output is the target's."""
    model, tokenizer, draft_path = pair
    window, stretch = 8, 40
    draft = load_draft(str(draft_path), sliding_window_size=window)
    engine = BatchGenerator(model, draft, tokenizer, max_batch=3, policy="fixed")
    wants = engine.speculation.want_draft
    cycles = []

    def plain_first(*args, **kwargs):  # a plain stretch, then drafting again
        cycles.append(None)
        return len(cycles) > stretch and wants(*args, **kwargs)

    engine.speculation.want_draft = plain_first
    widest, most_bytes, appended, row_bytes = 0, 0, [], 0
    for cache in engine.dcache:
        write = cache.update_and_fetch

        def spy(keys, values, _write=write, _cache=cache):
            nonlocal widest, most_bytes, row_bytes
            out = _write(keys, values)
            appended.append(keys.shape[2])
            widest = max(widest, _cache.keys.shape[2])
            most_bytes = max(most_bytes, _cache.nbytes / _cache.batch)
            # one slot of one row, keys and values
            row_bytes = 2 * keys.shape[1] * keys.shape[3] * keys.dtype.size
            return out

        cache.update_and_fetch = spy
    prompts = [prompt(n, s) for s, n in enumerate((60, 75, 90))]
    uids = [engine.insert(p, max_tokens=stretch + 24) for p in prompts]
    tokens = {u: [] for u in uids}
    while engine.active or engine.pending:
        for e in engine.step():
            tokens[e.uid].extend(e.tokens)
    for u, p in zip(uids, prompts):
        assert tokens[u] == [int(t) for t, _ in
                             generate_step(mx.array(p), model, max_tokens=stretch + 24)]
    size, slack = engine.dcache[0].size, engine.dcache[0].slack
    assert max(appended) <= slack < stretch  # the catch-up came in pieces
    assert widest <= size + slack
    assert most_bytes <= (size + slack) * row_bytes
