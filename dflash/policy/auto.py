"""The default policy: each cycle, the plan with the most expected committed tokens per ms."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from ..lookup import MAX_CHAIN, Match
from ..tree import build_tree, continuation_tree, node_kinds
from .backoff import MARGIN, Backoff, draft_rows, judged_rate
from .base import TREE_BUDGETS, Candidates, Policy
from .calibration import Calibration, expected_tokens, lookup_prior, tree_node_probs
from .plan import Chain, Continuation, Outcome, Plain, Plan, Tree, Unverified

if TYPE_CHECKING:
    from ..cost_model import CostModel
    from .memory import PairMemory

EMA = 0.5  # weight of the newest drafted block in the drafted blocks' running rate


class AutoPolicy(Policy):
    """Maximise expected committed tokens per ms under the cost model (see :mod:`dflash.policy`).

    ``trees``: the target can verify trees (drafted ones, and competing continuations merged into
    one); ``tree_budget`` caps the trees weighed; ``lookup``: the context's own continuations are
    weighed too; ``memory``: what the pair's earlier
    generations taught (:class:`~dflash.policy.memory.PairMemory`), started from and reported to.
    """

    name = "auto"
    needs_cost = True
    batched = True

    def __init__(self, block_size: int, cost: CostModel, *, trees: bool = False,
                 tree_budget: int | None = None, most: int = 0, pipelined: bool = False,
                 memory: PairMemory | None = None, lookup: bool = True):
        super().__init__(block_size, cost, pipelined=pipelined)
        cap = min(most, tree_budget or most)
        self.budgets = [b for b in TREE_BUDGETS if b <= cap] if trees else []
        # Nodes of a tree of competing continuations (as long as a chain of one may be)
        self.rival_nodes = min(tree_budget or MAX_CHAIN, MAX_CHAIN) if trees else 0
        self.calibration = Calibration.fresh(max(1, block_size - 1), MAX_CHAIN)
        self.looks_up = lookup
        self.looked: Match | None = None  # this cycle's continuation, if any
        self.draft_rate: float | None = None  # expected tokens per ms of recent drafted blocks
        self.expected: float | None = None  # tokens per ms expected of this cycle's plan
        self.depths: deque[int] = deque(maxlen=8)  # deepest row of recent plans
        self.backoff = Backoff()
        self._chain_cache: tuple[tuple[int, int], np.ndarray] | None = None
        self.memory = memory
        if memory is not None:
            carried = memory.start()
            carried.calibration.copy_into(self.calibration)
            self.depths.extend(carried.depths)
            self.backoff.losses = carried.losses
            self.draft_rate = carried.draft_rate

    @property
    def candidates(self) -> int:
        return max(self.budgets, default=1)

    def predict(self, conf: np.ndarray) -> np.ndarray:
        """Calibrated acceptance of each drafted row with top probability ``conf``."""
        return self.calibration.drafter.predict(conf)

    # -- before drafting ----------------------------------------------------------------------

    def before_draft(self, context: int, most: int,
                     continuation: Match | None = None) -> Plain | Continuation | None:
        stretch = self.plain_stretch(context, most)
        if self.looks_up and continuation is not None:
            plan = self._continuation_first(continuation, drafting=not stretch)
            if plan is not None:
                self.backoff.give_back(stretch)
                return plan
        return Plain(stretch) if stretch else None

    def plain_stretch(self, context: int, most: int) -> int:
        self.context = context
        return self.backoff.take(most)

    def give_back(self, steps: int) -> None:
        self.backoff.give_back(steps)

    def draft_rows(self, block: int) -> int:
        # Nothing known yet (the raw confidence of a random drafter is high), or a probe in a
        # losing streak (most likely verifies nothing): the smallest pass.
        return draft_rows(block, self.depths, losing=self.backoff.losses > 0)

    def _continuation_first(self, match: Match, drafting: bool) -> Continuation | None:
        """The continuation ``match`` verified without drafting (as many of its tokens as pay
        best: a long match earns a long chain), if it is expected to commit more per ms than a
        plain step and, when the drafter would draft (``drafting``), than its recent blocks;
        ``None``: not now (:meth:`after_draft` still weighs it)."""
        self.looked = match if match else None
        if self.looked is None:
            return None
        value, plan = self._continuation_plan(match, 0.0)
        if value * self._plain_ms() < MARGIN:
            return None
        # A drafter in a losing streak would only probe: the continuation goes first. One not
        # yet seen drafts, unless not even a block accepted whole could beat the continuation.
        drafter = self.draft_rate if self.draft_rate is not None else self._best_drafted_rate()
        if drafting and not self.backoff.losses and value < drafter:
            return None
        self.expected = value
        return plan

    def _continuation_plan(self, match: Match, draft_ms: float,
                           drafter_value: float | None = None) -> tuple[float, Continuation]:
        """The continuation's best plan after a drafter pass of ``draft_ms`` (none: 0) and its
        expected committed tokens per ms: as many of its tokens as pay best, verified as a chain;
        or, where rival continuations compete and the target verifies trees, the best prefix of
        their tree (:func:`~dflash.tree.continuation_tree`) if it is worth more."""
        value = self._lookup_values(match, draft_ms)
        k = int(np.argmax(value)) + 1
        best, plan = float(value[k - 1]), _chain_of(match, k, drafter_value)
        if not (self.rival_nodes and match.alternatives):
            return best, plan
        branches = (match, *match.alternatives)
        spine = self.lookup_expectation(match)
        tree = continuation_tree(-1, [m.tokens for m in branches],
                                 [self.lookup_expectation(m) for m in branches],
                                 self.rival_nodes)
        gain = 1.0 + np.cumsum(tree_node_probs(tree, spine, self.calibration.rivals))
        ms = self._chain_ms()
        n = min(len(gain), len(ms))
        values = gain[:n] / (draft_ms + ms[:n])  # the first b nodes: verify(b + 1)
        b = int(np.argmax(values)) + 1
        if values[b - 1] > best and not tree.prefix(b).is_chain():
            rivals = tree.prefix(b)
            spine_tokens = tuple(t for t, kind in zip(rivals.tokens, node_kinds(rivals))
                                 if kind == "spine")[1:]
            best = float(values[b - 1])
            plan = Continuation(spine_tokens, match.length, match.count, match.source,
                                drafter_value, rivals)
        return best, plan

    def _best_drafted_rate(self) -> float:
        """Tokens per ms of a drafted block whose every row is accepted: what no drafter beats."""
        rows = np.arange(1, self.calibration.drafter.rows + 1)
        return float(max((k + 1) / (self.cost.draft(k + 1, self.context) + ms)
                         for k, ms in zip(rows, self._chain_ms())))

    def _lookup_values(self, match: Match, draft_ms: float) -> np.ndarray:
        """Expected committed tokens per ms of verifying the first ``k`` continuation tokens."""
        p = self.lookup_expectation(match)
        return expected_tokens(p)[1:] / (draft_ms + self._chain_ms()[:len(p)])

    def _chain_ms(self) -> np.ndarray:
        """``verify(k + 1)`` for ``k = 1 .. rows`` at this context (kept per 64 tokens of it and
        per epoch of learnt costs: a plain stretch asks every step)."""
        bucket = (self.context // 64, getattr(self.cost, "epoch", 0))
        if self._chain_cache is None or self._chain_cache[0] != bucket:
            rows = self.calibration.continuation.rows
            self._chain_cache = (bucket, np.array(
                [self.cost.verify(k + 1, self.context) for k in range(1, rows + 1)]))
        return self._chain_cache[1]

    def lookup_expectation(self, match: Match | None) -> np.ndarray | None:
        if not (self.looks_up and match):
            return None
        n = min(len(match.tokens), self.calibration.continuation.rows)
        return self.calibration.continuation.predict(
            np.full(n, lookup_prior(match.length, match.count)))

    def lookup_worth(self, match: Match | None) -> bool:
        return bool(match) and self._lookup_values(match, 0.0).max() * self._plain_ms() >= MARGIN

    # -- after drafting -----------------------------------------------------------------------

    def after_draft(self, candidates: Candidates | None, anchor: int, draft_rows: int) -> Plan:
        log_probs, ids = candidates
        rows = len(log_probs)
        p = self.predict(np.exp(log_probs[:, 0].astype(np.float64)))
        draft_ms = self.cost.draft(draft_rows, self.context)
        chain = expected_tokens(p)[1:] / np.array(
            [draft_ms + self.cost.verify(k + 1, self.context) for k in range(1, rows + 1)])
        best: Plan = Chain(int(np.argmax(chain)) + 1)
        self.expected = float(chain.max())
        if self.budgets and log_probs.shape[1] >= 2:
            tree = build_tree(log_probs, ids, max(self.budgets), anchor)
            gain = 1.0 + np.cumsum(tree_node_probs(tree, p, self.calibration.nodes))
            budgets = [b for b in self.budgets if b < len(tree)]
            value = [gain[b - 1] / (draft_ms + self.cost.verify(b + 1, self.context))
                     for b in budgets]
            if value and max(value) > chain.max():
                b = budgets[int(np.argmax(value))]
                if not tree.prefix(b).is_chain():
                    self.expected = float(max(value))
                    best = Tree(tree.prefix(b))
        self.draft_rate = self.expected if self.draft_rate is None else \
            (1 - EMA) * self.draft_rate + EMA * self.expected
        if self.looked is not None:  # the drafter pass is spent either way
            value, plan = self._continuation_plan(self.looked, draft_ms, self.expected)
            if value > self.expected and value * self._plain_ms() >= MARGIN:
                self.expected = value
                return plan
        # A drafter that has not agreed once in a losing streak: a block whose best plan loses
        # to a plain step is not verified (its verify rows would most likely only confirm the
        # loss; the drafter pass is spent either way).
        if self.backoff.hopeless and self.expected * self._plain_ms() < 1.0:
            return Unverified()
        return best

    # -- after verifying ----------------------------------------------------------------------

    def learn(self, outcome: Outcome) -> None:
        plan, judged = outcome.plan, False
        match plan:
            case Plain() | Chain(0):  # nothing about a proposal source to learn
                return
            case Unverified():  # a losing probe
                self.backoff.lost()
                judged = True
            case Continuation():
                self.calibration.learn(outcome)
                if plan.drafter_value is not None:  # the drafted block it won over is judged
                    judged = True
                    if plan.drafter_value * self._plain_ms() < MARGIN:
                        self.backoff.lost()
                    else:
                        self.backoff.won()
            case Chain() | Tree():
                self.depths.append(self.calibration.learn(outcome))
                if not outcome.shared and self.expected is not None:
                    judged = True
                    cycle_ms = self.cost.draft(outcome.draft_rows, self.context) + \
                        self.cost.verify(plan.rows + 1, self.context)
                    rate = judged_rate(self.expected, (outcome.accepted + 1) / cycle_ms)
                    self.backoff.judge(rate, MARGIN / self._plain_ms(),
                                       agreed=outcome.accepted > 0)
        if self.memory is not None:
            self.memory.observe(outcome, (self.backoff.losses, self.draft_rate) if judged
                                else None)

    def finish(self) -> None:
        if self.memory is not None:
            self.memory.save()

    def _plain_ms(self) -> float:
        """What the plain step that speculation competes with costs: pipelined under greedy
        decoding, where the host builds the next pass while this one runs."""
        return self.cost.step(self.context, self.pipelined)

    @classmethod
    def describe(cls, cfg: dict) -> str:
        lookup = ("; the context's own continuation verified where it pays"
                  if cfg.get("lookup", True) else "; drafter proposals only (--no-lookup)")
        memory = f"; started from pair memory: {cfg['pair_memory']}" \
            if cfg.get("pair_memory") else ""
        return ("auto (rows chosen per cycle from this machine's measured cost model; plain "
                f"steps while speculation loses{lookup}{memory})")


def _chain_of(match: Match, k: int, drafter_value: float | None = None) -> Continuation:
    """The first ``k`` tokens of ``match`` as the plan that verifies them."""
    return Continuation(match.tokens[:k], match.length, match.count, match.source, drafter_value)
