"""Which tensor of a drafter gets how many bits: the quantization recipes of ``dflash convert``.

- ``uniform``: every linear projection at one width; ``mixed_H_L``: ``H`` bits outside the layer
  stack and in the first and last layer, ``L`` in the others; ``sensitivity``: per-tensor widths
  within an average bit budget, from the measured KL increase of quantizing each tensor alone.
- The calibration blocks the KL is measured on: the target's tapped features on fixed prompts when
  a target is given, synthetic ones otherwise (:func:`build_calibration`).
- DFlash2's codebooks and kernel projections (:func:`dflash2_plan`).

:func:`plan_quantization` turns a recipe into the report's fields and mlx-lm's per-tensor
``quantization`` block; :mod:`dflash.convert` applies it and writes the checkpoint.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from .drafter import CODEBOOKS, DFlashConfig, DFlashDraftModel, build_draft
from .errors import DFlashError
from .prompts import encode_prompt
from .target import TargetParts, forward, make_cache, target_parts
from .target import load_target as load_target_model

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
DEFAULT_SENSITIVITY_LEVELS = (3, 4, 5, 6, 8)
DEFAULT_CODEBOOK_BITS = 8  # DFlash2 selector codebooks (measured: docs/convert.md)
RECIPE_HELP = "uniform | mixed_H_L (e.g. mixed_8_4, mixed_6_4) | sensitivity"
MIXED_RE = re.compile(r"^mixed_(\d)_(\d)$")
LOSS_GAMMA = 7.0  # the DFlash loss decay for block 16: row k weighs exp(-(k-1)/gamma)

# Fixed prompts: calibration blocks and the acceptance comparison of the report.
FIXED_PROMPTS = (
    "Explain speculative decoding in three sentences.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Summarize the causes of the French Revolution.",
    "A train travels 120 km in 1.5 hours. What is its average speed in km/h? Explain.",
    "Write a short poem about the sea at night.",
    "List five tips for writing clear technical documentation.",
    "What is the difference between a list and a tuple in Python?",
)


# ---------------------------------------------------------------------------------------------
# Which tensors get how many bits


def _sort_key(path: str):
    order = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    m = re.match(r"layers\.(\d+)\.\w+\.(\w+)$", path)
    if m:
        name = m.group(2)
        return (1, int(m.group(1)), order.index(name) if name in order else 99, name)
    return (0, 0, 0, path)


def linear_paths(model: nn.Module) -> list[str]:
    """Module paths of the drafter's linear projections, ``fc`` first, in layer order."""
    return sorted((p for p, m in model.named_modules()
                   if isinstance(m, (nn.Linear, nn.QuantizedLinear))), key=_sort_key)


def is_kernel_projection(path: str) -> bool:
    """DFlash2's per-layer kernel projections (``layers.i.{attention,mlp}_conv.kernel_projection``)."""
    return path.endswith("_conv.kernel_projection")


def dflash2_plan(model: nn.Module, plan: dict[str, int], kept: dict[str, str], group_size: int,
                 codebook_bits: int | None, float_kernels: bool) -> list[str]:
    """DFlash2's extra choices on top of a recipe's plan (both edited in place): the kernel
    projections leave it with ``float_kernels``; the two codebooks (embeddings, outside the
    recipes: the block-prediction KL does not see them) join it at ``codebook_bits``, or stay in
    float with ``None``. The codebooks' paths, for the config's per-tensor block."""
    if not getattr(model.config, "is_dflash2", False):
        return []
    if float_kernels:
        for p in [p for p in plan if is_kernel_projection(p)]:
            del plan[p]
            kept[p] = "kernel projection kept in float (float_kernels)"
    mods = dict(model.named_modules())
    for p in CODEBOOKS:
        rank = mods[p].weight.shape[-1]
        if codebook_bits is None:
            kept[p] = "codebook kept in float (codebook_bits=None)"
        elif rank % group_size:
            kept[p] = f"selector rank {rank} is not a multiple of the group size {group_size}"
        else:
            plan[p] = codebook_bits
    return list(CODEBOOKS)


