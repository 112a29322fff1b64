"""Evaluating a drafter during training: held-out loss and accuracy, and τ through the engine.

Accuracy counts as the engine sees it: the argmax over the *full* head (the training loss only
sees the training vocabulary). τ is measured with the real speculative loop on held-out prompts,
with the proposals the exported drafter would make.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..acceptance import measure_tau
from ..prompts import encode_prompt, read_prompts
from .batches import Batch
from .data import Sample
from .loss import block_loss, block_stats
from .vocab import TrainingVocab


def load_eval_prompts(path: str | Path, tokenizer, n: int) -> list[list[int]]:
    """Token ids of the first ``n`` prompts of a prompt file (chat template applied)."""
    return [encode_prompt(tokenizer, it) for it in read_prompts(path)[:n]]


def validation_metrics(draft, embed, vocab: TrainingVocab, samples: list[Sample],
                       make_batch: Callable[[list[Sample], np.random.Generator, int], Batch],
                       batch_seqs: int, seed: int) -> dict:
    """Loss/accuracy/τ-estimate on validation samples (fixed anchors, no update)."""
    if not samples:
        return {}
    rng = np.random.default_rng([seed, 99])
    tot = {"loss": 0.0, "acc1": 0.0, "acc": 0.0, "tau": 0.0}
    for i in range(0, len(samples), batch_seqs):
        batch = make_batch(samples[i:i + batch_seqs], rng, 16)
        batch.neg_w = None
        loss, hard, _, h = block_loss(draft, embed, vocab.head_w, batch, 0.0)
        # accuracy as the engine sees it: argmax over the full head
        labels = np.array(batch.labels)
        full_labels = np.where(labels >= 0, vocab.ids[np.maximum(labels, 0)], -1)
        pred = mx.argmax(h @ vocab.head_full.T, axis=-1)
        mx.eval(loss, pred)
        correct = (np.array(pred) == full_labels) & (full_labels >= 0)
        st = block_stats(correct, full_labels)
        n = len(samples[i:i + batch_seqs])
        tot["loss"] += float(loss) * n
        for k in ("acc1", "acc", "tau"):
            tot[k] += st[k] * n
    return {f"val_{k}": v / len(samples) for k, v in tot.items()}


def engine_tau(model, tokenizer, draft, prompts: list[list[int]], block_sizes: str,
               max_tokens: int, draft_vocab: list[int] | None) -> dict:
    """τ and acceptance by position per block size (``"16,8"``), proposing from ``draft_vocab``."""
    out = {}
    draft.eval()
    draft.config.draft_vocab_ids = draft_vocab  # measure what is exported
    for bs in [int(b) for b in str(block_sizes).split(",") if b]:
        r = measure_tau(model, tokenizer, draft, prompts, bs, max_tokens)
        out[f"tau_b{bs}"] = round(r["tau"], 3)
        out[f"acc_pos_b{bs}"] = r["acceptance_by_position"][:8]
    draft.config.draft_vocab_ids = None
    draft.train()
    return out
