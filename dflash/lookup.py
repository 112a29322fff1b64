"""Proposals from text already seen: what followed the latest occurrence of the context's tail.

Why: answers copy from their prompt and from themselves (numbers and names in math answers,
identifiers in code, repeated phrases), and agents copy from their earlier turns (a file returned
whole after an edit, tool-call JSON, a retried request). A copied continuation costs no drafter
pass. Offline, on the built-in pair's held-out prompts at block 16 (the calibrated CPU costs),
choosing per cycle between the drafter's chain, the context's continuation and a plain step was
worth 1.65x plain decoding on GSM8K against 1.35x for the drafter alone, 1.52x against 1.00x on
HumanEval, 1.08x against 1.00x on chat. The verify policy (:mod:`dflash.policy`) decides, per
cycle, whether a continuation is worth its verify rows and how many of its tokens to verify (a
long match earns a long chain); verification keeps the output exact (a proposal the target would
not produce is rejected, and at T > 0 it is accepted with the target's probability of it, as any
proposal without a q).

Two sources, each returning a :class:`Match` (continuation, matched length, frequency), and the
competing continuations of the same context (:func:`continuations`: where earlier occurrences
continued differently, a target that verifies trees can check them together):

* :class:`ContextLookup`: the current sequence (prompt and what it has emitted so far), its
  3-/2-grams indexed incrementally.
* :class:`ContinuationIndex`: what a loaded pair has seen and written in earlier requests (each
  finished request's prompt and output), shared by the requests of one scope (the server keeps one
  per API key unless told otherwise: the speed of an answer must not reveal another client's text).
  It is bounded: a ring of ``budget`` tokens (the oldest dropped first) and hash chains in fixed
  numpy arrays, ``12 * budget + 8 * 2**table_bits`` bytes whatever is added, incremental (each
  token is linked once, when added; nothing is rebuilt per request).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import GenerationConfigError

ORDERS = (3, 2)  # longest match first: a 3-gram's continuation is right more often
MAX_MATCH = 64  # matched tokens counted backwards (a longer match earns no longer chain)
MAX_CHAIN = 64  # continuation tokens one verify pass may check (the policy prices each length)
KEY = 4  # tokens hashed to find earlier occurrences across requests
CANDIDATES = 8  # earlier occurrences of a key weighed per lookup (most recent first)
DEFAULT_BUDGET = 262_144  # tokens an index holds: 3 MiB of ring and chains
SEPARATOR = -1  # between documents in the ring: no match or continuation crosses it
COMPETING = 4  # continuations one lookup offers a tree verifier (the best and its rivals)


@dataclass(frozen=True)
class Match:
    """A proposed continuation: ``tokens`` followed an earlier occurrence of the context's last
    ``length`` tokens (``length`` counted up to :data:`MAX_MATCH`); ``count`` earlier
    occurrences continued with the same first token; ``source``: ``"context"`` (this sequence) or
    ``"index"`` (earlier requests); ``alternatives``: competing continuations of the same context
    (earlier occurrences that continued differently; only from :func:`continuations`)."""

    tokens: tuple[int, ...]
    length: int
    count: int = 1
    source: str = "context"
    alternatives: tuple[Match, ...] = field(default=(), compare=False, repr=False)

    def __bool__(self) -> bool:
        return bool(self.tokens)


def _match_length(history: Sequence[int], end: int, at) -> int:
    """How many tokens before ``history[end]`` equal those before position ``at`` (``at(j)``:
    the token ``j`` places back, ``None`` past the start), up to :data:`MAX_MATCH`."""
    n = 0
    while n < MAX_MATCH and n < end:
        token = at(n)
        if token is None or token != history[end - 1 - n]:
            break
        n += 1
    return n


class ContextLookup:
    """Where each n-gram of one growing token history last occurred, for :meth:`find`."""

    def __init__(self, orders: tuple[int, ...] | None = None):
        self.orders = orders or ORDERS
        self.last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.orders}
        # ``earlier[n][i]``: the previous start of the n-gram that starts at ``i`` (-1: none)
        self.earlier: dict[int, list[int]] = {n: [] for n in self.orders}
        self.indexed = dict.fromkeys(self.orders, 0)  # starts below this are in ``last``

    def _index(self, history: Sequence[int]) -> None:
        for n in self.orders:
            last = self.last[n]
            # A start ``i`` is indexed once its continuation exists (``i + n < len``): the n-gram
            # at the very end is the one looked up, not an earlier occurrence of itself.
            end = len(history) - n
            earlier = self.earlier[n]
            for i in range(self.indexed[n], end):
                key = tuple(history[i:i + n])
                earlier.append(last.get(key, -1))
                last[key] = i
            self.indexed[n] = max(self.indexed[n], end)

    def find(self, history: Sequence[int], length: int) -> Match | None:
        """Up to ``length`` tokens that followed the latest earlier occurrence of the history's
        last n tokens, for the longest order that occurred, with how far the match reaches back."""
        self._index(history)
        for n in self.orders:
            if len(history) <= n:
                continue
            start = self.last[n].get(tuple(history[-n:]))
            if start is not None:
                begin = start + n  # the continuation's first position
                matched = _match_length(history, len(history), lambda j, b=begin:
                                        history[b - 1 - j] if b - 1 - j >= 0 else None)
                return Match(tuple(history[begin:begin + length]), max(n, matched))
        return None

    def candidates(self, history: Sequence[int], length: int) -> list[Match]:
        """What followed each of the :data:`CANDIDATES` latest earlier occurrences of the
        history's last n tokens (the longest order that occurred), the latest first (the one
        :meth:`find` returns)."""
        self._index(history)
        for n in self.orders:
            if len(history) <= n:
                continue
            start = self.last[n].get(tuple(history[-n:]), -1)
            out: list[Match] = []
            while start >= 0 and len(out) < CANDIDATES:
                begin = start + n
                matched = _match_length(history, len(history), lambda j, b=begin:
                                        history[b - 1 - j] if b - 1 - j >= 0 else None)
                out.append(Match(tuple(history[begin:begin + length]), max(n, matched)))
                start = self.earlier[n][start]
            if out:
                return out
        return []


class ContinuationIndex:
    """Earlier requests' tokens in a bounded ring, found by the hash of their last :data:`KEY`
    tokens through hash chains (each position links to the previous one with the same hash).

    Thread-safe: the server's worker adds and looks up, the metrics read ``tokens``."""

    def __init__(self, budget: int = DEFAULT_BUDGET, table_bits: int | None = None):
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise GenerationConfigError(
                f"index budget: {budget!r}: a positive number of tokens")
        self.budget = budget
        bits = table_bits if table_bits is not None else max(10, min(22, budget.bit_length()))
        self.ring = np.full(budget, SEPARATOR, dtype=np.int32)
        self.chain = np.full(budget, -1, dtype=np.int64)  # previous position with the same hash
        self.heads = np.full(1 << bits, -1, dtype=np.int64)  # latest position of each hash
        self.mask = (1 << bits) - 1
        self.end = 0  # positions written so far (a position p lives at ``p % budget``)
        self.documents = 0
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Tokens held (separators included)."""
        return min(self.end, self.budget)

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes + self.chain.nbytes + self.heads.nbytes

    def _hash(self, key: Sequence[int]) -> int:
        h = 0
        for t in key:
            h = (h * 1_000_003 + int(t) + 1) & 0xFFFFFFFFFFFF
        return (h ^ (h >> 17)) & self.mask

    def _token(self, p: int) -> int | None:
        """The token at position ``p``, ``None`` if it left the ring, was never written, or is a
        separator."""
        if p < 0 or p >= self.end or p < self.end - self.budget:
            return None
        t = int(self.ring[p % self.budget])
        return None if t == SEPARATOR else t

    def add(self, tokens: Sequence[int]) -> None:
        """Index one document (a request's prompt and output): each of its positions becomes
        findable by the :data:`KEY` tokens before it."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return
        if len(tokens) + 1 > self.budget:  # keep the newest part that fits
            tokens = tokens[-(self.budget - 1):]
        with self._lock:
            start = self.end
            ring, chain, heads, budget = self.ring, self.chain, self.heads, self.budget
            for i, t in enumerate(tokens):
                p = start + i
                ring[p % budget] = t
                chain[p % budget] = -1
                if i >= KEY:  # position p continues the KEY tokens before it
                    h = self._hash(tokens[i - KEY:i])
                    chain[p % budget] = heads[h]
                    heads[h] = p
            p = start + len(tokens)
            ring[p % budget], chain[p % budget] = SEPARATOR, -1
            self.end = p + 1
            self.documents += 1

    def _occurrences(self, history: Sequence[int]) -> tuple[list[tuple[int, int]], dict[int, int]]:
        """The weighed earlier occurrences of the history's tail that match at least :data:`KEY`
        tokens, as ``(matched length, position)``, longest first (ties: the most recent), and how
        many of them continue with each first token. Called under the lock."""
        tail = [int(t) for t in history[-KEY:]]
        p = int(self.heads[self._hash(tail)])
        oldest = self.end - self.budget
        found: list[tuple[int, int]] = []
        firsts: dict[int, int] = {}
        seen = 0
        while p >= 0 and p >= oldest and p < self.end and seen < CANDIDATES:
            seen += 1
            nxt = int(self.chain[p % self.budget])
            first = self._token(p)
            matched = _match_length(history, len(history),
                                    lambda j, b=p: self._token(b - 1 - j))
            if matched >= KEY and first is not None:
                firsts[first] = firsts.get(first, 0) + 1
                found.append((matched, p))
            if nxt >= p:  # a link overwritten by a later lap of the ring
                break
            p = nxt
        found.sort(key=lambda o: -o[0])  # stable: the most recent first among equals
        return found, firsts

    def _read(self, p: int, length: int) -> tuple[int, ...]:
        """Up to ``length`` tokens from position ``p``, to the end of its document."""
        out: list[int] = []
        while len(out) < length:
            t = self._token(p + len(out))
            if t is None:
                break
            out.append(t)
        return tuple(out)

    def find(self, history: Sequence[int], length: int) -> Match | None:
        """The continuation of the longest earlier match of the history's tail (ties: the most
        recent), up to ``length`` tokens, with how many weighed occurrences agree on its first
        token; ``None`` where the last :data:`KEY` tokens never occurred."""
        found = self.candidates(history, length, most=1)
        return found[0] if found else None

    def candidates(self, history: Sequence[int], length: int,
                   most: int = CANDIDATES) -> list[Match]:
        """The continuations of up to ``most`` weighed earlier occurrences of the history's tail,
        longest match first (ties: the most recent), each with how many weighed occurrences agree
        on its first token."""
        if len(history) < KEY or length <= 0:
            return []
        with self._lock:
            found, firsts = self._occurrences(history)
            reads = [(matched, self._read(p, length)) for matched, p in found[:most]]
        return [Match(tokens, matched, firsts.get(tokens[0], 1), "index")
                for matched, tokens in reads if tokens]


def best_match(history: Sequence[int], length: int, context: ContextLookup,
               index: ContinuationIndex | None) -> Match | None:
    """The longer of the sequence's own and the index's continuations (ties: the sequence's)."""
    own = context.find(history, length)
    other = index.find(history, length) if index is not None else None
    if other is None or (own is not None and own.length >= other.length):
        return own
    return other


def continuations(history: Sequence[int], length: int, context: ContextLookup,
                  index: ContinuationIndex | None, most: int = COMPETING) -> Match | None:
    """:func:`best_match`'s continuation, with up to ``most - 1`` competing ones attached as its
    ``alternatives``: what other earlier occurrences of the matched context (in the sequence or
    the index) continued with, where that differs, the longest match first. A tree verifier
    checks them together (:func:`dflash.tree.continuation_tree`)."""
    own = context.candidates(history, length)
    other = index.candidates(history, length) if index is not None else []
    if not own and not other:
        return None
    first = own[0] if own and (not other or own[0].length >= other[0].length) else other[0]
    rivals = sorted((m for m in own + other if m is not first),
                    key=lambda m: (-m.length, -m.count))
    kept: list[Match] = []
    for m in rivals:
        if len(kept) + 1 >= most:
            break
        if m.tokens[:len(first.tokens)] == first.tokens[:len(m.tokens)]:
            continue  # adds nothing to the first: a prefix of it, or it of this one
        if any(m.tokens == k.tokens for k in kept):
            continue
        kept.append(m)
    return Match(first.tokens, first.length, first.count, first.source, tuple(kept))
