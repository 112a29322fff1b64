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
from ..prompts import encode_prompt, prompt_domain, read_prompts
from .batches import Batch
from .data import Sample
from .loss import block_loss, block_stats
from .vocab import TrainingVocab


def load_eval_prompts(path: str | Path, tokenizer, n: int) -> dict[str, list[list[int]]]:
    """Token ids of the first ``n`` prompts of each domain of a prompt file (chat template
    applied), by domain (:func:`~dflash.prompts.prompt_domain`, in the file's order): a mixed
    held-out file measures every domain, not only the first one's."""
    domains: dict[str, list[list[int]]] = {}
    for item in read_prompts(path):
        kept = domains.setdefault(prompt_domain(item["id"]), [])
        if len(kept) < n:
            kept.append(encode_prompt(tokenizer, item))
    return domains


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


def engine_tau(model, tokenizer, draft, prompts: dict[str, list[list[int]]], block_sizes: str,
               max_tokens: int, draft_vocab: list[int] | None) -> dict:
    """τ and acceptance by position per block size (``"16,8"``), proposing from ``draft_vocab``.

    ``prompts`` by domain: ``tau_b16`` counts every cycle of every domain; with several domains
    each also has its own, ``tau_b16_<domain>`` (a drafter can gain on chat and lose on math).
    """
    out = {}
    draft.eval()
    draft.config.draft_vocab_ids = draft_vocab  # measure what is exported
    for bs in [int(b) for b in str(block_sizes).split(",") if b]:
        emitted = cycles = 0.0
        accepted = np.zeros(8)
        for domain, ids in prompts.items():
            r = measure_tau(model, tokenizer, draft, ids, bs, max_tokens)
            emitted += r["tau"] * r["cycles"]
            cycles += r["cycles"]
            acc = np.zeros(8)
            head = r["acceptance_by_position"][:8]
            acc[:len(head)] = head
            accepted += acc * r["cycles"]
            if len(prompts) > 1:
                out[f"tau_b{bs}_{domain}"] = round(r["tau"], 3)
        out[f"tau_b{bs}"] = round(emitted / cycles, 3) if cycles else 0.0
        width = min(8, bs - 1)
        out[f"acc_pos_b{bs}"] = [round(float(a), 3) for a in accepted[:width] / max(cycles, 1)]
    draft.config.draft_vocab_ids = None
    draft.train()
    return out
