"""Sampling for a whole verify block at once, exactly as target-only decoding would sample.

Reference semantics: mlx-lm's ``generate_step`` with
``sampler=make_sampler(temperature, top_p, min_p, top_k=top_k)`` and
``logits_processors=make_logits_processors(logit_bias, repetition_penalty, ...) + custom``.

Row ``i`` of a verify pass predicts the token after ``history + proposals[:i]``; its logits
processors must see that history, as mlx-lm's would one token at a time. The built-in processors
(logit bias -> repetition -> presence -> frequency penalty, mlx-lm's order, semantics and dtype) are
computed for all rows in one vectorised pass and are bit-identical to mlx-lm's applied row by row;
custom processors (mlx-lm's ``(tokens, logits) -> logits`` form) follow, called row by row.
Sampling filters run in mlx-lm's order (top_p -> min_p -> top_k) on log-probabilities, then
temperature.

Acceptance (both exact for any settings):

- ``argmax`` proposals: the drafter proposes the argmax of its *processed* logits (bias and
  penalties applied with the proposals before each row in the history). Proposal ``i+1`` is accepted
  iff it equals the target's own sample at row ``i``; the first mismatch emits the target's sample.
  This is rejection sampling with a one-hot proposal, exact for any target sampler.
- ``sample`` proposals: the drafter samples each position from its processed distribution ``q``
  (same processors and filters as the target, the history again including the earlier proposals);
  proposal ``i+1`` is accepted with ``min(1, p/q)`` and the first rejection is resampled from
  ``norm(max(p - q, 0))`` (Leviathan et al.'s speculative sampling).

Custom ``logits_processors`` and ``sampler`` must be pure functions of their inputs (as mlx-lm's
are): they are called for every verify row, including rows after the first rejection.
"""

from __future__ import annotations

