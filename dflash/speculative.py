"""The speculative loop: draft a block, verify it in one target pass, accept a prefix, roll back."""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .backend import CLEAR_CACHE_EVERY, generation_context, pass_stream
from .cost_model import PassCosts, cost_model
from .distributed import model_ranks, shard_count
from .drafter import full_logits
from .grammar import FINISH_REASON, Constrained, GrammarState, apply_mask
from .logprobs import PromptScorer, TokenLogprob
from .lookup import MAX_CHAIN, ContextLookup, best_match, continuations
from .policy import (
    MAX_BACKOFF,
    Candidates,
    Chain,
    Continuation,
    Outcome,
    Plain,
    Plan,
    Policy,
    Tree,
    Unverified,
    draft_candidates,
    make_policy,
    policy_class,
)
from .policy.agreed import agreed
from .policy.memory import memory_of
from .prompt_cache import CacheEntry, PromptCache
from .request import DecodeRequest, build_request
from .settings import GenerationSettings
from .target import (
    VerifyTrace,
    commit_tree_path,
    forward,
    make_cache,
    prefill_calls,
    rollback,
    target_parts,
    tree_forward,
    tree_supported,
)
from .tree import DraftTree, walk


@dataclass
class DFlashResponse:
    """One streamed step: the text and tokens of one cycle, plus running statistics."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    token: int | None = None
    accepted: int = 0  # draft tokens accepted in this cycle
    verified_tokens: int = 0  # draft tokens sent to the target so far (see min_confidence)
    cycle_tau: int = 0  # tokens emitted by this cycle (accepted + 1)
    mean_tau: float = 0.0
    cycles: int = 0
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tokens: int = 0
    generation_tps: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    peak_memory: float = 0.0
    finish_reason: str | None = None
    reused_prompt_tokens: int = 0
    plain_steps: int = 0  # target steps without drafting (the policy's choice)
    tree_cycles: int = 0  # cycles that verified a draft tree
    lookup_cycles: int = 0  # cycles that verified a continuation of text already seen (no drafting)
    index_cycles: int = 0  # of those, continuations of earlier requests (the request's index)
    rows_per_pass: float = 0.0  # target rows per pass, anchor included
    # The passes chosen at this machine's calibrated costs (auto and tree policies; not batched)
    priced_ms: float | None = None
    acceptance_by_position: list[float] = field(default_factory=list)
    # finish_reason "grammar": why the grammar allowed no next token (dflash.grammar)
    grammar_message: str | None = None
    forced_tokens: int = 0  # tokens the grammar forced, proposed without the drafter
    # ``logprobs=N`` asked (dflash.logprobs): one entry per token of ``tokens``; and on the first
    # response, with ``prompt_logprobs``, one per prompt token (the first ``None``: nothing
    # predicts it).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str | None
    stats: DFlashResponse
    logprobs: list[TokenLogprob] | None = None  # one per token (``logprobs=N`` asked)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # ``prompt_logprobs=True``


class Detokenizer:
    """Incremental text with stop strings; wraps mlx-lm's streaming detokenizer."""

    def __init__(self, tokenizer, stops: list[str]):
        self.detok = tokenizer.detokenizer if tokenizer is not None else None
        if self.detok is not None:
            self.detok.reset()
        self.stops = stops
        self.text = ""
        self.sent = 0

    def add(self, tokens: list[int], final: bool) -> tuple[str, bool]:
        """New text for ``tokens``; ``True`` when a stop string ended the output."""
        if self.detok is None:
            return "", False
        for t in tokens:
            self.detok.add_token(t)
        if final:
            self.detok.finalize()
        self.text = self.detok.text
        hit = False
        if self.stops:
            positions = [self.text.find(s, max(0, self.sent - len(s))) for s in self.stops]
            positions = [p for p in positions if p >= 0]
            if positions:
                self.text = self.text[: min(positions)]
                hit = True
        # Hold back a tail that could be the start of a stop string.
        hold = 0 if (hit or final) else max((len(s) - 1 for s in self.stops), default=0)
        end = max(self.sent, len(self.text) - hold)
        segment = self.text[self.sent:end]
        self.sent = end
        return segment, hit


