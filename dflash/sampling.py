"""Sampling for a whole verify block at once, exactly as target-only decoding would sample.

Reference semantics: mlx-lm's ``generate_step`` with
``sampler=make_sampler(temperature, top_p, min_p, top_k=top_k)`` and
``logits_processors=make_logits_processors(logit_bias, repetition_penalty, ...) + custom``.

Row ``i`` of a verify pass predicts the token after ``history + proposals[:i]``; its logits
processors must see that history, as mlx-lm's would one token at a time. The built-in processors
(logit bias -> repetition -> presence -> frequency penalty: mlx-lm's order, semantics and dtype)
are applied to all rows in one vectorised pass, touching only the ids in each row's windows, and
are bit-identical to mlx-lm's applied row by row; custom processors (mlx-lm's
``(tokens, logits) -> logits`` form) follow, called row by row. The sampler's filters then run in
mlx-lm's order (top_p -> min_p -> top_k on log-probabilities), then temperature; they are computed
in float64 from each row's top candidates (equal to mlx-lm's distribution to float tolerance).

Acceptance (both exact for any settings):

- ``argmax`` proposals (default): the drafter proposes the argmax of its *processed* logits (bias
  and penalties, the proposals before each row in its history). Proposal ``i+1`` is accepted with
  the target's probability of it at row ``i`` -- the probability that the target's own sample
  equals it -- and the first rejected row emits a draw from that row's distribution conditioned on
  not being the proposal. That is the law of "sample every row, keep proposals while they match",
  i.e. rejection sampling with a one-hot proposal, at the cost of one uniform per row.
- ``sample`` proposals: the drafter samples each position from its processed distribution ``q``
  (same processors, filters and temperature over its top candidates, the history again including
  the earlier proposals); proposal ``i+1`` is accepted with ``min(1, p/q)`` and the first rejection
  is redrawn from ``norm(max(p - q, 0))`` (Leviathan et al.'s speculative sampling).
- A custom ``sampler`` (argmax proposals only): the target's token at every row comes from it, and
  proposals are kept while they equal those tokens.

Custom ``logits_processors`` and ``sampler`` must be pure functions of their inputs (as mlx-lm's
are): they are called for every verify row, including rows after the first rejection.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import mlx.core as mx
import numpy as np

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
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            _bad("temperature", self.temperature, "must be a finite number >= 0 (0 is greedy)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            _bad("top_p", self.top_p, "must be in (0, 1] (1 disables it)")
        if not _is_int(self.top_k) or self.top_k < 0:
            _bad("top_k", self.top_k, "must be an integer >= 0 (0 disables it)")
        if not _is_real(self.min_p) or not 0 <= self.min_p < 1:
            _bad("min_p", self.min_p, "must be in [0, 1) (0 disables it)")
        if self.repetition_penalty is not None and (
                not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf):
            _bad("repetition_penalty", self.repetition_penalty,
                 "must be a finite number > 0 (1 or None disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is None:
                setattr(self, name, 0.0)
            elif not _is_real(value) or not math.isfinite(value):
                _bad(name, value, "must be a finite number (0 disables it)")
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                _bad(name, value, "must be an integer >= 1")
        if self.logit_bias is not None:
            self.logit_bias = _checked_bias(self.logit_bias, vocab_size)
        if self.sampler is not None and not callable(self.sampler):
            _bad("sampler", self.sampler, "must be a callable logprobs -> tokens (mlx-lm's form)")
        if self.logits_processors is not None:
            if callable(self.logits_processors) or isinstance(self.logits_processors, (str, bytes)):
                _bad("logits_processors", self.logits_processors,
                     "must be a list of callables (tokens, logits) -> logits")
            try:
                procs = list(self.logits_processors)
            except TypeError:
                _bad("logits_processors", self.logits_processors,
                     "must be a list of callables (tokens, logits) -> logits")
            for proc in procs:
                if not callable(proc):
                    _bad("logits_processors", proc, "every entry must be callable")
            self.logits_processors = procs
        if self.proposal not in PROPOSAL_MODES:
            _bad("proposal", self.proposal, f"must be one of {', '.join(PROPOSAL_MODES)}")
        if self.proposal == "sample" and self.sampler is not None:
            _bad("proposal", self.proposal, "rejection sampling needs the built-in sampler's "
                 "distribution; use proposal='argmax' with a custom sampler")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            _bad("seed", self.seed, "must be an integer in [0, 2**64)")
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


def check_decode_settings(block_size, max_tokens, prefill_step_size, min_confidence) -> None:
    """Raise ``GenerationConfigError`` for a decoding limit outside its range (the loop's own
    settings, next to the sampling ones :meth:`SamplingConfig.validate` checks)."""
    if not isinstance(block_size, int) or block_size < 2:
        _bad("block_size", block_size, "must be an integer >= 2")
    if not isinstance(max_tokens, int) or max_tokens < 0:
        _bad("max_tokens", max_tokens, "must be an integer >= 0")
    if not isinstance(prefill_step_size, int) or prefill_step_size < 1:
        _bad("prefill_step_size", prefill_step_size, "must be >= 1")
    if not isinstance(min_confidence, (int, float)) or not 0.0 <= min_confidence <= 1.0:
        _bad("min_confidence", min_confidence, "must be in [0, 1]")


def _bad(name: str, value, rule: str) -> NoReturn:
    raise GenerationConfigError(f"{name}={value!r}: {rule}")


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _checked_bias(bias, vocab_size) -> dict[int, float]:
    if not isinstance(bias, dict):
        _bad("logit_bias", bias, "must be a dict mapping token ids to numbers")
    out: dict[int, float] = {}
    for tok, value in bias.items():
        if _is_int(tok):
            tok_id = int(tok)
        elif isinstance(tok, str) and tok.strip().lstrip("-").isdigit():
            tok_id = int(tok)
        else:
            _bad("logit_bias", tok, "keys must be integer token ids")
        if tok_id < 0 or (vocab_size is not None and tok_id >= vocab_size):
            hi = f"0..{vocab_size - 1}" if vocab_size is not None else ">= 0"
            _bad("logit_bias", tok, f"token id outside the vocabulary ({hi})")
        if tok_id in out:
            _bad("logit_bias", tok, "token id given twice")
        # -inf bans a token; +inf or nan would turn the distribution into nan.
        if not _is_real(value) or value == math.inf:
            _bad(f"logit_bias[{tok}]", value, "must be a number (or -inf to ban the token)")
        out[tok_id] = float(value)
    return out


# How many top candidates a row's filtered distribution is first computed from (target side, when
# top_p/min_p truncate but top_k does not bound the set); rows whose kept set reaches the last
# candidate are recomputed over the whole vocabulary.
CANDIDATES = 256
# The drafter's sampled rows are distributions over this many top candidates (or top_k, if
# larger): any q is exact as long as proposals are drawn from it and accepted against it.
DRAFT_CANDIDATES = 64


def _draw(rng: np.random.Generator, probs: np.ndarray) -> int:
    """Index drawn from unnormalised ``probs`` (float64) by inverse CDF; never a zero entry."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))


