"""The interface every verify policy implements, the checks of a policy's settings, and the
reading of a drafted block's candidates (shared by the engines)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ..errors import GenerationConfigError
from .plan import Continuation, Outcome, Plain, Plan
from .stats import PolicyStats

if TYPE_CHECKING:  # types only: the CLI reads POLICIES without loading MLX
    import mlx.core as mx

    from ..cost_model import CostModel
    from ..lookup import Match

TREE_BUDGETS = (2, 3, 4, 6, 8, 12, 16, 24, 32)
DEFAULT_TREE_BUDGET = 16

# A drafted block's candidates: each row's ``k`` best (log-probabilities, token ids), best first.
Candidates = tuple[np.ndarray, np.ndarray]


class Policy:
    """Per-cycle choices for one generation. The engine asks, in this order: :meth:`before_draft`
    (plain steps, or the context's continuation, without drafting), :meth:`draft_rows` (how big a
    drafter pass), :meth:`after_draft` (what of the drafted block to verify), and reports every
    cycle's :class:`~dflash.policy.plan.Outcome` to :meth:`observe`.

    Capabilities (class attributes, read by the engines instead of the policy's name):
    ``needs_cost`` (plans or prices with the cost model), ``reads_candidates`` (plans from the
    drafter's distributions; otherwise the engine reads them only to propose), ``batched`` (the
    batched engine runs it). Instance attribute ``looks_up``: verifies the context's own
    continuations (:mod:`dflash.lookup`).
    """

    name: ClassVar[str] = ""
    needs_cost: ClassVar[bool] = False
    reads_candidates: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def __init__(self, block_size: int, cost: CostModel | None = None, *, pipelined: bool = False):
        self.block_size, self.cost = block_size, cost
        self.pipelined = pipelined  # plain steps queue on the previous lazy token (greedy)
        self.context = 0  # tokens in the target's cache when the cycle was planned
        self.looks_up = False
        self.stats = PolicyStats(priced_ms=None if cost is None else 0.0)

    @property
    def candidates(self) -> int:
        """How many candidates per block row :meth:`after_draft` wants."""
        return 1

    def before_draft(self, context: int, most: int,
                     continuation: Match | None = None) -> Plain | Continuation | None:
        """Before drafting, at ``context`` tokens: up to ``most`` plain steps, or (some of) the
        ``continuation`` of text already seen, verified without a drafter pass; ``None``: draft."""
        self.context = context
        return None

    def plain_stretch(self, context: int, most: int) -> int:
        """Plain steps to take now (the rest of a stretch after an unverified probe)."""
        self.context = context
        return 0

    def draft_rows(self, block: int) -> int:
        """Rows of the drafter's block pass (anchor included)."""
        return block

    def after_draft(self, candidates: Candidates | None, anchor: int, draft_rows: int) -> Plan:
        """What of the drafted block to verify (``candidates``: ``None`` unless
        ``reads_candidates``)."""
        raise NotImplementedError

    def observe(self, outcome: Outcome) -> None:
        """Learn from a cycle's outcome (counted and priced here)."""
        self.context = outcome.context
        self.stats.count(outcome, self.cost, self.pipelined)
        self.learn(outcome)

    def learn(self, outcome: Outcome) -> None:
        """What a policy takes from an outcome besides the counts (nothing by default)."""

    def give_back(self, steps: int) -> None:
        """Plain steps of a stretch not taken."""

    def lookup_worth(self, match: Match | None) -> bool:
        """Whether the continuation ``match`` ends a plain stretch."""
        return False

    def lookup_expectation(self, match: Match | None) -> np.ndarray | None:
        """Calibrated acceptance of each row of a continuation (``None``: not looked up)."""
        return None

    def finish(self) -> None:
        """The generation ended."""

    @classmethod
    def describe(cls, cfg: dict) -> str:
        """One line for a benchmark report of a run with settings ``cfg``."""
        return cls.name


def check_tree_budget(tree_budget: int | None, cost: CostModel | None) -> int:
    """Raise unless ``tree_budget`` is ``None`` or within the cost model's measured rows (no cost
    model: nothing is in range); the largest budget allowed."""
    most = (max(cost.rows) - 1) if cost is not None else 0
    if tree_budget is not None and cost is None:  # not "from 1 to 0"
        raise GenerationConfigError(
            f"tree_budget={tree_budget!r}: only with policy 'tree' (or 'auto')")
    if tree_budget is not None and not (isinstance(tree_budget, int)
                                        and not isinstance(tree_budget, bool)
                                        and 1 <= tree_budget <= most):
        raise GenerationConfigError(
            f"tree_budget={tree_budget!r}: must be an integer from 1 to {most} (the cost "
            "model's measured range)")
    return most


def draft_candidates(scores: mx.array, ids: mx.array | None,
                     k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each block row's ``k`` best ``(log-probabilities, token ids)``, best first, read on the host
    at once. ``scores`` ``(L, n)``: the drafter's logits over its vocabulary; ``ids``: the token id
    of each column (a cut draft vocabulary, :meth:`head_scores`), ``None`` when the column is the
    token id."""
    import mlx.core as mx

    k = min(k, scores.shape[-1])
    scored = scores.astype(mx.float32)
    idx = mx.argpartition(-scored, kth=k - 1, axis=-1)[:, :k] if k > 1 else \
        mx.argmax(scored, axis=-1, keepdims=True)
    lp = mx.take_along_axis(scored, idx, axis=-1) - mx.logsumexp(scored, axis=-1, keepdims=True)
    tokens = idx if ids is None else ids[idx]
    lp, tokens = np.array(lp), np.array(tokens)
    order = np.argsort(-lp, axis=1, kind="stable")
    return np.take_along_axis(lp, order, axis=1), np.take_along_axis(tokens, order, axis=1)
