"""How many drafted tokens to verify each cycle, or whether to speculate at all.

A chain of 16 spends most of its verify rows on a tail that is never accepted: for the built-in
drafter on held-out math the chain's τ is ~2.1 whether 4, 8 or 16 rows are verified, while on this
CPU 16 rows cost ~1.7 one-token steps. On chat prompts the fixed policy was slower than plain
decoding (0.82×). The ``auto`` policy picks, per cycle, the verify length that maximises expected
committed tokens per second under the measured cost model (:mod:`dflash.cost_model`):

* **Acceptance, calibrated online.** The drafter's top probability at each block row is mapped to
  the probability that the row is accepted (given the rows before it were), per row and per
  confidence bin, from what this generation has seen so far (a Beta prior centred on the raw
  confidence until data arrive). Expected committed tokens for ``k`` verified rows:
  ``E(k) = 1 + sum_{j<=k} prod_{i<=j} p_i``.
* **Chain or tree.** A chain of ``k`` rows is worth ``E(k) / (draft + verify(k + 1))``; a draft tree
  of ``B`` nodes (:mod:`dflash.tree`, attention-only targets) is worth ``(1 + sum of its nodes'
  calibrated path probabilities) / (draft + verify(B + 1))``; the best of all is verified.
* **Draft only what is verified.** The drafter's block pass covers the deepest row the last few
  plans used plus two (at least 4, at most the block; the first cycle drafts 4): on the CPU a
  16-row draft pass costs ~3x a 4-row one and most of those rows were never verified.
* **No speculation when it loses.** When the committed tokens per second of recent speculative
  cycles (half the calibrated estimate of the plans chosen, half what they really committed) fall
  below a plain one-token step's by a 10 % margin, the next cycles are plain target steps (no drafter block pass; the drafter's context is
  still fed the new features), for a stretch that doubles while speculation keeps losing; then one
  speculative cycle probes again and decides afresh.
* **A probe pays only for its draft while it keeps losing.** In a losing streak a probe drafts
  ``MIN_DRAFT_ROWS`` rows; when the drafter has not agreed once in the streak and even the best
  plan is expected to commit fewer tokens per ms than a plain step, it verifies nothing: the
  cycle becomes the first plain step of the next stretch. The streak's first
  ``VERIFIED_LOSSES`` cycles, and every probe once the stretches are ``MAX_BACKOFF`` long, are
  verified, so that the calibration keeps learning. A drafter that never agrees (random weights)
  lost ~4 % to mlx-lm in its probes, not in the plain steps: a 16-row draft and a 2-row verify
  for one token each (docs/bench/heldout-auto-v2.md, section 4).

* **The context's own continuation.** What followed the last earlier occurrence of the latest
  3- or 2-gram (:mod:`dflash.lookup`) is a chain that costs no drafter pass; its rows'
  acceptance is calibrated online like the drafter's. Before drafting it is verified instead when
  it beats a plain step and the drafter's recent plans (in a plain stretch: a plain step); after
  drafting, when it beats the drafted block.
* **What earlier generations taught.** A loaded pair keeps its calibration between generations,
  and on disk for the next process (:mod:`dflash.pair_memory`, capped so new text still moves it):
  a generation starts from what the pair's earlier ones measured, and one that starts behind a
  losing streak probes with ``MIN_DRAFT_ROWS`` rows and does not verify what is expected to lose.
  Without it every generation relearned its drafter: a never-agreeing drafter verified its first
  two cycles and probed six times in each 96-token generation.

Exactness: the cut depends only on the drafter's distributions and on past cycles, never on the
tokens drawn in this cycle, so greedy output is the target's and rejection sampling stays exact.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .errors import GenerationConfigError
from .tree import DraftTree, build_tree, node_kinds, spine_length

if TYPE_CHECKING:  # types only: the CLI reads POLICIES without loading MLX
    import mlx.core as mx

    from .cost_model import CostModel
    from .pair_memory import PairMemory

POLICIES = ("auto", "confidence", "fixed", "tree")
BINS = 10
PRIOR = 0.5  # pseudo-observations of the raw confidence per bin (a drafter can be confidently wrong)
ROW_PRIOR = 4.0  # pseudo-observations of the bin's all-rows estimate per row
EMA = 0.5  # weight of the newest cycle in the running speculative rate
MAX_BACKOFF = 64
MIN_DRAFT_ROWS = 4  # rows of the smallest drafter block pass (anchor included), a probe's
VERIFIED_LOSSES = 2  # losing cycles verified before a probe expected to lose verifies nothing
# Speculation must beat a plain step by this factor: the cost model times the passes, not the
# host work around them (candidates, planning, bookkeeping), and its estimates are noisy.
MARGIN = 1.1
# Prior acceptance of a context continuation's rows by the order of the n-gram it matched
# (:mod:`dflash.lookup`), until the policy has seen some verified. Measured at every position of
# the built-in target's greedy answers to the held-out mix: a 3-gram continuation's first token
# was right 0.76 of the time on GSM8K, 0.66 on chat, 0.84 on HumanEval; a 2-gram's 0.60, 0.59,
# 0.47 (a 3-gram matched at 40-50 % of positions on GSM8K and HumanEval, 11 % on chat).
LOOKUP_PRIOR = {3: 0.7, 2: 0.5}


def lookup_prior(order: int) -> float:
    return LOOKUP_PRIOR.get(order, min(LOOKUP_PRIOR.values()))

TREE_BUDGETS = (2, 3, 4, 6, 8, 12, 16, 24, 32)
DEFAULT_TREE_BUDGET = 16


def check_policy(name: str) -> None:
    if name not in POLICIES:
        raise GenerationConfigError(f"policy={name!r}: must be one of {', '.join(POLICIES)}")


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


def check_trees_possible(policy: str, trees: bool) -> None:
    if policy == "tree" and not trees:
        raise GenerationConfigError(
            "policy='tree': this target has recurrent layers (or caches) that cannot verify "
            "a tree; it verifies chains (policy 'auto', 'fixed' or 'confidence')")


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


def confident_rows(log_conf, threshold: float) -> int:
    """Rows up to the first where the running product of top probabilities drops below
    ``threshold`` (at least one): the ``confidence`` policy."""
    limit = np.log(threshold) if threshold > 0 else -np.inf
    running = np.cumsum(log_conf)
    below = np.nonzero(running < limit)[0]
    return max(1, int(below[0]) if len(below) else len(running))


@dataclass
class AcceptanceModel:
    """P(row i accepted | rows before accepted, drafter confidence), per row and confidence bin.

    Each row's estimate shrinks towards its bin's estimate over all rows (``ROW_PRIOR``
    pseudo-observations), which shrinks towards the raw confidence (``PRIOR``): rows that are
    rarely reached (deep ones, behind a weak first row) borrow what the first rows taught."""

    rows: int
    accepted: np.ndarray = field(init=False)
    tried: np.ndarray = field(init=False)

    def __post_init__(self):
        self.accepted = np.zeros((self.rows, BINS))
        self.tried = np.zeros((self.rows, BINS))

    @staticmethod
    def _bins(conf: np.ndarray) -> np.ndarray:
        return np.minimum((conf * BINS).astype(int), BINS - 1)

    def predict(self, conf: np.ndarray) -> np.ndarray:
        rows = np.arange(len(conf))
        b = self._bins(conf)
        pooled = (self.accepted.sum(0)[b] + PRIOR * conf) / (self.tried.sum(0)[b] + PRIOR)
        return (self.accepted[rows, b] + ROW_PRIOR * pooled) / (self.tried[rows, b] + ROW_PRIOR)

    def update(self, conf: np.ndarray, verified: int, accepted: int) -> None:
        """Rows ``0..accepted-1`` were accepted; row ``accepted`` (if verified) was rejected."""
        b = self._bins(conf)
        for i in range(min(verified, accepted + 1)):
            self.tried[i, b[i]] += 1
            self.accepted[i, b[i]] += i < accepted

    def cap(self, most: float) -> None:
        """Scale every cell down to at most ``most`` observations (older ones weigh less)."""
        scale = np.minimum(1.0, most / np.maximum(self.tried, 1e-9))
        self.accepted *= scale
        self.tried *= scale

    def copy_into(self, other: AcceptanceModel) -> None:
        """``other``'s counts become these (the rows both have)."""
        n = min(self.rows, other.rows)
        other.accepted[:n], other.tried[:n] = self.accepted[:n], self.tried[:n]