@dataclass
class RowDist:
    """The filtered, tempered distribution of one row: ``probs`` (float64, sums to 1) over ``ids``
    (``None``: the whole vocabulary, index = token id)."""

    ids: np.ndarray | None
    probs: np.ndarray

    def prob(self, token: int) -> float:
        if self.ids is None:
            return float(self.probs[token])
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[0]]) if hit.size else 0.0

    def probs_at(self, ids: np.ndarray) -> np.ndarray:
        if self.ids is None:
            return self.probs[ids]
        lookup = dict(zip(self.ids.tolist(), self.probs.tolist()))
        return np.array([lookup.get(t, 0.0) for t in ids.tolist()], dtype=np.float64)

    def token(self, index: int) -> int:
        return int(index if self.ids is None else self.ids[index])

    def dense(self, vocab: int) -> np.ndarray:
        if self.ids is None:
            return self.probs
        out = np.zeros(vocab)
        out[self.ids] = self.probs
        return out


class Processors:
    """The logits processors of one generation, in mlx-lm's order: ``logit_bias``, the
    repetition / presence / frequency penalties over their windows, then the caller's own
    ``logits_processors``; applied to the target's verify rows (MLX, bit-identical to mlx-lm's
    processors row by row) and, bias and penalties, to the drafter's rows (NumPy)."""

    def __init__(self, cfg: SamplingConfig):
        self.cfg = cfg
        bias = cfg.logit_bias or {}
        self.bias_ids = mx.array([int(k) for k in bias], dtype=mx.int32) if bias else None
        self.bias_values = mx.array([float(v) for v in bias.values()]) if bias else None
        self.penalties = [(kind, value, size) for kind, value, size in (
            ("repetition", cfg.repetition_penalty, cfg.repetition_context_size),
            ("presence", cfg.presence_penalty, cfg.presence_context_size),
            ("frequency", cfg.frequency_penalty, cfg.frequency_context_size),
        ) if value]

    @property
    def history_dependent(self) -> bool:
        """Whether a row's processed logits depend on the tokens before it."""
        return bool(self.penalties or self.cfg.logits_processors)

    def bias(self, logits: mx.array) -> mx.array:
        if self.bias_ids is None:
            return logits
        return logits.at[:, self.bias_ids].add(self.bias_values)

    def penalty_counts(self, history: list[int],
                        earlier: list[int]) -> tuple[list[int], list[list[int]]]:
        """The ids one row's penalties touch (sorted) and, per penalty, how often each occurs in
        that penalty's window: the last ``size`` tokens of ``history + earlier``."""
        windows = [(history[-size:] + earlier)[-size:] for _, _, size in self.penalties]
        ids = sorted(set().union(*windows))
        return ids, [[w.count(t) for t in ids] for w in windows]

    def penalised(self, values, counts: list[list[list[int]]]):
        """mlx-lm's penalties, in its order, on ``values (R, W)`` where ``counts[k][r][w]`` is how
        often row ``r``'s id ``w`` occurs in penalty ``k``'s window; elementwise, in the values'
        dtype.

        MLX values (the target's rows) are bit-identical to mlx-lm's processors: the frequency
        penalty is a repeated subtraction, as mlx-lm's scatter-subtract does with duplicate ids.
        NumPy values (the drafter's rows, float64) multiply the count instead.
        """
        on_mx = isinstance(values, mx.array)
        where = mx.where if on_mx else np.where
        for (kind, value, _), listed in zip(self.penalties, counts):
            c = mx.array(listed) if on_mx else np.array(listed, dtype=np.float64)
            if kind == "repetition":
                penalised = where(values < 0, values * value, values / value)
                values = where(c > 0, penalised, values)
            elif kind == "presence":
                values = where(c > 0, values - value, values)
            elif on_mx:
                for k in range(max(max(row) for row in listed)):
                    values = where(c > k, values - value, values)
            else:
                values = values - c * value
        return values

    def apply(self, logits: mx.array, history: list[int],
                proposals: list[int] | None) -> mx.array:
        """Apply the processors to ``logits (R, V)``; row ``i`` sees ``history + proposals[:i]``.

        With ``proposals=None`` every row sees ``history`` alone. The penalties touch only the ids
        in each row's windows: gathered, penalised with mlx-lm's elementwise ops in the logits'
        dtype, scattered back (bit-identical to mlx-lm's processors row by row).
        """
        c = self.cfg
        rows = logits.shape[0]
        logits = self.bias(logits)
        if not self.history_dependent:
            return logits
        known = proposals is not None
        props = list(proposals[: rows - 1]) if known else []
        if self.penalties:
            rows_touched = [self.penalty_counts(history, props[:i]) for i in range(rows)]
            width = max(len(ids) for ids, _ in rows_touched)
            if width:
                # Pad each row with copies of its first id (same value, same count, same result).
                def pad(xs):
                    return xs + [xs[0] if xs else 0] * (width - len(xs))

                idx = mx.array([pad(ids) for ids, _ in rows_touched], dtype=mx.int32)
                counts = [[pad(c[k]) for _, c in rows_touched] for k in range(len(self.penalties))]
                values = self.penalised(mx.take_along_axis(logits, idx, axis=-1), counts)
                logits = mx.put_along_axis(logits, idx, values, axis=-1)
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


