"""The DFlash training recipe as pure numpy functions (checked element by element in tests).

* per sequence, random anchors inside the response; each anchor opens a block
  ``[token at anchor, MASK x (bs-1)]`` at absolute positions ``anchor .. anchor+bs-1``;
* a block sees the target features of context rows at positions **strictly before** its anchor and
  all of its own rows (bidirectional); blocks never see each other;
* block row ``k`` predicts the token at ``anchor+k`` (same position, no shift); row 0 has no loss;
* loss weights ``exp(-(k-1)/gamma)``.

Kept free of MLX and of any trainer state so that each rule can be read and tested on its own.
"""

from __future__ import annotations

import numpy as np

from ..errors import TrainConfigError


def default_gamma(block_size: int) -> float:
    """Decay of the loss weights: 7 for block 16, 5 for 10, 4 for 8 (DFlash), else scaled."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, 7.0 * block_size / 16))


def loss_weights(block_size: int, gamma: float) -> np.ndarray:
    """Weight of each block row: row 0 (the anchor) 0, row ``k >= 1`` ``exp(-(k-1)/gamma)``."""
    k = np.arange(block_size, dtype=np.float64)
    w = np.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w.astype(np.float32)


def anchor_range(prompt_len: int, seq_len: int) -> tuple[int, int]:
    """Anchors lie in the response, ``[prompt_len, seq_len - 2]``, so each has a label after it.

    At inference the first anchor is the first generated token (position ``prompt_len``).
    """
    return prompt_len, seq_len - 2


def sample_anchors(rng: np.random.Generator, prompt_len: int, seq_len: int, n: int) -> np.ndarray:
    """Up to ``n`` distinct random anchor positions inside the response, sorted."""
    lo, hi = anchor_range(prompt_len, seq_len)
    if hi < lo:
        return np.zeros(0, dtype=np.int64)
    count = hi - lo + 1
    if count <= n:
        return np.arange(lo, hi + 1, dtype=np.int64)
    return np.sort(rng.choice(count, size=n, replace=False) + lo).astype(np.int64)


def build_blocks(ids: np.ndarray, anchors: np.ndarray, block_size: int,
                 mask_token_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block inputs, labels and positions for anchors of one sequence.

    * ``tokens[b] = [ids[a], MASK, ..., MASK]``
    * ``labels[b, k] = ids[a + k]`` for ``k >= 1`` (same position, no shift); ``-1`` for row 0
      and for rows past the end of the sequence;
    * ``positions[b, k] = a + k``.
    """
    n = len(anchors)
    tokens = np.full((n, block_size), mask_token_id, dtype=np.int64)
    labels = np.full((n, block_size), -1, dtype=np.int64)
    tokens[:, 0] = ids[anchors]
    positions = anchors[:, None] + np.arange(block_size)[None]
    inside = positions < len(ids)
    inside[:, 0] = False
    labels[inside] = ids[positions[inside]]
    return tokens, labels, positions


def block_visibility(anchors: np.ndarray, ctx_len: int, block_size: int,
                     window: int | None = None, causal: bool = False) -> np.ndarray:
    """``vis[b, j, c]``: may row ``j`` of block ``b`` see key ``c`` of ``[context(ctx_len) ; block]``?

    Context key ``c < ctx_len`` is the target feature row of the token at position ``c``: visible iff
    ``c < anchor`` (strictly before the anchor). Keys ``ctx_len + i`` are the block's own rows: all
    visible (bidirectional) unless the layer is sliding-window with a causal block. Sliding layers
    also hide context rows ``window`` or more positions behind the query (as the engine does).
    """
    anchors = np.asarray(anchors)
    q_pos = anchors[:, None] + np.arange(block_size)[None]  # (n, bs)
    c_pos = np.arange(ctx_len)
    ctx = c_pos[None, None, :] < anchors[:, None, None]  # (n, 1, ctx)
    ctx = np.broadcast_to(ctx, (len(anchors), block_size, ctx_len))
    own = np.ones((len(anchors), block_size, block_size), dtype=bool)
    if window is not None:
        ctx = ctx & ((q_pos[:, :, None] - c_pos[None, None, :]) < window)
        if causal:
            own = own & np.tril(np.ones((block_size, block_size), dtype=bool))[None]
    return np.concatenate([ctx, own], axis=-1)


