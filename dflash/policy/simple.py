"""The policies that verify the same way every cycle: ``fixed``, ``confidence`` and ``tree``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..tree import build_tree
from .base import DEFAULT_TREE_BUDGET, Candidates, Policy
from .plan import Chain, Plan, Tree

if TYPE_CHECKING:
    from ..cost_model import CostModel


def confident_rows(log_conf, threshold: float) -> int:
    """Rows up to the first where the running product of top probabilities drops below
    ``threshold`` (at least one): the ``confidence`` policy."""
    limit = np.log(threshold) if threshold > 0 else -np.inf
    running = np.cumsum(log_conf)
    below = np.nonzero(running < limit)[0]
    return max(1, int(below[0]) if len(below) else len(running))


class FixedPolicy(Policy):
    """Verify the whole drafted block."""

    name = "fixed"
    reads_candidates = False
    batched = True

    def after_draft(self, candidates: Candidates | None, anchor: int, draft_rows: int) -> Plan:
        return Chain(draft_rows - 1)

    @classmethod
    def describe(cls, cfg: dict) -> str:
        return "fixed (the whole block)"


class ConfidencePolicy(Policy):
    """Verify up to the first row where the drafter's running confidence drops below
    ``min_confidence``."""

    name = "confidence"

    def __init__(self, block_size: int, cost: CostModel | None = None, *,
                 min_confidence: float = 0.0, pipelined: bool = False):
        super().__init__(block_size, cost, pipelined=pipelined)
        self.min_confidence = float(min_confidence)

    def after_draft(self, candidates: Candidates | None, anchor: int, draft_rows: int) -> Plan:
        return Chain(confident_rows(candidates[0][:, 0], self.min_confidence))

    @classmethod
    def describe(cls, cfg: dict) -> str:
        return (f"confidence (drafted tokens checked while the drafter's running confidence is "
                f"at least {cfg.get('min_confidence') or 0.0})")


class TreePolicy(Policy):
    """Verify a best-first draft tree of ``tree_budget`` nodes every cycle."""

    name = "tree"
    needs_cost = True

    def __init__(self, block_size: int, cost: CostModel | None = None, *,
                 tree_budget: int | None = None, most: int = DEFAULT_TREE_BUDGET,
                 pipelined: bool = False):
        super().__init__(block_size, cost, pipelined=pipelined)
        self.tree_budget = tree_budget or min(DEFAULT_TREE_BUDGET, most)

    @property
    def candidates(self) -> int:
        return self.tree_budget

    def after_draft(self, candidates: Candidates | None, anchor: int, draft_rows: int) -> Plan:
        return Tree(build_tree(*candidates, self.tree_budget, anchor))

    @classmethod
    def describe(cls, cfg: dict) -> str:
        budget = cfg.get("tree_budget")
        return f"tree (best-first draft trees of {budget or 'the default'} nodes)"
