"""Reuse of target and drafter caches across calls: multi-turn chat, agents and their sub-agents.

Why: a coding agent resends the whole conversation every turn. Keeping only the last prompt made
every turn prefill the previous reply again (first token ~5x later than ``mlx_lm.server``, which
keeps prompt and reply for ten conversations). So a :class:`PromptCache` keeps several
conversations, each as a :class:`CacheEntry` holding the target's caches, the drafter's context
and the token ids they hold (prompt *and* reply); a new prompt starts from the entry sharing its
longest token prefix and prefills only what follows.

The bookkeeping (least-recently-used eviction by entries and bytes, a trie of the entries'
tokens) is mlx-lm's own ``LRUPromptCache``: a :class:`CacheEntry` answers its cache protocol
(``nbytes``, ``is_trimmable``, ``trim``) as one cache. What mlx-lm cannot do lives here: the
drafter's caches ride along, and GatedDeltaNet states (Qwen3.5), which cannot be trimmed, are
restored from snapshots taken at prefill chunk ends and where a prompt stops sharing another
conversation's tokens (a sub-agent's system prompt: the next sub-agent starts there). MLX arrays
are immutable: a snapshot is a list of references, and a taken entry is a copy, so a generation
that fails leaves the cached conversations as they were.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from mlx_lm.models.cache import ArraysCache, LRUPromptCache, RotatingKVCache

from .cache_files import CacheFolder, pair_fingerprint, servable
from .errors import GenerationConfigError
from .target import TargetParts, make_cache

MAX_SNAPSHOTS = 8  # recurrent states kept per entry (Qwen3.5-4B's: ~25 MB each in bf16)
DEFAULT_ENTRIES = 10  # mlx_lm.server's --prompt-cache-size
DEFAULT_DISK_BYTES = 16 * 10**9  # a cache folder's budget (per scope) unless given


@dataclass
class CacheEntry:
    """One conversation's caches: the target's, the drafter's, and the ``tokens`` fed to both.

    ``reused``: how many prompt tokens a request taking it found already cached; ``shared``:
    how many it shares with some cached conversation (more than ``reused`` where that one's
    recurrent states cannot go back so far: the prefill snapshots there, for the next)."""

    target: list
    draft: list
    tokens: list[int] = field(default_factory=list)
    snapshots: dict[int, list] = field(default_factory=dict)
    reused: int = 0
    shared: int = 0

    # -- mlx-lm's cache protocol (LRUPromptCache stores the entry as a one-cache list) --------

    @property
    def nbytes(self) -> int:
        held = sum(c.nbytes for c in self.target + list(self.draft))
        return held + sum(a.nbytes for states in self.snapshots.values()
                          for state in states for a in state if a is not None)

    def is_trimmable(self) -> bool:
        """Can it go back to a shorter prefix? Not a wrapped sliding window (its early rows are
        gone), nor a recurrent state without a snapshot to restore."""
        if any(isinstance(c, RotatingKVCache) and not c.is_trimmable() for c in self.target):
            return False
        return not self._recurrent() or bool(self.snapshots)

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens, or more where a recurrent state has no snapshot there
        (back to the latest one before; none: everything). The tokens forgotten."""
        before = len(self.tokens)
        keep = max(0, before - n)
        recurrent = self._recurrent()
        if recurrent and keep < before:
            keep = max((k for k in self.snapshots if k <= keep), default=0)
            if keep == 0:
                self.target, self.draft = [], []
                self.tokens, self.snapshots = [], {}
                return before
            for i, state in zip(recurrent, self.snapshots[keep]):
                self.target[i].cache = list(state)
        for c in self.target:
            if not isinstance(c, ArraysCache):
                c.trim(c.offset - keep)
        for c in self.draft:
            c.trim(c.offset - keep)
        self.tokens = self.tokens[:keep]
        self.snapshots = {k: s for k, s in self.snapshots.items() if k <= keep}
        return before - keep

    # -- what the engines call -------------------------------------------------------------

    def usable(self, n: int) -> int:
        """The longest prefix of at most ``n`` of its tokens it can go back to."""
        return servable(len(self.tokens), n, self.is_trimmable(), bool(self._recurrent()),
                        self.snapshots)

    def snapshot(self, n_tokens: int) -> None:
        """Remember the recurrent states after ``n_tokens`` fed tokens (cheap: references).

        Taken at every prefill chunk's end, so that a prompt sharing only a prefix (a
        sub-agent's system prompt and tools) goes back to the latest one inside it. Past
        :data:`MAX_SNAPSHOTS` the one whose neighbours lie closest together goes: the points
        kept stay spread over the prompt, the newest always kept."""
        states = [list(self.target[i].cache) for i in self._recurrent()]
        if not states:
            return
        self.snapshots[n_tokens] = states
        while len(self.snapshots) > MAX_SNAPSHOTS:
            points = [0, *sorted(self.snapshots)]
            gaps = {points[i]: points[i + 1] - points[i - 1] for i in range(1, len(points) - 1)}
            del self.snapshots[min(gaps, key=gaps.get)]

    def _recurrent(self) -> list[int]:
        return [i for i, c in enumerate(self.target) if isinstance(c, ArraysCache)]


