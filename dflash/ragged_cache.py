"""A key/value cache for several sequences at once, each row with its own length.

The batched engine (:mod:`dflash.batch`) verifies a block for every sequence in one target pass,
then each sequence keeps a different number of those tokens. mlx-lm's ``BatchKVCache`` is
left-padded with one shared write index: a row that keeps fewer tokens than another must be
shifted (rolled) to stay right-aligned, a copy of its whole cache per cycle. Here rows are
right-ragged instead:

* row ``b`` holds its tokens in slots ``0 .. lengths[b] - 1``; a pass of ``n`` new tokens writes
  row ``b``'s keys at slots ``lengths[b] ..`` (one scatter for the whole batch);
* roll-back is :meth:`set_lengths`: slots past a row's length are stale and hidden by the mask
  (:meth:`make_mask`), and the next pass overwrites them;
* ``offset`` is the array of row lengths, which mlx-lm's attention modules hand to RoPE
  (``self.rope(x, offset=cache.offset)``; ``mx.fast.rope`` takes one offset per batch row), so
  every row is rotated at its own positions without touching mlx-lm.

The mlx-lm attention modules call it through ``update_and_fetch`` and the model's mask through
``make_mask``, like any mlx-lm cache. Sliding windows are not supported for targets (the engine
falls back to one sequence at a time for such targets). A windowed drafter's context window is a
mask (:meth:`RaggedKVCache.context_mask`: each row sees its last positions), and its layers keep
a :class:`RaggedWindowCache`, which drops from each row the positions no later block can see, so
the batch's drafter memory stays flat as contexts grow, as one sequence's
:class:`~dflash.dflash2.WindowCache` does.

A sequence moves between a batch and its own ordinary caches (``KVCache``, ``ArraysCache``):
:meth:`RaggedKVCache.add_cache` makes one a new row, :meth:`RaggedKVCache.only_row` hands a
batch's single row back as one (no copy), so a sequence decoding alone runs the single-sequence
engine (draft trees, pipelined plain steps) on an ordinary cache, and ``row`` copies a
finished row out for the prompt cache (the next turn of its conversation starts from it).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from .dflash2 import WindowCache
from .errors import CacheLayoutError


class RaggedKVCache:
    step = 256  # capacity grows in these steps, as mlx-lm's KVCache does

    def __init__(self):
        self.keys: mx.array | None = None  # (B, heads, capacity, head_dim)
        self.values: mx.array | None = None
        self.lengths: list[int] = []
        self.offset = mx.array([], dtype=mx.int32)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values, self.offset]

    def set_lengths(self, lengths: list[int]) -> None:
        """Keep only the first ``lengths[b]`` tokens of each row (roll-back, or commit a pass)."""
        self.lengths = [int(n) for n in lengths]
        self.offset = mx.array(self.lengths, dtype=mx.int32)

    def _reserve(self, slots: int) -> None:
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if slots <= capacity:
            return
        grown = -(-slots // self.step) * self.step
        pad = [(0, 0), (0, 0), (0, grown - capacity), (0, 0)]
        self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``n`` new tokens per row after each row's own length; every row's slots up to
        the longest row's new end (the mask hides what a row does not own)."""
        n = keys.shape[2]
        self._make_room(n)
        end = max(self._used()) + n
        slots = (self._next_slots()[:, None] + mx.arange(n)[None])[:, None, :, None]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(slots, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(slots, values.shape), values,
                                        axis=2)
        self.set_lengths([length + n for length in self.lengths])
        return self.keys[..., :end, :], self.values[..., :end, :]

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        end = max(self._used())
        return self.keys[..., :end, :], self.values[..., :end, :]

    # Where rows sit in the buffer: slot = position here (a bounded subclass shifts them).
    def _used(self) -> list[int]:
        return self.lengths

    def _next_slots(self) -> mx.array:
        return self.offset

    def _make_room(self, n: int) -> None:
        self._reserve(max(self.lengths) + n)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None
                  ) -> mx.array:
        """``(B, 1, n, end)``: query ``j`` of row ``b`` (position ``lengths[b] + j``) sees slots
        ``0 .. lengths[b] + j``: its context and the new tokens up to itself."""
        if window_size is not None:
            raise CacheLayoutError("RaggedKVCache has no sliding-window mask")
        end = max(self.lengths) + n
        last = self.offset[:, None, None, None] + mx.arange(n)[None, None, :, None]
        return mx.arange(end)[None, None, None, :] <= last

    def context_mask(self, n: int = 1, window: int | None = None) -> mx.array:
        """``(B, 1, n, end)``: which of :meth:`keys_and_values`' slots each row owns, as seen by
        ``n`` queries at positions ``lengths[b] ..``; with a ``window`` (a windowed drafter's),
        only the slots fewer than ``window`` positions behind each query."""
        end = max(self.lengths)
        slots = mx.arange(end)[None, None, None, :]
        length = self.offset[:, None, None, None]
        owned = slots < length
        if window is None:
            return mx.broadcast_to(owned, (self.batch, 1, n, end))
        queries = length + mx.arange(n)[None, None, :, None]
        return owned & (queries - slots < window)

    # -- rows join and leave ----------------------------------------------------------------

    def add(self, keys: mx.array, values: mx.array) -> None:
        """A new row holding one sequence's ``(1, heads, length, head_dim)`` keys and values."""
        length = keys.shape[2]
        if self.keys is None:
            capacity = max(self.step, -(-length // self.step) * self.step)
            pad = [(0, 0), (0, 0), (0, capacity - length), (0, 0)]
            self.keys, self.values = mx.pad(keys, pad), mx.pad(values, pad)
        else:
            self._reserve(length)
            pad = [(0, 0), (0, 0), (0, self.keys.shape[2] - length), (0, 0)]
            self.keys = mx.concatenate([self.keys, mx.pad(keys, pad)])
            self.values = mx.concatenate([self.values, mx.pad(values, pad)])
        self.set_lengths(self.lengths + [length])

    def add_cache(self, cache: KVCache) -> None:
        """A sequence's own ``KVCache`` becomes a new row. A bounded cache (a windowed drafter's
        :class:`~dflash.dflash2.WindowCache`, its last rows only) is padded in front to its
        positions: the slots it dropped are outside the window, hidden by :meth:`context_mask`."""
        keys, values = cache.keys_and_values()
        keys, values = keys[..., :cache.offset, :], values[..., :cache.offset, :]
        dropped = cache.offset - keys.shape[2]
        if dropped:
            pad = [(0, 0), (0, 0), (dropped, 0), (0, 0)]
            keys, values = mx.pad(keys, pad), mx.pad(values, pad)
        self.add(keys, values)

    def only_row(self) -> KVCache:
        """The batch's one row as an ordinary ``KVCache`` (sharing its buffer); the batch is
        left empty."""
        if self.batch != 1:
            raise CacheLayoutError(f"only_row: the batch holds {self.batch} rows, not 1")
        cache = KVCache()
        cache.keys, cache.values, cache.offset = self.keys, self.values, self.lengths[0]
        self.keys = self.values = None
        self.set_lengths([])
        return cache

    def row(self, i: int) -> KVCache:
        """A copy of row ``i`` as an ordinary ``KVCache`` (the batch keeps it): a finished
        sequence's caches, for the prompt cache."""
        cache = KVCache()
        n = self.lengths[i]
        cache.keys, cache.values = self.keys[i:i + 1, :, :n], self.values[i:i + 1, :, :n]
        cache.offset = n
        return cache

    def keep(self, rows: list[int]) -> None:
        """Keep rows ``rows`` (in that order); the capacity shrinks to what they need."""
        lengths = [self.lengths[i] for i in rows]
        if not rows:
            self.keys = self.values = None
            self.set_lengths([])
            return
        capacity = -(-max(lengths) // self.step) * self.step
        index = mx.array(rows)
        self.keys = self.keys[index, :, :capacity]
        self.values = self.values[index, :, :capacity]
        self.set_lengths(lengths)


class RaggedWindowCache(RaggedKVCache):
    """A windowed drafter layer's context for several sequences: each row keeps at least its
    last ``size`` positions (``window - 1``: all a block's anchor can see) and drops older ones.

    Row ``b``'s slot ``s`` holds position ``base[b] + s``; ``offset`` (RoPE's, the block's start)
    stays the row's absolute length. The context keys are rotated when written, so where a
    position sits in the buffer does not matter to attention, only the mask, which reads
    positions from ``base``. Appends write in place; when the buffer is full, every row's
    window is moved to the front in one gather (once per ``slack`` appended rows, as
    :class:`~dflash.dflash2.WindowCache` re-lays one sequence's), into a buffer of
    ``size + slack`` slots, or what one append needs where it is longer.
    """

    def __init__(self, size: int):
        super().__init__()
        self.size = size
        self.slack = min(size, WindowCache.max_slack)
        self.base: list[int] = []
        self._base = mx.array([], dtype=mx.int32)

    def _set_base(self, base: list[int]) -> None:
        self.base = [int(b) for b in base]
        self._base = mx.array(self.base, dtype=mx.int32)

    @property
    def held(self) -> list[int]:
        """Slots each row uses (its positions ``base[b] .. lengths[b] - 1``)."""
        return [n - b for n, b in zip(self.lengths, self.base)]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def _slots_for(self, need: int) -> int:
        """A buffer for ``need`` slots per row: grown in steps while the contexts are shorter
        than the window, then ``size + slack`` (or ``need``, for a longer append)."""
        if need + self.slack >= self.size:
            return max(self.size + self.slack, need)
        return -(-need // self.step) * self.step

    def _make_room(self, n: int) -> None:
        """Room for ``n`` more slots per row: in place while the buffer has it, else each row's
        last ``size`` positions moved to the front of a buffer of ``size + slack`` slots."""
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if max(self.held) + n <= capacity:
            return
        base = [max(b, length - self.size) for b, length in zip(self.base, self.lengths)]
        kept = max(length - b for b, length in zip(base, self.lengths))
        need = kept + n
        rows = self._slots_for(need)
        shift = mx.array([new - old for new, old in zip(base, self.base)], dtype=mx.int32)
        index = mx.minimum(shift[:, None] + mx.arange(kept)[None], capacity - 1)
        index = index[:, None, :, None]
        pad = [(0, 0), (0, 0), (0, rows - kept), (0, 0)]
        self.keys = mx.pad(mx.take_along_axis(self.keys, index, axis=2), pad)
        self.values = mx.pad(mx.take_along_axis(self.values, index, axis=2), pad)
        self._set_base(base)

    def _used(self) -> list[int]:
        return self.held

    def _next_slots(self) -> mx.array:
        return self.offset - self._base

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None
                  ) -> mx.array:
        raise CacheLayoutError("RaggedWindowCache holds a drafter's context, not a target's")

    def context_mask(self, n: int = 1, window: int | None = None) -> mx.array:
        """As :meth:`RaggedKVCache.context_mask`, over the slots each row holds (slot ``s`` of
        row ``b``: position ``base[b] + s``); the window is at most ``size + 1``."""
        if window is None or window > self.size + 1:
            raise CacheLayoutError(f"RaggedWindowCache({self.size}): a window of at most "
                             f"{self.size + 1} positions, not {window}")
        end = max(self.held)
        slots = mx.arange(end)[None, None, None, :]
        base = self._base[:, None, None, None]
        length = self.offset[:, None, None, None]
        queries = length + mx.arange(n)[None, None, :, None]
        return (slots < length - base) & (queries - (base + slots) < window)

    # -- rows join and leave ----------------------------------------------------------------

    def add(self, keys: mx.array, values: mx.array, offset: int | None = None) -> None:
        """A new row holding one sequence's last positions ``(1, heads, held, head_dim)``, the
        last of them at ``offset - 1`` (default: it holds them all)."""
        held = keys.shape[2]
        offset = held if offset is None else offset
        if held > self.size:
            keys, values = keys[..., held - self.size:, :], values[..., held - self.size:, :]
            held = self.size
        if self.keys is None:
            capacity = self._slots_for(held)
        else:
            capacity = self.keys.shape[2]
            if held > capacity:
                capacity = self._slots_for(held)
                grow = [(0, 0), (0, 0), (0, capacity - self.keys.shape[2]), (0, 0)]
                self.keys, self.values = mx.pad(self.keys, grow), mx.pad(self.values, grow)
        pad = [(0, 0), (0, 0), (0, capacity - held), (0, 0)]
        keys, values = mx.pad(keys, pad), mx.pad(values, pad)
        if self.keys is not None:
            keys = mx.concatenate([self.keys, keys])
            values = mx.concatenate([self.values, values])
        self.keys, self.values = keys, values
        self.set_lengths(self.lengths + [offset])
        self._set_base(self.base + [offset - held])

    def add_cache(self, cache) -> None:
        """A sequence's own ``WindowCache`` (or ``KVCache``) becomes a new row, its last
        ``size`` positions only."""
        keys, values = cache.keys_and_values()
        held = min(keys.shape[2], cache.offset)
        self.add(keys[..., :held, :], values[..., :held, :], cache.offset)

    def only_row(self) -> WindowCache:
        """The batch's one row as one sequence's ``WindowCache`` (sharing its buffer); the
        batch is left empty."""
        if self.batch != 1:
            raise CacheLayoutError(f"only_row: the batch holds {self.batch} rows, not 1")
        cache = WindowCache(self.size)
        cache._keys, cache._values = self.keys, self.values
        cache.used, cache.offset = self.held[0], self.lengths[0]
        self.keys = self.values = None
        self.set_lengths([])
        self._set_base([])
        return cache

    def row(self, i: int) -> WindowCache:
        """A copy of row ``i`` as one sequence's ``WindowCache`` (the batch keeps it)."""
        cache = WindowCache(self.size)
        held = self.held[i]
        cache._keys, cache._values = self.keys[i:i + 1, :, :held], self.values[i:i + 1, :, :held]
        cache.used, cache.offset = held, self.lengths[i]
        return cache

    def keep(self, rows: list[int]) -> None:
        base = [self.base[i] for i in rows]
        held = [self.lengths[i] - b for i, b in zip(rows, base)]
        if not rows:
            self.keys = self.values = None
            self.set_lengths([])
            self._set_base([])
            return
        capacity = max(self.size + self.slack, -(-max(held) // self.step) * self.step)
        capacity = min(capacity, self.keys.shape[2])
        index = mx.array(rows)
        self.keys = self.keys[index, :, :capacity]
        self.values = self.values[index, :, :capacity]
        self.set_lengths([self.lengths[i] for i in rows])
        self._set_base(base)


def append_rows(append: Callable[[mx.array, list], None], rows: mx.array, counts: list[int],
                caches: list) -> None:
    """Give a batch's drafter caches each row's ``counts[b]`` new context rows: ``rows`` holds
    them padded to the longest (``(B, max(counts), ...)``), ``append(rows, caches)`` writes them
    (the drafter's ``append_context``), and each row's length then advances by its own count.

    A :class:`RaggedWindowCache` holds ``size + slack`` slots per row, plus what one write
    brings beyond them: rows that took a long plain stretch (their features not fed meanwhile)
    would catch up in one write that wide. So the rows go in pieces of at most the smallest
    windowed layer's ``slack``, each row's length advanced after each piece, and every buffer
    stays within its ``size + slack`` slots per row. A row whose count ends inside a piece gets
    padding written past its length, which the next write overwrites."""
    width = rows.shape[1]
    piece = max(1, min((c.slack for c in caches if isinstance(c, RaggedWindowCache)),
                       default=width))
    before = caches[0].lengths
    for start in range(0, width, piece):
        append(rows[:, start:start + piece], caches)
        done = [n + min(k, start + piece) for n, k in zip(before, counts)]
        for cache in caches:
            cache.set_lengths(done)


class RaggedArraysCache:
    """A GatedDeltaNet layer's state for several sequences: the conv window ``(B, K-1, D)`` and
    the recurrent state ``(B, H, Dv, Dk)``, indexed like mlx-lm's ``ArraysCache`` (``[0]``,
    ``[1]``). Roll-back replays each row's accepted steps (:func:`dflash.target.rollback_rows`)."""

    def __init__(self):
        self.cache: list[mx.array | None] = [None, None]

    def __getitem__(self, i: int) -> mx.array | None:
        return self.cache[i]

    def __setitem__(self, i: int, value: mx.array) -> None:
        self.cache[i] = value

    @property
    def state(self) -> list[mx.array]:
        return [a for a in self.cache if a is not None]

    def add(self, conv: mx.array, recurrent: mx.array) -> None:
        """A new row from one sequence's ``(1, ...)`` conv window and recurrent state."""
        if self.cache[0] is None:
            self.cache = [conv, recurrent]
        else:
            self.cache = [mx.concatenate([self.cache[0], conv]),
                          mx.concatenate([self.cache[1], recurrent])]

    def add_cache(self, cache: ArraysCache) -> None:
        """A sequence's own ``ArraysCache`` becomes a new row."""
        self.add(cache[0], cache[1])

    def only_row(self) -> ArraysCache:
        """The batch's one row as an ordinary ``ArraysCache``; the batch is left empty."""
        if self.cache[0] is None or self.cache[0].shape[0] != 1:
            raise CacheLayoutError("only_row: the batch does not hold exactly 1 row")
        cache = ArraysCache(2)
        cache[0], cache[1] = self.cache
        self.cache = [None, None]
        return cache

    def row(self, i: int) -> ArraysCache:
        """A copy of row ``i`` as an ordinary ``ArraysCache`` (the batch keeps it)."""
        cache = ArraysCache(2)
        cache[0], cache[1] = self.cache[0][i:i + 1], self.cache[1][i:i + 1]
        return cache

    def keep(self, rows: list[int]) -> None:
        if not rows:
            self.cache = [None, None]
            return
        index = mx.array(rows)
        self.cache = [self.cache[0][index], self.cache[1][index]]