def stream_generate(model, draft, tokenizer, prompt: str | Sequence[int] | mx.array, *args,
                    prompt_cache: PromptCache | None = None,
                    settings: GenerationSettings | None = None,
                    **kwargs) -> Generator[DFlashResponse, None, None]:
    """Generate with DFlash speculative decoding, yielding one response per cycle.

    The settings are the fields of :class:`~dflash.settings.GenerationSettings` (``max_tokens``,
    sampling, stops, ``block_size``, ``policy`` ...; docs/api.md): given as ``settings=``, as
    keywords (which override ``settings``' fields), or the first few by position in mlx-lm's
    order (:data:`~dflash.settings.POSITIONAL`).

    Greedy output equals the target's own greedy output token for token; sampled output has the
    target's distribution under the same settings (see :mod:`dflash.sampling`). A
    :class:`~dflash.prompt_cache.PromptCache` carries the caches over to the next call, which then
    prefills only what its prompt does not share with the tokens already cached.

    ``policy`` chooses how many drafted tokens each cycle verifies (:mod:`dflash.policy`):
    ``"auto"`` (default) maximises expected committed tokens per second under this machine's
    measured cost model (:mod:`dflash.cost_model`) and takes plain target steps while speculation
    loses, and verifies draft trees where they are worth more than chains (attention-only targets;
    hybrid targets verify chains); ``"tree"`` verifies a best-first tree of ``tree_budget`` nodes
    (default 16) every cycle; ``"fixed"`` verifies the whole block; ``"confidence"`` verifies up to
    the first block row where the product of the drafter's top probabilities falls below
    ``min_confidence`` (giving ``min_confidence`` alone selects it). Under ``"auto"`` a cycle may
    verify the context's own continuation instead of a drafted block (:mod:`dflash.lookup`: no
    drafter pass); ``lookup=False`` verifies only the drafter's proposals. ``memory``: a
    :class:`~dflash.policy.memory.PairMemory` the ``auto`` policy starts from and teaches (what
    earlier generations of the pair measured; default: the one the drafter holds as
    ``draft.policy_memory``, else none). Outputs never depend on the policy.
    """
    settings = GenerationSettings.from_call(args, settings, **kwargs)
    parts = target_parts(model)
    request = build_request(parts, draft, tokenizer, prompt, settings)
    return run_request(parts, draft, tokenizer, request, prompt_cache)


@dataclass
class DecodeState:
    """What one sequence carries from cycle to cycle."""

    cache: list  # the target's caches: exactly the tokens in ``fed``
    dcache: list  # the drafter's context caches
    history: list[int]  # prompt + emitted tokens (what penalties and stops see)
    fed: list[int]  # tokens whose keys/values are in the target's cache
    policy: Policy | None = None
    # Target features ``(1, k, F)`` of committed tokens the drafter has not seen yet, one piece
    # per cycle or plain step: joined once when the drafter next drafts, not grown by a
    # concatenation per step (a stretch of n steps would copy O(n^2) rows).
    pending: list[mx.array] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    proposed_at: list[int] = field(default_factory=list)
    cycle_tokens: int = 0  # tokens emitted by speculative cycles (mean_tau's numerator)
    lookup: ContextLookup = field(default_factory=ContextLookup)  # n-grams of ``history``
    costs: PassCosts | None = None  # told each pass's time (dflash.cost_model)
    trees: bool = False  # the target verifies trees (attention-only)
    grammar: GrammarState | None = None  # the request's grammar, after the emitted tokens
    scorer: PromptScorer | None = None  # the prompt's log-probabilities (prompt_logprobs)

    def look(self, request: DecodeRequest, remaining: int, ahead: list[int] | None = None,
             rivals: bool = False):
        """The best continuation of the history (and ``ahead``, tokens about to join it) in the
        sequence itself or the request's index: at most ``remaining - 1`` tokens (the verify
        pass's own token comes last), and at most :data:`~dflash.lookup.MAX_CHAIN`; with
        ``rivals``, the competing continuations attached (a tree may verify them together)."""
        history = self.history + ahead if ahead else self.history
        find = continuations if rivals else best_match
        return find(history, min(MAX_CHAIN, remaining) - 1, self.lookup, request.index)

    def timed(self, kind: str, rows: int, context: int, seconds: float) -> None:
        """Tell the pass costs what a pass took (from its issue to the host read of its result)."""
        if self.costs is not None:
            self.costs.observe(kind, rows, context, seconds)

    def sync_drafter(self, draft) -> None:
        """Give the drafter the features of the last committed tokens."""
        taps = self.take_taps()
        if taps is not None:
            draft.append_context(taps, self.dcache)

    def commit_taps(self, taps: mx.array) -> None:
        """Features of newly committed tokens, for the drafter's next block."""
        self.pending.append(taps)

    @property
    def pending_rows(self) -> int:
        """Committed tokens whose features the drafter has not seen yet."""
        return sum(p.shape[1] for p in self.pending)

    def take_taps(self) -> mx.array | None:
        """The pending features ``(1, k, F)`` in one array (``None``: none), now the drafter's."""
        if not self.pending:
            return None
        taps = self.pending[0] if len(self.pending) == 1 else mx.concatenate(self.pending, axis=1)
        self.pending = []
        return taps