def _serves(longer: CacheEntry, shorter: CacheEntry) -> bool:
    """Whether ``longer`` holds all of ``shorter``'s tokens and can go back to them."""
    k = len(shorter.tokens)
    return (len(longer.tokens) > k and _common_prefix(longer.tokens, np.asarray(shorter.tokens)) == k
            and longer.usable(k) == k)


def _common_prefix(a: list[int], b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share (numpy: prompts run to 100k tokens)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != b[:n])
    return int(differ[0]) if differ.size else n


class PromptCache:
    """The caches of recent conversations, for ``stream_generate(..., prompt_cache=...)`` and
    the batched engine; at most ``max_entries`` entries and ``max_bytes`` bytes (``None``: no
    byte bound), least recently used evicted first. Used by one thread at a time (the server's
    worker owns its scopes' caches).

    ``directory``: conversations also kept on disk there (at most ``directory_bytes``), written
    when a reply is stored and loaded when a prompt first needs one, so they survive a restart
    (:mod:`dflash.cache_files`). :meth:`save` / :meth:`load` do the same at chosen moments.
    ``defer_writes``: a stored reply is only queued for the folder, and written when the owner
    calls :meth:`write_deferred` (the server: when it has been idle a moment), :meth:`flush`,
    or when memory lets the entry go (unless an entry held serves all of it); so a write never
    competes with the next turn's prefill."""

    def __init__(self, max_entries: int = DEFAULT_ENTRIES, max_bytes: int | None = None,
                 directory: str | Path | None = None,
                 directory_bytes: int = DEFAULT_DISK_BYTES, defer_writes: bool = False):
        for name, value in (("max_entries", max_entries), ("max_bytes", max_bytes),
                            ("directory_bytes", directory_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise GenerationConfigError(f"{name}={value!r}: must be an integer >= 1")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._lru = LRUPromptCache(max_entries, (1 << 63) if max_bytes is None else max_bytes)
        self.folder = None if directory is None else CacheFolder(directory, directory_bytes,
                                                                 defer=defer_writes)
        self._pairs: dict[tuple[int, int], tuple] = {}  # owner -> (parts, draft, fingerprint)

    @classmethod
    def load(cls, directory: str | Path, **bounds) -> PromptCache:
        """A cache kept in ``directory`` (written by :meth:`save` or a server's
        ``--prompt-cache-dir``): its entries are read when a prompt first needs one."""
        return cls(directory=directory, **bounds)

    def save(self, directory: str | Path | None = None) -> None:
        """Write every entry held to ``directory`` (default: this cache's own folder) and wait
        for the writes."""
        folder = self.folder if directory is None else CacheFolder(
            directory, self.folder.max_bytes if self.folder else DEFAULT_DISK_BYTES)
        if folder is None:
            raise GenerationConfigError("PromptCache.save: no directory given and none set")
        for owner, entry in self._held():
            if owner in self._pairs:
                folder.save(self._fingerprint(*self._pairs[owner][:2]), entry)
        folder.flush()

    def flush(self) -> int:
        """Write the deferred entries and wait for the entries being written to this cache's
        folder; how many were deferred."""
        return 0 if self.folder is None else self.folder.flush()

    def write_deferred(self) -> None:
        """Start writing the replies queued by ``defer_writes`` (in the background; call it
        from the thread that generates, when it is idle)."""
        if self.folder is not None:
            self.folder.write_queued()

    def __len__(self) -> int:
        return len(self._lru)

    def __deepcopy__(self, memo: dict) -> PromptCache:
        """An independent copy holding copies of the entries, in the same recency order.

        Copying mlx-lm's token trie as it is recurses once per token (a 100k-token prompt
        overflows Python's stack), so the copy is rebuilt by storing each entry again."""
        out = PromptCache(self.max_entries, self.max_bytes)
        for owner, entry in self._held():
            held = copy.deepcopy(entry, memo)
            out._lru.insert_cache(owner, list(held.tokens), [held])
        return out

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def clear(self) -> None:
        self._lru.trim_to(n_sequences=0)

    def take(self, parts: TargetParts, draft, prompt: list[int]) -> CacheEntry:
        """Caches for ``prompt``: a private copy of the entry that can serve the longest prefix
        of it, trimmed to that prefix (the last prompt token is always fed), or fresh ones.
        ``entry.reused`` says how many of the prompt's tokens it already holds.

        Every entry is weighed, not only the one sharing the longest prefix: a hybrid
        target's entry goes back only to its snapshots, so a shorter match with a snapshot
        at its end may serve more."""
        ids = np.asarray(prompt)
        best, reused, shared = None, 0, 0
        for held in self.entries(_owner(parts, draft)):
            common = _common_prefix(held.tokens, ids)
            shared = max(shared, common)
            usable = held.usable(min(common, len(prompt) - 1))
            if usable > reused:
                best, reused = held, usable
        if self.folder is not None:
            loaded = self._from_disk(parts, draft, ids, reused)
            if loaded is not None:
                best, reused = loaded
        if best is None:
            entry = CacheEntry(make_cache(parts), draft.make_cache())
        else:
            # the caches are written in place, so copied; snapshots hold immutable arrays: shared
            entry = copy.deepcopy(best, {id(best.snapshots): dict(best.snapshots)})
            entry.trim(len(entry.tokens) - reused)
        entry.reused = len(entry.tokens)
        entry.shared = max(entry.reused, min(shared, len(prompt) - 1))
        return entry

    def store(self, parts: TargetParts, draft, entry: CacheEntry, target: list, dcache: list,
              tokens: list[int], persist: bool = True) -> None:
        """Keep caches after a prefill or a generation: ``tokens`` are exactly those fed to
        ``target``, and ``dcache`` has seen the features of all of them. The entry is the
        cache's from now on: the caller must not write into these caches again. ``persist``:
        also written to the cache folder, if any (a finished reply; not a prompt whose reply
        is still being decoded)."""
        entry.target, entry.draft, entry.tokens = target, dcache, list(tokens)
        entry.snapshots = {k: s for k, s in entry.snapshots.items() if k <= len(tokens)}
        if not tokens:
            return
        owner = _owner(parts, draft)
        self._pairs.setdefault(owner, (parts, draft, None))
        self._lru.insert_cache(owner, list(tokens), [entry])
        if self.folder is None:
            return
        if persist:
            self.folder.save(self._fingerprint(parts, draft), entry)
        if self.folder.queued:
            # A queued entry memory let go of is written now, unless an entry held serves all
            # of it (this turn's prompt, stored before its reply: the reply's entry, queued
            # when it ends, takes its place).
            held = self.entries()
            ids = {id(e) for e in held}
            self.folder.write_queued(
                keep=lambda e: id(e) in ids or any(_serves(h, e) for h in held))

    def _fingerprint(self, parts: TargetParts, draft) -> str:
        owner = _owner(parts, draft)
        known = self._pairs.get(owner)
        if known is None or known[2] is None:
            known = self._pairs[owner] = (parts, draft, pair_fingerprint(parts, draft))
        return known[2]

    def _from_disk(self, parts: TargetParts, draft, ids: np.ndarray,
                   reused: int) -> tuple[CacheEntry, int] | None:
        """The file entry serving more of ``ids`` than ``reused`` (what memory serves), loaded
        and held in memory from now on; ``None`` if none does (or it does not read back)."""
        fingerprint = self._fingerprint(parts, draft)
        ranked = []
        for header in self.folder.headers(fingerprint):
            common = _common_prefix(header.tokens, ids)
            usable = servable(len(header.tokens), min(common, len(ids) - 1), header.trimmable,
                              header.recurrent, header.points)
            if usable > reused:
                ranked.append((usable, header))
        for usable, header in sorted(ranked, key=lambda r: -r[0]):
            found = self.folder.load(header, fingerprint, make_cache(parts), draft.make_cache())
            if found is not None:
                entry = CacheEntry(*found)
                self._pairs.setdefault(_owner(parts, draft), (parts, draft, fingerprint))
                self._lru.insert_cache(_owner(parts, draft), list(entry.tokens), [entry])
                return entry, usable
        return None

    def entries(self, owner: tuple[int, int] | None = None) -> list[CacheEntry]:
        """The entries held (``owner``: one pair's), least recently used first."""
        return [entry for model, entry in self._held() if owner is None or model == owner]

    def _held(self) -> list[tuple[tuple[int, int], CacheEntry]]:
        """``(owner, entry)`` for every entry, least recently used first."""
        held = []
        for lru in self._lru._lru._lrus.values():
            for model, tokens in lru:
                held.append((model, self._lru._trie.get(model, tokens).prompt_cache[0]))
        return held


def _owner(parts: TargetParts, draft) -> tuple[int, int]:
    """Which pair an entry belongs to: another pair never picks it up."""
    return (id(parts.model), id(draft))
