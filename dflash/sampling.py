"""Sampling for a whole verify block at once, exactly as target-only decoding would sample.

Row ``i`` of a verify pass predicts the token after ``history + proposals[:i]``; its logits
processors must see that history, as mlx-lm's would one token at a time. The built-in processors
(logit bias, repetition, presence and frequency penalties, in mlx-lm's order and semantics) are
computed for all rows in one vectorised pass; custom processors are called row by row.

Acceptance:
- ``argmax`` proposals: accept proposal ``i+1`` iff it equals the target's own sample at row ``i``;
  the first mismatch emits the target's sample. Rejection sampling with a one-hot proposal: exact
  for any target sampler.
- ``sample`` proposals: the drafter samples each position from its processed distribution ``q``;
  accept with ``min(1, p/q)`` and resample the first rejection from ``norm(max(p - q, 0))``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .errors import GenerationConfigError

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
PROPOSAL_MODES = ("argmax", "sample")


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: dict[int, float] | None = None
    sampler: Callable[[mx.array], mx.array] | None = None
    logits_processors: Sequence[LogitsProcessor] | None = None
    proposal: str = "argmax"
    seed: int | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``GenerationConfigError`` naming the first setting outside its range."""
        def bad(name, value, rule):
            raise GenerationConfigError(f"{name}={value!r}: {rule}")

        if not _is_number(self.temperature) or self.temperature < 0 or math.isnan(self.temperature):
            bad("temperature", self.temperature, "must be a number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", self.top_k, "must be an integer >= 0 (0 disables it)")
        if not _is_number(self.min_p) or not 0 <= self.min_p < 1:
            bad("min_p", self.min_p, "must be in [0, 1)")
        if self.repetition_penalty is not None and (
                not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0):
            bad("repetition_penalty", self.repetition_penalty, "must be a number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)):
                bad(name, getattr(self, name), "must be a number")
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                bad(name, value, "must be an integer >= 1")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", self.logit_bias, "must map token ids to numbers")
            for tok, value in self.logit_bias.items():
                try:
                    tok_id = int(tok)
                except (TypeError, ValueError):
                    bad("logit_bias", tok, "keys must be token ids")
                if vocab_size is not None and not 0 <= tok_id < vocab_size:
                    bad("logit_bias", tok, f"token id outside the vocabulary (0..{vocab_size - 1})")
                if not _is_number(value) or math.isnan(value):
                    bad(f"logit_bias[{tok}]", value, "must be a number")
        if self.proposal not in PROPOSAL_MODES:
            bad("proposal", self.proposal, f"must be one of {', '.join(PROPOSAL_MODES)}")
        if self.proposal == "sample" and self.sampler is not None:
            bad("proposal", self.proposal, "rejection sampling needs the built-in sampler's "
                "distribution; use proposal='argmax' with a custom sampler")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", self.seed, "must be an integer")

    @property
    def greedy(self) -> bool:
        return self.sampler is None and self.temperature == 0


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class BlockSampler:
    """Per-generation sampling state: processors, random key, and the block-wise primitives."""

    def __init__(self, cfg: SamplingConfig):
        self.cfg = cfg
        seed = cfg.seed if cfg.seed is not None else time.time_ns() % (2**63)
        self.key = mx.random.key(seed)
        bias = cfg.logit_bias or {}
        self.bias_ids = mx.array([int(k) for k in bias], dtype=mx.int32) if bias else None
        self.bias_values = mx.array([float(v) for v in bias.values()]) if bias else None

    def _next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    # -- processors -------------------------------------------------------------------------

    @property
    def has_history_processors(self) -> bool:
        c = self.cfg
        return bool(c.repetition_penalty or c.presence_penalty or c.frequency_penalty
                    or c.logits_processors)

    def process(self, logits: mx.array, history: list[int],
                proposals: list[int] | None) -> mx.array:
        """Apply the processors to ``logits (R, V)``; row ``i`` sees ``history + proposals[:i]``.

        With ``proposals=None`` every row sees ``history`` alone.
        """
        c = self.cfg
        rows = logits.shape[0]
        logits = logits.astype(mx.float32) if logits.dtype != mx.float32 else logits
        if self.bias_ids is not None:
            logits = logits.at[:, self.bias_ids].add(self.bias_values)
        if not self.has_history_processors:
            return logits
        full = history + list(proposals[: rows - 1]) if proposals is not None else history
        n_hist = len(history)
        shift = 1 if proposals is not None else 0

        def window(size: int) -> tuple[mx.array, mx.array]:
            """Token ids of each row's last ``size`` history tokens, and which slots are real."""
            ids, valid = [], []
            for i in range(rows):
                end = n_hist + i * shift
                start = max(0, end - size)
                row = full[start:end]
                ids.append(row + [0] * (size - len(row)))
                valid.append([True] * len(row) + [False] * (size - len(row)))
            return mx.array(ids, dtype=mx.int32), mx.array(valid)

        def counts(size: int) -> mx.array:
            ids, valid = window(size)
            zeros = mx.zeros(logits.shape, dtype=mx.float32)
            row_idx = mx.broadcast_to(mx.arange(rows)[:, None], ids.shape)
            return zeros.at[row_idx, ids].add(valid.astype(mx.float32))

        if c.repetition_penalty:
            present = counts(c.repetition_context_size) > 0
            p = c.repetition_penalty
            logits = mx.where(present, mx.where(logits < 0, logits * p, logits / p), logits)
        if c.presence_penalty:
            present = counts(c.presence_context_size) > 0
            logits = mx.where(present, logits - c.presence_penalty, logits)
        if c.frequency_penalty:
            logits = logits - counts(c.frequency_context_size) * c.frequency_penalty
        for proc in c.logits_processors or ():
            out_rows = [proc(mx.array(full[: n_hist + i * shift], dtype=mx.int32), logits[i:i + 1])
                        for i in range(rows)]
            logits = mx.concatenate(out_rows, axis=0)
        return logits

    # -- distributions and samples ---------------------------------------------------------

    def _filtered_logprobs(self, logits: mx.array) -> mx.array:
        """mlx-lm's make_sampler chain: top_p, min_p, top_k on log-probabilities."""
        c = self.cfg
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if 0 < c.top_p < 1.0:
            logprobs = apply_top_p(logprobs, c.top_p)
        if c.min_p != 0.0:
            logprobs = apply_min_p(logprobs, c.min_p)
        if c.top_k > 0 and c.top_k < logits.shape[-1]:
            logprobs = apply_top_k(logprobs, c.top_k)
        return logprobs

    def probs(self, logits: mx.array) -> mx.array:
        """The distribution the built-in sampler draws from, per row."""
        return mx.softmax(self._filtered_logprobs(logits) * (1.0 / self.cfg.temperature), axis=-1)

    def sample(self, logits: mx.array) -> mx.array:
        """One token per row of processed logits ``(R, V)`` -> ``(R,)``."""
        if self.cfg.sampler is not None:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return self.cfg.sampler(logprobs).reshape(-1)
        if self.cfg.temperature == 0:
            return mx.argmax(logits, axis=-1)
        scaled = self._filtered_logprobs(logits) * (1.0 / self.cfg.temperature)
        return mx.random.categorical(scaled, axis=-1, key=self._next_key())

    # -- drafting and acceptance -----------------------------------------------------------

    def propose(self, draft_logits: mx.array, history: list[int]) -> tuple[mx.array, mx.array | None]:
        """Proposals ``(P,)`` from drafter logits ``(P, V)`` and, when sampled, their ``q``."""
        if self.cfg.proposal == "argmax" or self.greedy:
            return mx.argmax(draft_logits, axis=-1), None
        # q may be any distribution we can evaluate; penalties use the committed history only.
        q = self.probs(self.process(draft_logits, history, None))
        tokens = mx.random.categorical(mx.log(q), axis=-1, key=self._next_key())
        return tokens, q

    @property
    def greedy(self) -> bool:
        return self.cfg.greedy

    def accept(self, target_logits: mx.array, proposals: list[int], q: mx.array | None,
               history: list[int]) -> tuple[int, int]:
        """``(a, bonus)``: the number of accepted proposals and the token emitted after them."""
        processed = self.process(target_logits, history, proposals)
        n_prop = len(proposals)
        if q is None:
            targets = self.sample(processed).tolist()
            a = 0
            while a < n_prop and proposals[a] == targets[a]:
                a += 1
            return a, targets[a]
        p = self.probs(processed)
        prop = mx.array(proposals, dtype=mx.int32)[:, None]
        p_prop = mx.take_along_axis(p[:n_prop], prop, axis=-1)[:, 0]
        q_prop = mx.take_along_axis(q, prop, axis=-1)[:, 0]
        u = mx.random.uniform(shape=(n_prop,), key=self._next_key())
        accepted = (u * q_prop < p_prop).tolist()
        a = 0
        while a < n_prop and accepted[a]:
            a += 1
        if a == n_prop:
            bonus_dist = p[n_prop]
        else:
            residual = mx.maximum(p[a] - q[a], 0.0)
            total = residual.sum()
            # p == q exactly leaves no residual mass; then any rejection had probability 0.
            bonus_dist = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p[a])
        bonus = mx.random.categorical(mx.log(bonus_dist), key=self._next_key())
        return a, int(bonus.item())