def run_request(parts, draft, tokenizer, request: DecodeRequest,
                prompt_cache: PromptCache | None = None) -> Generator[DFlashResponse, None, None]:
    """Decode one validated request (:func:`build_request`), one response per cycle."""
    if prompt_cache is not None and request.kv is not None:
        # A quantized cache's content depends on where its prompt switched: not reusable.
        prompt_cache.clear()
        prompt_cache = None
    if request.prompt_logprobs:
        # Every prompt row must come out of this prefill to be scored: a cached prefix would
        # skip its rows (and the entry this prefill could leave would be no different).
        prompt_cache = None
    if prompt_cache is None:
        entry = None
        cache, dcache, reused = request.target_cache(parts), draft.make_cache(), 0
    else:
        entry = prompt_cache.take(parts, draft, request.prompt_ids)
        cache, dcache, reused = entry.target, entry.draft, entry.reused
    cost = cost_model(parts, draft, request.priced_kv) if policy_class(request.policy).needs_cost \
        else None
    state = new_state(parts, draft, request, cache, dcache, cost)
    try:
        yield from _decode(parts, draft, tokenizer, request, state, reused,
                           None if entry is None else (prompt_cache, entry))
    finally:
        state.policy.finish()
        if request.index is not None:  # what this request saw and wrote, for the next ones
            request.index.add(state.history)


def new_state(parts, draft, request: DecodeRequest, cache: list | None, dcache: list | None,
              cost) -> DecodeState:
    """A sequence's state before its first token, with its own verify policy (shared by the
    single-sequence and batched engines: a batched sequence that runs alone decodes with this
    engine's cycle, on the same state), started from what the pair's earlier generations taught
    it where there is a memory (``request.memory``, else the drafter's, see
    :func:`~dflash.policy.memory.memory_of`). ``cache is None``: its caches come later."""
    # Under a grammar "auto" verifies chains, where the tokens it forces are free proposals;
    # "tree" verifies trees, each node masked with the state after its own path.
    trees = (request.grammar is None or request.policy == "tree") and \
        tree_supported(parts, make_cache(parts) if cache is None else cache)
    # A seeded sampled generation reproduces only if its verify shapes do (they decide how the
    # random stream is consumed): it starts from the raw confidence and prices its plans with the
    # stored calibration or the prior, which no timing moves (learnt prices differ from run to
    # run); its passes still teach the pair's shared costs.
    seeded = not request.sampler.greedy and request.sampler.cfg.seed is not None
    memory, shared_cost = None, cost
    if cost is not None and not seeded:
        memory = request.memory if request.memory is not None else memory_of(parts.model, draft)
    elif cost is not None:
        cost = cost.unlearnt()
    return DecodeState(cache, dcache, history=list(request.prompt_ids),
                       fed=list(request.prompt_ids),
                       # A sharded target's ranks all verify rank 0's plans (policy.agreed).
                       policy=agreed(make_policy(request.policy, request.block_size, cost,
                                                 min_confidence=request.min_confidence,
                                                 trees=trees, tree_budget=request.tree_budget,
                                                 pipelined=request.sampler.pipelines_plain_steps,
                                                 memory=memory, lookup=request.lookup),
                                     model_ranks(parts)),
                       accepted_at=[0] * (request.block_size - 1),
                       proposed_at=[0] * (request.block_size - 1),
                       costs=shared_cost if shared_cost is not None
                       else cost_model(parts, draft, request.priced_kv),
                       grammar=None if request.grammar is None else request.grammar.start(),
                       trees=trees,
                       scorer=PromptScorer(request.logprobs or 0) if request.prompt_logprobs
                       else None)


def prefill_chunk(parts, draft, tokens: list[int], cache: list, dcache: list,
                  scorer: PromptScorer | None = None) -> mx.array:
    """Feed one chunk of prompt ``tokens`` to the target and its taps to the drafter's context;
    the chunk's last logits ``(1, V)``, evaluated with the caches. ``scorer``: every row's logits
    are computed and the chunk's tokens scored (``prompt_logprobs``)."""
    # Only the last row's logits are read otherwise: the head (the largest matrix of a small
    # model) runs on that row alone.
    logits, taps = forward(parts, mx.array(tokens)[None], cache, draft.target_layer_ids,
                           logits_rows=None if scorer is not None else slice(-1, None))
    draft.append_context(taps, dcache)
    last = logits[0, -1:]
    mx.eval(last, [c.state for c in cache], [c.state for c in dcache])
    if scorer is not None:
        scorer.add(logits[0], tokens)
    return last


