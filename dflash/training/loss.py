"""The training forward and loss: many blocks of many sequences in one pass of the drafter.

Blocks lie along the batch axis (``(n_blocks, bs, hidden)``), each with its own RoPE offset (its
anchor) and a visibility mask over ``[context rows of its sequence ; its own rows]``: the recipe's
``[context ; all blocks]`` attention with the always-invisible cross-block entries left out (see
:func:`dflash.training.recipe.training_visibility`). The forward calls the drafter's own modules
(:class:`dflash.drafter.DraftLayer`), so trained weights load in the engine unchanged.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .batches import Batch


def draft_hidden(draft, context_feats, seq_index, block_embeds, anchors, masks):
    """Final-normed hidden states ``(n_blocks, bs, H)`` of many blocks in one pass.

    ``context_feats (S, T, n_taps*H)``: tap outputs of ``S`` sequences (padded to ``T``);
    ``seq_index (n,)``: the sequence of each block; ``anchors (n,)``: each block's start position
    (its RoPE offset); ``masks``: one ``(n, 1, bs, T+bs)`` visibility per drafter layer.
    Calls the drafter's own layers, exactly as :meth:`DFlashDraftModel.__call__` does for one block.
    """
    context = draft.project_context(context_feats)
    x = block_embeds
    for layer, mask in zip(draft.layers, masks):
        ctx_keys, ctx_values = layer.self_attn.context_kv(context, 0)
        x = layer(x, ctx_keys[seq_index], ctx_values[seq_index], anchors, mask)
    return draft.norm(x)



def block_loss(draft, embed, head_w, batch: Batch, soft_weight: float):
    """Weighted loss over all block rows, plus per-row correctness (for accuracy and τ).

    ``head_w`` rows are the training vocabulary (label indices point into it); the batch's
    ``neg_w`` rows (sampled negatives from the rest of the full head) only join the softmax.
    Returns ``(loss, hard_loss, correct, hidden)``; ``hidden`` carries no gradient.
    """
    h = draft_hidden(draft, batch.context, batch.seq_index, embed(batch.tokens), batch.anchors,
                     batch.masks)[:, 1:]
    if batch.neg_w is not None:
        head_w = mx.concatenate([head_w, batch.neg_w], axis=0)
    logits = h @ head_w.T
    logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    valid = batch.labels >= 0
    labels = mx.maximum(batch.labels, 0)
    hard = -mx.take_along_axis(logq, labels[..., None], axis=-1)[..., 0]
    per_row = hard
    if batch.soft_ids is not None and soft_weight > 0:
        soft = -(batch.soft_p * mx.take_along_axis(logq, batch.soft_ids, axis=-1)).sum(-1)
        per_row = (1 - soft_weight) * hard + soft_weight * soft
    w = batch.weights
    loss = (per_row * w).sum() / mx.maximum(w.sum(), 1e-9)
    correct = (mx.argmax(logits, axis=-1) == batch.labels) & valid
    hard_loss = (hard * w).sum() / mx.maximum(w.sum(), 1e-9)
    return loss, hard_loss, correct, mx.stop_gradient(h)


def block_stats(correct: np.ndarray, labels: np.ndarray) -> dict:
    """Accuracy at row 1, over all rows, and the τ the blocks would give (1 + leading correct)."""
    valid = labels >= 0
    lead = np.cumprod(correct, axis=1).sum(1)
    has = valid[:, 0]
    return {
        "acc1": float(correct[has, 0].mean()) if has.any() else 0.0,
        "acc": float(correct[valid].mean()) if valid.any() else 0.0,
        "tau": float(1 + lead[has].mean()) if has.any() else 1.0,
    }