def parse_recipe(recipe: str | None) -> tuple[str, tuple[int, int] | None]:
    if recipe in (None, "", "uniform"):
        return "uniform", None
    if recipe == "sensitivity":
        return "sensitivity", None
    m = MIXED_RE.match(recipe)
    if m:
        hi, lo = int(m.group(1)), int(m.group(2))
        if hi in SUPPORTED_BITS and lo in SUPPORTED_BITS and hi > lo:
            return "mixed", (hi, lo)
    raise DFlashError(f"quant_recipe={recipe!r}: unknown recipe; use {RECIPE_HELP} "
                      f"(bits from {SUPPORTED_BITS}, high > low)")


def _mixed_plan(paths: list[str], n_layers: int, hi: int, lo: int) -> dict[str, int]:
    """``hi`` bits outside the layer stack (``fc``, DFlash2's selector projection) and in the
    first and last layer, ``lo`` in the others."""
    edge = {0, n_layers - 1}
    plan = {}
    for p in paths:
        m = re.match(r"layers\.(\d+)\.", p)
        plan[p] = hi if not m or int(m.group(1)) in edge else lo
    return plan


def _split_divisible(model: nn.Module, paths: list[str], group_size: int):
    mods = dict(model.named_modules())
    ok, kept = [], {}
    for p in paths:
        in_dim = mods[p].weight.shape[-1]
        if in_dim % group_size:
            kept[p] = f"input dimension {in_dim} is not a multiple of the group size {group_size}"
        else:
            ok.append(p)
    return ok, kept


# ---------------------------------------------------------------------------------------------
# Calibration: block predictions of the unquantized drafter vs a quantized one


class Calibration:
    """Calibration blocks and the head their predictions are read through.

    ``samples`` are ``(taps (1, T, n_taps*H), block_embeds (1, bs, H))`` in float32; ``head`` is a
    ``(V', H)`` matrix of head rows (a vocabulary subset that holds the reference's likely tokens).
    """

    def __init__(self, samples, description: str, head_fn, head_rows_fn, vocab_size: int,
                 subset_topk: int = 32, max_subset: int = 4096):
        self.samples = samples
        self.description = description
        self._head_fn = head_fn
        self._head_rows_fn = head_rows_fn
        self.vocab_size = vocab_size
        self.subset_topk = subset_topk
        self.max_subset = max_subset
        self.head = None
        self.ref_logp = None
        self.ref_top = None
        self.weights = None

    def hidden(self, model: DFlashDraftModel) -> mx.array:
        rows = []
        for taps, embeds in self.samples:
            cache = model.make_cache()
            model.append_context(taps, cache)
            rows.append(model(embeds, cache)[0, 1:])
        return mx.concatenate(rows, axis=0)

    def set_reference(self, model: DFlashDraftModel) -> None:
        h = self.hidden(model)
        if self.vocab_size <= self.max_subset:
            ids = mx.arange(self.vocab_size)
        else:
            logits = self._head_fn(h)
            k = min(self.subset_topk, logits.shape[-1])
            top = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]
            ids = mx.array(sorted(set(top.reshape(-1).tolist()))[: self.max_subset])
        self.head = self._head_rows_fn(ids).astype(mx.float32)
        logits = h @ self.head.T
        self.ref_logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        self.ref_top = mx.argmax(logits, axis=-1)
        block_rows = [e.shape[1] - 1 for _, e in self.samples]
        w = [math.exp(-j / LOSS_GAMMA) for n in block_rows for j in range(n)]
        self.weights = mx.array(w) / sum(w)
        mx.eval(self.head, self.ref_logp, self.ref_top, self.weights)

    def score(self, model: DFlashDraftModel) -> tuple[float, float]:
        """(weighted mean KL(ref || model) in nats, top-1 agreement with the reference)."""
        logits = self.hidden(model) @ self.head.T
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        kl = (mx.exp(self.ref_logp) * (self.ref_logp - logp)).sum(axis=-1)
        agree = (mx.argmax(logits, axis=-1) == self.ref_top).astype(mx.float32).mean()
        kl = (kl * self.weights).sum()
        mx.eval(kl, agree)
        return max(float(kl), 0.0), float(agree)