import math
import numbers
import time
from collections import Counter
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
        """Raise ``GenerationConfigError`` naming the first setting outside its range.

        Normalises in place what it accepts loosely: ``logit_bias`` keys given as strings (JSON)
        become ints, numpy scalars become Python numbers.
        """
        def bad(name, value, rule):
            raise GenerationConfigError(f"{name}={value!r}: {rule}")

        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            bad("temperature", self.temperature, "must be a finite number >= 0 (0 is greedy)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "must be in (0, 1] (1 disables it)")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", self.top_k, "must be an integer >= 0 (0 disables it)")
        if not _is_real(self.min_p) or not 0 <= self.min_p < 1:
            bad("min_p", self.min_p, "must be in [0, 1) (0 disables it)")
        if self.repetition_penalty is not None and (
                not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf):
            bad("repetition_penalty", self.repetition_penalty,
                "must be a finite number > 0 (1 or None disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is None:
                setattr(self, name, 0.0)
            elif not _is_real(value) or not math.isfinite(value):
                bad(name, value, "must be a finite number (0 disables it)")
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                bad(name, value, "must be an integer >= 1")
        if self.logit_bias is not None:
            self.logit_bias = _checked_bias(self.logit_bias, vocab_size, bad)
        if self.sampler is not None and not callable(self.sampler):
            bad("sampler", self.sampler, "must be a callable logprobs -> tokens (mlx-lm's form)")
        if self.logits_processors is not None:
            if callable(self.logits_processors) or isinstance(self.logits_processors, (str, bytes)):
                bad("logits_processors", self.logits_processors,
                    "must be a list of callables (tokens, logits) -> logits")
            try:
                procs = list(self.logits_processors)
            except TypeError:
                bad("logits_processors", self.logits_processors,
                    "must be a list of callables (tokens, logits) -> logits")
            for proc in procs:
                if not callable(proc):
                    bad("logits_processors", proc, "every entry must be callable")
            self.logits_processors = procs
        if self.proposal not in PROPOSAL_MODES:
            bad("proposal", self.proposal, f"must be one of {', '.join(PROPOSAL_MODES)}")
        if self.proposal == "sample" and self.sampler is not None:
            bad("proposal", self.proposal, "rejection sampling needs the built-in sampler's "
                "distribution; use proposal='argmax' with a custom sampler")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            bad("seed", self.seed, "must be an integer in [0, 2**64)")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            setattr(self, name, float(getattr(self, name)))
        if self.repetition_penalty is not None:
            self.repetition_penalty = float(self.repetition_penalty)
        for name in ("top_k", "repetition_context_size", "presence_context_size",
                     "frequency_context_size"):
            setattr(self, name, int(getattr(self, name)))
        if self.seed is not None:
            self.seed = int(self.seed)

    @property
    def greedy(self) -> bool:
        return self.sampler is None and self.temperature == 0


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _checked_bias(bias, vocab_size, bad) -> dict[int, float]:
    if not isinstance(bias, dict):
        bad("logit_bias", bias, "must be a dict mapping token ids to numbers")
    out: dict[int, float] = {}
    for tok, value in bias.items():
        if _is_int(tok):
            tok_id = int(tok)
        elif isinstance(tok, str) and tok.strip().lstrip("-").isdigit():
            tok_id = int(tok)
        else:
            bad("logit_bias", tok, "keys must be integer token ids")
        if tok_id < 0 or (vocab_size is not None and tok_id >= vocab_size):
            hi = f"0..{vocab_size - 1}" if vocab_size is not None else ">= 0"
            bad("logit_bias", tok, f"token id outside the vocabulary ({hi})")
        if tok_id in out:
            bad("logit_bias", tok, "token id given twice")
        # -inf bans a token; +inf or nan would turn the distribution into nan.
        if not _is_real(value) or value == math.inf:
            bad(f"logit_bias[{tok}]", value, "must be a number (or -inf to ban the token)")
        out[tok_id] = float(value)
    return out


class BlockSampler:
    """Per-generation sampling state: processors, random key, and the block-wise primitives."""

    def __init__(self, cfg: SamplingConfig):
        self.cfg = cfg
        seed = cfg.seed if cfg.seed is not None else time.time_ns() % (2**63)
        self.key = mx.random.key(seed)
        if cfg.sampler is not None and cfg.seed is not None:
            # A custom sampler draws from MLX's global generator, as it would under mlx-lm.
            mx.random.seed(cfg.seed)
        bias = cfg.logit_bias or {}
        self.bias_ids = mx.array([int(k) for k in bias], dtype=mx.int32) if bias else None
        self.bias_values = mx.array([float(v) for v in bias.values()]) if bias else None
        self.penalties = [(kind, value, size) for kind, value, size in (
            ("repetition", cfg.repetition_penalty, cfg.repetition_context_size),
            ("presence", cfg.presence_penalty, cfg.presence_context_size),
            ("frequency", cfg.frequency_penalty, cfg.frequency_context_size),
        ) if value]

    def _next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    @property
    def greedy(self) -> bool:
        return self.cfg.greedy

    # -- processors -------------------------------------------------------------------------

    @property
    def has_history_processors(self) -> bool:
        return bool(self.penalties or self.cfg.logits_processors)

    def _bias(self, logits: mx.array) -> mx.array:
        if self.bias_ids is None:
            return logits
        return logits.at[:, self.bias_ids].add(self.bias_values)

    @staticmethod
    def _windows(history: list[int], proposals: list[int], rows: int, size: int,
                 known: bool) -> list[list[int]]:
        """Row ``i``'s window: the last ``size`` tokens of ``history + proposals[:i]``.

        With ``known=False`` only the history part of each window is returned (the caller adds
        the proposals' part itself).
        """
        tail = history[-size:]
        seq = tail + list(proposals[: rows - 1]) if known else tail
        out = []
        for i in range(rows):
            end = len(tail) + i
            start = max(0, end - size)
            out.append(seq[start:end] if known else tail[start:])
        return out

    @staticmethod
    def _counts(windows: list[list[int]], vocab: int) -> tuple[mx.array, int]:
        """``(rows, vocab)`` float32 occurrence counts of each row's window, and the largest."""
        rows = len(windows)
        width = max((len(w) for w in windows), default=0)
        if width == 0:
            return mx.zeros((rows, vocab), dtype=mx.float32), 0
        ids = [w + [0] * (width - len(w)) for w in windows]
        valid = [[1.0] * len(w) + [0.0] * (width - len(w)) for w in windows]
        row_idx = mx.broadcast_to(mx.arange(rows)[:, None], (rows, width))
        counts = mx.zeros((rows, vocab), dtype=mx.float32).at[
            row_idx, mx.array(ids, dtype=mx.int32)].add(mx.array(valid))
        biggest = max((max(Counter(w).values()) for w in windows if w), default=0)
        return counts, biggest

    @staticmethod
    def _penalise(logits: mx.array, kind: str, value: float, counts: mx.array,
                  biggest: int | None) -> mx.array:
        """mlx-lm's penalty ``kind`` where ``counts > 0``, elementwise in ``logits``' dtype.

        ``biggest`` (the largest count) makes the frequency penalty a repeated subtraction, as
        mlx-lm's scatter-subtract does with duplicate ids; ``None`` multiplies instead.
        """
        if kind == "repetition":
            penalised = mx.where(logits < 0, logits * value, logits / value)
            return mx.where(counts > 0, penalised, logits)
        if kind == "presence":
            return mx.where(counts > 0, logits - value, logits)
        if biggest is None:
            return logits - (counts * value).astype(logits.dtype)
        for k in range(biggest):
            logits = mx.where(counts > k, logits - value, logits)
        return logits

    def process(self, logits: mx.array, history: list[int],
                proposals: list[int] | None) -> mx.array:
        """Apply the processors to ``logits (R, V)``; row ``i`` sees ``history + proposals[:i]``.

        With ``proposals=None`` every row sees ``history`` alone.
        """
        c = self.cfg
        rows, vocab = logits.shape
        logits = self._bias(logits)
        if not self.has_history_processors:
            return logits
        known = proposals is not None
        props = list(proposals[: rows - 1]) if known else []
        for kind, value, size in self.penalties:
            if known:
                windows = self._windows(history, props, rows, size, True)
            else:
                windows = [history[-size:]] * rows
            counts, biggest = self._counts(windows, vocab)
            logits = self._penalise(logits, kind, value, counts, biggest)
        if c.logits_processors:
            full = mx.array(history + props, dtype=mx.int32)
            n_hist, shift = len(history), 1 if known else 0
            out_rows = []
            for i in range(rows):
                row = logits[i:i + 1]
                for proc in c.logits_processors:
                    row = proc(full[: n_hist + i * shift], row)
                out_rows.append(row)
            logits = mx.concatenate(out_rows, axis=0)
        return logits

    # -- distributions and samples ---------------------------------------------------------

    def _filtered_logprobs(self, logits: mx.array) -> mx.array:
        """mlx-lm's make_sampler chain: log-softmax, then top_p, min_p, top_k."""
        c = self.cfg
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if 0 < c.top_p < 1.0:
            logprobs = apply_top_p(logprobs, c.top_p)
        if c.min_p != 0.0:
            logprobs = apply_min_p(logprobs, c.min_p)
        if 0 < c.top_k < logits.shape[-1]:
            logprobs = apply_top_k(logprobs, c.top_k)
        return logprobs

    def probs(self, logits: mx.array) -> mx.array:
        """The distribution (float32) the built-in sampler draws from, per row."""
        scaled = self._filtered_logprobs(logits).astype(mx.float32) * (1.0 / self.cfg.temperature)
        return mx.softmax(scaled, axis=-1)

    def sample(self, logits: mx.array) -> mx.array:
        """One token per row of processed logits ``(R, V)`` -> ``(R,)``."""
        if self.cfg.sampler is not None:
            out = []
            for i in range(logits.shape[0]):
                row = logits[i:i + 1]
                out.append(self.cfg.sampler(row - mx.logsumexp(row, keepdims=True)).reshape(-1))
            return mx.concatenate(out)
        if self.cfg.temperature == 0:
            return mx.argmax(logits, axis=-1)
        scaled = self._filtered_logprobs(logits) * (1.0 / self.cfg.temperature)
        return mx.random.categorical(scaled, axis=-1, key=self._next_key())

    # -- drafting and acceptance -----------------------------------------------------------

    def propose(self, draft_logits: mx.array, history: list[int]) -> tuple[mx.array, mx.array | None]:
        """Proposals ``(P,)`` from drafter logits ``(P, V)`` and, when sampled, their ``q (P, V)``.

        The drafter's logits get the target's built-in processors (bias, penalties), row ``j``
        seeing ``history + proposals[:j]``; custom processors are left to the target (they may be
        costly, and any proposal distribution is exact). ``argmax`` proposes each row's maximum,
        ``sample`` draws from the filtered, tempered distribution ``q``.
        """
        sampled = self.cfg.proposal == "sample" and not self.greedy
        rows, vocab = draft_logits.shape
        logits = self._bias(draft_logits)
        if not self.penalties:
            if not sampled:
                return mx.argmax(logits, axis=-1), None
            q = self.probs(logits)
            return mx.random.categorical(mx.log(q), axis=-1, key=self._next_key()), q
        # History part of every row's window now; the proposals' part row by row (lazily).
        base = [self._counts(self._windows(history, [], rows, size, False), vocab)[0]
                for _, _, size in self.penalties]
        keys = mx.random.split(self._next_key(), rows) if sampled else None
        ids = mx.arange(vocab)
        cum = [mx.zeros((vocab,), dtype=mx.float32)]  # cum[j]: one-hot counts of proposals < j
        tokens, qs = [], []
        for j in range(rows):
            row = logits[j:j + 1]
            for (kind, value, size), counts in zip(self.penalties, base):
                recent = cum[j] - cum[max(0, j - size)]
                row = self._penalise(row, kind, value, counts[j:j + 1] + recent[None], None)
            if sampled:
                q = self.probs(row)
                tok = mx.random.categorical(mx.log(q), axis=-1, key=keys[j])
                qs.append(q)
            else:
                tok = mx.argmax(row, axis=-1)
            tokens.append(tok)
            cum.append(cum[-1] + (ids == tok).astype(mx.float32))
        return mx.concatenate(tokens), (mx.concatenate(qs) if sampled else None)

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
        if n_prop == 0:
            return 0, int(mx.random.categorical(mx.log(p[0]), key=self._next_key()).item())
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
            # p == q leaves no residual mass; a rejection then had probability 0 (rounding).
            bonus_dist = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p[a])
        bonus = mx.random.categorical(mx.log(bonus_dist), key=self._next_key())
        return a, int(bonus.item())