def _prefill(parts, draft, request: DecodeRequest, state: DecodeState, start: int,
             entry: CacheEntry | None = None) -> mx.array:
    """Feed the prompt from ``start`` in chunks (the drafter sees every row); the last logits.
    A quantized cache takes mlx-lm's chunks (the last prompt token alone): where its calls end
    decides which rows see float keys. ``entry``: snapshots its recurrent states at each
    chunk's end (:meth:`CacheEntry.snapshot`)."""
    n, step = len(request.prompt_ids), request.prefill_step_size
    ends = prefill_calls(n, step) if request.kv is not None else range(start + step, n + step, step)
    if entry is not None and start < entry.shared < n:  # a prefix other conversations share
        ends = sorted({*ends, entry.shared})
    begin = start
    for end in ends:
        end = min(end, n)
        last = prefill_chunk(parts, draft, request.prompt_ids[begin:end], state.cache,
                             state.dcache, state.scorer)
        if entry is not None:
            entry.snapshot(end)
        if request.progress:
            request.progress(end, n)
        begin = end
    return last


class StepResult(NamedTuple):
    tokens: list[int]  # emitted: the accepted proposals and the target's own next token
    accepted: int
    verified: int  # proposals sent to the target
    drafted_at: float  # perf_counter when drafting ended (the draft/verify time split)
    plain: bool  # the policy skipped drafting: a plain one-token target step
    depths: int | None = None  # a tree's depth (a chain's is ``verified``)
    lookup: bool = False  # the proposals were the context's continuation, not the drafter's
    logprobs: list[TokenLogprob] | None = None  # one per token (``request.logprobs`` asked)


class DraftedBlock(NamedTuple):
    """One drafter block pass: its rows (anchor included), scores over the draft vocabulary and
    the column ids, and the candidates the policy reads (``None``: it reads none)."""

    rows: int
    scores: mx.array
    columns: mx.array | None
    candidates: Candidates | None

    @property
    def log_conf(self) -> np.ndarray | None:
        """The drafter's top log-probability per block row (``None``: not read)."""
        return None if self.candidates is None else self.candidates[0][:, 0]


def speculative_step(parts, draft, request: DecodeRequest, state: DecodeState, bs: int,
                     remaining: int, max_stretch: int = MAX_BACKOFF) -> StepResult:
    """One cycle as the policy plans it: draft -> verify (a chain, a continuation or a tree) ->
    accept -> roll back; or up to ``max_stretch`` plain target steps while speculation loses."""
    policy, anchor, context = state.policy, state.history[-1], len(state.fed)
    most = min(remaining, max_stretch)
    block: DraftedBlock | None = None
    if bs <= 1:  # the last token: nothing to propose
        plan: Plan | None = Chain(0)
    else:
        look = state.look(request, remaining, rivals=state.trees) if policy.looks_up else None
        plan = policy.before_draft(context, most, look)
    if plan is None:
        block = draft_block(parts, draft, request, state, policy.draft_rows(bs))
        plan = policy.after_draft(block.candidates, anchor, block.rows)
    match plan:
        case Plain(steps):
            if state.grammar is not None and bs > 1 and state.grammar.forces():
                # What the grammar forces next is a free chain: one pass verifies it.
                return verify_chain(parts, draft, request, state, Chain(0), None, context)
            return plain_steps(parts, draft, request, state, steps)
        case Unverified():  # not worth verifying: the first step of the next plain stretch
            policy.observe(Outcome(plan, log_conf=block.log_conf, draft_rows=block.rows,
                                   context=context))
            return plain_steps(parts, draft, request, state,
                               1 + policy.plain_stretch(len(state.fed), most - 1))
        case Tree() | Continuation(tree=DraftTree()):  # a drafted tree, or rival continuations
            return verify_tree(parts, draft, request, state, plan, block, context)
        case _:
            return verify_chain(parts, draft, request, state, plan, block, context)


def draft_block(parts, draft, request: DecodeRequest, state: DecodeState,
                rows: int) -> DraftedBlock:
    """The drafter's block pass of ``rows`` rows over ``[anchor, MASK ...]``, with the new target
    features as its context; the candidates read on the host where the policy plans from them
    (or greedy v1 proposals are read from them)."""
    started = time.perf_counter()
    state.sync_drafter(draft)
    # Scores over the draft vocabulary only (a cut vocabulary is ~1/6 of the target's): no
    # full-vocabulary row of -inf to scatter into, gather from and argmax over.
    scores, columns = draft.block_scores(parts, state.history[-1], rows, state.dcache)
    candidates = None
    if state.policy.reads_candidates or _proposes_argmax(request, draft) \
            or state.grammar is not None:
        # A grammar replaces a rejected argmax by the best candidate it allows: more of them.
        k = state.policy.candidates if state.grammar is None else \
            max(state.policy.candidates, GRAMMAR_CANDIDATES)
        candidates = draft_candidates(scores, columns, k)
        state.timed("draft", rows, len(state.fed), time.perf_counter() - started)
    return DraftedBlock(rows, scores, columns, candidates)


# Drafter candidates per row a grammar chooses from where it rejects the drafter's argmax.
GRAMMAR_CANDIDATES = 16