def prompt_token_ids(tokenizer, prompts, vocab: int, seed: int,
                     length: int = 48) -> list[list[int]]:
    """Each prompt as one user turn through the chat template; without a tokenizer (a target
    given as a bare model), ``length`` random ids per prompt, the same for the same ``seed``."""
    if tokenizer is not None:
        return [encode_prompt(tokenizer, {"prompt": p}) for p in prompts]
    key = mx.random.key(seed)
    out = []
    for _ in prompts:
        key, sub = mx.random.split(key)
        out.append(mx.random.randint(0, vocab, (length,), key=sub).tolist())
    return out


def build_calibration(cfg: DFlashConfig, target=None, prompts=FIXED_PROMPTS,
                      n_samples: int = 16, context_len: int = 64, seed: int = 0) -> Calibration:
    """Calibration blocks from the target (real tap features) or synthetic ones."""
    bs = cfg.block_size
    hid = cfg.hidden_size
    key = mx.random.key(seed)
    if target is not None:
        parts, tokenizer = target
        seqs = prompt_token_ids(tokenizer, prompts, cfg.vocab_size, seed)
        samples = []
        per_prompt = max(1, math.ceil(n_samples / len(seqs)))
        for ids in seqs:
            ids = ids[:256]
            if len(ids) < 2:
                continue
            _, taps = forward(parts, mx.array(ids)[None], make_cache(parts), cfg.target_layer_ids)
            taps = taps.astype(mx.float32)
            for j in range(per_prompt):
                # anchors spread over the prompt; context = rows strictly before the anchor
                a = 1 + (len(ids) - 2) * (j + 1) // (per_prompt + 1) if len(ids) > 2 else 1
                block = mx.array([ids[a]] + [cfg.mask_token_id] * (bs - 1))[None]
                samples.append((taps[:, :a], parts.embed(block).astype(mx.float32)))
        if not samples:
            raise DFlashError("calibration: every prompt is shorter than 2 tokens")
        samples = samples[:max(n_samples, 1)]
        mx.eval(samples)
        desc = (f"{len(samples)} blocks of {bs} at anchors inside {len(seqs)} fixed prompts, "
                "context = the target's tapped layer outputs, block predictions read through "
                "the target's LM head")
        return Calibration(samples, desc,
                           lambda h: parts.head(h.astype(parts.norm.weight.dtype)),
                           parts.head_rows, parts.vocab_size)

    samples = []
    for i in range(n_samples):
        key, k1, k2 = mx.random.split(key, 3)
        t = context_len // 2 + (i * 7) % max(context_len // 2, 1)
        taps = mx.random.normal((1, t, cfg.num_taps * hid), key=k1)
        embeds = mx.random.normal((1, bs, hid), key=k2) * 0.5
        samples.append((taps, embeds))
    n_vocab = min(cfg.vocab_size, 1024)
    key, kh = mx.random.split(key)
    head = mx.random.normal((n_vocab, hid), key=kh) * (3.0 / math.sqrt(hid))
    mx.eval(samples, head)
    desc = (f"SYNTHETIC: {n_samples} blocks of {bs} with random context features, random block "
            f"embeddings and a random {n_vocab}-row head (no target given: pass --target for "
            "calibration on real target features)")
    return Calibration(samples, desc, lambda h: h @ head.T, lambda ids: head[ids], n_vocab)


def _fake_quant(w: mx.array, group_size: int, bits: int) -> mx.array:
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    return mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits)


def _plan_score(calib: Calibration, ref: DFlashDraftModel, stored: dict[str, mx.array],
                plan: dict[str, int], group_size: int) -> tuple[float, float]:
    """``calib.score`` of ``ref`` with ``plan``'s tensors swapped for their quantize->dequantize
    round trip (from ``stored``, the weights as they will be stored); ``ref`` is left as it was."""
    mods = dict(ref.named_modules())
    saved = {}
    try:
        for p, bits in plan.items():
            saved[p] = mods[p].weight
            mods[p].weight = _fake_quant(stored[p], group_size, bits).astype(mx.float32)
        return calib.score(ref)
    finally:
        for p, w in saved.items():
            mods[p].weight = w


