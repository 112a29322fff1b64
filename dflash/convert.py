"""``dflash convert``: a Hugging Face DFlash drafter -> an MLX checkpoint, optionally quantized.

The output folder holds ``config.json`` (every original field kept, plus mlx-lm's ``quantization``
block with per-tensor overrides), ``model.safetensors`` (or shards with
``model.safetensors.index.json`` above ``max_shard_bytes``) and a generated ``README.md`` model card.
:func:`dflash.drafter.load_draft` loads every output.

What quantizes: the linear projections (``fc``, attention q/k/v/o, MLP gate/up/down), with mlx's
affine quantization (``mx.quantize``: packed uint32 weights + scales + biases per group). Norms stay
in floating point. A projection whose input dimension is not a multiple of the group size stays in
floating point too, and the card lists it.

Recipes:

- ``uniform`` (default): every projection at ``q_bits``.
- ``mixed_H_L`` (e.g. ``mixed_8_4``, ``mixed_6_4``): ``fc`` and every projection of the first and
  the last drafter layer at ``H`` bits, the rest at ``L`` bits.
- ``sensitivity``: measures, per projection and per bit width, how much quantizing that projection
  alone raises the KL divergence of the drafter's block predictions (logits through the target's
  LM head, rows 1.. of each block, weighted like the DFlash training loss) from the unquantized
  drafter's, on calibration blocks; then spends an average bit budget (``bit_budget``, bits per
  quantized weight, weighted by parameter count) greedily where it lowers that KL most per bit.

Calibration blocks come from the real target when one is given (its tapped layer outputs on fixed
prompts, its embedding and LM head). Without a target they are synthetic (random context features,
random block embeddings and a random head) and the report says so.

Everything is written into a temporary folder next to the destination and renamed into place at the
end: on any failure nothing is left at the destination.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import time
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import dequantize_model, get_total_parameters

from . import __version__, backend, console
from .acceptance import measure_tau
from .checkpoint import (
    INDEX_FILE,
    drafter_weights,
    read_config,
    read_weights,
    resolve_path,
    weight_files,
    write_atomically,
)
from .drafter import (
    CODEBOOKS,
    DFlashConfig,
    DFlashDraftModel,
    build_draft,
    load_draft,
    published_names,
)
from .errors import DFlashError, DraftCheckpointError
from .prompts import encode_prompt, read_prompts
from .target import TargetParts, check_compatible, forward, make_cache, target_parts
from .target import load_target as load_target_model

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DEFAULT_MAX_SHARD_BYTES = 5 << 30
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
# Reading and validating the source


def _check_architecture(raw: dict, source: str) -> None:
    archs = raw.get("architectures")
    if archs is None:
        return
    if not isinstance(archs, list) or not any("dflash" in str(a).lower() for a in archs):
        raise DraftCheckpointError(
            f"{source}: architecture {archs!r} is not a DFlash drafter (expected e.g. "
            "'DFlashDraftModel'); this command converts drafters, not target models")


def _source_quantization(raw: dict, weights: dict[str, mx.array]) -> dict | None:
    q = raw.get("quantization") or raw.get("quantization_config")
    if q:
        return q
    if any(k.endswith(".scales") for k in weights) or any(
            v.dtype == mx.uint32 for v in weights.values()):
        return {"detected": "packed weights with scales"}
    return None


def _float_dtype(weights: dict[str, mx.array]) -> mx.Dtype:
    """The dtype held by most floating-point parameters."""
    counts: dict[mx.Dtype, int] = {}
    for v in weights.values():
        if mx.issubdtype(v.dtype, mx.floating):
            counts[v.dtype] = counts.get(v.dtype, 0) + v.size
    return max(counts, key=counts.get) if counts else mx.float32


class Source(NamedTuple):
    """The drafter to convert, read and validated (names and shapes), in floating point."""

    path: Path
    raw: dict  # its config.json (without a quantization block once dequantized)
    cfg: DFlashConfig
    model: DFlashDraftModel
    files: list[Path]  # the safetensors read, for the size before
    quantization: dict | None  # the source's own quantization, if any
    dtype: mx.Dtype  # the source's floating-point dtype


def read_source(src: Path, dequantize: bool) -> Source:
    """The source drafter as a float model; a quantized source only with ``dequantize``."""
    cfg_path = src / "config.json"
    raw = read_config(src)
    _check_architecture(raw, str(cfg_path))
    cfg = DFlashConfig.from_dict(raw, source=str(cfg_path))
    weights = drafter_weights(read_weights(src))
    quant = _source_quantization(raw, weights)
    if quant is not None:
        if not dequantize:
            bits = quant.get("bits", "?") if isinstance(quant, dict) else "?"
            raise DraftCheckpointError(
                f"{src}: already quantized (bits={bits}); converting it again would stack two "
                "quantization errors. Convert the original bf16 drafter, or pass --dequantize "
                "(dequantize=True) to start from its dequantized weights")
        if "quant_method" in quant or "detected" in quant:
            raise DraftCheckpointError(
                f"{src}: quantized in a format other than MLX's "
                f"({quant.get('quant_method', quant.get('detected'))}); only MLX-quantized "
                "drafters can be dequantized here")
        model = build_draft(cfg, weights, str(src), quant)
        dequantize_model(model)
        raw = {k: v for k, v in raw.items() if k not in ("quantization", "quantization_config")}
    else:
        model = build_draft(cfg, weights, str(src))
    return Source(src, raw, cfg, model, weight_files(src), quant,
                  _float_dtype(dict(tree_flatten(model.parameters()))))


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
# Writing


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise DFlashError(f"max shard size {text!r}: expected e.g. 5GB, 500MB or a byte count")
    unit = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[m.group(2).upper()]
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base**unit)


def save_weights(folder: Path, weights: dict[str, mx.array], max_shard_bytes: int) -> list[Path]:
    """One ``model.safetensors``, or shards plus ``model.safetensors.index.json``."""
    if max_shard_bytes <= 0:
        raise DFlashError(f"max_shard_bytes={max_shard_bytes}: must be > 0")
    shards: list[dict[str, mx.array]] = []
    size = 0
    for k in sorted(weights, key=lambda n: (_sort_key(n.rsplit(".", 1)[0]), n)):
        v = weights[k]
        if not shards or size + v.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    if len(shards) == 1:
        f = folder / "model.safetensors"
        mx.save_safetensors(str(f), shards[0], metadata={"format": "mlx"})
        return [f]
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(folder / name), shard, metadata={"format": "mlx"})
        weight_map.update({k: name for k in shard})
        files.append(folder / name)
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return files


def _files_size(files) -> int:
    return sum(f.stat().st_size for f in files if f.is_file())


def _bits_per_weight(model: nn.Module) -> float:
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return nbytes * 8 / max(get_total_parameters(model), 1)


def _compatible_targets(raw: dict, src: Path, source_name: str) -> list[str]:
    found: list[str] = []

    def add(value):
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and v and v not in found:
                found.append(v)

    dcfg = raw.get("dflash_config") or {}
    for key in ("target_model", "target_model_name_or_path", "target_model_path", "base_model",
                "target"):
        add(raw.get(key))
        add(dcfg.get(key) if isinstance(dcfg, dict) else None)
    readme = src / "README.md"
    if readme.is_file():
        text = readme.read_text(errors="replace")
        m = re.match(r"---\n(.*?)\n---", text, re.DOTALL)
        if m:
            lines = m.group(1).splitlines()
            for i, line in enumerate(lines):
                if line.startswith("base_model:"):
                    rest = line.split(":", 1)[1].strip()
                    if rest:
                        add(rest.strip("'\""))
                    for nxt in lines[i + 1:]:
                        if not nxt.strip().startswith("- "):
                            break
                        add(nxt.strip()[2:].strip("'\""))
    if not found:
        m = re.match(r"(.+?)-DFlash", source_name.split("/")[-1], re.IGNORECASE)
        if m:
            add(m.group(1) + " (inferred from the drafter's name)")
    return found


def _fmt_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def model_card(report: dict, raw: dict, cfg: DFlashConfig, name: str, src: Path) -> str:
    """A README.md in the spirit of the public DFlash MLX cards."""
    q = report["quantization"]
    recipe = report["recipe"]
    source = report["source"]
    if Path(source).expanduser().exists():
        # a local folder: its name, not this machine's path (the card travels with the weights)
        source = src.name
    targets = _compatible_targets(raw, src, source)
    if q is None:
        q_line, short = f"none ({report['dtype']} weights)", f"{report['dtype']}"
    elif recipe == "uniform":
        q_line, short = f"Uniform {q['bits']}-bit", f"{q['bits']}-bit quantized"
    elif recipe == "sensitivity":
        q_line = (f"Sensitivity-aware mixed precision (average {report['average_bits']:.2f} bits "
                  f"per quantized weight, budget {report['sensitivity']['bit_budget']})")
        short = f"sensitivity-aware mixed-precision ({report['average_bits']:.2f}-bit average)"
    else:
        hi, lo = parse_recipe(recipe)[1]
        q_line = (f"Mixed {hi}/{lo}-bit (`{recipe}`: `fc` and the first and last layer at {hi} "
                  f"bits, the rest at {lo})")
        short = f"mixed {hi}/{lo}-bit quantized"
    target_example = targets[0].split(" (")[0] if targets else "PATH_OR_REPO_OF_THE_TARGET"
    lines = [
        f"# {name}", "",
        f"MLX {short} version of the DFlash drafter `{source}`, for Apple Silicon and any other "
        "MLX backend.", "",
        "This is the **drafter** of a DFlash speculative decoding pair: a block diffusion model "
        f"that fills a block of {cfg.block_size} tokens in one pass; the target verifies them all "
        "in one forward pass and keeps the longest agreeing prefix, so the output is exactly "
        "the target's. It is **not a standalone chat model**: it has no embedding table and no "
        "LM head of its own and borrows the target's.", "",
        "## Compatible targets", "",
    ]
    if targets:
        lines += [f"- {t}" for t in targets]
    lines += [
        f"- any target with hidden size {cfg.hidden_size}, a vocabulary of {cfg.vocab_size} "
        + (f"and {cfg.num_target_layers} decoder layers " if cfg.num_target_layers else "")
        + f"whose layers {cfg.target_layer_ids} (0-based outputs) this drafter was trained on "
          "(fine-tunes of the original target work; unrelated models of the same shape do not)",
        "",
        "## Quantization", "",
        "| | |", "|---|---|",
        f"| Source | `{source}` ({report['source_dtype']}) |",
        "| Format | MLX (safetensors, mlx-lm `quantization` config block) |",
        f"| Quantization | {q_line} |",
    ]
    if q is not None:
        lines += [f"| Group size | {q['group_size']} |", "| Mode | affine |"]
    lines += [
        f"| Floating-point dtype | {report['dtype']} |",
        f"| Size on disk | {_fmt_size(report['size_before'])} -> {_fmt_size(report['size_after'])} |",
        f"| Bits per weight | {report['bits_per_weight']:.2f} |",
        "| Target platform | Apple Silicon (Metal); also runs on MLX's CPU and CUDA backends |",
        "",
    ]
    if q is not None:
        by_bits: dict[int, list[str]] = {}
        for p, b in report["quantized"].items():
            by_bits.setdefault(b, []).append(p)
        lines += ["Quantized tensors (packed `weight` + `scales` + `biases`):", ""]
        for b in sorted(by_bits, reverse=True):
            lines.append(f"- **{b}-bit** ({len(by_bits[b])}): " + ", ".join(f"`{p}`" for p in by_bits[b]))
        lines += ["", "Kept in floating point:", "",
                  "- every norm (`hidden_norm`, `norm`, `input_layernorm`, "
                  "`post_attention_layernorm`, `q_norm`, `k_norm`)"]
        for p, why in report["kept"].items():
            lines.append(f"- `{p}`: {why}")
        if recipe == "uniform":
            lines += ["", f"This release does **not** use sensitivity-aware mixed precision: every "
                          f"quantizable projection is quantized to {q['bits']} bits."]
        lines.append("")
    if report.get("calibration"):
        c = report["calibration"]
        lines += ["## Measured on this conversion", "",
                  f"- Calibration: {c['description']}",
                  f"- Block-prediction KL divergence from the unquantized drafter: {c['kl']:.4g} nats; "
                  f"top-1 agreement {100 * c['top1_agreement']:.1f} %"]
        if report.get("sensitivity") and "uniform_comparison" in report["sensitivity"]:
            u = report["sensitivity"]["uniform_comparison"]
            lines.append(f"- Uniform {u['bits']}-bit for comparison: KL {u['kl']:.4g} nats, "
                         f"top-1 agreement {100 * u['top1_agreement']:.1f} %")
    if report.get("tau"):
        t = report["tau"]
        if not report.get("calibration"):
            lines += ["## Measured on this conversion", ""]
        lines.append(f"- Mean acceptance τ (greedy, block {cfg.block_size}, {t['prompts']} fixed "
                     f"prompts, target `{t['target']}`): original {t['original']:.3f}, "
                     f"converted {t['converted']:.3f}")
    if report.get("calibration") or report.get("tau"):
        lines.append("")
    if report.get("notes"):
        lines += ["Notes:", ""] + [f"- {n}" for n in report["notes"]] + [""]
    lines += [
        "## Usage", "",
        "```python",
        "from dflash.model_mlx import load, load_draft, stream_generate",
        "",
        f'model, tokenizer = load("{target_example}")',
        f'draft = load_draft("{name}")',
        "",
        'messages = [{"role": "user", "content": "Explain speculative decoding."}]',
        "prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)",
        "",
        f"for r in stream_generate(model, draft, tokenizer, prompt, block_size={cfg.block_size}, "
        "max_tokens=2048, temperature=0.6):",
        '    print(r.text, end="", flush=True)',
        "```", "",
        "Weight-only quantization of the drafter barely moves acceptance; float16 *activations* "
        "do (keep the drafter in bfloat16 or float32), and the output is always exactly the "
        "target's.", "",
        "## Credits", "",
        "- z-lab DFlash team (method and original drafter), the Qwen team, Apple MLX", "",
        "```bibtex",
        "@article{chen2026dflash,",
        "  title={DFlash: Block Diffusion for Flash Speculative Decoding},",
        "  author={Chen, Jian and Liang, Yesheng and Liu, Zhijian},",
        "  year={2026},",
        "  eprint={2602.06036},",
        "  archivePrefix={arXiv},",
        "  primaryClass={cs.LG}",
        "}",
        "```", "",
        f"Converted with `dflash convert` (dflash {__version__}).", "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The target (optional): calibration features and the acceptance comparison


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


def compare_tau(target: Target, original: DFlashDraftModel, converted: DFlashDraftModel,
                prompts, max_tokens: int) -> dict:
    """Mean greedy acceptance τ of the original and the converted drafter on the same prompts."""
    ids = prompt_token_ids(target.tokenizer, prompts, original.config.vocab_size, seed=0)
    orig = measure_tau(target.model, target.tokenizer, original, ids, max_tokens=max_tokens)
    conv = measure_tau(target.model, target.tokenizer, converted, ids, max_tokens=max_tokens)
    return {
        "original": orig["tau"], "converted": conv["tau"], "prompts": len(prompts),
        "max_tokens": max_tokens, "target": target.name,
        "outputs_identical": orig["outputs"] == conv["outputs"],
        "draft_ms_per_cycle": {"original": orig["draft_ms_per_cycle"],
                               "converted": conv["draft_ms_per_cycle"]}}


# ---------------------------------------------------------------------------------------------
# The conversion


def _checked_options(quantize, q_bits, q_group_size, dtype, quant_recipe, bit_budget,
                     max_shard_bytes) -> tuple[str, tuple[int, int] | None, bool, float | None]:
    """``(recipe kind, mixed bits, quantize, bit_budget)`` once every option is in range."""
    if q_bits not in SUPPORTED_BITS:
        raise DFlashError(f"q_bits={q_bits!r}: unsupported; MLX affine quantization supports "
                          f"{', '.join(map(str, SUPPORTED_BITS))} bits")
    if q_group_size not in SUPPORTED_GROUP_SIZES:
        raise DFlashError(f"q_group_size={q_group_size!r}: unsupported; use one of "
                          f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))}")
    if dtype is not None and dtype not in DTYPES:
        raise DFlashError(f"dtype={dtype!r}: use one of {', '.join(DTYPES)}")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise DFlashError(f"max_shard_bytes={max_shard_bytes!r}: must be a positive byte count")
    kind, mixed = parse_recipe(quant_recipe)
    quantize = bool(quantize or quant_recipe not in (None, "", "uniform"))
    if kind == "sensitivity":
        bit_budget = float(q_bits if bit_budget is None else bit_budget)
        if not SUPPORTED_BITS[0] <= bit_budget <= 8:
            raise DFlashError(f"bit_budget={bit_budget}: must be between 2 and 8")
    elif bit_budget is not None:
        raise DFlashError("bit_budget only applies to --quant-recipe sensitivity")
    return kind, mixed, quantize, bit_budget


def _checked_destination(src: Path, mlx_path: str | Path, force: bool) -> Path:
    dst = Path(mlx_path).expanduser()
    if dst.resolve() == src.resolve() or dst.resolve() in src.resolve().parents:
        raise DFlashError(f"mlx_path={dst}: would overwrite the source folder {src}")
    if dst.exists() and not force:
        raise DFlashError(f"mlx_path={dst}: already exists; pass --force (force=True) to replace it")
    if dst.exists() and not dst.is_dir():
        raise DFlashError(f"mlx_path={dst}: exists and is not a folder")
    return dst


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


def _quantize(model: nn.Module, plan: dict[str, int], group_size: int) -> None:
    def predicate(p, m):
        if p not in plan:
            return False
        return {"group_size": group_size, "bits": plan[p], "mode": "affine"}

    nn.quantize(model, class_predicate=predicate)
    mx.eval(model.parameters())


def _output_config(raw: dict, quantization: dict | None, dtype_name: str) -> dict:
    """The source's config.json with the new quantization block and float dtype."""
    out = dict(raw)
    for k in ("quantization", "quantization_config"):
        out.pop(k, None)
    if quantization is not None:
        out["quantization"] = quantization
        out["quantization_config"] = quantization
    if "torch_dtype" in out or "dtype" not in out:
        out["torch_dtype"] = dtype_name
    if "dtype" in out:
        out["dtype"] = dtype_name
    return out


