"""Log-probabilities of the emitted tokens (and of the prompt's), from passes the engine runs anyway.

OpenAI defines a token's log-probability as the model's own log-softmax over its raw logits, before
any sampling setting (temperature, top-p, penalties, logit bias), and so does mlx-lm's
``generate_step`` (``logits - logsumexp(logits)``, what it yields with each token). The row that
scores a token is the row that predicted it: a verify pass's row ``i`` for the ``i``-th accepted
proposal or the bonus token after them, a plain step's one row, the prefill's last row for the
first token, and (``echo``) the prefill's row ``i - 1`` for prompt token ``i``. No pass is added:
the rows are read out of logits the engine computed to accept or sample the tokens, and only for a
request that asks (nothing is computed otherwise).

Values are float32 (the logits are cast first: a bf16 head's values would otherwise be rounded to
bf16 before the subtraction); on float32 targets they equal mlx-lm's within float tolerance
(tests/test_logprobs.py: ``1e-4``).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .errors import GenerationConfigError

# The most alternatives OpenAI's API returns per token (chat's ``top_logprobs``); the server's
# limit on every endpoint. The Python API takes any count up to the vocabulary.
MAX_TOP_LOGPROBS = 20
# Rows whose log-softmax is read at a time when a whole prefill chunk is scored (``echo``): one
# chunk's full-vocabulary rows are already as large as its logits.
SCORE_ROWS = 256


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the target, and the ``top`` most likely tokens at its
    position (``(token id, log-probability)``, most likely first; ties by id)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_logprobs(logprobs: int | None, vocab_size: int) -> None:
    """``GenerationConfigError`` naming ``logprobs`` unless it is ``None`` or a count of
    alternatives in ``0 .. vocab_size``."""
    if logprobs is None:
        return
    if isinstance(logprobs, bool) or not isinstance(logprobs, (int, np.integer)) \
            or not 0 <= logprobs <= vocab_size:
        raise GenerationConfigError(
            f"logprobs={logprobs!r}: the number of most likely tokens to return with each "
            f"token's log-probability, an integer in 0..{vocab_size} (or None: none)")


def log_softmax(logits: mx.array) -> mx.array:
    """The rows' log-probabilities in float32, as mlx-lm computes them (lazy)."""
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def read_logprobs(lp: mx.array, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Row ``i`` of log-probabilities ``lp`` ``(R, V)`` scores ``tokens[i]``; with the ``top``
    most likely tokens of each row. One host read."""
    if not tokens:
        return []
    ids = mx.array([int(t) for t in tokens], dtype=mx.int32)[:, None]
    chosen = mx.take_along_axis(lp, ids, axis=-1)[:, 0]
    k = min(int(top), lp.shape[-1])
    if k == 0:
        values = np.array(chosen).tolist()
        return [TokenLogprob(int(t), float(v)) for t, v in zip(tokens, values)]
    best = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k] if k < lp.shape[-1] else \
        mx.broadcast_to(mx.arange(lp.shape[-1]), lp.shape)
    best_lp = mx.take_along_axis(lp, best, axis=-1)
    mx.eval(chosen, best, best_lp)
    chosen_np, best_np, best_lp_np = np.array(chosen), np.array(best), np.array(best_lp)
    out = []
    for i, t in enumerate(tokens):
        order = np.lexsort((best_np[i], -best_lp_np[i]))  # most likely first, ties by id
        out.append(TokenLogprob(int(t), float(chosen_np[i]),
                                tuple((int(best_np[i, j]), float(best_lp_np[i, j]))
                                      for j in order)))
    return out


def logprobs_of(logits: mx.array, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """:func:`read_logprobs` of raw ``logits`` ``(R, V)``."""
    return read_logprobs(log_softmax(logits), tokens, top)


class PromptScorer:
    """The prompt's own log-probabilities, chunk by chunk as the prefill feeds it (``echo``).

    Prompt token ``i`` is scored by the prefill's row ``i - 1``; the first token has no row
    (``None``, as OpenAI's ``echo`` gives it), and the last row of a chunk scores the next chunk's
    first token, so it is carried over."""

    def __init__(self, top: int):
        self.top = top
        self.entries: list[TokenLogprob | None] = [None]
        self._carry: mx.array | None = None

    def add(self, logits: mx.array, tokens: Sequence[int]) -> None:
        """Score one chunk from its logits ``(L, V)`` (every row's)."""
        rows, targets = logits, list(tokens[1:])
        if self._carry is not None:  # the previous chunk's last row scores this one's first
            rows, targets = mx.concatenate([self._carry, logits]), list(tokens)
        for start in range(0, len(targets), SCORE_ROWS):
            block = targets[start:start + SCORE_ROWS]
            self.entries += logprobs_of(rows[start:start + len(block)], block, self.top)
        self._carry = logits[-1:]
        mx.eval(self._carry)  # the chunk's logits can go


class TokenText:
    """Each token's own bytes and text, as OpenAI's ``logprobs`` entries show a token.

    Byte-level BPE tokens map back to their bytes (a token may hold part of a UTF-8 character),
    SentencePiece tokens to their bytes with ``▁`` as a space; any other tokenizer decodes the id
    alone. A token that is not valid UTF-8 on its own is shown with ``\\x..`` escapes, as OpenAI
    shows such tokens (its ``bytes`` are the exact ones)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        detok = getattr(tokenizer, "_detokenizer", None)
        self.tokenmap = getattr(detok, "tokenmap", None)
        self.kind = type(detok).__name__ if detok is not None else ""
        self._cache: dict[int, bytes] = {}

    def bytes(self, token: int) -> bytes:
        cached = self._cache.get(token)
        if cached is not None:
            return cached
        raw = None
        if self.tokenmap is not None and 0 <= token < len(self.tokenmap):
            piece = self.tokenmap[token]
            if self.kind == "BPEStreamingDetokenizer" and isinstance(piece, str):
                from mlx_lm.tokenizer_utils import _byte_decoder

                decoder = _byte_decoder()
                raw = b"".join(bytes([decoder[c]]) if c in decoder else c.encode("utf-8")
                               for c in piece)
            elif self.kind == "SPMStreamingDetokenizer" and isinstance(piece, bytes):
                raw = piece.replace("\u2581".encode("utf-8"), b" ")
        if raw is None:
            raw = self.tokenizer.decode([token]).encode("utf-8")
        self._cache[token] = raw
        return raw

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", errors="backslashreplace")


def text_offsets(pieces: Sequence[bytes], start: int = 0) -> list[int]:
    """Where each token's text starts in the text the tokens make together (from ``start``): the
    characters decoded before it (a character split over tokens counts where it completes)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out, at = [], start
    for piece in pieces:
        out.append(at)
        at += len(decoder.decode(piece))
    return out