def expected_tokens(p: np.ndarray) -> np.ndarray:
    """``E[k]`` for ``k = 0..len(p)``: committed tokens when the first ``k`` rows are verified."""
    return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(p))])


class NodeCalibration:
    """Accepted share of what the drafter's probability predicted, for off-spine nodes.

    Priors: a runner-up is as likely as the drafter says; a node below one is right ~30 % as often
    (measured on a 27B DFlash2 pair: 22 % after an accepted sibling vs 65-84 % on the spine)."""

    PRIORS = {"sibling": (1.0, 1.0), "branch": (0.3, 1.0)}

    def __init__(self):
        self.hits = {k: h for k, (h, _) in self.PRIORS.items()}
        self.mass = {k: m for k, (_, m) in self.PRIORS.items()}

    def factor(self, kind: str) -> float:
        return self.hits[kind] / self.mass[kind]

    def cap(self, most: float) -> None:
        """At most ``most`` units of predicted mass per kind (older nodes weigh less)."""
        for kind, mass in self.mass.items():
            if mass > most:
                self.hits[kind] *= most / mass
                self.mass[kind] = most

    def update(self, tree: DraftTree, path: list[int]) -> None:
        """Nodes whose parent was accepted were tested; each was accepted iff it is on ``path``."""
        kinds = node_kinds(tree)
        reached = {0, *path}
        for i in range(1, len(tree)):
            if tree.parents[i] in reached and kinds[i] != "spine":
                self.mass[kinds[i]] += float(np.exp(tree.scores[i] - tree.scores[tree.parents[i]]))
                self.hits[kinds[i]] += i in reached


