"""How the batched engine (:mod:`dflash.batch`) speculates: one verify width for the whole pass,
and the same losing-streak back-off as a single sequence (:mod:`dflash.policy.backoff`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .backoff import MARGIN, Backoff, draft_rows, judged_rate
from .calibration import expected_tokens

if TYPE_CHECKING:
    from ..cost_model import CostModel
    from .auto import AutoPolicy


def batch_width(acceptance: list[np.ndarray], cost: CostModel, context: int,
                draft_ms: float) -> tuple[int, float]:
    """The verify width ``n`` (anchor included; 1: a plain step, no proposals) of one batched
    target pass over ``len(acceptance)`` sequences, and its expected committed tokens per ms.

    The pass is a ``(B, n)`` block, so it costs ``B * n`` rows whichever sequence fills them:
    every sequence verifies up to ``n - 1`` proposals, and ``acceptance[b]`` (sequence ``b``'s
    calibrated per-row acceptance) says what that is worth. ``draft_ms`` (what drafting costs or
    cost) is charged to speculative widths only. Speculation must beat a plain batched step by
    ``MARGIN``; as the batch grows, ``verify(B * n)`` grows with it and the plain step wins by
    itself.
    """
    b = len(acceptance)
    best, best_rate = 1, MARGIN * b / cost.verify(b, context)
    longest = max((len(p) for p in acceptance), default=0)
    for n in range(2, longest + 2):
        tokens = sum(expected_tokens(p)[min(n - 1, len(p))] for p in acceptance)
        rate = tokens / (draft_ms + cost.verify(b * n, context))
        if rate > best_rate:
            best, best_rate = n, rate
    rate = best_rate if best > 1 else best_rate / MARGIN
    return best, rate


def _none_empty(looked: Sequence[np.ndarray | None]) -> list[np.ndarray]:
    return [np.zeros(0) if lp is None else lp for lp in looked]


class BatchPolicy:
    """Policy ``auto`` for a batch: whether to draft, and the pass's verify width.

    Each row brings its own calibrated acceptance (its sequence's
    :class:`~dflash.policy.auto.AutoPolicy`) and, where it has one, its continuation's
    (``looked``: ``None`` for a row without one). The batch keeps one :class:`Backoff`."""

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.backoff = Backoff()
        self.depths: deque[int] = deque(maxlen=8)  # proposals of recent drafted passes' widths

    def draft_rows(self, cap: int) -> int:
        """Rows of the batched drafter pass (anchor included), at most ``cap``."""
        return draft_rows(cap, self.depths)

    def want_draft(self, rows: Sequence[tuple[AutoPolicy, np.ndarray | None]],
                   looked: Sequence[np.ndarray | None], context: int, cap: int) -> bool:
        """Draft this cycle? Not while plain steps are predicted to win (a stretch of the
        back-off), nor while the rows' continuations are. ``rows``: each row's policy and the
        drafter's top probabilities in its last drafted block (``None``: none yet)."""
        if cap < 2:
            return False
        if self.backoff.take(1):
            return False
        if self.backoff.probing() or any(conf is None for _, conf in rows):
            return True
        drafted = self.draft_rows(cap)
        width, rate = batch_width([policy.predict(conf) for policy, conf in rows], self.cost,
                                  context, self.cost.draft(len(rows) * drafted, context))
        if any(lp is not None for lp in looked):
            _, look_rate = batch_width(_none_empty(looked), self.cost, context, 0.0)
            if look_rate >= rate:
                return False
        if width > 1:
            return True
        self.backoff.lost()
        return False

    def width_after_draft(self, rows: Sequence[tuple[AutoPolicy, np.ndarray]],
                          looked: Sequence[np.ndarray | None], context: int,
                          drafted_rows: int) -> tuple[int, list[bool]]:
        """The drafting is spent: the width (1: a plain step now, a loss) and which rows verify
        their continuation instead (where it is expected to commit more than their block)."""
        drafted = [policy.predict(conf) for policy, conf in rows]
        use_look = [lp is not None and expected_tokens(lp)[-1] > expected_tokens(dp)[-1]
                    for lp, dp in zip(looked, drafted)]
        width, _ = batch_width([lp if u else dp for u, lp, dp in zip(use_look, looked, drafted)],
                               self.cost, context, 0.0)
        if width == 1:
            self.backoff.lost()
        return width, use_look

    def width_without_draft(self, looked: Sequence[np.ndarray | None],
                            context: int) -> tuple[int, list[bool]]:
        """No drafting this cycle: the rows' continuations verified where they beat a plain
        batched step (a row without one takes a plain step in the same pass)."""
        if not any(lp is not None for lp in looked):
            return 1, [False] * len(looked)
        width, _ = batch_width(_none_empty(looked), self.cost, context, 0.0)
        return width, [lp is not None for lp in looked]

    def judge(self, rows: Sequence[tuple[AutoPolicy, np.ndarray]], use_look: Sequence[bool],
              looked: Sequence[np.ndarray | None], committed: int, context: int,
              drafted_rows: int, width: int) -> None:
        """After a pass of ``width`` (``drafted_rows``: its drafter pass, 0: none): did it beat
        plain steps? What the rows' calibrations expect now (``use_look``: of the continuation
        ``looked``) against the ``committed`` tokens."""
        if drafted_rows:
            self.depths.append(width - 1)
        if width <= 1 or not drafted_rows:
            return
        b = len(rows)
        ms = self.cost.draft(b * drafted_rows, context) + self.cost.verify(b * width, context)
        expect = [lp if u else policy.predict(conf)
                  for (policy, conf), u, lp in zip(rows, use_look, looked)]
        expected = sum(expected_tokens(p)[min(width - 1, len(p))] for p in expect)
        self.backoff.judge(judged_rate(expected, committed, ms),
                           MARGIN * b / self.cost.verify(b, context), smooth=False)


class FixedBatchPolicy(BatchPolicy):
    """Policy ``fixed`` for a batch: every row verifies the whole drafted block."""

    def __init__(self, cost: CostModel | None = None):
        super().__init__(cost)

    def draft_rows(self, cap: int) -> int:
        return cap

    def want_draft(self, rows, looked, context: int, cap: int) -> bool:
        return cap >= 2

    def width_after_draft(self, rows, looked, context: int,
                          drafted_rows: int) -> tuple[int, list[bool]]:
        return drafted_rows, [False] * len(rows)

    def judge(self, rows, use_look, looked, committed: int, context: int, drafted_rows: int,
              width: int) -> None:
        return None
