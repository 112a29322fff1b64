"""What the drafter's (and the context's) proposals are worth: acceptance calibrated online.

The drafter's top probability at a block row is not the chance that the target accepts the row; a
drafter can be confidently wrong. So each proposal source keeps counts of what was verified and
what was accepted, per row and per confidence bin, and predicts from them (a Beta prior centred on
the raw confidence until data arrive). Off-spine tree nodes keep their own correction.

Pure numpy: the policy's arithmetic, testable without a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..tree import DraftTree, node_kinds, spine_length
from .plan import Chain, Continuation, Outcome, Tree

BINS = 10
PRIOR = 0.5  # pseudo-observations of the raw confidence per bin (a drafter can be confidently wrong)
ROW_PRIOR = 4.0  # pseudo-observations of the bin's all-rows estimate per row
# A continuation's rows are calibrated per class of match (:mod:`dflash.lookup`): the class is
# how far back its context matched, one class up where three or more earlier occurrences agree.
# Each class has its own confidence bin, and its prior acceptance until some rows are verified
# (2- and 3-gram priors measured: docs/how-it-works.md, "Verify policy"; the longer classes'
# priors are what verification quickly replaces).
MATCH_CLASSES = ((16, 0.95), (8, 0.85), (4, 0.75), (3, 0.65), (0, 0.5))  # (shortest match, prior)
AGREEING = 3  # earlier occurrences agreeing on the first token that earn one class up


def lookup_prior(match: int, count: int = 1) -> float:
    """The prior acceptance of a continuation's rows whose context matched ``match`` tokens,
    ``count`` earlier occurrences agreeing (also its confidence bin in the calibration)."""
    classes = [i for i, (shortest, _) in enumerate(MATCH_CLASSES) if match >= shortest]
    i = classes[0] if classes else len(MATCH_CLASSES) - 1
    if count >= AGREEING:
        i = max(0, i - 1)
    return MATCH_CLASSES[i][1]


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
        """Each row's calibrated acceptance, from the drafter's top probability ``conf``."""
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

    def grown(self, rows: int) -> AcceptanceModel:
        """This model, or a copy with at least ``rows`` rows (a longer block than before)."""
        if rows <= self.rows:
            return self
        grown = AcceptanceModel(rows)
        self.copy_into(grown)
        return grown

    def decay(self, most: float) -> None:
        """Scale each confidence bin's counts (all rows together) down to at most ``most``
        observations: toward the prior, each row keeping its share."""
        scale = np.minimum(1.0, most / np.maximum(self.tried.sum(0), 1e-9))
        self.accepted *= scale
        self.tried *= scale

    def copy(self) -> AcceptanceModel:
        out = AcceptanceModel(self.rows)
        self.copy_into(out)
        return out


def expected_tokens(p: np.ndarray) -> np.ndarray:
    """``E[k]`` for ``k = 0..len(p)``: committed tokens when the first ``k`` rows are verified,
    ``E(k) = 1 + sum_{j<=k} prod_{i<=j} p_i``."""
    return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(p))])


class NodeCalibration:
    """Accepted share of what the drafter's probability predicted, for off-spine tree nodes.

    Priors: a runner-up is as likely as the drafter says; a node below one is right less often
    (measured: docs/how-it-works.md, "Verify policy")."""

    PRIORS = {"sibling": (1.0, 1.0), "branch": (0.3, 1.0)}

    def __init__(self, priors: dict[str, tuple[float, float]] | None = None):
        self.priors = priors or self.PRIORS
        self.hits = {k: h for k, (h, _) in self.priors.items()}
        self.mass = {k: m for k, (_, m) in self.priors.items()}

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

    def copy(self) -> NodeCalibration:
        out = NodeCalibration(self.priors)
        out.hits, out.mass = dict(self.hits), dict(self.mass)
        return out


# Competing continuations (:func:`dflash.tree.continuation_tree`): a rival's first node is priced
# as its own chain's acceptance times what the continuations before it leave, the nodes below it
# as its chain's rows; both taken at face value until verified nodes say otherwise.
RIVAL_PRIORS = {"sibling": (1.0, 1.0), "branch": (1.0, 1.0)}


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
class Calibration:
    """Everything a generation learns about its proposal sources: the drafter's chain rows, the
    context continuations' rows (kept apart: a source the text favours is judged on its own
    record, not the drafter's) and the off-spine tree nodes."""

    drafter: AcceptanceModel
    continuation: AcceptanceModel
    nodes: NodeCalibration = field(default_factory=NodeCalibration)
    # Off-spine nodes of continuation trees (rival continuations), kept apart from the drafter's
    rivals: NodeCalibration = field(default_factory=lambda: NodeCalibration(RIVAL_PRIORS))

    @classmethod
    def fresh(cls, rows: int, continuation_rows: int | None = None) -> Calibration:
        return cls(AcceptanceModel(rows), AcceptanceModel(max(rows, continuation_rows or rows)))

    def copy(self) -> Calibration:
        return Calibration(self.drafter.copy(), self.continuation.copy(), self.nodes.copy(),
                           self.rivals.copy())

    def copy_into(self, other: Calibration) -> None:
        """``other``'s counts become these (the rows both have)."""
        self.drafter.copy_into(other.drafter)
        self.continuation.copy_into(other.continuation)
        other.nodes = self.nodes.copy()
        other.rivals = self.rivals.copy()

    def learn(self, outcome: Outcome) -> int | None:
        """Count a verified cycle: a continuation's rows teach the continuation model; a drafted
        chain's or tree's spine the drafter's (where its confidences are known), a tree's
        off-spine nodes the node calibration. The deepest proposal verified (``None``: nothing
        about a proposal source to learn). A continuation tree's first continuation (its
        spine) teaches the continuation model like a chain, its rivals the rivals' calibration."""
        plan = outcome.plan
        if isinstance(plan, Continuation):
            rows, accepted = len(plan.tokens), outcome.accepted
            if plan.tree is not None:
                path = list(outcome.path or ())
                accepted = spine_length(plan.tree, path)
                self.rivals.update(plan.tree, path)
            conf = np.full(rows, lookup_prior(plan.match, plan.count))
            self.continuation = self.continuation.grown(rows)
            self.continuation.update(conf, rows, accepted)
            return None
        if isinstance(plan, Tree):
            path = list(outcome.path or ())
            spine, accepted = spine_length(plan.tree), spine_length(plan.tree, path)
            depth = max(plan.tree.depths)
            self.nodes.update(plan.tree, path)
        elif isinstance(plan, Chain) and plan.rows:
            spine, accepted, depth = plan.rows, outcome.accepted, plan.rows
        else:  # a plain step, an unverified probe or nothing proposed
            return None
        if outcome.log_conf is not None and len(outcome.log_conf):
            conf = np.exp(np.asarray(outcome.log_conf, dtype=np.float64))
            self.drafter = self.drafter.grown(len(conf))
            self.drafter.update(conf, spine, accepted)
        return depth

    def cap(self, most: float) -> None:
        """At most ``most`` observations per cell (older ones weigh less)."""
        self.drafter.cap(most)
        self.continuation.cap(most)
        self.nodes.cap(most)
        self.rivals.cap(most)

    def decay(self, most: float) -> None:
        """At most ``most`` observations per confidence bin of each model, and ``most`` units of
        predicted mass per node kind: what a new generation inherits."""
        self.drafter.decay(most)
        self.continuation.decay(most)
        self.nodes.cap(most)
        self.rivals.cap(most)