def tree_node_probs(tree: DraftTree, spine: np.ndarray, calibration: NodeCalibration) -> np.ndarray:
    """Calibrated probability that each node (pop order, root excluded) is accepted: the product
    over its path of each step's chance: ``spine[d]`` on the spine, the drafter's probability
    times the kind's calibration factor off it."""
    kinds = node_kinds(tree)
    p = np.ones(len(tree))
    for i in range(1, len(tree)):
        if kinds[i] == "spine":
            step = spine[tree.depths[i] - 1]
        else:
            q = float(np.exp(tree.scores[i] - tree.scores[tree.parents[i]]))
            step = min(1.0, q * calibration.factor(kinds[i]))
        p[i] = p[tree.parents[i]] * step
    return p[1:]


@dataclass
class Plan:
    """What to verify this cycle: the first ``rows`` proposals of the chain, or a tree."""

    rows: int
    tree: DraftTree | None = None
    plain: bool = False  # verify nothing: a plain target step is expected to commit more per ms
    lookup: list[int] | None = None  # the context's continuation (:mod:`dflash.lookup`) instead
    order: int = 0  # of the n-gram the continuation matched
    drafter_value: float | None = None  # a drafted block's best plan when the lookup won over it


@dataclass
class PolicyStats:
    """What the policy chose over a generation (for bench and server statistics)."""

    speculative_cycles: int = 0
    tree_cycles: int = 0
    plain_steps: int = 0
    unverified_probes: int = 0  # drafter passes whose block was not worth verifying
    lookup_cycles: int = 0  # chains of the context's own continuation
    rows_verified: int = 0  # target rows over all passes (anchor included)
    # The passes chosen, priced by the calibrated cost model (None: no cost model, or a batched
    # sequence, whose passes are shared): what the choices cost on this machine, whatever else
    # runs on it, so policies compare on a busy machine.
    priced_ms: float | None = 0.0

    @property
    def rows_per_pass(self) -> float:
        passes = self.speculative_cycles + self.plain_steps + self.lookup_cycles
        return self.rows_verified / passes if passes else 0.0


