"""Batched speculative decoding: several sequences share every drafter pass and every target pass.

Why: on a small target, a verify pass of 16 rows costs about what 2 one-token steps cost, so one
sequence leaves most of a pass's rows idle. Serving several users, those rows are better spent on
their sequences: one drafter pass drafts every active sequence's block, one target pass verifies
all of them, and each sequence accepts and rolls back on its own.

Design:

* **Ragged caches.** Target and drafter keep one :class:`~dflash.ragged_cache.RaggedKVCache` per
  layer: row ``b`` owns slots ``0 .. length_b - 1``, a pass writes each row's new keys after its
  own length, the mask hides the rest, RoPE reads one offset per row, and roll-back is setting a
  row's length. No copy per cycle (mlx-lm's left-padded ``BatchKVCache`` would need each row
  re-aligned after a partial acceptance), and mlx-lm's own attention modules run unchanged. A
  drafter with a draft window keeps a :class:`~dflash.ragged_cache.RaggedWindowCache` per layer
  instead: each row only the positions its window still sees.
* **One step** (:meth:`BatchGenerator.step`): cancelled sequences leave; at most
  ``prefill_chunk`` prompt tokens are prefilled, from the head of the queue (each prompt alone
  through ordinary caches: exactly the single-sequence prefill; short prompts arriving together
  share one step's budget); a prompt whose prefill is done emits its first token and joins the
  batch (its caches become new rows); then one decode cycle for every joined sequence; finished
  sequences leave. A burst of prompts is prefilled before the batch decodes on (the step ends
  after its prefill while the next waiting prompt fits in ``PREFILL_BURST`` chunks since the
  last cycle: every first token of a burst goes out without waiting for decode cycles), while a
  long prompt costs the others one chunk per cycle. (Prefilling several prompts in one padded
  pass was measured no faster on the CPU than one after another, so prompts stay alone.)
* **A lone sequence** (one row, nothing waiting) decodes with the single-sequence engine's own
  cycle (:func:`~dflash.speculative.speculative_step`: its verify policy, draft trees,
  pipelined plain steps) on ordinary caches taken from the batch's one row, and goes back into
  the batch as row 0 when another sequence joins; the state it carries (policy statistics,
  acceptance calibration, sampler, stats) is the same object in both. Hybrid targets too: the
  GatedDeltaNet row becomes an ``ArraysCache`` (chains: trees need attention-only targets).
* **Verify width across the batch.** A ``(B, n)`` pass costs ``B * n`` rows however they are
  shared, so every sequence verifies up to ``n - 1`` proposals (fewer near its ``max_tokens``)
  and the policy chooses ``n``: :func:`~dflash.policy.batch.batch_width` maximises expected
  committed tokens per millisecond under the measured cost model, from each sequence's own
  calibrated acceptance (its :class:`~dflash.policy.auto.AutoPolicy`). ``n = 1`` is plain
  batched decoding, without a drafter pass: as the batch grows, ``verify(B * n)`` grows and plain
  steps win by themselves. When speculation loses, plain
  steps run for a stretch that doubles while it keeps losing, then one cycle probes again (the
  single-sequence back-off, :class:`~dflash.policy.batch.BatchPolicy`).
  ``policy="fixed"`` verifies the whole block. Chains only: trees are for a lone sequence.
* **Continuations.** Under ``auto`` a row may verify its own context's continuation
  (:mod:`dflash.lookup`) instead of its drafted block, where that is expected to commit more;
  when the rows' continuations beat drafting, the pass has no drafter pass at all (rows without
  one take a plain step in it).
* **Per sequence**: sampling settings, seeds, penalties, stops and limits are the
  single-sequence engine's (:func:`~dflash.request.build_request`, ``BlockSampler.accept``,
  :func:`~dflash.speculative.emit`), so greedy output equals the target alone and sampled output
  keeps its distribution.

With ``max_batch=1`` there is never a batch: sequences go through the single-sequence engine
(draft trees and pipelined plain steps included), one after another.

Hybrid targets (Qwen3.5) batch too: their GatedDeltaNet layers keep a
:class:`~dflash.ragged_cache.RaggedArraysCache` (conv window and recurrent state per row), and
roll-back replays each row's accepted steps from the pass's start state with the other steps
masked (:func:`~dflash.target.rollback_rows`). Targets with sliding windows and DFlash2 drafters
are not batched: the engine says so once and decodes their sequences one at a time through the
single-sequence engine (each step advances each of them by one cycle).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache

from .backend import generation_context, generation_stream, pass_stream
from .batch_pass import BatchPass
from .console import log
from .cost_model import cost_model
from .distributed import model_ranks
from .errors import GenerationConfigError
from .policy import (
    check_policy,
    make_batch_policy,
    policy_class,
)
from .policy.agreed import agreed_batch
from .policy.memory import PairMemory
from .prompt_cache import CacheEntry, PromptCache
from .ragged_cache import RaggedArraysCache, RaggedKVCache
from .request import DecodeRequest, build_request
from .sampling import _is_int, check_decode_settings
from .settings import ENGINE_HOME, GenerationSettings
from .speculative import (
    DecodeState,
    Detokenizer,
    DFlashResponse,
    GenerationResult,
    StepResult,
    count_step,
    emit,
    first_token,
    new_state,
    prefill_chunk,
    run_request,
    snapshot,
    speculative_step,
)
from .target import (
    check_compatible,
    make_cache,
    target_parts,
)

# Most plain one-token steps a lone sequence takes in one engine step (the single-sequence policy
# backs off for up to MAX_BACKOFF): a request arriving meanwhile waits at most these.
LONE_STRETCH = 16
# Prompt tokens (in prefill chunks) the batch may wait for, without decoding, while a burst of
# arriving prompts is prefilled: enough for a few chat-sized prompts, not one long document.
PREFILL_BURST = 2


@dataclass
class BatchEvent:
    """What one step produced for one sequence: new text and tokens, or its end."""

    uid: int
    text: str
    tokens: list[int]
    finish_reason: str | None
    stats: DFlashResponse


@dataclass
class _Sequence:
    uid: int
    request: DecodeRequest
    state: DecodeState | None  # None in the one-at-a-time fallback (its stream keeps one)
    stats: DFlashResponse
    detok: Detokenizer
    cache: list | None = None  # its own caches while it prefills
    dcache: list | None = None
    prefilled: int = 0
    tic: float = 0.0  # when its prefill started, then when its decoding started
    conf: np.ndarray | None = None  # the drafter's top probabilities in its last drafted block
    stream: Generator[DFlashResponse, None, None] | None = None  # one-at-a-time fallback
    prompt_cache: PromptCache | None = None  # where its prefill starts from and is kept
    entry: CacheEntry | None = None  # the caches it took from there

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - self.stats.generation_tokens


def fallback_reason(parts, draft) -> str | None:
    """Why this pair cannot be batched (None: it can)."""
    if draft.config.is_dflash2:
        return "DFlash2 drafters are not batched"
    if any(t != "full_attention" for t in draft.layer_types()):
        return "drafters with sliding-window layers are not batched"
    for i, c in enumerate(make_cache(parts)):
        if type(c) not in (KVCache, ArraysCache):
            return (f"target layer {i} keeps a {type(c).__name__} (sliding-window layers are "
                    "not batched)")
    return None


class BatchGenerator:
    """Continuous batching of speculative decoding; driven by one thread calling :meth:`step`."""

    def __init__(self, model, draft, tokenizer, *, max_batch: int = 8, prefill_chunk: int = 256,
                 block_size: int | None = None, policy: str = "auto",
                 prompt_cache: PromptCache | None = None, memory: PairMemory | None = None):
        self.parts = target_parts(model)
        check_compatible(self.parts, draft)
        self.draft, self.tokenizer = draft, tokenizer
        self.costs = cost_model(self.parts, draft)  # told each batched pass's time
        self.stream = generation_stream()  # mlx-lm's: every pass of a step runs on it
        for name, value in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk)):
            if not _is_int(value) or value < 1:
                raise GenerationConfigError(f"{name}={value!r}: must be an integer >= 1")
        self.max_batch, self.prefill_chunk = int(max_batch), int(prefill_chunk)
        self.block_size = draft.block_size if block_size is None else block_size
        check_decode_settings(self.block_size, 0, self.prefill_chunk, 0.0)
        check_policy(policy)
        self.policy = policy
        self.memory = memory  # every sequence's policy starts from it (None: the drafter's)
        self.fallback = fallback_reason(self.parts, draft)
        if self.fallback is not None:
            log(f"dflash: {self.fallback}; decoding the batch one sequence at a time")
        elif self.max_batch == 1:  # never a batch: the single-sequence engine (trees included)
            self.fallback = "max_batch=1"
        # How the batch speculates (the same back-off as one sequence); None: not batched.
        # Sharded, rank 0 decides and the other ranks take its decisions (policy.agreed).
        self.speculation = None if self.fallback else agreed_batch(make_batch_policy(
            policy, cost_model(self.parts, draft) if policy_class(policy).needs_cost else None),
            model_ranks(self.parts))
        # Shared prefixes (system prompts, earlier turns): each prompt is prefilled alone, so it
        # can start from the caches of the last prompt prefilled (see PromptCache.take).
        self.prompt_cache = prompt_cache
        self.queue: deque[_Sequence] = deque()
        self.prefilling: _Sequence | None = None
        self.rows: list[_Sequence] = []  # decoding; row i of the batch caches
        self.cache = [RaggedKVCache() if type(c) is KVCache else RaggedArraysCache()
                      for c in make_cache(self.parts)]
        self.dcache = draft.make_batch_cache()
        self.cancelled: set[int] = set()
        self.next_uid = 0
        self.stalled = 0  # prompt tokens prefilled since the last decode cycle

    @property
    def cost(self):
        """The cost model the batch and its sequences' policies decide with (``None``: none)."""
        return None if self.speculation is None else self.speculation.cost

    @cost.setter
    def cost(self, cost) -> None:
        if self.speculation is not None:
            self.speculation.cost = cost

    # -- requests -----------------------------------------------------------------------------

    def insert(self, prompt: str | Sequence[int], prompt_cache: PromptCache | None = None,
               settings: GenerationSettings | None = None, **kwargs) -> int:
        """Queue a prompt with the settings of :func:`~dflash.speculative.stream_generate`
        (``settings=`` and/or keywords, checked now: a typed error names the field); its uid.
        ``prompt_cache``: the prefix cache its prefill starts from and is kept in (``None``: the
        batch's)."""
        settings = GenerationSettings.from_call((), settings, **kwargs)
        for name, value in settings.engine_settings_given().items():
            home = ENGINE_HOME[name]
            raise GenerationConfigError(
                f"{name}={value!r}: a setting of the whole batch ({home}), not of one request"
                if home else f"{name}={value!r}: not a setting of BatchGenerator; "
                "stream_generate does take it")
        request = build_request(self.parts, self.draft, self.tokenizer, prompt, settings.replace(
            block_size=self.block_size, policy=self.policy, prefill_step_size=self.prefill_chunk,
            memory=self.memory))
        if request.kv is not None and self.fallback is None:
            # mlx-lm batches no quantized cache (its BatchKVCache cannot convert, its
            # BatchGenerator takes no kv_bits, its server decodes kv_bits requests one at a
            # time): there is no batched decoding of its to be identical to.
            raise GenerationConfigError(
                f"kv_bits={request.kv.bits}: the batched engine (max_batch={self.max_batch}) keeps "
                "float caches, as mlx-lm's batched decoding does (mlx-lm has no batched quantized "
                "KV cache); quantized KV caches decode one sequence at a time (max_batch=1, the "
                "server's max_concurrency=1)")
        # (The one-at-a-time fallback decodes with the single-sequence engine's own state.)
        state = None if self.fallback else \
            new_state(self.parts, self.draft, request, None, None, self.cost)
        if state is not None:  # its passes are shared with other rows: no price of its own
            state.policy.stats.priced_ms = None
        uid, self.next_uid = self.next_uid, self.next_uid + 1
        prompt_cache = self.prompt_cache if prompt_cache is None else prompt_cache
        if request.prompt_logprobs:  # every prompt row is scored: nothing cached is skipped
            prompt_cache = None
        self.queue.append(_Sequence(uid, request, state,
                                    DFlashResponse(prompt_tokens=len(request.prompt_ids)),
                                    Detokenizer(self.tokenizer, request.stops),
                                    prompt_cache=prompt_cache))
        return uid

    def cancel(self, uid: int) -> None:
        """The sequence leaves at the next step (its last event says ``"cancelled"``)."""
        self.cancelled.add(uid)

    @property
    def active(self) -> int:
        """Sequences decoding or prefilling."""
        return len(self.rows) + (self.prefilling is not None)

    @property
    def pending(self) -> int:
        """Sequences waiting for a place in the batch."""
        return len(self.queue)

    # -- the engine step ----------------------------------------------------------------------

    def step(self) -> list[BatchEvent]:
        """One engine step: leaves, at most one prefill chunk, then one decode cycle unless a
        burst of prompts is still being prefilled (see :meth:`_prefill_first`)."""
        with pass_stream(self.stream):
            return self._step()

    def _step(self) -> list[BatchEvent]:
        events: list[BatchEvent] = []
        self._leave_cancelled(events)
        if self.fallback is not None:
            self._step_one_at_a_time(events)
            return events
        first = self._prefill_first()
        fed = self._prefill(events)
        if first:  # the first tokens go out now; decoding waits for the burst's prefills
            self.stalled += fed
            return events
        self.stalled = 0
        if len(self.rows) == 1 and self.prefilling is None and not self.queue:
            self._lone_cycle(events)
        elif self.rows:
            self._cycle(events)
        return events

    def _next_prompt(self) -> _Sequence | None:
        """The sequence the next prefill chunk is for, if any."""
        if self.prefilling is not None:
            return self.prefilling
        return self.queue[0] if self.queue and len(self.rows) < self.max_batch else None

    def _prefill_first(self) -> bool:
        """Prefill without a decode cycle this step? Yes while the next waiting prompt can be
        prefilled to its end within ``PREFILL_BURST`` chunks of prompt tokens since the last
        cycle: a burst of short prompts gets every first token before the batch decodes on,
        while a long prompt still costs the others one chunk per cycle (docs/how-it-works.md,
        "Many sequences at once")."""
        seq = self._next_prompt()
        if seq is None:
            return False
        if not self.rows:
            self.stalled = 0  # nobody waits
            return True
        left = len(seq.request.prompt_ids) - seq.prefilled
        return self.stalled + left <= PREFILL_BURST * self.prefill_chunk

    def _prefill(self, events: list[BatchEvent]) -> int:
        """Up to ``prefill_chunk`` prompt tokens, from the head of the queue; the tokens fed."""
        budget = self.prefill_chunk
        while budget > 0 and self._next_prompt() is not None:
            if self.prefilling is None:
                self._start_prefill(self.queue.popleft())
            budget -= self._prefill_step(events, budget)
        return self.prefill_chunk - budget

    def _start_prefill(self, seq: _Sequence) -> None:
        self.prefilling, seq.tic = seq, time.perf_counter()
        if seq.prompt_cache is None:
            seq.cache, seq.dcache = make_cache(self.parts), self.draft.make_cache()
            return
        seq.entry = seq.prompt_cache.take(self.parts, self.draft, seq.request.prompt_ids)
        seq.cache, seq.dcache, seq.prefilled = seq.entry.target, seq.entry.draft, seq.entry.reused
        seq.stats.reused_prompt_tokens = seq.prefilled

    def _event(self, seq: _Sequence, response: DFlashResponse, events: list[BatchEvent]) -> None:
        if response.finish_reason is not None and seq.state is not None:
            seq.state.policy.finish()
            if seq.request.index is not None:  # what it saw and wrote, for the next requests
                seq.request.index.add(seq.state.history)
        if response.tokens or response.text or response.finish_reason is not None:
            events.append(BatchEvent(seq.uid, response.text, list(response.tokens),
                                     response.finish_reason, response))

    def _leave_cancelled(self, events: list[BatchEvent]) -> None:
        if not self.cancelled:
            return
        gone = self.cancelled
        self.cancelled = set()
        for seq in [s for s in self.queue if s.uid in gone]:
            self.queue.remove(seq)
            self._event(seq, snapshot(seq.stats, "", [], "cancelled"), events)
        if self.prefilling is not None and self.prefilling.uid in gone:
            seq, self.prefilling = self.prefilling, None
            self._event(seq, snapshot(seq.stats, "", [], "cancelled"), events)
        for seq in self.rows:
            if seq.uid in gone:
                if seq.stream is not None:
                    seq.stream.close()
                self._event(seq, snapshot(seq.stats, "", [], "cancelled"), events)
        self._keep([i for i, s in enumerate(self.rows) if s.uid not in gone])

    def _keep(self, rows: list[int]) -> None:
        """Only these rows stay in the batch (the others finished or left)."""
        if len(rows) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in rows]
        if self.fallback is None:
            for c in self.cache + self.dcache:
                c.keep(rows)

    def _prefill_step(self, events: list[BatchEvent], budget: int) -> int:
        """Up to ``budget`` prompt tokens of the prefilling sequence (alone, through its own
        caches); at the prompt's end, its first token and its join. The tokens fed."""
        seq = self.prefilling
        ids, begin = seq.request.prompt_ids, seq.prefilled
        chunk = ids[begin:begin + budget]
        if seq.entry is not None and begin < seq.entry.shared < begin + len(chunk):
            chunk = ids[begin:seq.entry.shared]  # a prefix other conversations share: snapshot
        last = prefill_chunk(self.parts, self.draft, chunk, seq.cache, seq.dcache,
                             seq.state.scorer)
        mx.clear_cache()  # after each prompt chunk, as mlx-lm's prefill
        seq.prefilled = begin + len(chunk)
        if seq.entry is not None:  # a point a prompt sharing only a prefix can go back to
            seq.entry.snapshot(seq.prefilled)
        if seq.request.progress:
            seq.request.progress(seq.prefilled, len(ids))
        if seq.prefilled < len(ids):
            return len(chunk)
        self.prefilling = None
        self._joined(seq, last, events)
        return len(chunk)

    def _joined(self, seq: _Sequence, last: mx.array, events: list[BatchEvent]) -> None:
        """A prompt is prefilled: its first token, then its caches join the batch as a row."""
        ids = seq.request.prompt_ids
        if seq.prompt_cache is not None:  # the next prompt may share a prefix with this one
            seq.prompt_cache.store(self.parts, self.draft, seq.entry, seq.cache, seq.dcache, ids,
                                   persist=seq.request.max_tokens == 0)
        prompt_scores = None if seq.state.scorer is None else seq.state.scorer.entries
        if seq.request.max_tokens == 0:
            response = snapshot(seq.stats, "", [], "length")
            response.prompt_logprobs = prompt_scores
            self._event(seq, response, events)
            return
        token = first_token(seq.request, seq.state, last)
        now = time.perf_counter()
        seq.stats.prompt_tps = len(ids) / (now - seq.tic)
        seq.tic = now
        response = emit(seq.request, seq.state, seq.stats, seq.detok, [token], seq.tic,
                        seq.request.scored(last, [token]))
        response.prompt_logprobs = prompt_scores
        self._event(seq, response, events)
        if response.finish_reason is not None:
            return
        if self.rows or seq.prompt_cache is not None:
            # (Copied into the batch: the prompt cache keeps these for the next prompt.)
            self._to_batch()
            self._add_row(seq.cache, seq.dcache)
        else:  # alone so far: it keeps its own caches (see _lone_cycle)
            seq.state.cache, seq.state.dcache = seq.cache, seq.dcache
        seq.cache = seq.dcache = None
        self.rows.append(seq)

    # -- a sequence alone: the single-sequence engine's cycle ---------------------------------

    def _add_row(self, cache: list, dcache: list) -> None:
        for ragged, c in zip(self.cache + self.dcache, cache + dcache):
            ragged.add_cache(c)

    def _to_batch(self) -> None:
        """A lone sequence's own caches become row 0 of the batch (another one joins)."""
        if len(self.rows) != 1 or self.rows[0].state.cache is None:
            return
        state = self.rows[0].state
        self._add_row(state.cache, state.dcache)
        state.cache = state.dcache = None

    def _lone_cycle(self, events: list[BatchEvent]) -> None:
        """One cycle of the single-sequence engine (:func:`~dflash.speculative.speculative_step`:
        its policy, draft trees, pipelined plain steps) for the only sequence, on ordinary
        caches taken from the batch's one row; its state (policy statistics, acceptance
        calibration, sampler, stats) is the one it decodes with in a batch."""
        seq = self.rows[0]
        state = seq.state
        if state.cache is None:
            state.cache = [c.only_row() for c in self.cache]
            state.dcache = [c.only_row() for c in self.dcache]
        # A long plain stretch goes in pieces, so a request arriving meanwhile waits at most
        # LONE_STRETCH steps for its prefill.
        t0 = time.perf_counter()
        step = speculative_step(self.parts, self.draft, seq.request, state,
                                min(seq.request.block_size, seq.remaining), seq.remaining,
                                max_stretch=LONE_STRETCH)
        count_step(seq.stats, state, step, t0, time.perf_counter())
        response = emit(seq.request, state, seq.stats, seq.detok, step.tokens, seq.tic,
                        step.logprobs)
        self._event(seq, response, events)
        if response.finish_reason is not None:
            self._keep_reply(seq, state.cache, state.dcache)
            state.cache = state.dcache = None
            self.rows = []

    # -- one decode cycle for every row -------------------------------------------------------

    def _cycle(self, events: list[BatchEvent]) -> None:
        """One decode cycle for every row: one batched pass (:class:`~dflash.batch_pass.BatchPass`),
        then each row's statistics and event."""
        self._to_batch()  # a lone sequence while another prefills
        t0 = time.perf_counter()
        steps = BatchPass(self.parts, self.draft, self.costs, self.speculation, self.cache,
                          self.dcache, self.rows).run(self.block_size)
        self._emit_all(steps, t0, time.perf_counter(), events)

    def _emit_all(self, steps: list[StepResult], t0: float, t2: float,
                  events: list[BatchEvent]) -> None:
        """Each row's statistics and event; finished rows leave."""
        done = []
        for s, step in zip(self.rows, steps):
            count_step(s.stats, s.state, step, t0, t2)
            response = emit(s.request, s.state, s.stats, s.detok, step.tokens, s.tic,
                            step.logprobs)
            self._event(s, response, events)
            done.append(response.finish_reason is not None)
            if done[-1]:
                i = len(done) - 1
                self._keep_reply(s, [c.row(i) for c in self.cache],
                                 [c.row(i) for c in self.dcache])
        self._keep([i for i, d in enumerate(done) if not d])

    def _keep_reply(self, seq: _Sequence, cache: list, dcache: list) -> None:
        """A finished sequence's caches (prompt and reply) go to its prompt cache, where the
        next turn of its conversation finds them; ``cache`` and ``dcache`` are its own."""
        if seq.prompt_cache is None or seq.entry is None:
            return
        seq.state.dcache = dcache
        seq.state.sync_drafter(self.draft)  # the last cycle's features
        mx.eval([c.state for c in cache + dcache])
        reply = CacheEntry(cache, dcache, snapshots=dict(seq.entry.snapshots))
        seq.prompt_cache.store(self.parts, self.draft, reply, cache, dcache, seq.state.fed)

    # -- targets that cannot be batched -------------------------------------------------------

    def _step_one_at_a_time(self, events: list[BatchEvent]) -> None:
        """The single-sequence engine for each sequence in turn, one cycle each per step."""
        while self.queue and len(self.rows) < self.max_batch:
            seq = self.queue.popleft()
            seq.stream = run_request(self.parts, self.draft, self.tokenizer, seq.request,
                                     seq.prompt_cache)
            self.rows.append(seq)
        done = []
        for seq in self.rows:
            response = next(seq.stream)
            seq.stats = response
            self._event(seq, response, events)
            done.append(response.finish_reason is not None)
        self._keep([i for i, d in enumerate(done) if not d])