def sensitivity_plan(ref: DFlashDraftModel, stored: dict[str, mx.array], paths: list[str],
                     calib: Calibration, group_size: int, bit_budget: float,
                     levels=DEFAULT_SENSITIVITY_LEVELS, log=None) -> tuple[dict[str, int], dict]:
    """Per-tensor bits within an average budget, from measured single-tensor KL increases.

    ``ref`` is the float32 drafter (calibration reference, already set on ``calib``), ``stored``
    the weights as they will be stored (the output dtype), quantized from there.
    """
    levels = sorted(set(levels))
    if not levels or any(b not in SUPPORTED_BITS for b in levels):
        raise DFlashError(f"sensitivity levels {levels}: each must be one of {SUPPORTED_BITS}")
    if bit_budget < levels[0]:
        raise DFlashError(f"bit_budget={bit_budget}: below the lowest level ({levels[0]} bits)")
    sizes = {p: int(stored[p].size) for p in paths}
    total = sum(sizes.values())
    table: dict[str, dict[int, float]] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(paths):
        table[p] = {}
        best = math.inf
        for b in levels:
            kl, _ = _plan_score(calib, ref, stored, {p: b}, group_size)
            best = min(best, kl)  # more bits never cost more: keep it monotone against noise
            table[p][b] = best
        if log and (i + 1) % 8 == 0:
            log(f"  sensitivity {i + 1}/{len(paths)} tensors ({time.perf_counter() - t0:.0f}s)")
    # Greedy: upgrade the step with the best KL reduction per extra bit, while the budget allows.
    bits = {p: levels[0] for p in paths}
    spent = levels[0] * total
    allowed = bit_budget * total + 1e-6
    while True:
        best_step, best_ratio = None, 0.0
        for p in paths:
            for b in levels:
                if b <= bits[p]:
                    continue
                extra = (b - bits[p]) * sizes[p]
                if spent + extra > allowed:
                    continue
                gain = table[p][bits[p]] - table[p][b]
                ratio = gain / extra
                if ratio > best_ratio:
                    best_step, best_ratio = (p, b, extra), ratio
        if best_step is None:
            break
        p, b, extra = best_step
        bits[p] = b
        spent += extra
    # Any budget left (no measurable gain anywhere): raise the cheapest tensors uniformly.
    for b in levels:
        for p in sorted(paths, key=lambda q: sizes[q]):
            if bits[p] < b and spent + (b - bits[p]) * sizes[p] <= allowed:
                spent += (b - bits[p]) * sizes[p]
                bits[p] = b
    info = {"levels": levels, "bit_budget": bit_budget,
            "average_bits": spent / total if total else 0.0,
            "kl_single_tensor": {p: {str(b): v for b, v in table[p].items()} for p in paths},
            "seconds": round(time.perf_counter() - t0, 2)}
    return bits, info


# ---------------------------------------------------------------------------------------------
# The target (optional): calibration features and the acceptance comparison's pair


class Target(NamedTuple):
    model: nn.Module
    tokenizer: Any  # None when given a bare model: prompts are then random ids
    parts: TargetParts
    name: str


def load_target(target) -> Target:
    """``target``: a path / hub id, a loaded mlx-lm model, or ``(model, tokenizer)``."""
    if isinstance(target, (str, Path)):
        model, tokenizer = load_target_model(str(target))
        name = str(target)
    elif isinstance(target, tuple):
        model, tokenizer = target
        name = type(model).__name__
    else:
        model, tokenizer, name = target, None, type(target).__name__
    return Target(model, tokenizer, target_parts(model), name)




# ---------------------------------------------------------------------------------------------
# The plan


