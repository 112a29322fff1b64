"""Generate responses with the target and keep, from the very same passes, what training needs.

Before, a training record cost two target passes: datagen generated the response (~150 tok/s on
both cores) and a second, teacher-forced pass computed the tap features and the target's top-k
(~70 tok/s) - about 50 finished training tokens per second end to end. Here every forward pass that
generates a token also yields that token's tap outputs and the target's next-token distribution, so
each token costs one target row:

* the prompt is prefilled alone (one row per prompt token, its taps kept);
* then sequences decode together, one row each per step, in a continuous batch: mlx-lm's
  ``BatchKVCache`` holds rows of different lengths (left-padded), a finished sequence leaves the
  batch (``filter``) and a newly prefilled one joins it (``merge`` + ``extend``) between steps.

Per finished sequence (``Rollout``), aligned with :class:`dflash.training.features.FeatureStore`:

* ``feats[p]``: float16 tap outputs of the token at position ``p`` (prompt and response). The last
  token is never fed to the target, so its row is zeros; training never reads it (context rows are
  strictly before an anchor, and anchors end two tokens before the end).
* ``top_ids[p]`` / ``top_logp[p]``: the target's top-k distribution of the token at ``p + 1``, for
  response positions ``p >= prompt_len``; prompt rows (which training never reads: labels start
  after the first response token) hold id 0 with log-probability -inf.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..target import TargetParts, forward, make_cache

FILLER_LOGP = np.float16(-np.inf)


def filler_rows(n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` top-k rows that training never reads (prompt rows, the last token's): id 0 at
    log-probability -inf."""
    return np.zeros((n, k), np.int32), np.full((n, k), FILLER_LOGP, np.float16)


@dataclass
class Rollout:
    """One finished sequence: ids, why it ended, and (when captured) its features and top-k."""

    id: str
    prompt_ids: list[int]
    response_ids: list[int]
    finish_reason: str  # "stop" (ends with its stop token) or "length"
    feats: np.ndarray | None = None  # (len, n_taps * hidden) float16
    top_ids: np.ndarray | None = None  # (len, k) int32
    top_logp: np.ndarray | None = None  # (len, k) float16


@dataclass
class _Sequence:
    id: str
    prompt_ids: list[int]
    response: list[int]
    max_tokens: int | None = None  # this sequence's own cap (None: the engine's)
    feats: list[np.ndarray] = field(default_factory=list)  # one block of rows per pass
    top_ids: list[np.ndarray] = field(default_factory=list)
    top_logp: list[np.ndarray] = field(default_factory=list)


@dataclass
class CaptureStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    rows: int = 0  # sequence-rows summed over decode steps
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return (self.prompt_tokens + self.generated_tokens) / self.seconds if self.seconds else 0.0


