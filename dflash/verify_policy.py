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
* **Chain length.** ``k* = argmax_k E(k) / (draft + verify(k + 1))``.
* **No speculation when it loses.** When the committed tokens per second of recent speculative
  cycles fall below a plain one-token step's, the next cycles are plain target steps (no drafter
  block pass; the drafter's context is still fed the new features), for a stretch that doubles
  while speculation keeps losing; then one speculative cycle probes again.

Exactness: the cut depends only on the drafter's distributions and on past cycles, never on the
tokens drawn in this cycle, so greedy output is the target's and rejection sampling stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .errors import GenerationConfigError

if TYPE_CHECKING:  # types only: the CLI reads POLICIES without loading MLX
    import mlx.core as mx

    from .cost_model import CostModel

POLICIES = ("auto", "confidence", "fixed")
BINS = 10
PRIOR = 2.0  # pseudo-observations of the raw confidence per bin
EMA = 0.3  # weight of the newest cycle in the running speculative rate
MAX_BACKOFF = 64


def row_confidence(draft_logits: mx.array, columns: mx.array | None) -> mx.array:
    """Log of the drafter's top probability per block row (``columns``: the draft vocabulary)."""
    import mlx.core as mx

    scored = draft_logits if columns is None else draft_logits[:, columns]
    return (mx.max(scored, axis=-1) - mx.logsumexp(scored, axis=-1)).astype(mx.float32)


def confident_rows(log_conf: list[float], threshold: float) -> int:
    """Rows up to the first where the running product of top probabilities drops below
    ``threshold`` (at least one): the ``confidence`` policy."""
    limit = np.log(threshold) if threshold > 0 else -np.inf
    running = np.cumsum(log_conf)
    below = np.nonzero(running < limit)[0]
    return max(1, int(below[0]) if len(below) else len(log_conf))


@dataclass
class AcceptanceModel:
    """P(row i accepted | rows before accepted, drafter confidence), per row and confidence bin."""

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
        return (self.accepted[rows, b] + PRIOR * conf) / (self.tried[rows, b] + PRIOR)

    def update(self, conf: np.ndarray, verified: int, accepted: int) -> None:
        """Rows ``0..accepted-1`` were accepted; row ``accepted`` (if verified) was rejected."""
        b = self._bins(conf)
        seen = min(verified, accepted + 1)
        for i in range(seen):
            self.tried[i, b[i]] += 1
            self.accepted[i, b[i]] += i < accepted


def expected_tokens(p: np.ndarray) -> np.ndarray:
    """``E[k]`` for ``k = 0..len(p)``: committed tokens when the first ``k`` rows are verified."""
    return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(p))])


@dataclass
class PolicyStats:
    """What the policy chose over a generation (for bench and server statistics)."""

    speculative_cycles: int = 0
    plain_steps: int = 0
    rows_verified: int = 0  # target rows over all passes (anchor included)

    @property
    def rows_per_pass(self) -> float:
        passes = self.speculative_cycles + self.plain_steps
        return self.rows_verified / passes if passes else 0.0

    def as_dict(self) -> dict:
        passes = self.speculative_cycles + self.plain_steps
        return {"speculative_cycles": self.speculative_cycles, "plain_steps": self.plain_steps,
                "plain_share": round(self.plain_steps / passes, 4) if passes else 0.0,
                "rows_per_pass": round(self.rows_per_pass, 3)}


class VerifyPolicy:
    """Per-cycle choices for one generation: speculate or not, and how many rows to verify."""

    def __init__(self, name: str, block_size: int, cost: CostModel | None = None,
                 min_confidence: float = 0.0):
        if name not in POLICIES:
            raise GenerationConfigError(f"policy={name!r}: must be one of {', '.join(POLICIES)}")
        if name == "auto" and cost is None:
            raise GenerationConfigError("policy='auto' needs a cost model")
        self.name, self.cost, self.min_confidence = name, cost, float(min_confidence)
        self.acceptance = AcceptanceModel(max(1, block_size - 1))
        self.context = 0
        self.rate: float | None = None  # committed tokens per ms of recent speculative cycles
        self.backoff = 0  # plain steps still to take
        self.losses = 0  # consecutive losing probes
        self.stats = PolicyStats()

    # -- before drafting ----------------------------------------------------------------------

    def speculate(self, context: int) -> bool:
        """Draft this cycle? (``False``: a plain one-token step.)"""
        self.context = context
        if self.name != "auto" or self.backoff <= 0:
            return True
        self.backoff -= 1
        return False

    # -- after drafting -----------------------------------------------------------------------

    def rows(self, log_conf: list[float], draft_rows: int) -> int:
        """How many of the drafted proposals to verify (at least one)."""
        if self.name == "fixed":
            return len(log_conf)
        if self.name == "confidence":
            return confident_rows(log_conf, self.min_confidence)
        conf = np.exp(np.asarray(log_conf, dtype=np.float64))
        gain = expected_tokens(self.acceptance.predict(conf))[1:]
        cost = np.array([self.cost.draft(draft_rows) + self.cost.verify(k + 1, self.context)
                         for k in range(1, len(conf) + 1)])
        return int(np.argmax(gain / cost)) + 1

    # -- after verifying ----------------------------------------------------------------------

    def record(self, log_conf: list[float] | None, verified: int, accepted: int,
               draft_rows: int) -> None:
        """Learn from a cycle: ``verified`` proposals sent, ``accepted`` of them kept."""
        self.stats.rows_verified += verified + 1
        if log_conf is None:  # a plain step
            self.stats.plain_steps += 1
            return
        self.stats.speculative_cycles += 1
        conf = np.exp(np.asarray(log_conf, dtype=np.float64))
        self.acceptance.update(conf, verified, accepted)
        if self.name != "auto":
            return
        cycle_ms = self.cost.draft(draft_rows) + self.cost.verify(verified + 1, self.context)
        rate = (accepted + 1) / cycle_ms
        self.rate = rate if self.rate is None else (1 - EMA) * self.rate + EMA * rate
        plain = 1.0 / self.cost.verify(1, self.context)
        if self.rate < plain:
            self.losses += 1
            self.backoff = min(MAX_BACKOFF, 2 ** self.losses)
        else:
            self.losses = 0