def _proposes_argmax(request: DecodeRequest, draft) -> bool:
    """Greedy v1 proposals are each row's argmax: read on the host with the candidates, so the
    verify pass is queued without a second round trip to the device."""
    return request.sampler.proposes_argmax and not draft.config.is_dflash2


def _proposals(parts, draft, request: DecodeRequest, state: DecodeState, plan: Plan,
               block: DraftedBlock | None) -> tuple[list[int], mx.array | None]:
    """The tokens a chain plan verifies, and the drafter's distribution ``q`` where they were
    sampled from it."""
    if isinstance(plan, Continuation):
        return list(plan.tokens), None
    if plan.rows == 0:
        return [], None
    if _proposes_argmax(request, draft):
        return block.candidates[1][:plan.rows, 0].tolist(), None
    logits = full_logits(block.scores, block.columns, parts.vocab_size)
    proposals, q = draft.propose(logits[:plan.rows], state.history[-1], state.dcache,
                                 request.sampler, state.history)
    return proposals.tolist(), q


def verify_chain(parts, draft, request: DecodeRequest, state: DecodeState,
                 plan: Chain | Continuation, block: DraftedBlock | None,
                 context: int) -> StepResult:
    """One target pass over ``[anchor, proposals]``; accept a prefix; roll back the rest."""
    anchor = state.history[-1]
    proposals, q = _proposals(parts, draft, request, state, plan, block)
    constrained = None
    if state.grammar is not None:
        constrained = constrain_chain(request, state, plan, block, proposals, q)
        proposals, q = constrained.tokens, constrained.q
    drafted = time.perf_counter()
    trace = VerifyTrace()
    verified = len(proposals) + 1
    logits, taps = forward(parts, mx.array([anchor] + proposals)[None], state.cache,
                           draft.target_layer_ids, trace)
    allowed = None
    if constrained is not None:
        mx.async_eval(logits)  # the pass runs while the host expands the rows' masks
        allowed = state.grammar.allowed(constrained.bits)
    a, bonus = request.sampler.accept(logits[0], proposals, q, state.history, allowed=allowed)
    if constrained is not None:
        state.grammar.settle(constrained, a, bonus)
    state.timed("verify", verified, context, time.perf_counter() - drafted)
    emitted = proposals[:a] + [bonus]
    # Rows 0..a predicted the emitted tokens: read before the roll-back replaces the pass.
    scores = request.scored(logits[0], emitted)
    rollback(state.cache, trace, keep=a + 1, verified=verified)
    state.fed += [anchor] + proposals[:a]
    state.commit_taps(taps[:, : a + 1])
    # (Forced tokens may run past the plan's rows: its calibration learns its own rows only.)
    planned = len(plan.tokens) if isinstance(plan, Continuation) else plan.rows
    state.policy.observe(Outcome(plan, min(a, planned),
                                 log_conf=None if block is None else block.log_conf,
                                 draft_rows=0 if block is None else block.rows, context=context))
    # No host sync: the roll-back replay runs while Python emits this cycle's tokens.
    mx.async_eval(state.pending, [c.state for c in state.cache])
    return StepResult(emitted, a, verified - 1, drafted, False,
                      lookup=isinstance(plan, Continuation), logprobs=scores)


def constrain_chain(request: DecodeRequest, state: DecodeState, plan: Plan,
                    block: DraftedBlock | None, proposals: list[int], q) -> Constrained:
    """A chain's proposals under the sequence's grammar (:meth:`GrammarState.constrain`): cut
    where it rejects them, a rejected argmax replaced by the drafter's best allowed candidate,
    forced tokens proposed for free up to the drafted block's rows."""
    if isinstance(plan, Continuation):
        cap, alternatives = len(proposals), None
    elif block is None:  # no drafter pass: the forced tokens alone, within the block
        remaining = request.max_tokens - (len(state.history) - len(request.prompt_ids))
        cap, alternatives = min(request.block_size, remaining) - 1, None
    else:
        cap = max(len(proposals), block.rows - 1)
        alternatives = None
        if q is None and block.candidates is not None:  # deterministic proposals only
            alternatives = block.candidates[1][:len(proposals)]
    return state.grammar.constrain(proposals, cap, q, alternatives, draw=request.sampler._draw)