def _top_k(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """Top-``k`` ids and their log-probabilities (normalised over the whole vocabulary)."""
    logits = logits.astype(mx.float32)
    ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
    logp = mx.take_along_axis(logits, ids, axis=-1) - mx.logsumexp(logits, axis=-1, keepdims=True)
    return ids.astype(mx.int32), logp.astype(mx.float16)


class RolloutEngine:
    """Continuous-batch greedy (or temperature) decoding of many prompts with tap capture.

    ``capture=False`` skips features and top-k (used to write user turns for chat data).
    """

    def __init__(self, parts: TargetParts, *, taps: list[int], topk: int = 16,
                 max_tokens: int = 512, batch_size: int = 32, stop_ids: Iterable[int] = (),
                 temperature: float = 0.0, seed: int = 0, capture: bool = True,
                 prefill_step_size: int = 2048):
        self.parts, self.taps, self.topk = parts, list(taps), int(topk)
        self.max_tokens, self.batch_size = int(max_tokens), int(batch_size)
        self.stop_ids = {int(t) for t in stop_ids}
        self.temperature, self.capture = float(temperature), bool(capture)
        self.prefill_step_size = int(prefill_step_size)
        self.key = mx.random.key(seed)
        self.stats = CaptureStats()

    # -- one token from a distribution --------------------------------------------------------

    def _choose(self, logits: mx.array) -> mx.array:
        if self.temperature <= 0:
            return mx.argmax(logits, axis=-1)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logits.astype(mx.float32) / self.temperature, key=sub)

    # -- prefill: one prompt alone ------------------------------------------------------------

    def _prefill(self, item_id: str, prompt_ids: list[int]) -> tuple[_Sequence, list]:
        """Feed the prompt alone; its taps are kept and its last row gives the first token."""
        seq = _Sequence(item_id, list(prompt_ids), [])
        cache = make_cache(self.parts)
        n = len(prompt_ids)
        tap_ids = self.taps if self.capture else []
        for start in range(0, n, self.prefill_step_size):
            last = start + self.prefill_step_size >= n
            chunk = mx.array(prompt_ids[start:start + self.prefill_step_size])[None]
            logits, taps = forward(self.parts, chunk, cache, tap_ids,
                                   logits_rows=slice(-1, None) if last else slice(0, 0))
            wanted = [c.state for c in cache]
            if self.capture:
                wanted.append(feats := taps[0].astype(mx.float16))
            if last:
                wanted.append(first := self._choose(logits[0, -1]))
            mx.eval(wanted)
            if self.capture:
                seq.feats.append(np.array(feats))
        seq.response.append(int(first.item()))
        if self.capture:  # prompt rows: nothing training reads (see the module docstring)
            ids, logp = filler_rows(n, self.topk)
            seq.top_ids.append(ids)
            seq.top_logp.append(logp)
        self.stats.prompt_tokens += n
        self.stats.generated_tokens += 1
        return seq, cache

    def _finished(self, seq: _Sequence) -> str | None:
        if seq.response[-1] in self.stop_ids:
            return "stop"
        if len(seq.response) >= (seq.max_tokens or self.max_tokens):
            return "length"
        return None

    def _rollout(self, seq: _Sequence, reason: str) -> Rollout:
        out = Rollout(seq.id, seq.prompt_ids, seq.response, reason)
        if self.capture:
            width = seq.feats[0].shape[-1]
            out.feats = np.concatenate(seq.feats + [np.zeros((1, width), np.float16)])
            last_ids, last_logp = filler_rows(1, self.topk)  # nothing predicts past the end
            out.top_ids = np.concatenate(seq.top_ids + [last_ids])
            out.top_logp = np.concatenate(seq.top_logp + [last_logp])
        return out

    # -- the loop -----------------------------------------------------------------------------

    def run(self, items: Iterable[tuple]) -> Iterator[Rollout]:
        """Yield a :class:`Rollout` per ``(id, prompt_ids)`` (or ``(id, prompt_ids, max_tokens)``,
        a cap of its own) as each finishes (not in order)."""
        pending = iter(items)
        active: list[_Sequence] = []
        cache: list | None = None
        exhausted = False
        tic = time.perf_counter()
        while True:
            # Join: prefill new prompts until the batch is full.
            joined_seqs, joined_caches = [], []
            while not exhausted and len(active) + len(joined_seqs) < self.batch_size:
                item = next(pending, None)
                if item is None:
                    exhausted = True
                    break
                seq, seq_cache = self._prefill(str(item[0]), list(item[1]))
                seq.max_tokens = int(item[2]) if len(item) > 2 and item[2] else None
                reason = self._finished(seq)
                if reason is not None:
                    self.stats.seconds = time.perf_counter() - tic
                    yield self._rollout(seq, reason)
                    continue
                joined_seqs.append(seq)
                joined_caches.append(seq_cache)
            if joined_seqs:
                merged = [type(layer_caches[0]).merge(list(layer_caches))
                          for layer_caches in zip(*joined_caches)]
                if cache is None:
                    cache = merged
                else:
                    for mine, theirs in zip(cache, merged):
                        mine.extend(theirs)
                active += joined_seqs
            if not active:
                self.stats.seconds = time.perf_counter() - tic
                return

            # Step: every active sequence feeds its last token.
            tokens = mx.array([[s.response[-1]] for s in active])
            logits, taps = forward(self.parts, tokens, cache, self.taps if self.capture else [])
            nxt = self._choose(logits[:, -1])
            if self.capture:
                top_ids, top_logp = _top_k(logits[:, -1], self.topk)
                feats = taps[:, -1].astype(mx.float16)
                mx.eval(nxt, top_ids, top_logp, feats)
                top_ids, top_logp, feats = np.array(top_ids), np.array(top_logp), np.array(feats)
            else:
                mx.eval(nxt)
            nxt = nxt.tolist()
            self.stats.steps += 1
            self.stats.rows += len(active)
            self.stats.generated_tokens += len(active)

            keep = []
            for i, seq in enumerate(active):
                if self.capture:
                    seq.feats.append(feats[i:i + 1])
                    seq.top_ids.append(top_ids[i:i + 1])
                    seq.top_logp.append(top_logp[i:i + 1])
                seq.response.append(int(nxt[i]))
                reason = self._finished(seq)
                if reason is None:
                    keep.append(i)
                else:
                    self.stats.seconds = time.perf_counter() - tic
                    yield self._rollout(seq, reason)
            if len(keep) < len(active):
                active = [active[i] for i in keep]
                if keep:
                    index = mx.array(keep)
                    for c in cache:
                        c.filter(index)
                else:
                    cache = None
