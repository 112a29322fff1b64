"""One plan for every rank of a sharded target: rank 0 plans, the other ranks take its plans.

Every pass of a sharded target is a sequence of collectives the ranks must enter with the same
shapes, so every rank must verify the same rows each cycle. ``auto`` and ``tree`` plan with this
machine's learnt pass timings (:mod:`dflash.cost_model`), which differ between ranks, so on a
sharded target rank 0 runs the policy (:class:`PlanLeader`: its own timings, calibration and pair
memory, exactly as on one process) and hands each decision to the other ranks
(:class:`PlanFollower`), which never price anything. A decision travels as one fixed-size int32
array (:data:`WIDTH`, see :func:`encode`) summed over the ranks, the others adding zeros
(:meth:`dflash.ranks.Ranks.ints_from_main`):

* at the start of a cycle, one: its plain stretch, the context's continuation it verifies, or
  "draft ``rows`` rows, read ``k`` candidates per row" (sent where the engine asks for the rows);
* after a drafter pass, one: the chain or tree of the drafted block, the continuation that won
  over it, or "not verified, then ``n`` plain steps" (sent where the engine asks for the stretch:
  the stretch follows from the outcome, which the engine reports first);
* in a plain stretch, one per step at which the context offers a continuation: whether to end the
  stretch and verify it (no continuation: no message, every rank goes on).

Trees and continuations carry everything a rank verifies (tokens, tree parents), not what it
would recompute, so the ranks agree even where their calibrations or memories differ; a chain
names rows of the drafted block, which is the same on every rank (its inputs are), which is also
why "``rows`` rows, ``k`` candidates" suffices before drafting. The engine asks the policy inside
the generation's stream, so each message follows any pass queued there, on every rank alike.
Policies whose plans depend on nothing rank-local (``fixed``, ``confidence``) are not wrapped
(:func:`agreed`).

The batched engine's ``auto`` (:class:`~dflash.policy.batch.BatchPolicy`: whether the batch
drafts, how many rows, the pass's width and which rows verify their context's continuation) prices
with the same timings and is agreed the same way (:func:`agreed_batch`): rank 0 decides, one
message of ``2 + rows`` int32s per decision: before drafting, "draft ``n`` rows" or the width and
continuation rows of a pass without a drafter; after drafting, the width and continuation rows. A
row's continuation comes from its own text and its scope's index, the same on every rank (the
server replays every call into each rank's scopes), so its tokens are not sent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..errors import RankLost, RankMessageError
from ..lookup import MAX_CHAIN
from ..tree import DraftTree
from .base import Candidates, Policy
from .plan import Chain, Continuation, Outcome, Plain, Plan, Tree, Unverified

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..lookup import Match
    from .batch import BatchPolicy

# Message kinds
DRAFT, PLAIN, CHAIN, TREE, CONTINUATION, UNVERIFIED, WORTH, WIDTH_OF_PASS = range(1, 9)
_NAMES = {DRAFT: "draft", PLAIN: "plain", CHAIN: "chain", TREE: "tree",
          CONTINUATION: "continuation", UNVERIFIED: "unverified", WORTH: "lookup",
          WIDTH_OF_PASS: "width"}
_KINDS = {Plain: PLAIN, Chain: CHAIN, Tree: TREE, Continuation: CONTINUATION}
_SOURCES = ("context", "index")
MAX_NODES = MAX_CHAIN + 1  # a tree of rival continuations, root included (drafted ones are smaller)
_HEAD = 12  # kind, a, b, tokens, nodes, match, count, source, has value, value (2), has ranks
WIDTH = _HEAD + MAX_CHAIN + 6 * MAX_NODES  # tokens; node tokens, parents, depths, ranks, scores (2)


class Channel(Protocol):
    """What the plans travel over: :class:`dflash.ranks.Ranks` (``is_main``: rank 0)."""

    is_main: bool

    def ints_from_main(self, values: np.ndarray | None, width: int) -> np.ndarray: ...


def _f64(value: float) -> np.ndarray:
    return np.array([value], dtype=np.float64).view(np.int32)


def encode(what: Plan | int, a: int = 0, b: int = 0) -> np.ndarray:
    """One message: a plan (plain stretch, chain, tree, continuation) with every field it holds,
    exactly (floats as their float64 bits), or a message kind with the numbers ``a`` and ``b``."""
    out = np.zeros(WIDTH, dtype=np.int32)
    tree, plan = None, None
    if isinstance(what, int):
        kind = what
    else:
        plan, kind = what, _KINDS[type(what)]
    match plan:
        case Chain(rows):
            a = rows
        case Plain(steps):
            a = steps
        case Tree(tree=tree):
            pass
        case Continuation():
            if len(plan.tokens) > MAX_CHAIN:
                raise RankMessageError(
                    f"a continuation of {len(plan.tokens)} tokens: at most {MAX_CHAIN}")
            out[_HEAD:_HEAD + len(plan.tokens)] = plan.tokens
            out[3], out[5], out[6] = len(plan.tokens), plan.match, plan.count
            out[7] = _SOURCES.index(plan.source)
            if plan.drafter_value is not None:
                out[8], out[9:11] = 1, _f64(plan.drafter_value)
            tree = plan.tree
    out[0], out[1], out[2] = kind, a, b
    if tree is not None:
        n = len(tree)
        if n > MAX_NODES:
            raise RankMessageError(f"a tree of {n} nodes: at most {MAX_NODES}")
        out[4] = n
        start = _HEAD + MAX_CHAIN
        for i, column in enumerate((tree.tokens, tree.parents, tree.depths)):
            out[start + i * MAX_NODES:start + i * MAX_NODES + n] = column
        if tree.ranks is not None:
            out[11] = 1
            out[start + 3 * MAX_NODES:start + 3 * MAX_NODES + n] = tree.ranks
        scores = np.asarray(tree.scores, dtype=np.float64).view(np.int32)
        out[start + 4 * MAX_NODES:start + 4 * MAX_NODES + 2 * n] = scores
    return out


def decode(message: np.ndarray) -> tuple[int, Plan | None, int, int]:
    """``(kind, plan, a, b)`` of a message :func:`encode` wrote (``plan`` ``None`` for the kinds
    that hold numbers only)."""
    kind, a, b = int(message[0]), int(message[1]), int(message[2])
    tree = None
    n = int(message[4])
    if n:
        start = _HEAD + MAX_CHAIN
        tokens, parents, depths = (message[start + i * MAX_NODES:start + i * MAX_NODES + n].tolist()
                                   for i in range(3))
        ranks = message[start + 3 * MAX_NODES:start + 3 * MAX_NODES + n].tolist() \
            if message[11] else None
        scores = np.ascontiguousarray(message[start + 4 * MAX_NODES:start + 4 * MAX_NODES + 2 * n]
                                      ).view(np.float64).tolist()
        tree = DraftTree(tokens, parents, depths, scores, ranks)
    if kind == CHAIN:
        return kind, Chain(a), a, b
    if kind == PLAIN:
        return kind, Plain(a), a, b
    if kind == TREE:
        return kind, Tree(tree), a, b
    if kind == CONTINUATION:
        value = float(np.ascontiguousarray(message[9:11]).view(np.float64)[0]) \
            if message[8] else None
        plan = Continuation(tuple(message[_HEAD:_HEAD + int(message[3])].tolist()),
                            int(message[5]), int(message[6]), _SOURCES[int(message[7])], value,
                            tree)
        return kind, plan, a, b
    return kind, None, a, b


def agreed(policy: Policy, ranks: Channel | None) -> Policy:
    """``policy`` as the ranks of a sharded target run it: unchanged on one process (``ranks``
    ``None`` or not distributed) and for a policy that prices nothing (its plans depend only on
    the drafter's outputs, the same everywhere); else rank 0 plans and the others follow."""
    if ranks is None or not getattr(ranks, "distributed", True) or not policy.needs_cost:
        return policy
    return PlanLeader(policy, ranks) if ranks.is_main else PlanFollower(policy, ranks)


class PlanLeader(Policy):
    """Rank 0: the policy itself, each decision handed to the other ranks as it is taken."""

    def __init__(self, inner: Policy, ranks: Channel):
        super().__init__(inner.block_size, inner.cost, pipelined=inner.pipelined)
        self.inner, self.ranks = inner, ranks
        self.name, self.needs_cost = inner.name, inner.needs_cost
        self.reads_candidates, self.looks_up = inner.reads_candidates, inner.looks_up
        self.stats = inner.stats
        self._unverified = False  # an unverified block, told with the stretch after it

    def _send(self, what: Plan | int, a: int = 0, b: int = 0) -> None:
        self.ranks.ints_from_main(encode(what, a, b), WIDTH)

    @property
    def candidates(self) -> int:
        return self.inner.candidates

    def before_draft(self, context: int, most: int,
                     continuation: Match | None = None) -> Plain | Continuation | None:
        plan = self.inner.before_draft(context, most, continuation)
        if plan is not None:  # else told with the rows drafted
            self._send(plan)
        return plan

    def draft_rows(self, block: int) -> int:
        rows = self.inner.draft_rows(block)
        self._send(DRAFT, a=rows, b=self.inner.candidates)
        return rows

    def after_draft(self, candidates: Candidates | None, anchor: int, draft_rows: int) -> Plan:
        plan = self.inner.after_draft(candidates, anchor, draft_rows)
        if isinstance(plan, Unverified):
            self._unverified = True
        else:
            self._send(plan)
        return plan

    def plain_stretch(self, context: int, most: int) -> int:
        steps = self.inner.plain_stretch(context, most)
        if self._unverified:
            self._unverified = False
            self._send(UNVERIFIED, a=steps)
        return steps

    def lookup_worth(self, match: Match | None) -> bool:
        if not match:  # no continuation: no stretch ends, on any rank, without a word
            return False
        worth = self.inner.lookup_worth(match)
        self._send(WORTH, a=int(worth))
        return worth

    def observe(self, outcome: Outcome) -> None:
        self.inner.observe(outcome)

    def give_back(self, steps: int) -> None:
        self.inner.give_back(steps)

    def lookup_expectation(self, match: Match | None) -> np.ndarray | None:
        return self.inner.lookup_expectation(match)

    def finish(self) -> None:
        self.inner.finish()


class PlanFollower(Policy):
    """A rank other than 0: each decision is rank 0's, received where the engine asks for it;
    nothing is priced or learnt here (outcomes are only counted)."""

    def __init__(self, inner: Policy, ranks: Channel):
        super().__init__(inner.block_size, None, pipelined=inner.pipelined)
        self.ranks = ranks
        self.name, self.needs_cost = inner.name, inner.needs_cost
        self.reads_candidates, self.looks_up = inner.reads_candidates, inner.looks_up
        self._rows = self._candidates = self._stretch = 0

    def _receive(self, *kinds: int) -> tuple[int, Plan | None, int, int]:
        kind, plan, a, b = decode(self.ranks.ints_from_main(None, WIDTH))
        if kind not in kinds:
            raise RankLost(
                f"the ranks are out of step: rank 0 sent a {_NAMES.get(kind, kind)!r} decision "
                f"where this rank expected {' or '.join(repr(_NAMES[k]) for k in kinds)}")
        return kind, plan, a, b

    @property
    def candidates(self) -> int:
        return self._candidates

    def before_draft(self, context: int, most: int,
                     continuation: Match | None = None) -> Plain | Continuation | None:
        self.context = context
        kind, plan, a, b = self._receive(PLAIN, CONTINUATION, DRAFT)
        if kind == DRAFT:
            self._rows, self._candidates = a, b
            return None
        return plan

    def draft_rows(self, block: int) -> int:
        return self._rows

    def after_draft(self, candidates: Candidates | None, anchor: int, draft_rows: int) -> Plan:
        kind, plan, a, _ = self._receive(CHAIN, TREE, CONTINUATION, UNVERIFIED)
        if kind == UNVERIFIED:
            self._stretch = a
            return Unverified()
        return plan

    def plain_stretch(self, context: int, most: int) -> int:
        self.context = context
        steps, self._stretch = self._stretch, 0
        return steps

    def lookup_worth(self, match: Match | None) -> bool:
        if not match:
            return False
        return bool(self._receive(WORTH)[2])


# ---------------------------------------------------------------------------------------------
# The batched engine's policy


def agreed_batch(policy: BatchPolicy, ranks: Channel | None) -> BatchPolicy:
    """The batched engine's ``policy`` as the ranks of a sharded target run it: unchanged on one
    process and for ``fixed`` (it prices nothing); else rank 0 decides and the others follow."""
    from .batch import FixedBatchPolicy

    if ranks is None or not getattr(ranks, "distributed", True) \
            or isinstance(policy, FixedBatchPolicy):
        return policy
    return BatchLeader(policy, ranks) if ranks.is_main else BatchFollower(policy, ranks)


def _own(rows: Sequence[tuple[Policy, np.ndarray | None]]) -> list:
    """The rows' policies as rank 0 runs them (a sequence's policy on a sharded target is a
    :class:`PlanLeader` around the one that prices), with their drafter confidences."""
    return [(policy.inner if isinstance(policy, PlanLeader) else policy, conf)
            for policy, conf in rows]


class BatchLeader:
    """Rank 0: the batch policy itself, each decision handed to the other ranks."""

    def __init__(self, inner: BatchPolicy, ranks: Channel):
        self.inner, self.ranks = inner, ranks

    @property
    def cost(self):
        return self.inner.cost

    @cost.setter
    def cost(self, cost) -> None:
        self.inner.cost = cost

    def _send(self, rows: int, kind: int, a: int, use_look: Sequence[bool] = ()) -> None:
        self.ranks.ints_from_main(np.array([kind, a, *map(int, use_look)]), 2 + rows)

    def want_draft(self, rows, looked, context: int, cap: int) -> bool:
        want = self.inner.want_draft(_own(rows), looked, context, cap)
        if want:  # else told with the width of the pass without a drafter
            self._send(len(rows), DRAFT, self.inner.draft_rows(cap))
        return want

    def draft_rows(self, cap: int) -> int:
        return self.inner.draft_rows(cap)

    def width_after_draft(self, rows, looked, context: int, drafted_rows: int
                          ) -> tuple[int, list[bool]]:
        width, use_look = self.inner.width_after_draft(_own(rows), looked, context, drafted_rows)
        self._send(len(rows), WIDTH_OF_PASS, width, use_look)
        return width, use_look

    def width_without_draft(self, looked, context: int) -> tuple[int, list[bool]]:
        width, use_look = self.inner.width_without_draft(looked, context)
        self._send(len(looked), WIDTH_OF_PASS, width, use_look)
        return width, use_look

    def judge(self, rows, use_look, looked, committed: int, context: int, drafted_rows: int,
              width: int) -> None:
        self.inner.judge(_own(rows), use_look, looked, committed, context, drafted_rows, width)


class BatchFollower:
    """A rank other than 0: each of the batch's decisions is rank 0's; nothing is priced."""

    def __init__(self, inner: BatchPolicy, ranks: Channel):
        self.cost, self.ranks = inner.cost, ranks
        self._rows = 0
        self._width: tuple[int, list[bool]] = (1, [])

    def _receive(self, rows: int, *kinds: int) -> tuple[int, int, list[bool]]:
        message = self.ranks.ints_from_main(None, 2 + rows)
        kind, a = int(message[0]), int(message[1])
        if kind not in kinds:
            raise RankLost(
                f"the ranks are out of step: rank 0 sent a {_NAMES.get(kind, kind)!r} decision "
                f"where this rank expected {' or '.join(repr(_NAMES[k]) for k in kinds)}")
        return kind, a, [bool(x) for x in message[2:]]

    def want_draft(self, rows, looked, context: int, cap: int) -> bool:
        kind, a, use_look = self._receive(len(rows), DRAFT, WIDTH_OF_PASS)
        if kind == DRAFT:
            self._rows = a
            return True
        self._width = (a, use_look)
        return False

    def draft_rows(self, cap: int) -> int:
        return self._rows

    def width_after_draft(self, rows, looked, context: int, drafted_rows: int
                          ) -> tuple[int, list[bool]]:
        _, width, use_look = self._receive(len(rows), WIDTH_OF_PASS)
        return width, use_look

    def width_without_draft(self, looked, context: int) -> tuple[int, list[bool]]:
        return self._width

    def judge(self, rows, use_look, looked, committed: int, context: int, drafted_rows: int,
              width: int) -> None:
        return None