class VerifyPolicy:
    """Per-cycle choices for one generation: speculate or not, a chain of how many rows, or a tree.

    ``trees``: whether the target can verify trees (attention-only targets).
    """

    def __init__(self, name: str, block_size: int, cost: CostModel | None = None,
                 min_confidence: float = 0.0, trees: bool = False,
                 tree_budget: int | None = None, pipelined: bool = False,
                 memory: PairMemory | None = None, lookup: bool = True):
        check_policy(name)
        if name in ("auto", "tree") and cost is None:
            raise GenerationConfigError(f"policy={name!r} needs a cost model")
        check_trees_possible(name, trees)
        most = check_tree_budget(tree_budget, cost)
        self.name, self.cost, self.min_confidence = name, cost, float(min_confidence)
        self.pipelined = pipelined  # plain steps queue on the previous lazy token (greedy)
        self.tree_budget = tree_budget or min(DEFAULT_TREE_BUDGET, most)
        # Under auto, a given tree_budget caps the trees considered.
        cap = min(most, tree_budget or most)
        self.budgets = [b for b in TREE_BUDGETS if b <= cap] if trees and name == "auto" else []
        self.acceptance = AcceptanceModel(max(1, block_size - 1))
        self.lookup = lookup and name == "auto"
        self.lookup_acceptance = AcceptanceModel(max(1, block_size - 1))
        self.looked: tuple[list[int], int] | None = None  # this cycle's continuation, if any
        self.draft_rate: float | None = None  # expected tokens per ms of recent drafted blocks
        self._chain_cache: tuple[int, np.ndarray] | None = None
        self.nodes = NodeCalibration()
        self.context = 0
        self.rate: float | None = None  # expected committed tokens per ms of recent cycles
        self.expected: float | None = None  # of the plan chosen this cycle
        self.depths: deque[int] = deque(maxlen=8)  # deepest row of recent plans
        self.backoff = 0  # plain steps still to take
        self.losses = 0  # consecutive losing probes
        self.agreed = False  # a verified cycle of this losing streak accepted a proposal
        self.stats = PolicyStats(priced_ms=None if cost is None else 0.0)
        self.memory = memory if name == "auto" else None
        if self.memory is not None:
            self.memory.seed(self)

    @property
    def candidates(self) -> int:
        """How many candidates per block row :meth:`plan` wants (1 without trees)."""
        if self.name == "tree":
            return self.tree_budget
        return max(self.budgets, default=1)

    # -- before drafting ----------------------------------------------------------------------

    def draft_rows(self, block: int) -> int:
        """Rows of the drafter's block pass (anchor included)."""
        if self.name != "auto":
            return block
        # The first cycle knows nothing of this drafter (its plan trusts the raw confidence, and
        # a random drafter's is ~0.97: it verified a 17-node tree), and a probe in a losing
        # streak most likely verifies nothing: the smallest pass.
        if self.losses or not self.depths:
            return min(block, MIN_DRAFT_ROWS)
        return max(2, min(block, max(MIN_DRAFT_ROWS, max(self.depths) + 3)))

    def plain_stretch(self, context: int, most: int = MAX_BACKOFF) -> int:
        """Plain one-token target steps to take now, before the next speculative cycle (0:
        speculate this cycle); at most ``most``, the rest of the stretch is taken next time."""
        self.context = context
        if self.name != "auto":
            return 0
        steps = min(self.backoff, max(0, most))
        self.backoff -= steps
        return steps

    def lookup_plan(self, tokens: list[int], order: int, drafting: bool) -> Plan | None:
        """A chain of the context's continuation ``tokens`` (matched on an ``order``-gram),
        verified without drafting, if it is expected to commit more per ms than a plain step
        and, when the drafter would draft this cycle (``drafting``), than its recent blocks;
        ``None``: not now (:meth:`plan` still weighs it against the drafted block)."""
        self.looked = (tokens, order) if self.lookup and tokens else None
        if self.looked is None:
            return None
        value = self._lookup_values(tokens, order, 0.0)
        k = int(np.argmax(value)) + 1
        if value[k - 1] * self._plain_ms() < MARGIN:
            return None
        # A drafter in a losing streak would only probe: the continuation goes first. One not
        # yet seen drafts, unless not even a block accepted whole could beat the continuation.
        drafter = self.draft_rate if self.draft_rate is not None else self._best_drafted_rate()
        if drafting and not self.losses and value[k - 1] < drafter:
            return None
        self.expected = float(value[k - 1])
        return Plan(k, lookup=tokens[:k], order=order)

    def _best_drafted_rate(self) -> float:
        """Tokens per ms of a drafted block whose every row is accepted: what no drafter beats."""
        rows = np.arange(1, self.acceptance.rows + 1)
        return float(max((k + 1) / (self.cost.draft(k + 1) + ms)
                         for k, ms in zip(rows, self._chain_ms())))

    def _lookup_values(self, tokens: list[int], order: int, draft_ms: float) -> np.ndarray:
        """Expected committed tokens per ms of verifying the first ``k`` continuation tokens."""
        p = self.lookup_expectation(tokens, order)
        return expected_tokens(p)[1:] / (draft_ms + self._chain_ms()[:len(p)])

    def _chain_ms(self) -> np.ndarray:
        """``verify(k + 1)`` for ``k = 1 .. rows`` at this context (kept per 64 tokens of it:
        a plain stretch asks every step)."""
        bucket = self.context // 64
        if self._chain_cache is None or self._chain_cache[0] != bucket:
            rows = self.lookup_acceptance.rows
            self._chain_cache = (bucket, np.array(
                [self.cost.verify(k + 1, self.context) for k in range(1, rows + 1)]))
        return self._chain_cache[1]

    def lookup_expectation(self, tokens: list[int], order: int) -> np.ndarray | None:
        """Calibrated acceptance of each row of the continuation ``tokens`` (``None``: no
        continuation, or this policy does not look up): what a batched pass weighs."""
        if not (self.lookup and tokens):
            return None
        n = min(len(tokens), self.lookup_acceptance.rows)
        return self.lookup_acceptance.predict(np.full(n, lookup_prior(order)))

    def lookup_worth(self, tokens: list[int], order: int) -> bool:
        """Whether the continuation ``tokens`` beats a plain step (ends a plain stretch)."""
        return bool(tokens) and \
            self._lookup_values(tokens, order, 0.0).max() * self._plain_ms() >= MARGIN

    def give_back(self, steps: int) -> None:
        """Plain steps of the stretch not taken (a continuation was verified instead): taken
        after it."""
        self.backoff += max(0, steps)

    # -- after drafting -----------------------------------------------------------------------

    def plan(self, log_probs: np.ndarray, ids: np.ndarray, anchor: int, draft_rows: int) -> Plan:
        """What to verify, from each row's candidates ``(L, K)`` sorted best first."""
        rows = len(log_probs)
        if self.name == "fixed":
            return Plan(rows)
        if self.name == "confidence":
            return Plan(confident_rows(log_probs[:, 0], self.min_confidence))
        if self.name == "tree":
            return Plan(0, build_tree(log_probs, ids, self.tree_budget, anchor))
        conf = np.exp(log_probs[:, 0].astype(np.float64))
        p = self.acceptance.predict(conf)
        draft_ms = self.cost.draft(draft_rows)
        chain = expected_tokens(p)[1:] / np.array(
            [draft_ms + self.cost.verify(k + 1, self.context) for k in range(1, rows + 1)])
        best = Plan(int(np.argmax(chain)) + 1)
        self.expected = float(chain.max())
        if self.budgets and log_probs.shape[1] >= 2:
            tree = build_tree(log_probs, ids, max(self.budgets), anchor)
            gain = 1.0 + np.cumsum(tree_node_probs(tree, p, self.nodes))
            budgets = [b for b in self.budgets if b < len(tree)]
            value = [gain[b - 1] / (draft_ms + self.cost.verify(b + 1, self.context))
                     for b in budgets]
            if value and max(value) > chain.max():
                b = budgets[int(np.argmax(value))]
                if not tree.prefix(b).is_chain():
                    self.expected = float(max(value))
                    best = Plan(0, tree.prefix(b))
        # A drafter that has not agreed once in a losing streak: a block whose best plan loses
        # to a plain step is not verified, its verify rows would most likely only confirm the
        # loss (the drafter pass is spent either way). The streak's first two cycles are verified
        # (one unlucky cycle is no evidence), and once the stretches are MAX_BACKOFF long every
        # probe is verified again, so that the calibration keeps learning and speculation comes
        # back when the text changes.
        self.draft_rate = self.expected if self.draft_rate is None else \
            (1 - EMA) * self.draft_rate + EMA * self.expected
        if self.looked is not None:  # the drafter pass is spent either way
            value = self._lookup_values(*self.looked, draft_ms)
            k = int(np.argmax(value)) + 1
            if value[k - 1] > self.expected and value[k - 1] * self._plain_ms() >= MARGIN:
                drafter_value, self.expected = self.expected, float(value[k - 1])
                return Plan(k, lookup=self.looked[0][:k], order=self.looked[1],
                            drafter_value=drafter_value)
        if (VERIFIED_LOSSES <= self.losses and not self.agreed
                and 2 ** self.losses < MAX_BACKOFF
                and self.expected * self._plain_ms() < 1.0):
            return Plan(0, plain=True)
        return best

    # -- after verifying ----------------------------------------------------------------------

    def record(self, log_conf: np.ndarray | None, plan: Plan | None, accepted: int,
               path: list[int] | None, draft_rows: int) -> None:
        """Learn from a cycle (``plan is None``: a plain step): ``accepted`` tokens were kept;
        for a tree, along ``path`` (node indices). A ``plain`` plan (nothing verified) counts
        as a losing probe; the plain steps taken instead are recorded one by one."""
        self._price(plan, draft_rows)
        if plan is None:
            self.stats.plain_steps += 1
            self.stats.rows_verified += 1
            return
        if plan.plain:
            self.stats.unverified_probes += 1
            self._lost()
            return
        if plan.lookup is not None:
            self._record_lookup(plan, accepted)
            return
        self.stats.speculative_cycles += 1
        if plan.tree is None and not plan.rows:
            # A cycle with nothing proposed (the last token of a generation): nothing about the
            # drafter to learn, and not a lost bet on it.
            self.stats.rows_verified += 1
            return
        if plan.tree is not None:
            self.stats.tree_cycles += 1
            verified = len(plan.tree) - 1
            spine, spine_accepted = spine_length(plan.tree), spine_length(plan.tree, path)
            self.depths.append(max(plan.tree.depths))
            self.nodes.update(plan.tree, path)
        else:
            verified = plan.rows
            spine, spine_accepted = plan.rows, accepted
            self.depths.append(plan.rows)
        self.stats.rows_verified += verified + 1
        conf = None
        if log_conf is not None and len(log_conf):
            conf = np.exp(np.asarray(log_conf, dtype=np.float64))
            self.acceptance.update(conf, spine, spine_accepted)
        if self.memory is not None:
            self.memory.observe(conf, spine, spine_accepted, plan.tree, path, self.depths[-1])
        if self.name != "auto" or self.expected is None:
            return
        # Half the calibrated expectation, half what this cycle really committed: the calibration
        # starts from the drafter's own confidence, and a confidently wrong drafter (measured: a
        # random one probed 30 times in 96 tokens, 0.77x) must lose its probes at once.
        cycle_ms = self.cost.draft(draft_rows) + self.cost.verify(verified + 1, self.context)
        rate = 0.5 * (self.expected + (accepted + 1) / cycle_ms)
        self.rate = rate if self.rate is None else (1 - EMA) * self.rate + EMA * rate
        # A losing cycle counts at once; the average keeps one lucky cycle from hiding a trend.
        if min(self.rate, rate) < MARGIN / self._plain_ms():
            self.agreed |= accepted > 0
            self._lost()
        else:
            self.losses, self.agreed = 0, False
            if self.memory is not None:
                self.memory.streak(0, self.draft_rate)

    def _record_lookup(self, plan: Plan, accepted: int) -> None:
        """A verified continuation teaches its own calibration; a drafted block it won over is
        judged by what it was expected to commit (the drafter's streak goes on or ends)."""
        self.stats.lookup_cycles += 1
        self.stats.rows_verified += plan.rows + 1
        conf = np.full(plan.rows, lookup_prior(plan.order))
        self.lookup_acceptance.update(conf, plan.rows, accepted)
        if self.memory is not None:
            self.memory.observe_lookup(conf, plan.rows, accepted)
        if plan.drafter_value is None:
            return
        if plan.drafter_value * self._plain_ms() < MARGIN:
            self._lost()
        else:
            self.losses, self.agreed = 0, False
            if self.memory is not None:
                self.memory.streak(0, self.draft_rate)

    def _price(self, plan: Plan | None, draft_rows: int) -> None:
        """Add this cycle's passes at the calibrated costs to ``stats.priced_ms``."""
        if self.cost is None or self.stats.priced_ms is None:
            return
        if plan is None:
            self.stats.priced_ms += self._plain_ms()
            return
        ms = self.cost.draft(draft_rows) if draft_rows else 0.0
        if not plan.plain:
            rows = len(plan.tree) if plan.tree is not None else plan.rows + 1
            ms += self.cost.verify(rows, self.context)
        self.stats.priced_ms += ms

    def _plain_ms(self) -> float:
        """What the plain step that speculation competes with costs: pipelined under greedy
        decoding, where the host builds the next pass while this one runs."""
        return self.cost.step(self.context, self.pipelined)

    def _lost(self) -> None:
        """Speculation lost this cycle: a plain stretch twice as long as the last one."""
        self.losses += 1
        self.backoff = min(MAX_BACKOFF, 2 ** self.losses)
        self.rate = None  # the probe after the plain stretch decides afresh
        if self.memory is not None:
            self.memory.streak(self.losses, self.draft_rate)


# ---------------------------------------------------------------------------------------------
# Batches (dflash.batch)


def batch_width(acceptance: list[np.ndarray], cost: CostModel, context: int,
                draft_ms: float) -> tuple[int, float]:
    """The verify width ``n`` (anchor included; 1: a plain step, no proposals) of one batched
    target pass over ``len(acceptance)`` sequences, and its expected committed tokens per ms.

    The pass is a ``(B, n)`` block, so it costs ``B * n`` rows whichever sequence fills them:
    every sequence verifies up to ``n - 1`` proposals, and ``acceptance[b]`` (sequence ``b``'s
    calibrated per-row acceptance, :class:`AcceptanceModel`) says what that is worth. ``draft_ms``
    (what drafting costs or cost) is charged to speculative widths only. Speculation must beat a
    plain batched step by ``MARGIN``; as the batch grows, ``verify(B * n)`` grows with it and the
    plain step wins by itself.
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