def plain_steps(parts, draft, request: DecodeRequest, state: DecodeState, n: int) -> StepResult:
    """Up to ``n`` one-token target steps, no drafting (the drafter's context is still fed).

    Greedy without history-dependent processors, each pass is queued on the previous pass's
    still-lazy token before that token is read, as mlx-lm's own decoding does, so host work
    overlaps the next pass. Stops early at a stop id (a queued pass then fed it: ``fed`` says so).
    """
    sampler, tap_ids, policy = request.sampler, draft.target_layer_ids, state.policy
    grammar = state.grammar
    # A grammar reads each token before the next pass is queued: a token it then forces more
    # after ends the stretch before that pass, and one verify pass takes the forced tokens.
    pipelined = sampler.pipelines_plain_steps and grammar is None
    started, context = time.perf_counter(), len(state.fed)

    def step(token) -> tuple[mx.array, mx.array]:
        tokens = mx.array([[token]]) if isinstance(token, int) else token.reshape(1, 1)
        logits, taps = forward(parts, tokens, state.cache, tap_ids)
        return logits[0, -1:], taps

    fed, (logits, taps) = state.history[-1], step(state.history[-1])
    out: list[int] = []
    rows: list[mx.array] = []  # each step's raw logits, read once at the end (logprobs asked)
    stretch, i = n, 0
    while i < n:
        more = i + 1 < n
        if request.logprobs is not None:
            rows.append(logits)
        processed = sampler.process(logits, state.history + out, None)
        if grammar is not None:
            # Computed while the pass queued on the last token runs (pipelined steps).
            allowed = grammar.step_mask()
            if allowed is None:  # no token can follow: this step's token is dropped, stop here
                more, n = False, i + 1
            processed = apply_mask(processed, allowed)
        if pipelined:
            lazy = mx.argmax(processed, axis=-1)
            if more:  # queue the next pass on the lazy token, then read it
                next_logits, next_taps = step(lazy)
                mx.async_eval(next_logits, next_taps)
            token = int(lazy.item())
        else:
            token = int(sampler.sample(processed).item())
        if grammar is not None and grammar.dead is None:
            grammar.consume(token)
        state.fed.append(fed)
        state.commit_taps(taps)
        policy.observe(Outcome(Plain(1), context=len(state.fed)))  # priced at its own context
        out.append(token)
        if more and policy.looks_up and policy.lookup_worth(
                state.look(request, MAX_CHAIN, out)):
            # The context continues itself here: end the stretch and verify that instead (a
            # pass already queued on this token is taken first, as the stretch's last step).
            n = i + 2 if pipelined else i + 1
            more = i + 1 < n
        if more and grammar is not None and grammar.dead is None and grammar.forces():
            # The grammar forces what follows: end the stretch and verify that for free.
            n = i + 2 if pipelined else i + 1
            more = i + 1 < n
        if token in request.stop_ids or not more:
            if token in request.stop_ids and pipelined and more:
                state.fed.append(token)  # the queued pass fed it
                state.commit_taps(next_taps)
                if shard_count(parts) > 1:
                    # Finished here, not left running past the generation's end: a sharded
                    # target's next collective outside this stream would otherwise pair with one
                    # of its own. (One process lets it finish while the caller reads the output.)
                    mx.eval(next_logits, next_taps)
            break
        if not pipelined:
            next_logits, next_taps = step(token)
            if grammar is not None:  # the pass runs while the host computes its mask
                mx.async_eval(next_logits, next_taps)
        fed, logits, taps = token, next_logits, next_taps
        i += 1
    policy.give_back(stretch - len(out))
    # A stretch of pipelined steps prices a plain step; one step alone, a lone one-row pass.
    state.timed("step" if pipelined and len(out) > 1 else "verify", 1, context,
                (time.perf_counter() - started) / max(1, len(out)))
    mx.async_eval(state.pending, [c.state for c in state.cache])
    scores = request.scored(mx.concatenate(rows), out) if rows else None
    return StepResult(out, len(out) - 1, 0, started, True, logprobs=scores)


def verify_tree(parts, draft, request: DecodeRequest, state: DecodeState,
                plan: Tree | Continuation, block: DraftedBlock | None, context: int) -> StepResult:
    """One target pass over a draft tree (or a tree of rival continuations, rooted here at the
    anchor); walk the target's tokens down it; keep that path."""
    tree, sampler = plan.tree, request.sampler
    if isinstance(plan, Continuation):
        tree = DraftTree([state.history[-1]] + tree.tokens[1:], tree.parents, tree.depths,
                         tree.scores, tree.ranks)
    kept, bits = list(range(len(tree))), None
    if state.grammar is not None:  # nodes the grammar rejects cost no row; each row its mask
        kept, bits = state.grammar.tree(tree)
        tree = tree.subtree(kept)
    drafted = time.perf_counter()
    start = len(state.fed)
    logits, taps = tree_forward(parts, tree, state.cache, draft.target_layer_ids)
    logits = logits[0]
    if sampler.has_history_processors:  # each node's processors see its own path
        rows = [sampler.process(logits[i:i + 1],
                                state.history + [tree.tokens[j] for j in tree.path_to(i)], None)
                for i in range(len(tree))]
        processed = mx.concatenate(rows)
    else:
        processed = sampler.process(logits, state.history, None)
    if bits is not None:
        processed = apply_mask(processed, state.grammar.allowed(bits))
    # One independent draw per node (argmax when greedy): exact without the drafter's q.
    path, bonus = walk(tree, sampler.sample(processed).tolist())
    if bits is not None:
        state.grammar.settle_path([tree.tokens[i] for i in path], bonus)
    state.timed("verify", len(tree), start, time.perf_counter() - drafted)
    keep = [0] + path
    # The root and the accepted nodes predicted the emitted tokens (the path, then the bonus).
    scores = request.scored(logits[mx.array(keep)], [tree.tokens[i] for i in path] + [bonus])
    commit_tree_path(state.cache, start, keep, len(tree))
    state.fed += [tree.tokens[i] for i in keep]
    state.commit_taps(taps[:, mx.array(keep)])
    state.policy.observe(Outcome(plan, len(path), tuple(kept[i] for i in path),
                                 None if block is None else block.log_conf,
                                 0 if block is None else block.rows, context))
    mx.async_eval(state.pending, [c.state for c in state.cache])
    return StepResult([tree.tokens[i] for i in path] + [bonus], len(path), len(tree) - 1,
                      drafted, False, depths=max(tree.depths),
                      lookup=isinstance(plan, Continuation), logprobs=scores)