def write_checkpoint(folder: Path, weights: dict[str, mx.array], config: dict, src: Path,
                     max_shard_bytes: int) -> list[Path]:
    """Weights, config.json and the source's licence / generation config; the weight files."""
    files = save_weights(folder, weights, max_shard_bytes)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for pattern in ("LICENSE*", "generation_config.json"):
        for f in src.glob(pattern):
            if f.is_file():
                shutil.copy(f, folder / f.name)
    return files


def convert(
    hf_path: str | Path,
    mlx_path: str | Path,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    dtype: str | None = None,
    quant_recipe: str | None = None,
    force: bool = False,
    dequantize: bool = False,
    target=None,
    bit_budget: float | None = None,
    sensitivity_levels=DEFAULT_SENSITIVITY_LEVELS,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    calib_prompts=FIXED_PROMPTS,
    calib_samples: int = 16,
    codebook_bits: int | None = DEFAULT_CODEBOOK_BITS,
    float_kernels: bool = False,
    tau_prompts=FIXED_PROMPTS,
    tau_max_tokens: int = 64,
    verify: bool = True,
    log=None,
) -> dict:
    """Convert a DFlash drafter to an MLX checkpoint at ``mlx_path`` and return a report.

    ``quant_recipe`` (``uniform``, ``mixed_H_L``, ``sensitivity``) implies ``quantize``.
    ``bit_budget`` (sensitivity only, default ``q_bits``) is the average number of bits per
    quantized weight. ``target`` (path / hub id / loaded model / ``(model, tokenizer)``) gives
    real calibration features and the τ comparison (skipped when ``tau_prompts`` is empty).
    DFlash2 drafters: ``codebook_bits`` (None: float) for the selector's two codebooks, and
    ``float_kernels`` keeps the convolutions' kernel projections in float (docs/convert.md).
    Raises a :class:`DFlashError` subclass naming the problem; on failure nothing is left at
    ``mlx_path``.
    """
    log = log or (lambda *_: None)
    t_start = time.perf_counter()
    kind, mixed, quantize, bit_budget = _checked_options(
        quantize, q_bits, q_group_size, dtype, quant_recipe, bit_budget, max_shard_bytes)
    if codebook_bits is not None and codebook_bits not in SUPPORTED_BITS:
        raise DFlashError(f"codebook_bits={codebook_bits!r}: one of {SUPPORTED_BITS}, or None "
                          "(float)")
    src = resolve_path(hf_path)
    dst = _checked_destination(src, mlx_path, force)

    log(f"[convert] reading {src}")
    source = read_source(src, dequantize)
    cfg, model = source.cfg, source.model
    src_weights = dict(tree_flatten(model.parameters()))  # the original drafter, for τ
    out_dtype = DTYPES[dtype] if dtype else source.dtype
    model.update(tree_map(lambda p: p.astype(out_dtype) if mx.issubdtype(p.dtype, mx.floating)
                          else p, model.parameters()))
    mx.eval(model.parameters())
    bpw_before = _bits_per_weight(model) if source.quantization is None else None

    tgt = None
    if target is not None:
        log(f"[convert] loading target {target}")
        tgt = load_target(target)
        check_compatible(tgt.parts, model)

    report: dict[str, Any] = {
        "source": str(hf_path), "source_path": str(src), "destination": str(dst),
        "source_dtype": DTYPE_NAMES.get(source.dtype, str(source.dtype)),
        "dtype": DTYPE_NAMES.get(out_dtype, str(out_dtype)),
        "source_quantization": source.quantization,
        "recipe": kind if kind != "mixed" else quant_recipe,
        "quantization": None, "quantized": {}, "kept": {},
        "size_before": _files_size(source.files), "bits_per_weight_before": bpw_before,
        "calibration": None, "sensitivity": None, "tau": None, "notes": [],
    }
    if quantize:
        report.update(plan_quantization(
            model, src_weights, kind, mixed, q_bits, q_group_size, bit_budget,
            sensitivity_levels, tgt, calib_prompts, calib_samples, log, codebook_bits,
            float_kernels))
        _quantize(model, report["quantized"], q_group_size)
    out_cfg = _output_config(source.raw, report["quantization"], report["dtype"])
    report["bits_per_weight"] = _bits_per_weight(model)

    def fill(folder: Path) -> None:
        weights = dict(tree_flatten(model.parameters()))
        # float codebooks under their released (bare) names; load_draft reads both forms
        files = write_checkpoint(folder, published_names(weights), out_cfg, src, max_shard_bytes)
        report["files"] = [f.name for f in files]
        report["sharded"] = len(files) > 1
        report["size_after"] = _files_size(files)
        measure = tgt is not None and bool(tau_prompts)
        if verify or measure:
            converted = _verify_readback(folder, cfg, weights, report["quantization"])
        if measure:
            log(f"[convert] measuring τ on {len(tau_prompts)} prompts (original vs converted)")
            original = build_draft(cfg, src_weights, str(src))
            backend.prepare_for_backend(original)
            report["tau"] = compare_tau(tgt, original, converted, tau_prompts, tau_max_tokens)
        report["seconds"] = round(time.perf_counter() - t_start, 2)
        (folder / "README.md").write_text(model_card(report, source.raw, cfg, dst.name, src))

    write_atomically(dst, fill)
    log(f"[convert] done in {report['seconds']} s")
    return report


