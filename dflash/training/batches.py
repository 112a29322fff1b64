"""One training batch: the blocks of a few sequences, their context, labels and visibility masks."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .data import Sample
from .features import FeatureStore
from .recipe import block_visibility, build_blocks, sample_anchors
from .vocab import TrainingVocab


@dataclass
class Batch:
    context: object  # (S, T, nH) float32
    seq_index: object  # (n,)
    tokens: object  # (n, bs)
    anchors: object  # (n,)
    masks: list
    labels: object  # (n, bs-1) index into the training vocabulary, -1 none
    weights: object  # (n, bs-1)
    soft_ids: object | None  # (n, bs-1, K) index into the training vocabulary
    soft_p: object | None  # (n, bs-1, K) probabilities (0 for ids outside the vocabulary)
    n_rows: int = 0
    neg_w: object | None = None  # (R, H) head rows of sampled negatives (outside the vocabulary)
    prev_ids: object | None = None  # (n, bs-1) full id before each labelled row (DFlash2 selector)
    vocab_ids: object | None = None  # (n_vocab,) full id of each training-vocabulary row


def make_batch(samples: list[Sample], rng: np.random.Generator, features: FeatureStore,
               vocab: TrainingVocab, draft, n_anchors: int, row_w: np.ndarray,
               soft_weight: float, negatives: int) -> Batch:
    """Up to ``n_anchors`` random blocks of each sample, labelled in ``vocab`` rows.

    ``row_w`` are the loss weights of block rows 1.. (row 0 carries none); ``soft_weight > 0``
    adds the teacher's top-k (renormalised over the vocabulary); ``negatives`` random head rows
    from outside the vocabulary join the softmax. ``rng`` draws the anchors, then the negatives.
    """
    bs, mask_token_id = draft.block_size, draft.mask_token_id
    feats, anchors, tokens, labels, seq_idx, soft, prev = [], [], [], [], [], [], []
    for s_i, s in enumerate(samples):
        f = features.get(s)
        a = sample_anchors(rng, s.prompt_len, len(s.ids), n_anchors)
        t, lab, pos = build_blocks(s.ids.astype(np.int64), a, bs, mask_token_id)
        feats.append(f)
        anchors.append(a)
        tokens.append(t)
        labels.append(lab[:, 1:])
        # the gold token before row k (the anchor for row 1): the selector's teacher-forced input
        prev.append(s.ids[np.minimum(pos[:, :-1], len(s.ids) - 1)].astype(np.int64))
        seq_idx.append(np.full(len(a), s_i))
        if "top_ids" in f:
            rows = np.clip(pos[:, 1:] - 1, 0, len(s.ids) - 1)  # teacher row of token a+k
            soft.append((f["top_ids"][rows], f["top_logp"][rows].astype(np.float32)))
    anchors_np = np.concatenate(anchors)
    labels_np = np.concatenate(labels)
    ctx_len = int(max(int(a.max()) for a in anchors))
    ctx_len = max(8, -(-ctx_len // 32) * 32)  # fewer distinct shapes
    n_taps_h = feats[0]["feats"].shape[1]
    context = np.zeros((len(samples), ctx_len, n_taps_h), dtype=np.float32)
    for i, f in enumerate(feats):
        n = min(ctx_len, f["feats"].shape[0])
        context[i, :n] = f["feats"][:n]
    sub_labels = np.where(labels_np >= 0, vocab.to_sub[np.maximum(labels_np, 0)], -1)
    weights = np.where(sub_labels >= 0, row_w[None, :], 0.0).astype(np.float32)
    masks = []
    for layer in draft.layers:
        attn = layer.self_attn
        vis = block_visibility(anchors_np, ctx_len, bs, attn.sliding_window, attn.block_causal)
        masks.append(mx.array(vis[:, None]))
    soft_ids = soft_p = None
    if soft and soft_weight > 0:
        ids = np.concatenate([s[0] for s in soft])
        logp = np.concatenate([s[1] for s in soft])
        sub = vocab.to_sub[ids]
        p = np.exp(logp) * (sub >= 0)
        p = p / np.maximum(p.sum(-1, keepdims=True), 1e-9)
        p = p * (labels_np >= 0)[..., None]
        soft_ids, soft_p = mx.array(np.maximum(sub, 0)), mx.array(p.astype(np.float32))
    return Batch(
        neg_w=vocab.negatives(rng, negatives), context=mx.array(context),
        seq_index=mx.array(np.concatenate(seq_idx)), tokens=mx.array(np.concatenate(tokens)),
        anchors=mx.array(anchors_np.astype(np.int32)), masks=masks, labels=mx.array(sub_labels),
        weights=mx.array(weights), soft_ids=soft_ids, soft_p=soft_p,
        n_rows=int((sub_labels >= 0).sum()), prev_ids=mx.array(np.concatenate(prev)),
        vocab_ids=mx.array(vocab.ids))