def _decode(parts, draft, tokenizer, request: DecodeRequest, state: DecodeState, reused: int,
            keep: tuple[PromptCache, CacheEntry] | None) -> Generator[DFlashResponse, None, None]:
    # As mlx-lm's stream_generate: the wired limit around the generation (Metal), each pass on
    # the generation stream, the buffer cache cleared after the prompt, now and then, and at the
    # end (dflash.backend.generation_context).
    with generation_context(parts.model) as stream:
        yield from _decode_on(parts, draft, tokenizer, request, state, reused, keep, stream)


def _decode_on(parts, draft, tokenizer, request: DecodeRequest, state: DecodeState, reused: int,
               keep: tuple[PromptCache, CacheEntry] | None,
               stream) -> Generator[DFlashResponse, None, None]:
    # ``keep``: where the caches go when the generation ends (prompt and reply, for the next
    # turn); a generation that fails or is abandoned keeps nothing (its caches may be
    # mid-update), and the entry it took stays in the prompt cache untouched (it had a copy).
    detok = Detokenizer(tokenizer, request.stops)
    stats = DFlashResponse(prompt_tokens=len(request.prompt_ids),
                           priced_ms=state.policy.stats.priced_ms)  # 0.0, or None: not priced
    max_tokens = request.max_tokens
    mx.reset_peak_memory()

    tic = time.perf_counter()
    with pass_stream(stream):
        last_logits = _prefill(parts, draft, request, state, reused,
                               None if keep is None else keep[1])
    if keep is not None:
        stats.reused_prompt_tokens = reused

    def finish_cache() -> None:
        if keep is not None:
            state.sync_drafter(draft)
            mx.eval([c.state for c in state.dcache])
            keep[0].store(parts, draft, keep[1], state.cache, state.dcache, state.fed)

    prompt_scores = None if state.scorer is None else state.scorer.entries
    if max_tokens == 0:
        stats.finish_reason = "length"
        finish_cache()
        stats.peak_memory = mx.get_peak_memory() / 1e9  # the prefill's
        stats.prompt_logprobs = prompt_scores
        yield stats
        return
    with pass_stream(stream):
        emitted = [first_token(request, state, last_logits)]
        scores = request.scored(last_logits, emitted)
    mx.clear_cache()
    stats.prompt_tps = len(request.prompt_ids) / (time.perf_counter() - tic)
    tic = time.perf_counter()
    while True:
        # Emit what the last cycle produced (the first time: the prefill's token).
        response = emit(request, state, stats, detok, emitted, tic, scores)
        if prompt_scores is not None:  # on the first response only
            response.prompt_logprobs, prompt_scores = prompt_scores, None
        if response.finish_reason is not None:
            finish_cache()
        yield response
        if response.finish_reason is not None:
            return

        t0 = time.perf_counter()
        done = stats.generation_tokens
        bs = min(request.block_size, max_tokens - done)
        with pass_stream(stream):
            step = speculative_step(parts, draft, request, state, bs, max_tokens - done)
        emitted, scores = step.tokens, step.logprobs
        count_step(stats, state, step, t0, time.perf_counter())
        if (done + len(emitted)) // CLEAR_CACHE_EVERY > done // CLEAR_CACHE_EVERY:
            mx.clear_cache()


def first_token(request: DecodeRequest, state: DecodeState, last_logits: mx.array) -> int:
    """The token after the prompt, from the prefill's last logits."""
    sampler = request.sampler
    processed = sampler.process(last_logits, state.history, [])
    if state.grammar is not None:
        processed = apply_mask(processed, state.grammar.step_mask())
    token = int(sampler.sample(processed).item())
    if state.grammar is not None and state.grammar.dead is None:
        state.grammar.consume(token)
    return token


