"""The pieces DFlash2 drafters add to the v1 backbone: a block-local grouped dynamic convolution
around each sublayer, a candidate selector that turns independent per-position logits into one
coherent chain, and a context cache bounded by the attention window.

Why: a v1 drafter proposes each position's own argmax, so position ``t`` cannot know what was
proposed at ``t - 1``. DFlash2 keeps the one-pass backbone (cost ~1 % more) and adds (1) a two-tap
convolution so each block token mixes in its left neighbour's features, and (2) a low-rank
transition score between consecutive tokens, walked over the top-k unary candidates of each
position. Verification is unchanged (a chain), so output stays exactly the target's.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def block_conv(y: mx.array, coefficients: mx.array) -> mx.array:
    """``out[t, c] = sum_j coefficients[t, j, c] * y[t - j, c]`` with ``y`` zero before the block.

    ``y (B, L, H)`` is one block (the drafter runs one block per call), so a tap never reaches
    across a block boundary into context or an earlier block.
    """
    B, L, H = y.shape
    out = coefficients[:, :, 0] * y
    for j in range(1, min(coefficients.shape[2], L)):
        shifted = mx.concatenate([mx.zeros((B, j, H), dtype=y.dtype), y[:, : L - j]], axis=1)
        out = out + coefficients[:, :, j] * shifted
    return out


class GroupedDynamicConv(nn.Module):
    """Two convolutions around one pre-norm sublayer, with per-position dynamic kernels.

    ``base_kernel (2, K, H)`` is shared; ``kernel_projection`` maps the normalised input ``u`` to a
    correction ``(2 sides, K taps, H // group)``, one coefficient per group of ``group`` channels.
    Side 0 convolves the sublayer's input, side 1 its output; both use the ``u``-derived kernel.
    """

    def __init__(self, hidden: int, taps: int, group: int):
        super().__init__()
        self.taps, self.group, self.groups = taps, group, hidden // group
        self.base_kernel = mx.zeros((2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)

    def identity(self) -> None:
        """The initialisation that makes the convolution an exact no-op (tap 0 = 1, rest 0)."""
        self.base_kernel = mx.zeros(self.base_kernel.shape).at[:, 0].add(1.0)
        self.kernel_projection.weight = mx.zeros(self.kernel_projection.weight.shape)

    def __call__(self, u: mx.array, sublayer: Callable[[mx.array], mx.array]) -> mx.array:
        """``Conv(sublayer(Conv(u; side 0)); side 1)``, the residual branch of one sublayer."""
        B, L, H = u.shape
        delta = self.kernel_projection(u).reshape(B, L, 2, self.taps, self.groups, 1)
        delta = mx.broadcast_to(delta, (B, L, 2, self.taps, self.groups, self.group))
        coefficients = self.base_kernel + delta.reshape(B, L, 2, self.taps, H)
        out = sublayer(block_conv(u, coefficients[:, :, 0]))
        return block_conv(out, coefficients[:, :, 1])


class CandidateSelector(nn.Module):
    """Scores ``s_t(b) = U_t(b) + sum_r A[a_{t-1}, r] * g_t[r] * B[b, r]`` over the top-k
    candidates ``b`` of the unary logits ``U_t``, with ``g_t = P h_t`` and ``a_{t-1}`` the token
    chosen one position earlier (the anchor for the first)."""

    def __init__(self, hidden: int, rank: int, vocab: int, top_k: int,
                 output_multiplier: float = 1.0, softcap: float | None = None):
        super().__init__()
        self.top_k = top_k
        self.output_multiplier = output_multiplier
        self.softcap = softcap
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)

    def unary(self, head_logits: mx.array) -> mx.array:
        """``U``: the target head's logits of the drafter's hidden states, scaled and capped."""
        logits = head_logits * self.output_multiplier
        if self.softcap:
            logits = self.softcap * mx.tanh(logits / self.softcap)
        return logits

    def lattice(self, hidden: mx.array, unary: mx.array,
                anchor: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Everything the walk needs, for ``R`` rows: candidate ids ``(R, K)``, their unary values
        ``(R, K)``, the first row's transition from the anchor ``(K,)``, and the transitions
        ``(R-1, K, K)`` from each candidate of row ``t-1`` to each of row ``t``. One pass, K wide."""
        k = min(self.top_k, unary.shape[-1])
        ids = mx.argpartition(-unary, kth=k - 1, axis=-1)[:, :k]
        values = mx.take_along_axis(unary, ids, axis=-1)
        order = mx.argsort(-values, axis=-1)  # best first: argmax ties go to the top unary
        ids = mx.take_along_axis(ids, order, axis=-1)
        values = mx.take_along_axis(values, order, axis=-1)
        successor = self.successor_codebook(ids) * self.hidden_projection(hidden)[:, None]
        first = successor[0] @ self.predecessor_codebook(mx.array([anchor]))[0]
        rest = self.predecessor_codebook(ids[:-1]) @ successor[1:].transpose(0, 2, 1)
        mx.eval(ids, values, first, rest)
        return (np.array(ids).astype(np.int64), np.array(values.astype(mx.float32), np.float64),
                np.array(first.astype(mx.float32), np.float64),
                np.array(rest.astype(mx.float32), np.float64))


def walk(ids: np.ndarray, values: np.ndarray, first: np.ndarray, rest: np.ndarray,
         choose: Callable[[np.ndarray, np.ndarray], int]) -> list[int]:
    """The selector's path: at row ``t`` score the candidates given the token chosen at ``t-1``
    and let ``choose(ids, scores)`` pick an index (argmax, or a draw from softmax(scores/T))."""
    path, prev = [], None
    for t in range(ids.shape[0]):
        scores = values[t] + (first if t == 0 else rest[t - 1][prev])
        prev = choose(ids[t], scores)
        path.append(int(ids[t][prev]))
    return path


class WindowCache:
    """Context keys/values of the last ``size`` positions (``window - 1``: all a block's anchor
    can see). ``offset`` counts every position ever added, as mlx-lm's caches do.

    The rows live in a buffer of at most ``size + slack`` rows (grown in steps up to that): an
    append writes in place and the oldest rows are dropped only when the buffer is full, so the
    window is copied once per ``slack`` appended rows rather than on every append, and memory
    stays flat however long the context grows. ``keys`` / ``values`` are the rows in the window, oldest first (contiguous positions
    ``offset - len .. offset - 1``).
    """

    max_slack = 256

    def __init__(self, size: int):
        self.size = size
        self.slack = min(size, self.max_slack)
        self._keys = self._values = None
        self.used = 0  # rows written in the buffer (the last ``size`` of them are the window)
        self.offset = 0

    @property
    def keys(self) -> mx.array | None:
        return None if self._keys is None else self._keys[..., self._start():self.used, :]

    @property
    def values(self) -> mx.array | None:
        return None if self._values is None else self._values[..., self._start():self.used, :]

    def _start(self) -> int:
        return max(self.used - self.size, 0)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        self.offset += n
        if n >= self.size:  # the new rows alone fill the window
            self._keys, self._values = keys[..., n - self.size:, :], values[..., n - self.size:, :]
            self.used = self.size
            return self.keys_and_values()
        if self._keys is None or self.used + n > self._keys.shape[2]:
            kept = min(self.used, self.size - n)  # the rows still in the window after this append
            # grown in steps while the context is shorter than the window, as mlx-lm's caches are
            need = kept + n
            rows = (self.size + self.slack if need + self.slack >= self.size
                    else -(-need // self.max_slack) * self.max_slack)
            new_k = mx.zeros((*keys.shape[:2], rows, keys.shape[3]), keys.dtype)
            new_v = mx.zeros((*values.shape[:2], rows, values.shape[3]), values.dtype)
            if kept:
                new_k[..., :kept, :] = self._keys[..., self.used - kept:self.used, :]
                new_v[..., :kept, :] = self._values[..., self.used - kept:self.used, :]
            self._keys, self._values, self.used = new_k, new_v, kept
        self._keys[..., self.used:self.used + n, :] = keys
        self._values[..., self.used:self.used + n, :] = values
        self.used += n
        return self.keys_and_values()

    def skip(self, n: int) -> None:
        """Advance over ``n`` positions that would fall out of the window anyway (the rows held
        so far are older still: they go)."""
        self.offset += n
        self.used = 0

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    @property
    def state(self):
        return self._keys, self._values

    @property
    def nbytes(self) -> int:
        """Bytes the buffer holds (flat once the context passes the window)."""
        return 0 if self._keys is None else self._keys.nbytes + self._values.nbytes

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` positions. Older rows still in the buffer come back into the
        window; positions already dropped stay unknown: the drafter then sees fewer context rows
        until new ones arrive (proposals only; output is exact)."""
        n = min(self.offset, n)
        self.used = max(self.used - n, 0)
        self.offset -= n
        return n


class DFlash2Cache(list):
    """The per-layer context caches of one sequence, plus the final hidden states of the block
    drafted last, which the selector reads when the loop asks for proposals."""

    block_hidden: mx.array | None = None