class BlockSampler:
    """Per-generation sampling state: processors, random generator, and the block-wise primitives.

    Processors run in MLX on the ``(R, V)`` logits; the rows are then copied to NumPy once, where
    whole-row reductions (log-sum-exp, top candidates) and everything after them (filters on the
    candidates, acceptance, draws) run in float64 with a seeded generator. A verify pass costs one
    uniform per row plus one draw, not a sort and a Gumbel draw over the vocabulary per row.
    """

    def __init__(self, cfg: SamplingConfig):
        self.cfg = cfg
        seed = cfg.seed if cfg.seed is not None else time.time_ns() % (2**63)
        self.rng = np.random.default_rng(seed)
        if cfg.sampler is not None and cfg.seed is not None:
            # A custom sampler draws from MLX's global generator, as it would under mlx-lm.
            mx.random.seed(cfg.seed)
        self.proc = Processors(cfg)
        c = cfg
        self.top_p = 0 < c.top_p < 1.0
        self.filtered = self.top_p or c.min_p != 0.0 or c.top_k > 0

    @property
    def greedy(self) -> bool:
        return self.cfg.greedy

    @property
    def pipelines_plain_steps(self) -> bool:
        """Plain one-token steps can be queued on the previous step's still-lazy token (greedy,
        no history-dependent processors, no custom sampler), as mlx-lm's own decoding does."""
        return self.greedy and not self.has_history_processors and self.cfg.sampler is None

    # -- processors -------------------------------------------------------------------------

    @property
    def has_history_processors(self) -> bool:
        return self.proc.history_dependent

    def process(self, logits: mx.array, history: list[int],
                proposals: list[int] | None) -> mx.array:
        """:meth:`Processors.apply`: row ``i`` of ``logits (R, V)`` sees ``history +
        proposals[:i]`` (``proposals=None``: every row sees ``history``)."""
        return self.proc.apply(logits, history, proposals)

    # -- distributions ----------------------------------------------------------------------

    def _keep(self, lp: np.ndarray, total: float) -> np.ndarray:
        """mlx-lm's filters (top_p, then min_p, then top_k) on log-probs sorted descending."""
        c = self.cfg
        keep = np.ones(lp.shape, dtype=bool)
        if self.top_p:
            probs = np.exp(lp)
            before = np.cumsum(probs) - probs  # mass of the larger ones
            inside = before < c.top_p * total
            keep &= lp >= lp[np.flatnonzero(inside)[-1]]  # ties with the last kept stay
        if c.min_p != 0.0:
            keep &= lp >= lp[0] + math.log(c.min_p)
        if c.top_k > 0:
            keep[c.top_k:] = False
        return keep

    def dists(self, logits: mx.array) -> list[RowDist] | _DenseDists:
        """The built-in sampler's distribution of each row of processed ``logits (R, V)``.

        mlx-lm's chain: log-softmax, top_p, min_p, top_k, then softmax(logprobs / temperature).
        With truncating filters the kept set is found among each row's top candidates (top_k of
        them when top_k is set; otherwise ``CANDIDATES``, and the whole row when the kept set
        reaches the last candidate). Without, rows stay over the whole vocabulary.
        """
        rows = _Rows(logits)
        vocab = rows.vocab
        temp = self.cfg.temperature
        if not self.filtered:
            return _DenseDists(rows, 1.0 / temp)
        c = self.cfg
        bounded = 0 < c.top_k < vocab
        ids, vals = rows.top(min(vocab, c.top_k if bounded else CANDIDATES))
        lse = rows.logsumexp(1.0)
        out: list[RowDist] = []
        for i in range(rows.n):
            lp = vals[i] - lse[i]
            keep = self._keep(lp, 1.0)
            if keep[-1] and not bounded and ids.shape[1] < vocab:
                # The kept set may reach past the candidates: the whole row, sorted.
                full = rows.row(i)
                order = np.argsort(-full, kind="stable")
                lp = full[order] - lse[i]
                keep = self._keep(lp, 1.0)
                out.append(_row_dist(order[keep], lp[keep] / temp))
            else:
                out.append(_row_dist(ids[i][keep], lp[keep] / temp))
        return out

    def probs(self, logits: mx.array) -> mx.array:
        """Dense ``(R, V)`` float32 probabilities the built-in sampler draws from."""
        rows, vocab = logits.shape
        d = self.dists(logits)
        return mx.array(np.stack([d[i].dense(vocab) for i in range(rows)]).astype(np.float32))

    # -- samples ----------------------------------------------------------------------------

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
        d = self.dists(logits)
        return mx.array([self._draw(d[i]) for i in range(logits.shape[0])])

    def _draw(self, dist: RowDist, exclude: int | None = None) -> int:
        probs = dist.probs
        if exclude is not None:
            hit = exclude if dist.ids is None else np.flatnonzero(dist.ids == exclude)
            if np.size(hit) and probs.sum() - probs[hit].sum() > 0:
                probs = probs.copy()
                probs[hit] = 0.0
        return dist.token(_draw(self.rng, probs))

    # -- drafting and acceptance -----------------------------------------------------------

    @property
    def proposes_argmax(self) -> bool:
        """Proposals are each drafter row's raw argmax (no bias, no penalties, not sampled)."""
        return not self.samples_proposals and not self.proc.penalties and self.proc.bias_ids is None

    @property
    def samples_proposals(self) -> bool:
        """Proposals are drawn (and accepted against their ``q``), not the drafter's argmax."""
        return self.cfg.proposal == "sample" and not self.greedy

    def draw_scores(self, ids: np.ndarray, scores: np.ndarray) -> tuple[int, RowDist]:
        """An index drawn from softmax(scores / temperature) over ``ids``, and that distribution
        (a proposal's ``q``: no filters, which stay on the target side)."""
        q = _row_dist(ids, np.asarray(scores, dtype=np.float64) / self.cfg.temperature)
        return int(_draw(self.rng, q.probs)), q

    def propose(self, draft_logits: mx.array,
                history: list[int]) -> tuple[mx.array, list[RowDist] | None]:
        """Proposals ``(P,)`` from drafter logits ``(P, V)`` and, when sampled, their ``q``.

        The drafter's rows get the target's bias and penalties, row ``j`` seeing
        ``history + proposals[:j]``; ``sample`` draws from the target's filters and temperature
        applied to the row's top ``DRAFT_CANDIDATES`` (or ``top_k``) candidates, and ``q`` is
        exactly the distribution each proposal was drawn from. Custom processors are left to the
        target (any proposal distribution is exact).
        """
        sampled = self.samples_proposals
        rows, vocab = draft_logits.shape
        logits = self.proc.bias(draft_logits)
        if not sampled and not self.proc.penalties:
            return mx.argmax(logits, axis=-1), None
        c = self.cfg
        m = min(vocab, max(c.top_k, DRAFT_CANDIDATES))
        source = _Rows(logits).np
        tokens: list[int] = []
        qs: list[RowDist] = []
        for j in range(rows):
            row = source[j]
            if self.proc.penalties:
                ids, counts = self.proc.penalty_counts(history, tokens)
                if ids:
                    row = row.copy()
                    row[ids] = self.proc.penalised(row[ids].astype(np.float64)[None],
                                               [[c] for c in counts])[0]
            if not sampled:
                tokens.append(int(np.argmax(row)))
                continue
            ids, vals = _top(row, m)
            lp = vals - _logsumexp(vals)  # q lives on the candidates
            keep = self._keep(lp, 1.0)
            q = _row_dist(ids[keep], lp[keep] / c.temperature)
            tokens.append(self._draw(q))
            qs.append(q)
        return mx.array(tokens), (qs if sampled else None)

    def accept(self, target_logits: mx.array, proposals: list[int], q: list[RowDist] | None,
               history: list[int], allowed: mx.array | None = None) -> tuple[int, int]:
        """``(a, bonus)``: the number of accepted proposals and the token emitted after them.
        ``allowed`` ``(R, V)``: a grammar's mask per row (dflash.grammar), applied after the
        processors (``-inf`` where it is False): the target's distribution restricted to it.

        ``argmax`` proposals (``q is None``): proposal ``i+1`` is accepted with the target's
        probability of it at row ``i`` (what "the target's sample equals it" has), and the first
        rejection draws from that row conditioned on not being the proposal. ``sample``: accepted
        with ``min(1, p/q)``, the first rejection drawn from ``norm(max(p - q, 0))``.
        """
        processed = self.process(target_logits, history, proposals)
        if allowed is not None:
            processed = mx.where(allowed, processed, -math.inf)
        n_prop = len(proposals)
        if self.greedy or self.cfg.sampler is not None:
            targets = self.sample(processed).tolist()
            a = 0
            while a < n_prop and proposals[a] == targets[a]:
                a += 1
            return a, targets[a]
        p = self.dists(processed)
        p_prop = p.probs_of(proposals) if isinstance(p, _DenseDists) else \
            np.array([p[i].prob(t) for i, t in enumerate(proposals)])
        u = self.rng.random(n_prop)
        if q is None:
            accepted = u < p_prop
        else:
            q_prop = np.array([q[i].prob(t) for i, t in enumerate(proposals)])
            accepted = u * q_prop < p_prop
        a = 0
        while a < n_prop and accepted[a]:
            a += 1
        row = p[a]
        if a == n_prop:
            return a, self._draw(row)
        if q is None:
            return a, self._draw(row, exclude=proposals[a])
        return a, self._residual(row, q[a])

    def _residual(self, p: RowDist, q: RowDist) -> int:
        """A draw from ``norm(max(p - q, 0))``, the law of the token after a rejection."""
        q_at_p = q.dense(p.probs.size) if p.ids is None else q.probs_at(p.ids)
        residual = np.maximum(p.probs - q_at_p, 0.0)
        if residual.sum() <= 0:  # p == q: a rejection had probability 0 (rounding)
            return self._draw(p)
        return p.token(_draw(self.rng, residual))


