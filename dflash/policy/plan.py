"""What the target verifies in one cycle (a :data:`Plan`), and what came of it (an
:class:`Outcome`): the one vocabulary between the engines and the policies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

from ..tree import DraftTree


@dataclass(frozen=True)
class Plain:
    """``steps`` one-token target steps, no drafter pass (the drafter's context is still fed)."""

    steps: int = 1


@dataclass(frozen=True)
class Continuation:
    """A continuation of text already seen (:mod:`dflash.lookup`), verified as a chain, or with
    its rivals as a tree: no drafter pass. ``match``: how many tokens of the context it matched (up to
    :data:`~dflash.lookup.MAX_MATCH`); ``count``: earlier occurrences agreeing on its first token;
    ``source``: ``"context"`` (this sequence) or ``"index"`` (earlier requests);
    ``drafter_value``: the drafted block it won over, if one was drafted (expected tokens per ms
    of that block's best plan); ``tree``: where competing continuations are verified together
    (attention-only targets), their trie (:func:`~dflash.tree.continuation_tree`), whose spine
    is ``tokens``."""

    tokens: tuple[int, ...]
    match: int
    count: int = 1
    source: str = "context"
    drafter_value: float | None = None
    tree: DraftTree | None = None

    @property
    def rows(self) -> int:
        return len(self.tokens) if self.tree is None else len(self.tree) - 1


@dataclass(frozen=True)
class Chain:
    """The first ``rows`` drafted proposals (``0``: nothing proposed, the anchor alone: the last
    token of a generation)."""

    rows: int


@dataclass(frozen=True)
class Tree:
    """A best-first draft tree (attention-only targets)."""

    tree: DraftTree

    @property
    def rows(self) -> int:
        return len(self.tree) - 1


@dataclass(frozen=True)
class Unverified:
    """A drafted block not worth verifying (a probe in a losing streak): the cycle becomes the
    first plain step of the next stretch."""


Plan = Union[Plain, Continuation, Chain, Tree, Unverified]


@dataclass(frozen=True)
class Outcome:
    """What one cycle did, reported to the policy after verification.

    ``accepted``: proposals kept (for a tree, along ``path``: node indices); ``log_conf``: the
    drafter's top log-probability per block row (``None`` where no block was drafted);
    ``draft_rows``: rows of the drafter's pass (``0``: none); ``context``: tokens in the target's
    cache when the cycle was planned; ``shared``: a row of a batched pass (its passes belong to the
    batch, which judges them: the sequence's policy only learns its calibration)."""

    plan: Plan
    accepted: int = 0
    path: tuple[int, ...] | None = None
    log_conf: np.ndarray | None = None
    draft_rows: int = 0
    context: int = 0
    shared: bool = False
