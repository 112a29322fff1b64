"""What a policy chose over a generation, counted from its outcomes, and what the chosen passes
cost at this machine's calibrated costs (bench and server statistics)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .plan import Chain, Continuation, Outcome, Plain, Tree, Unverified

if TYPE_CHECKING:
    from ..cost_model import CostModel


def price(outcome: Outcome, cost: CostModel, pipelined: bool) -> float:
    """Milliseconds of the passes ``outcome`` took at the calibrated costs: a plain step's (as
    pipelined or not), or the drafter's pass and the verify pass (none for an unverified probe)."""
    plan, context = outcome.plan, outcome.context
    if isinstance(plan, Plain):
        return cost.step(context, pipelined) * plan.steps
    ms = cost.draft(outcome.draft_rows, context) if outcome.draft_rows else 0.0
    if not isinstance(plan, Unverified):
        ms += cost.verify(plan.rows + 1, context)
    return ms


@dataclass
class PolicyStats:
    """Counts of what the policy chose (one place: :meth:`count`, from every outcome)."""

    speculative_cycles: int = 0
    tree_cycles: int = 0
    plain_steps: int = 0
    unverified_probes: int = 0  # drafter passes whose block was not worth verifying
    lookup_cycles: int = 0  # chains of text already seen (this sequence's or the index's)
    index_cycles: int = 0  # of those, continuations found in earlier requests (dflash.lookup)
    rows_verified: int = 0  # target rows over all passes (anchor included)
    # The passes chosen, priced by the calibrated cost model (None: no cost model, or a batched
    # sequence, whose passes are shared): what the choices cost on this machine, whatever else
    # runs on it, so policies compare on a busy machine.
    priced_ms: float | None = 0.0

    @property
    def rows_per_pass(self) -> float:
        passes = self.speculative_cycles + self.plain_steps + self.lookup_cycles
        return self.rows_verified / passes if passes else 0.0

    def count(self, outcome: Outcome, cost: CostModel | None, pipelined: bool) -> None:
        """Add one outcome (and its price, where there is a cost model and a price is kept)."""
        if cost is not None and self.priced_ms is not None:
            self.priced_ms += price(outcome, cost, pipelined)
        match outcome.plan:
            case Plain(steps):
                self.plain_steps += steps
                self.rows_verified += steps
            case Unverified():
                self.unverified_probes += 1
            case Continuation() as plan:
                self.lookup_cycles += 1
                self.index_cycles += plan.source == "index"
                self.rows_verified += plan.rows + 1
            case Tree() as plan:
                self.speculative_cycles += 1
                self.tree_cycles += 1
                self.rows_verified += plan.rows + 1
            case Chain(rows):
                self.speculative_cycles += 1
                self.rows_verified += rows + 1
