"""Per-cycle choice of what the target verifies, learnt from what it accepted.

Each cycle the engine asks the policy for a plan (:mod:`dflash.policy.plan`) and reports its
:class:`Outcome` back. The default, ``auto``, decides in this order:

1. Back-off: while speculation is losing, take the rest of a plain stretch: ``Plain(n)``.
2. Continuation first: the context's own continuation (:mod:`dflash.lookup`) when it beats a
   plain step and the drafter's recent blocks: ``Continuation``, no drafter pass.
3. Draft rows: the deepest recent plan plus three (the smallest pass before any, or in a streak).
4. After drafting, the plan with the most expected tokens per ms,
   ``value = E[tokens | calibration] / (draft_ms + verify_ms(rows))`` (:mod:`dflash.cost_model`),
   among the chains ``Chain(k)``, the draft trees ``Tree`` (attention-only targets) and the
   continuation; a hopeless probe verifies nothing (``Unverified``).
5. Observe: calibrate acceptance (:mod:`dflash.policy.calibration`), judge the cycle against a
   plain step, and lose -> plain stretch of 2, 4, ... ``MAX_BACKOFF`` steps, then probe
   (:mod:`dflash.policy.backoff`).

Given a :class:`PairMemory` (:mod:`.memory`), ``auto`` starts from what the pair's earlier
generations taught, decayed toward the prior. ``fixed``, ``confidence`` and ``tree`` verify the
same way every cycle (:mod:`.simple`). Exactness never depends on the policy: it reads the
drafter's distributions and past outcomes, never the tokens drawn this cycle. Measurements behind
the constants: docs/how-it-works.md, "The verify policy".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import GenerationConfigError
from .auto import AutoPolicy
from .backoff import MAX_BACKOFF, MIN_DRAFT_ROWS, Backoff
from .base import Candidates, Policy, check_tree_budget, draft_candidates
from .batch import BatchPolicy, FixedBatchPolicy, batch_width
from .calibration import AcceptanceModel, Calibration, NodeCalibration, expected_tokens
from .memory import PairMemory
from .plan import Chain, Continuation, Outcome, Plain, Plan, Tree, Unverified
from .simple import ConfidencePolicy, FixedPolicy, TreePolicy, confident_rows
from .stats import PolicyStats

if TYPE_CHECKING:
    from ..cost_model import CostModel

_CLASSES: dict[str, type[Policy]] = {
    c.name: c for c in (AutoPolicy, ConfidencePolicy, FixedPolicy, TreePolicy)}
POLICIES = tuple(sorted(_CLASSES))
BATCHED_POLICIES = tuple(name for name in POLICIES if _CLASSES[name].batched)


def check_policy(name: str) -> None:
    if name not in _CLASSES:
        raise GenerationConfigError(f"policy={name!r}: must be one of {', '.join(POLICIES)}")


def policy_class(name: str) -> type[Policy]:
    """The class of the policy called ``name`` (its capabilities, :meth:`Policy.describe`)."""
    check_policy(name)
    return _CLASSES[name]


def check_trees_possible(policy: str, trees: bool) -> None:
    if policy == TreePolicy.name and not trees:
        raise GenerationConfigError(
            "policy='tree': this target has recurrent layers (or caches) that cannot verify "
            "a tree; it verifies chains (policy 'auto', 'fixed' or 'confidence')")


def make_policy(name: str, block_size: int, cost: CostModel | None = None, *,
                min_confidence: float = 0.0, trees: bool = False,
                tree_budget: int | None = None, pipelined: bool = False,
                memory: PairMemory | None = None, lookup: bool = True) -> Policy:
    """The policy called ``name`` for one generation, its settings checked (typed errors naming
    the field). ``trees``: the target can verify trees (attention-only targets); ``memory``:
    what the pair's earlier generations taught (``auto`` only)."""
    cls = policy_class(name)
    if cls.needs_cost and cost is None:
        raise GenerationConfigError(f"policy={name!r} needs a cost model")
    check_trees_possible(name, trees)
    most = check_tree_budget(tree_budget, cost)
    if cls is AutoPolicy:
        return AutoPolicy(block_size, cost, trees=trees, tree_budget=tree_budget, most=most,
                          pipelined=pipelined, memory=memory, lookup=lookup)
    if cls is TreePolicy:
        return TreePolicy(block_size, cost, tree_budget=tree_budget, most=most,
                          pipelined=pipelined)
    if cls is ConfidencePolicy:
        return ConfidencePolicy(block_size, cost, min_confidence=min_confidence,
                                pipelined=pipelined)
    return cls(block_size, cost, pipelined=pipelined)


def make_batch_policy(name: str, cost: CostModel | None) -> BatchPolicy:
    """How a batch of sequences under policy ``name`` speculates (one of
    ``BATCHED_POLICIES``)."""
    if name not in BATCHED_POLICIES:
        raise GenerationConfigError(
            f"policy={name!r}: the batched engine verifies chains with "
            f"{' or '.join(repr(p) for p in BATCHED_POLICIES)}")
    return FixedBatchPolicy(cost) if name == FixedPolicy.name else BatchPolicy(cost)


__all__ = [
    "POLICIES", "BATCHED_POLICIES", "MAX_BACKOFF", "MIN_DRAFT_ROWS", "AcceptanceModel",
    "AutoPolicy", "Backoff", "BatchPolicy", "Calibration", "Candidates", "Chain",
    "ConfidencePolicy", "Continuation", "FixedBatchPolicy", "FixedPolicy", "NodeCalibration",
    "Outcome", "PairMemory", "Plain", "Plan", "Policy", "PolicyStats", "Tree", "TreePolicy", "Unverified",
    "batch_width", "check_policy", "check_tree_budget", "check_trees_possible",
    "confident_rows", "draft_candidates", "expected_tokens", "make_batch_policy", "make_policy",
    "policy_class",
]
