"""Ranks over ``mx.distributed``: which rank this process is, and the few collectives training and
datagen need (and a sharded target's decoding: rank 0's values handed to every rank).

Started with ``mlx.launch -n 2 --backend ring python -m dflash train ...`` every process sees the
same data order; each rank takes its own shard of it (``items[rank::size]``), gradients are
averaged with an all-reduce, so all ranks step identically, and only rank 0 writes checkpoints,
logs and exports. A plain ``python -m dflash ...`` is one rank of one, and every collective here is
then a no-op, so single-process runs take exactly the path they always took.

A rank that dies: ``mlx.launch`` reports ``Node with rank N exited with code X`` and terminates the
other ranks (they would otherwise wait in the next all-reduce). Checkpoints and data records are
written atomically, so the same command with ``--resume`` (datagen: the same command) continues
from the last complete checkpoint (the records written). Note that ``mlx.launch`` itself may exit 0
in that case: a finished run is one whose export records ``step == --steps``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .errors import RankMessageError


@dataclass(frozen=True)
class Ranks:
    """This process's place among the data-parallel ranks (``size == 1``: not distributed)."""

    rank: int = 0
    size: int = 1
    group: object | None = None

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes checkpoints, logs, manifests and exports."""
        return self.rank == 0

    def shard(self, items: list) -> list:
        """This rank's share of ``items`` (every item on exactly one rank)."""
        return items[self.rank::self.size]

    def barrier(self) -> None:
        """Wait until every rank got here."""
        if self.distributed:
            mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=self.group))

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on some rank (e.g. a time budget ran out)."""
        if not self.distributed:
            return flag
        total = mx.distributed.all_sum(mx.array([float(flag)]), group=self.group)
        return bool(total.item() > 0)

    def from_main(self, value: int) -> int:
        """Rank 0's ``value`` on every rank."""
        if not self.distributed:
            return value
        mine = mx.array([value if self.is_main else 0], dtype=mx.int32)
        return int(mx.distributed.all_sum(mine, group=self.group).item())

    def ints_from_main(self, values: np.ndarray | None, width: int) -> np.ndarray:
        """Rank 0's ``values`` (at most ``width`` int32s, zero-padded to ``width``) on every
        rank; the other ranks' ``values`` are ignored. One all-sum of ``width`` int32s to which
        the other ranks add zeros: every rank must call it with the same ``width``."""
        mine = np.zeros(width, dtype=np.int32)
        if self.is_main and values is not None:
            values = np.asarray(values, dtype=np.int32).ravel()
            if len(values) > width:
                raise RankMessageError(f"{len(values)} values: at most width={width}")
            mine[:len(values)] = values
        if not self.distributed:
            return mine
        return np.array(mx.distributed.all_sum(mx.array(mine), group=self.group))

    def average_gradients(self, grads):
        """The mean of every rank's gradients (each rank's own batch), the same on all ranks."""
        if not self.distributed:
            return grads
        return nn.average_gradients(grads, group=self.group)

    def union(self, ids: np.ndarray) -> np.ndarray:
        """The sorted union of every rank's ``ids`` (non-negative integers)."""
        ids = np.unique(np.asarray(ids, dtype=np.int64))
        if not self.distributed:
            return ids
        width = self.from_max(len(ids))
        padded = np.full(max(width, 1), -1, dtype=np.int32)
        padded[:len(ids)] = ids
        every = np.array(mx.distributed.all_gather(mx.array(padded), group=self.group))
        return np.unique(every[every >= 0])

    def from_max(self, value: int) -> int:
        """The largest ``value`` over the ranks."""
        if not self.distributed:
            return value
        one_hot = np.zeros(self.size, dtype=np.int32)
        one_hot[self.rank] = value
        return int(np.array(mx.distributed.all_sum(mx.array(one_hot), group=self.group)).max())


@functools.cache
def init_ranks() -> Ranks:
    """The ranks ``mlx.launch`` started (one rank when started without it); joined once."""
    if not mx.distributed.is_available():
        return Ranks()
    group = mx.distributed.init()
    if group.size() <= 1:
        return Ranks()
    return Ranks(group.rank(), group.size(), group)
