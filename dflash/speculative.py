"""The speculative loop: draft a block, verify it in one target pass, accept a prefix, roll back."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from .backend import default_min_confidence
from .errors import GenerationConfigError
from .prompt_cache import PromptCache
from .prompts import encode_text
from .sampling import BlockSampler, SamplingConfig, check_decode_settings
from .target import VerifyTrace, check_compatible, forward, make_cache, rollback, target_parts


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
    acceptance_by_position: list[float] = field(default_factory=list)


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str | None
    stats: DFlashResponse


def _stop_sequences(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not isinstance(s, str) or not s for s in stops):
        raise GenerationConfigError(f"stop={stop!r}: stop strings must be non-empty strings")
    return stops


class _Detokenizer:
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


def stream_generate(
    model,
    draft,
    tokenizer,
    prompt: str | Sequence[int] | mx.array,
    block_size: int | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float | None = None,
    repetition_context_size: int = 20,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    seed: int | None = None,
    *,
    logit_bias: dict[int, float] | None = None,
    sampler: Callable[[mx.array], mx.array] | None = None,
    logits_processors: Sequence[Callable] | None = None,
    proposal: str | None = None,
    presence_context_size: int = 20,
    frequency_context_size: int = 20,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    prefill_step_size: int = 2048,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    prompt_cache: PromptCache | None = None,
    min_confidence: float | None = None,
) -> Generator[DFlashResponse, None, None]:
    """Generate with DFlash speculative decoding, yielding one response per cycle.

    Greedy output equals the target's own greedy output token for token; sampled output has the
    target's distribution under the same settings (see :mod:`dflash.sampling`). A
    :class:`~dflash.prompt_cache.PromptCache` carries the caches over to the next call, which then
    prefills only what its prompt does not share with the tokens already cached.

    ``min_confidence`` shortens the verify pass: drafted tokens are verified up to (not including)
    the first block row where the product of the drafter's top probabilities so far falls below
    it (at least one always is). ``None`` takes the backend's default
    (:func:`dflash.backend.default_min_confidence`: 0 on GPUs, where a verify row costs almost
    nothing; a small threshold on the CPU, where every row costs). Outputs do not depend on it.
    """
    parts = target_parts(model)
    check_compatible(parts, draft)
    block_size = draft.block_size if block_size is None else block_size
    if min_confidence is None:
        min_confidence = default_min_confidence()
    check_decode_settings(block_size, max_tokens, prefill_step_size, min_confidence)
    if proposal is None:
        # Measured on the built-in pair (scripts/bench_sampling.py): sampled proposals accept more
        # at T > 0; at T = 0 both modes are the same. A custom sampler has no q to reject against.
        proposal = "argmax" if sampler is not None else "sample"
    cfg = SamplingConfig(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, repetition_context_size=repetition_context_size,
        presence_penalty=presence_penalty, presence_context_size=presence_context_size,
        frequency_penalty=frequency_penalty, frequency_context_size=frequency_context_size,
        logit_bias=logit_bias, sampler=sampler, logits_processors=logits_processors,
        proposal=proposal, seed=seed)
    cfg.validate(parts.vocab_size)
    stops = _stop_sequences(stop)

    if isinstance(prompt, str):
        prompt_ids = encode_text(tokenizer, prompt)
    else:
        prompt_ids = [int(t) for t in (prompt.tolist() if isinstance(prompt, mx.array) else prompt)]
    if not prompt_ids:
        raise GenerationConfigError("prompt: must hold at least one token")
    if any(not 0 <= t < parts.vocab_size for t in prompt_ids):
        raise GenerationConfigError("prompt: token id outside the target vocabulary")
    stop_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    stop_ids |= {int(t) for t in stop_token_ids or ()}

    return _generate(parts, draft, tokenizer, prompt_ids, block_size, max_tokens,
                     BlockSampler(cfg), stops, stop_ids, prefill_step_size,
                     prompt_progress_callback, prompt_cache, float(min_confidence))


def _generate(parts, draft, tokenizer, prompt_ids, block_size, max_tokens, sampler, stops,
              stop_ids, prefill_step_size, progress, prompt_cache, min_confidence
              ) -> Generator[DFlashResponse, None, None]:
    if prompt_cache is None:
        yield from _decode(parts, draft, tokenizer, prompt_ids, block_size, max_tokens, sampler,
                           stops, stop_ids, prefill_step_size, progress,
                           make_cache(parts), draft.make_cache(), 0, None, min_confidence)
        return
    cache, dcache, reused = prompt_cache.take(parts, draft, prompt_ids)
    try:
        yield from _decode(parts, draft, tokenizer, prompt_ids, block_size, max_tokens, sampler,
                           stops, stop_ids, prefill_step_size, progress, cache, dcache, reused,
                           prompt_cache, min_confidence)
    except BaseException:
        prompt_cache.clear()  # caches may be mid-update
        raise


def _decode(parts, draft, tokenizer, prompt_ids, block_size, max_tokens, sampler, stops,
            stop_ids, prefill_step_size, progress, cache, dcache, reused, prompt_cache,
            min_confidence) -> Generator[DFlashResponse, None, None]:
    taps_ids = draft.target_layer_ids
    detok = _Detokenizer(tokenizer, stops)
    stats = DFlashResponse(prompt_tokens=len(prompt_ids))
    accepted_at = [0] * (block_size - 1)
    proposed_at = [0] * (block_size - 1)
    # A restricted draft vocabulary leaves -inf elsewhere: the confidence needs only its columns
    # (a full-vocabulary logsumexp was ~10 % of a cycle on the CPU).
    draft_columns = (draft.head_cut(parts)[0] if draft.config.draft_vocab_ids is not None
                     else None)
    mx.reset_peak_memory()

    # Prefill in chunks; the drafter sees every prompt row.
    tic = time.perf_counter()
    n = len(prompt_ids)
    for start in range(reused, n, prefill_step_size):
        chunk = mx.array(prompt_ids[start:start + prefill_step_size])[None]
        logits, taps = forward(parts, chunk, cache, taps_ids)
        draft.append_context(taps, dcache)
        mx.eval(logits[:, -1], [c.state for c in cache], [c.state for c in dcache])
        if progress:
            progress(min(start + prefill_step_size, n), n)
    history = list(prompt_ids)
    fed = list(prompt_ids)  # exactly the tokens in the target cache
    hidden = None
    if prompt_cache is not None:
        prompt_cache.snapshot(n)
        stats.reused_prompt_tokens = reused
    if max_tokens == 0:
        stats.finish_reason = "length"
        if prompt_cache is not None:
            prompt_cache.store(parts, draft, cache, dcache, fed, hidden)
        yield stats
        return
    anchor = int(sampler.sample(sampler.process(logits[0, -1:], history, [])).item())
    stats.prompt_tps = n / (time.perf_counter() - tic)
    tic = time.perf_counter()

    emitted = [anchor]
    cycle_tokens = 0
    while True:
        # Emit what the last cycle produced (the first time: the prefill's token).
        finish = None
        for j, t in enumerate(emitted):
            if t in stop_ids:
                emitted, finish = emitted[:j], "stop"
                break
        remaining = max_tokens - stats.generation_tokens
        if len(emitted) >= remaining and finish is None:
            emitted, finish = emitted[:remaining], "length"
        history.extend(emitted)
        stats.generation_tokens += len(emitted)
        text, hit_stop = detok.add(emitted, final=finish is not None)
        if hit_stop:
            finish = "stop"
        elapsed = time.perf_counter() - tic
        stats.generation_tps = stats.generation_tokens / elapsed if elapsed > 0 else 0.0
        stats.peak_memory = mx.get_peak_memory() / 1e9
        stats.acceptance_by_position = [a / p if p else 0.0
                                        for a, p in zip(accepted_at, proposed_at)]
        if finish is not None and prompt_cache is not None:
            prompt_cache.store(parts, draft, cache, dcache, fed, hidden)
        yield _snapshot(stats, text, emitted, finish)
        if finish is not None:
            return

        # Draft: one pass over [anchor, MASK ...] with the new target features as context.
        anchor = history[-1]
        bs = min(block_size, max_tokens - stats.generation_tokens)
        t0 = time.perf_counter()
        if hidden is not None:
            draft.append_context(hidden, dcache)
        proposals, q = [], None
        if bs > 1:
            draft_logits = draft.block_logits(parts, anchor, bs, dcache)
            if min_confidence > 0:  # propose only the rows the target will see
                draft_logits = draft_logits[:_confident_rows(draft_logits, draft_columns,
                                                             min_confidence)]
            proposals, q = sampler.propose(draft_logits, history)
            proposals = proposals.tolist()
        verified = len(proposals) + 1
        t1 = time.perf_counter()

        # Verify: one target pass over [anchor, proposals]; accept a prefix; roll back the rest.
        trace = VerifyTrace()
        verify_in = mx.array([anchor] + proposals)[None]
        logits, taps = forward(parts, verify_in, cache, taps_ids, trace)
        a, bonus = sampler.accept(logits[0], proposals, q, history)
        rollback(cache, trace, keep=a + 1, verified=verified)
        fed += [anchor] + proposals[:a]
        hidden = taps[:, : a + 1]
        # No host sync: the roll-back replay runs while Python emits this cycle's tokens.
        mx.async_eval(hidden, [c.state for c in cache])
        t2 = time.perf_counter()

        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1
        stats.cycles += 1
        stats.verified_tokens += verified - 1
        cycle_tokens += a + 1
        stats.mean_tau = cycle_tokens / stats.cycles
        stats.accepted = a
        stats.cycle_tau = a + 1
        for j in range(verified - 1):
            proposed_at[j] += 1
            accepted_at[j] += j < a
        emitted = proposals[:a] + [bonus]


def _confident_rows(draft_logits: mx.array, columns: mx.array | None, threshold: float) -> int:
    """How many leading block rows to propose and verify: up to the first row where the running
    product of the drafter's top probabilities drops below ``threshold`` (at least one).

    ``columns``: the draft vocabulary, when the other logits are -inf. The rule reads the
    drafter's distributions only, never which tokens are drawn from them: a cut that looked at a
    sampled proposal's own probability would verify likely draws more often than unlikely ones
    and bias rejection sampling (measured: chi-square p ~ 1e-5).
    """
    scored = draft_logits if columns is None else draft_logits[:, columns]
    top = mx.max(scored, axis=-1) - mx.logsumexp(scored, axis=-1)
    running = mx.cumsum(top.astype(mx.float32)).tolist()
    limit = math.log(threshold)
    n = next((i for i, v in enumerate(running) if v < limit), len(running))
    return max(1, n)


def _snapshot(stats: DFlashResponse, text: str, tokens: list[int], finish) -> DFlashResponse:
    out = DFlashResponse(**{k: getattr(stats, k) for k in stats.__dataclass_fields__})
    out.text, out.tokens, out.finish_reason = text, list(tokens), finish
    out.token = tokens[-1] if tokens else None
    out.acceptance_by_position = list(stats.acceptance_by_position)
    return out


def generate(model, draft, tokenizer, prompt, verbose: bool = False, **kwargs) -> GenerationResult:
    """Non-streaming :func:`stream_generate`: the whole text, the tokens and the final statistics."""
    text, tokens, last = [], [], None
    for r in stream_generate(model, draft, tokenizer, prompt, **kwargs):
        text.append(r.text)
        tokens.extend(r.tokens)
        last = r
        if verbose:
            print(r.text, end="", flush=True)
    if verbose:
        print()
    return GenerationResult("".join(text), tokens, last.finish_reason, last)
