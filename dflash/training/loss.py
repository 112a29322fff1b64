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
    Calls the drafter's own layers, exactly as :meth:`DFlashDraftModel.__call__` does for one block;
    each block is its own batch row, so DFlash2's convolution never reaches across blocks. Blocks
    grouped by sequence share its context keys/values
    (:func:`~dflash.drafter.shared_context_attention`); ungrouped ones get a copy each.
    """
    context = draft.project_context(context_feats)
    x = block_embeds * draft.config.input_embedding_scale  # DFlash2's scale (1 for v1)
    seq = np.asarray(seq_index)
    # Blocks grouped by sequence (as make_batch lays them out) share their sequence's context
    # keys/values instead of each gathering a copy (~2x faster per layer, forward + backward).
    rows = (np.bincount(seq, minlength=context.shape[0]).tolist()
            if len(seq) and np.all(np.diff(seq) >= 0) else None)
    for layer, mask in zip(draft.layers, masks):
        ctx_keys, ctx_values = layer.self_attn.context_kv(context, 0)
        if rows is None:
            x = layer(x, ctx_keys[seq_index], ctx_values[seq_index], anchors, mask)
        else:
            x = layer(x, ctx_keys, ctx_values, anchors, mask, rows)
    return draft.norm(x)



def selector_loss(selector, hidden: mx.array, unary: mx.array, batch: Batch) -> mx.array:
    """DFlash2's selector cross-entropy, teacher-forced.

    For each row, the candidates are the strict top-k of the unary logits ``unary (n, bs-1, Vt)``
    over the training vocabulary (the ids the exported drafter may propose); each scores
    ``s(b) = U(b) + sum_r A[prev, r] g[r] B[b, r]`` with ``prev`` the gold token before the row
    (the anchor for row 1) and ``g = P h``; the label is the gold token's index among them. Rows
    whose gold token is not a candidate add nothing; the sum is normalised by the row weights
    of the rows that count.
    """
    k = min(selector.top_k, unary.shape[-1])
    cand = mx.argpartition(-mx.stop_gradient(unary), kth=k - 1, axis=-1)[..., :k]
    scores = mx.take_along_axis(unary, cand, axis=-1)
    pair = selector.predecessor_codebook(batch.prev_ids) * selector.hidden_projection(hidden)
    successor = selector.successor_codebook(batch.vocab_ids[cand])  # (n, bs-1, k, r)
    scores = scores + (successor @ pair[..., None])[..., 0]
    gold = cand == batch.labels[..., None]
    w = batch.weights * gold.any(-1)
    ce = mx.logsumexp(scores, axis=-1) - (scores * gold).sum(-1)
    return (ce * w).sum() / mx.maximum(w.sum(), 1e-9)


def block_loss(draft, embed, head_w, batch: Batch, soft_weight: float,
               selector_weight: float = 0.0):
    """Weighted loss over all block rows, plus per-row correctness (for accuracy and τ).

    ``head_w`` rows are the training vocabulary (label indices point into it); the batch's
    ``neg_w`` rows (sampled negatives from the rest of the full head) only join the softmax.
    A DFlash2 drafter's logits are its selector's unary logits, and ``selector_weight`` adds
    :func:`selector_loss`. Returns ``(loss, hard_loss, correct, hidden)``; ``hidden`` carries no
    gradient.
    """
    h = draft_hidden(draft, batch.context, batch.seq_index, embed(batch.tokens), batch.anchors,
                     batch.masks)[:, 1:]
    n_vocab = head_w.shape[0]
    if batch.neg_w is not None:
        head_w = mx.concatenate([head_w, batch.neg_w], axis=0)
    logits = h @ head_w.T
    selector = getattr(draft, "candidate_selector", None)
    if selector is not None:
        logits = selector.unary(logits)
    valid = batch.labels >= 0
    labels = mx.maximum(batch.labels, 0)
    soft_ids = batch.soft_ids if batch.soft_ids is not None and soft_weight > 0 else None
    lse = mx.logsumexp(logits, axis=-1)
    if selector is None:
        # The label's (and the teacher's top-k) logits as h · head row: their gradient reaches h
        # without a vocabulary-wide scatter (a step 5 % cheaper; the head is frozen).
        hard = lse - (h * head_w[labels]).sum(-1)
        if soft_ids is not None:
            mean_row = (batch.soft_p[..., None] * head_w[soft_ids]).sum(-2)
            soft = lse * batch.soft_p.sum(-1) - (h * mean_row).sum(-1)
    else:
        hard = lse - mx.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        if soft_ids is not None:
            soft = (batch.soft_p * (lse[..., None] - mx.take_along_axis(logits, soft_ids, axis=-1))
                    ).sum(-1)
    per_row = hard
    if soft_ids is not None:
        per_row = (1 - soft_weight) * hard + soft_weight * soft
    w = batch.weights
    loss = (per_row * w).sum() / mx.maximum(w.sum(), 1e-9)
    if selector is not None and selector_weight > 0:
        loss = loss + selector_weight * selector_loss(selector, h, logits[..., :n_vocab], batch)
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