class _Rows:
    """A logits matrix ``(R, V)`` copied to NumPy float32 once, with the whole-row reductions
    the sampler needs (float64 results). NumPy's exp/partition beat MLX's on the CPU; elsewhere
    the copy is one transfer per verify pass."""

    def __init__(self, logits: mx.array):
        self.n, self.vocab = logits.shape
        self.np = np.array(logits if logits.dtype == mx.float32 else logits.astype(mx.float32))

    def top(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Ids and values of each row's ``m`` largest entries, sorted descending."""
        return _top(self.np, m)

    def at(self, tokens: list[int]) -> np.ndarray:
        """Row ``i``'s value of ``tokens[i]``."""
        return self.np[np.arange(len(tokens)), tokens].astype(np.float64)

    def logsumexp(self, scale: float) -> np.ndarray:
        """Per-row ``log(sum(exp(scale * x)))``."""
        x = self.np * np.float32(scale)
        top = x.max(axis=-1, keepdims=True)
        with np.errstate(invalid="ignore"):
            return top[:, 0] + np.log(np.exp(x - top).sum(axis=-1, dtype=np.float64))

    def row(self, i: int) -> np.ndarray:
        return self.np[i].astype(np.float64)


def _top(x: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Ids and float64 values of the ``m`` largest entries of each row (or of a 1-D ``x``),
    sorted descending."""
    vocab = x.shape[-1]
    if m >= vocab:
        ids = np.broadcast_to(np.arange(vocab), x.shape)
        vals = x
    else:
        ids = np.argpartition(-x, m - 1, axis=-1)[..., :m]
        vals = np.take_along_axis(x, ids, axis=-1)
    vals = vals.astype(np.float64)
    order = np.argsort(-vals, axis=-1, kind="stable")
    return np.take_along_axis(ids, order, axis=-1).astype(np.int64), \
        np.take_along_axis(vals, order, axis=-1)


class _DenseDists:
    """Unfiltered rows over the whole vocabulary: softmax(x / temperature), row by row."""

    def __init__(self, rows: _Rows, scale: float):
        self.rows = rows
        self.scale = scale
        self.lse = rows.logsumexp(scale)

    def probs_of(self, tokens: list[int]) -> np.ndarray:
        return np.exp(self.rows.at(tokens) * self.scale - self.lse[: len(tokens)])

    def __len__(self) -> int:
        return self.rows.n

    def __getitem__(self, i: int) -> RowDist:
        return _row_dist(None, self.rows.row(i) * self.scale)


def _logsumexp(x: np.ndarray) -> float:
    top = float(np.max(x))
    return top + math.log(float(np.exp(x - top).sum()))


def _row_dist(ids: np.ndarray | None, scaled: np.ndarray) -> RowDist:
    """Softmax of ``scaled`` (log-probs / temperature) over ``ids``, in float64."""
    probs = np.exp(scaled - np.max(scaled))
    return RowDist(ids, probs / probs.sum())

