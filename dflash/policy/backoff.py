"""The losing-streak back-off, shared by the single-sequence policy and the batched engine.

Speculation is judged after each cycle by its committed tokens per millisecond, taken as half what
the calibration expected of the plan and half what the cycle really committed (the calibration
starts from the drafter's own confidence, and a confidently wrong drafter must lose at once). A
cycle below a plain step's rate by ``MARGIN`` is a loss: the next ``2**losses`` steps (at most
``MAX_BACKOFF``) are plain target steps, then one cycle probes again and decides afresh. A win
ends the streak::

    win ──────────────────────────────────────────────┐
     ▲                                                ▼
    probe ◀── 2^k plain steps ◀── loss (k += 1) ◀── speculate

Also here: how many rows the drafter's block pass covers (a probe in a streak drafts the
smallest pass; otherwise the deepest recent plan and a little more).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MAX_BACKOFF = 64  # longest plain stretch
MIN_DRAFT_ROWS = 4  # rows of the smallest drafter block pass (anchor included), a probe's
VERIFIED_LOSSES = 2  # losing cycles verified before a probe expected to lose verifies nothing
# Speculation must beat a plain step by this factor: the cost model times the passes, not the
# host work around them (candidates, planning, bookkeeping), and its estimates are noisy.
MARGIN = 1.1
EMA = 0.5  # weight of the newest cycle in a running rate


def judged_rate(expected: float, committed: float, ms: float = 1.0) -> float:
    """Tokens per ms a speculative cycle is judged by: half what was expected, half what was
    committed (both tokens over ``ms``, or both already tokens per ms)."""
    return 0.5 * (expected + committed) / ms


def draft_rows(block: int, depths: Iterable[int], losing: bool = False) -> int:
    """Rows of the drafter's block pass (anchor included), at most ``block``: the deepest of the
    recent plans' verified proposals (``depths``) plus three, at least ``MIN_DRAFT_ROWS``; the
    smallest pass before any plan or in a losing streak (a probe most likely verifies nothing)."""
    deepest = max(depths, default=None)
    if losing or deepest is None:
        return min(block, MIN_DRAFT_ROWS)
    return max(2, min(block, max(MIN_DRAFT_ROWS, deepest + 3)))


@dataclass
class Backoff:
    """One losing streak's state: consecutive ``losses``, plain steps still to take
    (``stretch``), the running judged ``rate`` (``None``: the next cycle decides afresh),
    whether the drafter ``agreed`` in a verified cycle of this streak, and whether the next
    speculative cycle is a ``probe`` (it drafts whatever the estimates say)."""

    losses: int = 0
    stretch: int = 0
    rate: float | None = None
    agreed: bool = False
    probe: bool = False

    def take(self, most: int) -> int:
        """Plain steps to take now (0: speculate), at most ``most``; the rest stays for later."""
        steps = min(self.stretch, max(0, most))
        self.stretch -= steps
        return steps

    def give_back(self, steps: int) -> None:
        """Plain steps taken out but not taken (a continuation was verified instead)."""
        self.stretch += max(0, steps)

    def probing(self) -> bool:
        """Whether this cycle is the probe after a stretch (asked once per probe)."""
        probe, self.probe = self.probe, False
        return probe

    def lost(self) -> None:
        """Speculation lost: a plain stretch twice as long as the last one, then a probe."""
        self.losses += 1
        self.stretch = min(MAX_BACKOFF, 2 ** self.losses)
        self.rate = None
        self.probe = True

    def won(self) -> None:
        self.losses, self.agreed = 0, False

    def judge(self, rate: float, bar: float, agreed: bool = False, smooth: bool = True) -> bool:
        """A judged speculative cycle at ``rate`` tokens per ms (:func:`judged_rate`) against
        ``bar`` (``MARGIN`` times a plain step's rate); whether it lost. ``smooth``: the running
        rate counts too (a losing cycle counts at once; the average keeps one lucky cycle from
        hiding a trend)."""
        if smooth:
            self.rate = rate if self.rate is None else (1 - EMA) * self.rate + EMA * rate
            rate = min(self.rate, rate)
        if rate < bar:
            self.agreed |= agreed
            self.lost()
            return True
        self.won()
        return False

    @property
    def hopeless(self) -> bool:
        """A probe expected to lose verifies nothing: the streak is past its first
        ``VERIFIED_LOSSES`` cycles, the drafter never agreed in it, and the stretches are not yet
        ``MAX_BACKOFF`` long (from then on every probe is verified, so the calibration keeps
        learning and speculation comes back when the text changes)."""
        return (VERIFIED_LOSSES <= self.losses and not self.agreed
                and 2 ** self.losses < MAX_BACKOFF)