def batch_generate(model, draft, tokenizer, prompts: Sequence[str | Sequence[int]], *,
                   max_batch: int = 8, prefill_chunk: int = 256, block_size: int | None = None,
                   policy: str = "auto", memory: PairMemory | None = None,
                   settings: GenerationSettings | None = None,
                   **kwargs) -> list[GenerationResult]:
    """Generate for every prompt through one :class:`BatchGenerator`; results in input order.

    The settings are :func:`~dflash.speculative.stream_generate`'s (``settings=`` and/or
    keywords: ``max_tokens``, ``temperature``, ``stop``, ...), the same for every prompt.
    """
    settings = GenerationSettings.from_call((), settings, **kwargs)
    engine = BatchGenerator(model, draft, tokenizer, max_batch=max_batch,
                            prefill_chunk=prefill_chunk, block_size=block_size, policy=policy,
                            memory=memory)
    uids = [engine.insert(p, settings=settings) for p in prompts]
    text: dict[int, list[str]] = {u: [] for u in uids}
    tokens: dict[int, list[int]] = {u: [] for u in uids}
    last: dict[int, DFlashResponse] = {}
    asked = settings.logprobs is not None
    scores: dict[int, list | None] = {u: [] if asked else None for u in uids}
    prompt_scores: dict[int, list | None] = {u: None for u in uids}
    with generation_context(model):  # as mlx-lm's batch_generate: the wired limit (Metal)
        while engine.active or engine.pending:
            for e in engine.step():
                text[e.uid].append(e.text)
                tokens[e.uid].extend(e.tokens)
                last[e.uid] = e.stats
                if e.stats.logprobs is not None:
                    scores[e.uid].extend(e.stats.logprobs)
                if e.stats.prompt_logprobs is not None:
                    prompt_scores[e.uid] = e.stats.prompt_logprobs
    return [GenerationResult("".join(text[u]), tokens[u], last[u].finish_reason, last[u],
                             scores[u], prompt_scores[u]) for u in uids]