def _verify_readback(folder: Path, cfg: DFlashConfig, weights: dict[str, mx.array],
                     qblock: dict | None) -> DFlashDraftModel:
    """``load_draft`` the written folder; every tensor must equal what was meant to be written."""
    converted = load_draft(folder)
    expect = build_draft(cfg, weights, "in-memory conversion", qblock)
    backend.prepare_for_backend(expect)
    want = dict(tree_flatten(expect.parameters()))
    got = dict(tree_flatten(converted.parameters()))
    if set(want) != set(got):
        raise DraftCheckpointError(f"{folder}: tensors read back differ from those written")
    for k, v in want.items():
        if got[k].shape != v.shape or not mx.array_equal(got[k], v).item():
            raise DraftCheckpointError(f"{folder}: tensor {k} does not read back as written")
    return converted


def format_report(r: dict) -> str:
    """The human summary printed at the end of ``dflash convert``."""
    lines = [f"[convert] {r['source']} -> {r['destination']}"]
    if r["quantization"] is None:
        lines.append(f"  weights: {r['dtype']} (not quantized)")
    else:
        by_bits: dict[int, int] = {}
        for b in r["quantized"].values():
            by_bits[b] = by_bits.get(b, 0) + 1
        mix = ", ".join(f"{n} tensors at {b} bits" for b, n in sorted(by_bits.items(), reverse=True))
        lines.append(f"  quantization: {r['recipe']}, group size {r['quantization']['group_size']}, "
                     f"{mix or 'nothing quantized'}; floats in {r['dtype']}")
        if r["kept"]:
            lines.append("  kept in float: " + "; ".join(f"{p} ({why})"
                                                          for p, why in r["kept"].items()))
    before = r["bits_per_weight_before"]
    lines.append(f"  size on disk: {_fmt_size(r['size_before'])} -> {_fmt_size(r['size_after'])}"
                 f" ({len(r['files'])} file{'s' if len(r['files']) > 1 else ''})")
    lines.append("  bits per weight: "
                 + (f"{before:.2f} -> " if before is not None else "")
                 + f"{r['bits_per_weight']:.2f}")
    if r.get("sensitivity"):
        s = r["sensitivity"]
        lines.append(f"  sensitivity: budget {s['bit_budget']} bits, spent "
                     f"{s['average_bits']:.2f} bits per quantized weight ({s['seconds']} s)")
        if "uniform_comparison" in s:
            u = s["uniform_comparison"]
            lines.append(f"    uniform {u['bits']}-bit for comparison: KL {u['kl']:.4g}, "
                         f"top-1 {100 * u['top1_agreement']:.1f} %")
    if r.get("calibration"):
        c = r["calibration"]
        lines.append(f"  block-prediction KL vs unquantized: {c['kl']:.4g} nats, top-1 agreement "
                     f"{100 * c['top1_agreement']:.1f} %")
        lines.append(f"    calibration: {c['description']}")
    if r.get("tau"):
        t = r["tau"]
        lines.append(f"  mean τ (greedy, {t['prompts']} prompts, {t['max_tokens']} tokens): "
                     f"original {t['original']:.3f} -> converted {t['converted']:.3f}"
                     + ("" if t["outputs_identical"] else
                        "  [outputs differ: float rounding of the verify pass]"))
    for note in r.get("notes", []):
        lines.append(f"  note: {note}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line


def add_convert_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``dflash convert``."""
    parser.add_argument("--hf-path", required=True,
                        help="source drafter: a local folder or a Hugging Face repo id")
    parser.add_argument("--mlx-path", required=True, help="destination folder")
    parser.add_argument("-q", "--quantize", action="store_true",
                        help="quantize the linear projections (affine, mlx-lm format)")
    parser.add_argument("--q-bits", type=int, default=4, choices=SUPPORTED_BITS,
                        help="bits per weight for uniform quantization, and the default "
                             "sensitivity budget (default 4)")
    parser.add_argument("--q-group-size", type=int, default=64, choices=SUPPORTED_GROUP_SIZES,
                        help="quantization group size (default 64)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="dtype of the floating-point tensors (norms, scales, unquantized "
                             "weights); default: the source's")
    parser.add_argument("--quant-recipe", default=None,
                        help=f"{RECIPE_HELP}; any recipe implies -q")
    parser.add_argument("--bit-budget", type=float, default=None,
                        help="sensitivity recipe: average bits per quantized weight "
                             "(default --q-bits)")
    parser.add_argument("--force", action="store_true", help="replace an existing --mlx-path")
    parser.add_argument("--dequantize", action="store_true",
                        help="accept an MLX-quantized source and start from its dequantized "
                             "weights")
    parser.add_argument("--target", default=None,
                        help="target model (folder or repo id): real calibration features and "
                             "the acceptance comparison in the report")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="shard the weights above this size (e.g. 5GB, 500MB; default 5GB)")
    parser.add_argument("--calib-prompts", default=None,
                        help="JSONL prompt file for calibration and the τ comparison "
                             "(default: 8 built-in prompts)")
    parser.add_argument("--tau-max-tokens", type=int, default=64,
                        help="tokens generated per prompt for the τ comparison (default 64)")
    parser.add_argument("--codebook-bits", default=str(DEFAULT_CODEBOOK_BITS),
                        choices=[str(b) for b in SUPPORTED_BITS] + ["float"],
                        help="DFlash2: bits of the selector's two codebooks when quantizing, or "
                             f"float (default {DEFAULT_CODEBOOK_BITS})")
    parser.add_argument("--float-kernels", action="store_true",
                        help="DFlash2: keep the convolutions' kernel projections in float")
    parser.add_argument("--report-json", default=None, help="also write the report as JSON here")
    return parser


def run_convert(args: argparse.Namespace) -> int:
    """Run ``dflash convert`` from parsed arguments; errors propagate as ``DFlashError``.

    Progress goes to stderr, the final report to stdout.
    """
    prompts = FIXED_PROMPTS
    if args.calib_prompts:
        prompts = tuple(item.get("prompt") or item["messages"][-1]["content"]
                        for item in read_prompts(args.calib_prompts))
    report = convert(
        args.hf_path, args.mlx_path, quantize=args.quantize, q_bits=args.q_bits,
        q_group_size=args.q_group_size, dtype=args.dtype, quant_recipe=args.quant_recipe,
        force=args.force, dequantize=args.dequantize, target=args.target,
        bit_budget=args.bit_budget, max_shard_bytes=parse_size(args.max_shard_size),
        calib_prompts=prompts, tau_prompts=prompts, tau_max_tokens=args.tau_max_tokens,
        codebook_bits=None if args.codebook_bits == "float" else int(args.codebook_bits),
        float_kernels=args.float_kernels, log=console.log)
    print(format_report(report), flush=True)
    if args.report_json:
        Path(args.report_json).write_text(json.dumps(report, indent=2, default=str))
    return 0