def emit(request: DecodeRequest, state: DecodeState, stats: DFlashResponse, detok: Detokenizer,
         emitted: list[int], tic: float,
         logprobs: list[TokenLogprob] | None = None) -> DFlashResponse:
    """The response for the tokens a cycle produced: cut at a stop id, at ``max_tokens`` or at a
    stop string; the history and the running statistics updated (``tic``: decoding's start).
    ``logprobs``: the tokens' log-probabilities, cut with them."""
    finish = None
    grammar = state.grammar
    if grammar is not None and grammar.drop_last:
        # The last token came from a row the grammar allowed nothing in: not the grammar's.
        emitted, finish, grammar.drop_last = emitted[:-1], FINISH_REASON, False
        stats.grammar_message = grammar.dead
    if grammar is not None:
        stats.forced_tokens = grammar.forced_total
    for j, t in enumerate(emitted):
        if t in request.stop_ids:
            emitted, finish = emitted[:j], "stop"
            break
    remaining = request.max_tokens - stats.generation_tokens
    if len(emitted) >= remaining and finish is None:
        emitted, finish = emitted[:remaining], "length"
    state.history.extend(emitted)
    stats.generation_tokens += len(emitted)
    text, hit_stop = detok.add(emitted, final=finish is not None)
    if hit_stop:
        finish = "stop"
    elapsed = time.perf_counter() - tic
    stats.generation_tps = stats.generation_tokens / elapsed if elapsed > 0 else 0.0
    stats.peak_memory = mx.get_peak_memory() / 1e9
    stats.acceptance_by_position = [a / p if p else 0.0
                                    for a, p in zip(state.accepted_at, state.proposed_at)]
    response = snapshot(stats, text, emitted, finish)
    if logprobs is not None:
        response.logprobs = list(logprobs[:len(emitted)])
    return response


def count_step(stats: DFlashResponse, state: DecodeState, step: StepResult, t0: float,
               t2: float) -> None:
    """Add one step (started at ``t0``, ended at ``t2``) to the running statistics."""
    a = step.accepted
    stats.draft_time += step.drafted_at - t0
    stats.verify_time += t2 - step.drafted_at
    stats.accepted = a
    stats.cycle_tau = a + 1
    stats.plain_steps = state.policy.stats.plain_steps
    stats.tree_cycles = state.policy.stats.tree_cycles
    stats.rows_per_pass = state.policy.stats.rows_per_pass
    stats.priced_ms = state.policy.stats.priced_ms
    if step.plain:
        return
    stats.cycles += 1
    stats.verified_tokens += step.verified
    state.cycle_tokens += a + 1
    stats.mean_tau = state.cycle_tokens / stats.cycles
    stats.lookup_cycles = state.policy.stats.lookup_cycles
    stats.index_cycles = state.policy.stats.index_cycles
    if step.lookup:  # acceptance by position is the drafter's
        return
    for j in range(step.verified if step.depths is None else step.depths):
        state.proposed_at[j] += 1
        state.accepted_at[j] += j < a


def snapshot(stats: DFlashResponse, text: str, tokens: list[int], finish) -> DFlashResponse:
    out = DFlashResponse(**{k: getattr(stats, k) for k in stats.__dataclass_fields__})
    out.text, out.tokens, out.finish_reason = text, list(tokens), finish
    out.token = tokens[-1] if tokens else None
    out.acceptance_by_position = list(stats.acceptance_by_position)
    return out


def generate(model, draft, tokenizer, prompt, verbose: bool = False, *,
             prompt_cache: PromptCache | None = None, settings: GenerationSettings | None = None,
             **kwargs) -> GenerationResult:
    """Non-streaming :func:`stream_generate`: the whole text, the tokens and the final statistics
    (with ``logprobs=N``, every token's log-probability; ``prompt_logprobs``, the prompt's)."""
    settings = GenerationSettings.from_call((), settings, **kwargs)
    text, tokens, last = [], [], None
    scores, prompt_scores = None, None
    for r in stream_generate(model, draft, tokenizer, prompt, prompt_cache=prompt_cache,
                             settings=settings):
        text.append(r.text)
        tokens.extend(r.tokens)
        last = r
        if r.logprobs is not None:
            scores = (scores or []) + r.logprobs
        if r.prompt_logprobs is not None:
            prompt_scores = r.prompt_logprobs
        if verbose:
            print(r.text, end="", flush=True)
    if verbose:
        print()
    if settings.logprobs is not None and scores is None:
        scores = []  # asked, and no token came
    return GenerationResult("".join(text), tokens, last.finish_reason, last, scores,
                            prompt_scores)