def training_visibility(anchors: np.ndarray, ctx_len: int, block_size: int) -> np.ndarray:
    """The recipe's full matrix: rows = all blocks' rows, keys = ``[context ; all blocks' rows]``.

    Only for documentation and tests: the trainer computes the same attention block by block
    (:func:`block_visibility`), skipping the cross-block entries that are always invisible.
    """
    n = len(anchors)
    per_block = block_visibility(anchors, ctx_len, block_size)
    full = np.zeros((n * block_size, ctx_len + n * block_size), dtype=bool)
    for b in range(n):
        rows = slice(b * block_size, (b + 1) * block_size)
        full[rows, :ctx_len] = per_block[b, :, :ctx_len]
        full[rows, ctx_len + b * block_size: ctx_len + (b + 1) * block_size] = \
            per_block[b, :, ctx_len:]
    return full


def default_taps(num_layers: int, n: int = 5) -> list[int]:
    """``n`` target layers spread from layer 1 to layer ``L-3`` (as the published drafters do)."""
    if num_layers < 1:
        raise TrainConfigError("target has no decoder layers to tap")
    n = max(1, min(n, num_layers))
    if n == num_layers:
        return list(range(num_layers))
    start = 1 if num_layers > 3 else 0
    end = num_layers - 3 if num_layers - 3 > start else num_layers - 1
    if n == 1:
        return [end]
    ids = [int(round(start + i * (end - start) / (n - 1))) for i in range(n)]
    return sorted(set(ids))


def parse_taps(text: str | list[int] | None, num_layers: int) -> list[int]:
    """``--taps`` as layer ids (``"1,8,14"`` or a list), checked against the target; default spread."""
    if text is None or text == "":
        return default_taps(num_layers)
    if isinstance(text, str):
        try:
            taps = [int(t) for t in text.replace(" ", "").split(",") if t]
        except ValueError:
            raise TrainConfigError(f"--taps {text!r}: expected comma-separated layer ids") from None
    else:
        taps = [int(t) for t in text]
    if not taps:
        raise TrainConfigError("--taps: at least one target layer id is needed")
    bad = [t for t in taps if not 0 <= t < num_layers]
    if bad:
        raise TrainConfigError(f"--taps {bad}: out of range for a target with {num_layers} layers "
                               f"(valid ids 0..{num_layers - 1})")
    if len(set(taps)) != len(taps):
        raise TrainConfigError(f"--taps {taps}: repeated layer id")
    return taps


def pick_mask_token(tokenizer, vocab_size: int, seen: set[int] | None = None) -> int:
    """An id that never appears in normal text: a spare special token of the target vocabulary.

    Order of preference: a token literally named like a mask; a row of the embedding beyond the
    tokenizer's vocabulary (padding rows); the highest-id special token that is not BOS/EOS/PAD/UNK,
    not produced by the chat template and not seen in the data; finally the last row.
    """
    seen = set(seen or ())
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    get_vocab = getattr(hf, "get_vocab", None)  # tokenizers without one have no named mask
    vocab = get_vocab() if get_vocab is not None else {}
    for name in ("<|mask|>", "<mask>", "[MASK]", "<|MASK|>"):
        if name in vocab and vocab[name] < vocab_size:
            return int(vocab[name])
    n_tok = len(hf) if hasattr(hf, "__len__") else vocab_size
    if n_tok < vocab_size:
        return int(n_tok)
    reserved = set(getattr(tokenizer, "eos_token_ids", None) or [])
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        v = getattr(hf, attr, None)
        if isinstance(v, int):
            reserved.add(v)
    try:
        template = tokenizer.apply_chat_template([{"role": "user", "content": "x"}],
                                                 add_generation_prompt=True)
        reserved |= {int(t) for t in template}
    except ValueError:
        pass  # no chat template (transformers raises ValueError): it reserves no ids
    special = sorted(int(i) for i in getattr(hf, "all_special_ids", []) or [])
    for i in reversed(special):
        if i not in reserved and i not in seen and 0 <= i < vocab_size:
            return i
    return vocab_size - 1
