"""One batched decode pass: every row of a :class:`~dflash.batch.BatchGenerator` drafted,
verified and rolled back together.

Why its own module: the batch engine's step is two jobs that share little, bringing prompts in
(queue, chunked prefill, joining) and decoding the joined rows. This is the second: plan the
pass (its width, whether the drafter drafts, which rows verify their own continuation), propose,
cut the proposals to each row's grammar, run one target pass over every row, accept each row's
prefix with its own sampler, roll the rest back, and tell the batch policy what it cost and
committed. A ``(B, n)`` pass costs ``B * n`` rows however they are shared (on this CPU a 16-row
pass costs 2.1-2.7 one-token steps), so the width is the policy's one choice for all rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .drafter import full_logits
from .grammar import Constrained
from .lookup import Match
from .policy import Chain, Continuation, Outcome, Plain, draft_candidates
from .ragged_cache import append_rows
from .speculative import StepResult
from .target import VerifyTrace, forward, rollback_rows


@dataclass
class PassPlan:
    """What one batched pass verifies: each row's continuation (``looks``: a
    :class:`~dflash.lookup.Match`, ``None`` where it has none) and its calibrated acceptance (``looked``: ``None`` where it has none), the drafter's
    pass (``drafted_rows``: 0 for none; its scores, top log-probabilities and tokens), the verify
    ``width`` (anchor included) and which rows verify their continuation (``use_look``)."""

    looks: list[Match | None]
    looked: list[np.ndarray | None]
    drafted_rows: int = 0
    scores: mx.array | None = None
    columns: mx.array | None = None
    log_conf: list[np.ndarray] | None = None
    top_ids: np.ndarray | None = None
    width: int = 1
    use_look: list[bool] | None = None
    # Per row: its proposals under its grammar (dflash.grammar; None: the row has none)
    constrained: list[Constrained | None] | None = None


@dataclass
class BatchPass:
    """One pass over ``rows`` (the batch's sequences, row ``i`` of ``cache`` and ``dcache``):
    :meth:`run` drafts, verifies and rolls back, and returns each row's step."""

    parts: object  # the target's parts (dflash.target.TargetParts)
    draft: object  # the drafter
    costs: object  # the cost model told each pass's time
    speculation: object  # the batch policy (dflash.policy.batch)
    cache: list  # the target's ragged caches, one per layer
    dcache: list  # the drafter's
    rows: list  # the sequences decoding (dflash.batch._Sequence), in row order

    def run(self, block_size: int) -> list[StepResult]:
        """Plan the pass, propose, verify, judge: each row's step, in row order."""
        context = max(len(s.state.fed) for s in self.rows)  # tokens in the longest row's cache
        cap = min(block_size, max(s.remaining for s in self.rows))
        plan = self._plan(context, cap)
        proposals, qs = self._proposals(plan)
        self._constrain(plan, proposals, qs)
        drafted = time.perf_counter()
        steps = self._verify(plan, proposals, qs, drafted)
        self.speculation.judge([(s.state.policy, s.conf) for s in self.rows], plan.use_look,
                               plan.looked, sum(len(step.tokens) for step in steps), context,
                               plan.drafted_rows, plan.width)
        return steps

    def _sync_drafter(self) -> None:
        """Give the drafter's context every row's features of the tokens committed since."""
        pending = [s.state.take_taps() for s in self.rows]
        counts = [0 if p is None else p.shape[1] for p in pending]
        most = max(counts)
        if most == 0:
            return
        like = next(p for p in pending if p is not None)
        padded = mx.concatenate([
            mx.zeros((1, most, like.shape[-1]), like.dtype) if p is None else
            mx.pad(p, [(0, 0), (0, most - p.shape[1]), (0, 0)]) for p in pending])
        append_rows(self.draft.append_context, padded, counts, self.dcache)  # bounded pieces

    def _plan(self, context: int, cap: int) -> PassPlan:
        """The pass's width, whether (and how deep) the drafter drafts, and which rows verify
        their own context's continuation (:mod:`dflash.lookup`: proposals without a drafter
        pass) instead of a drafted block."""
        rows = self.rows
        # A batched pass is as wide as its widest row: continuations stay within the block.
        looks = [s.state.look(s.request, cap) if s.state.policy.looks_up and cap > 1 else None
                 for s in rows]
        looked = [s.state.policy.lookup_expectation(look) for s, look in zip(rows, looks)]
        plan = PassPlan(looks, looked)
        speculation = self.speculation
        if speculation.want_draft([(s.state.policy, s.conf) for s in rows], looked, context,
                                  cap):
            plan.drafted_rows = speculation.draft_rows(cap)
            self._draft(plan)
            plan.width, plan.use_look = speculation.width_after_draft(
                [(s.state.policy, s.conf) for s in rows], looked, context, plan.drafted_rows)
        else:
            plan.width, plan.use_look = speculation.width_without_draft(looked, context)
        return plan

    def _draft(self, plan: PassPlan) -> None:
        """One drafter pass for every row; each row's top probabilities kept (``conf``)."""
        started = time.perf_counter()
        self._sync_drafter()
        anchors = [s.state.history[-1] for s in self.rows]
        # Scores over the draft vocabulary only (as the single-sequence cycle reads them).
        plan.scores, plan.columns = self.draft.block_scores_batch(
            self.parts, anchors, plan.drafted_rows, self.dcache)
        # Every row's top log-probability and token in one host read (not one per sequence);
        # greedy proposals are those tokens.
        batch_rows, block_rows, n_vocab = plan.scores.shape
        top_lp, top_ids = draft_candidates(plan.scores.reshape(-1, n_vocab), plan.columns, 1)
        plan.log_conf = list(top_lp[:, 0].reshape(batch_rows, block_rows))
        plan.top_ids = top_ids[:, 0].reshape(batch_rows, block_rows)
        self.costs.observe("draft", batch_rows * block_rows,
                           max(len(s.state.fed) for s in self.rows), time.perf_counter() - started)
        for s, lc in zip(self.rows, plan.log_conf):
            s.conf = np.exp(lc.astype(np.float64))

    def _proposals(self, plan: PassPlan) -> tuple[list[list[int]], list]:
        """Each row's proposals (up to ``width - 1``; a row's continuation, its drafted block,
        or none: a plain step in the pass) and, where sampled from the drafter, its ``q``."""
        proposals, qs = [], []
        for i, s in enumerate(self.rows):
            k = min(plan.width - 1, s.remaining - 1)
            props, q = [], None
            if k > 0 and plan.use_look[i]:
                props = list(plan.looks[i].tokens[:k])
            elif k > 0 and not plan.drafted_rows:
                pass  # a pass of continuations: this row takes a plain step in it
            elif k > 0 and s.request.sampler.proposes_argmax:
                props = plan.top_ids[i, :k].tolist()
            elif k > 0:
                props, q = self.draft.propose(full_logits(plan.scores[i, :k], plan.columns,
                                                          self.parts.vocab_size),
                                              s.state.history[-1], self.dcache,
                                              s.request.sampler, s.state.history)
                props = props.tolist()
            proposals.append(props)
            qs.append(q)
        return proposals, qs

    def _constrain(self, plan: PassPlan, proposals: list[list[int]], qs: list) -> None:
        """Rows with a grammar: their proposals cut where it rejects them and forced tokens
        proposed for free, within the pass's width (drafted rows: within the drafter's block),
        and each row's masks (:meth:`~dflash.grammar.GrammarState.constrain`). Rows without a
        grammar are left as they are."""
        if all(s.state.grammar is None for s in self.rows):
            return
        plan.constrained = [None] * len(self.rows)
        for i, s in enumerate(self.rows):
            grammar = s.state.grammar
            if grammar is None:
                continue
            cap = len(proposals[i])
            if plan.drafted_rows and not (proposals[i] and plan.use_look[i]):
                cap = max(cap, min(plan.width - 1, s.remaining - 1, plan.drafted_rows - 1))
            c = grammar.constrain(proposals[i], cap, qs[i], draw=s.request.sampler._draw)
            proposals[i], qs[i], plan.constrained[i] = c.tokens, c.q, c

    def _verify(self, plan: PassPlan, proposals: list[list[int]], qs: list,
                drafted: float) -> list[StepResult]:
        """One target pass over every row's anchor and proposals (padding after them is never
        read); each row accepts a prefix and reports it to its policy; the rest rolled back."""
        anchors = [s.state.history[-1] for s in self.rows]
        width = plan.width
        tokens = [[a] + p + [a] * (width - 1 - len(p)) for a, p in zip(anchors, proposals)]
        trace = VerifyTrace()
        logits, taps = forward(self.parts, mx.array(tokens), self.cache,
                               self.draft.target_layer_ids, trace)
        steps, keep = [], []
        longest = max(len(s.state.fed) for s in self.rows)
        allowed = [None] * len(self.rows)
        if plan.constrained is not None:
            mx.async_eval(logits)  # the pass runs while the host expands the rows' masks
            allowed = [None if c is None else s.state.grammar.allowed(c.bits)
                       for s, c in zip(self.rows, plan.constrained)]
        for i, s in enumerate(self.rows):
            props = proposals[i]
            c = None if plan.constrained is None else plan.constrained[i]
            a, bonus = s.request.sampler.accept(logits[i, :len(props) + 1], props, qs[i],
                                                s.state.history, allowed=allowed[i])
            if c is not None:
                s.state.grammar.settle(c, a, bonus)
            context = len(s.state.fed)
            s.state.fed += [anchors[i]] + props[:a]
            s.state.commit_taps(taps[i:i + 1, :a + 1])
            looked = bool(props) and plan.use_look[i]
            if looked:
                look = plan.looks[i]
                outcome = Outcome(Continuation(tuple(props), look.length, look.count, look.source),
                                  a, context=context, shared=True)
            elif props:
                outcome = Outcome(Chain(len(props)), a, log_conf=plan.log_conf[i],
                                  draft_rows=plan.drafted_rows, context=context, shared=True)
            else:
                outcome = Outcome(Plain(1), context=context, shared=True)
            s.state.policy.observe(outcome)
            emitted = props[:a] + [bonus]
            # Rows 0..a of its pass predicted them (read only where the request asks).
            steps.append(StepResult(emitted, a, len(props), drafted, not props,
                                    lookup=looked,
                                    logprobs=s.request.scored(logits[i, :a + 1], emitted)))
            keep.append(a + 1)
        # Every row's accepted count read on the host: the pass is done.
        self.costs.observe("verify", len(self.rows) * width, longest,
                           time.perf_counter() - drafted)
        rollback_rows(self.cache, trace, keep, width)
        mx.async_eval([c.state for c in self.cache])
        return steps