def _sensitivity_plan_checked(ref, stored, paths, calib, group_size, bit_budget, levels,
                              log) -> tuple[dict[str, int], dict, str | None]:
    """:func:`sensitivity_plan`, kept only if it measures better than the uniform plan of the
    same budget; the note says when it did not."""
    log(f"[convert] measuring sensitivity of {len(paths)} tensors at {sorted(set(levels))} bits")
    plan, info = sensitivity_plan(ref, stored, paths, calib, group_size, bit_budget, levels, log)
    floor_bits = max((b for b in info["levels"] if b <= bit_budget), default=None)
    info["chosen"] = "greedy"
    if floor_bits is None or not paths:
        return plan, info, None
    # The greedy plan assumes tensors' KL increases add up; check it against the uniform plan of
    # the same budget and keep whichever measures better.
    uniform = {p: floor_bits for p in paths}
    kl_u, ag_u = _plan_score(calib, ref, stored, uniform, group_size)
    kl_g, _ = _plan_score(calib, ref, stored, plan, group_size)
    info["uniform_comparison"] = {"bits": floor_bits, "kl": kl_u, "top1_agreement": ag_u}
    if kl_u >= kl_g:
        return plan, info, None
    info["chosen"] = f"uniform {floor_bits}-bit (measured better)"
    info["average_bits"] = float(floor_bits)
    return uniform, info, (
        f"sensitivity: the greedy mix measured worse (KL {kl_g:.4g}) than uniform "
        f"{floor_bits}-bit (KL {kl_u:.4g}) on the calibration blocks; kept uniform")


def plan_quantization(model: DFlashDraftModel, src_weights: dict[str, mx.array], kind: str,
                      mixed: tuple[int, int] | None, q_bits: int, group_size: int,
                      bit_budget: float | None, levels, target: Target | None, calib_prompts,
                      calib_samples: int, log, codebook_bits: int | None = DEFAULT_CODEBOOK_BITS,
                      float_kernels: bool = False) -> dict:
    """Bits per projection under the recipe, as the report's fields: ``quantization`` (the config
    block), ``quantized`` (the plan), ``kept``, ``average_bits``, ``calibration``,
    ``sensitivity`` and ``notes``.

    ``model`` holds the weights as they will be stored; ``src_weights`` the source drafter's (the
    calibration reference, before any dtype change). DFlash2: see :func:`dflash2_plan`.
    """
    cfg = model.config
    stored = {p: m.weight for p, m in model.named_modules()
              if isinstance(m, (nn.Linear, nn.Embedding))}
    paths = linear_paths(model)
    qpaths, kept = _split_divisible(model, paths, group_size)
    fields: dict[str, Any] = {"kept": kept, "notes": [], "calibration": None,
                              "sensitivity": None}
    if not qpaths:
        fields["notes"].append(f"no projection has an input dimension divisible by {group_size}: "
                               "nothing was quantized")
    calib = ref = None
    if kind == "sensitivity" or target is not None:
        ref = build_draft(cfg, {k: v.astype(mx.float32) for k, v in src_weights.items()},
                          "calibration reference")
        calib = build_calibration(cfg, (target.parts, target.tokenizer) if target else None,
                                  prompts=calib_prompts, n_samples=calib_samples)
        calib.set_reference(ref)
        log(f"[convert] calibration: {calib.description}")
    if kind == "uniform":
        plan = {p: q_bits for p in qpaths}
    elif kind == "mixed":
        plan = _mixed_plan(qpaths, cfg.num_hidden_layers, *mixed)
    else:
        plan, fields["sensitivity"], note = _sensitivity_plan_checked(
            ref, stored, qpaths, calib, group_size, bit_budget, levels, log)
        if note:
            fields["notes"].append(note)
    paths = paths + dflash2_plan(model, plan, kept, group_size, codebook_bits, float_kernels)
    sizes = {p: int(stored[p].size) for p in plan}
    counts: dict[int, int] = {}
    for p, b in plan.items():
        counts[b] = counts.get(b, 0) + sizes[p]
    base_bits = max(counts, key=counts.get) if counts else q_bits
    qblock: dict[str, Any] = {"group_size": group_size, "bits": base_bits, "mode": "affine"}
    for p in paths:
        if p in plan and plan[p] != base_bits:
            qblock[p] = {"group_size": group_size, "bits": plan[p]}
        elif p not in plan:
            qblock[p] = False
    total = sum(sizes.values())
    fields["quantization"] = qblock
    fields["quantized"] = dict(plan)
    fields["average_bits"] = (sum(b * sizes[p] for p, b in plan.items()) / total
                              if total else 0.0)
    if calib is not None:
        kl, agree = _plan_score(calib, ref, stored, plan, group_size)
        fields["calibration"] = {"description": calib.description, "kl": kl,
                                 "top1_agreement": agree}
    return fields
