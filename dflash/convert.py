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

This module reads the source, checks the options, writes the checkpoint and runs the command;
which tensor gets how many bits (the recipes, the calibration, the sensitivity measurement) lives
in :mod:`dflash.convert_plan`, the model card and the printed report in :mod:`dflash.convert_card`.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import dequantize_model, get_total_parameters

from . import backend, console
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
from .convert_card import format_report, model_card
from .convert_plan import (
    DEFAULT_CODEBOOK_BITS,
    DEFAULT_SENSITIVITY_LEVELS,
    FIXED_PROMPTS,
    RECIPE_HELP,
    SUPPORTED_BITS,
    Calibration,
    Target,
    _sort_key,
    build_calibration,
    dflash2_plan,
    is_kernel_projection,
    linear_paths,
    load_target,
    parse_recipe,
    plan_quantization,
    prompt_token_ids,
    sensitivity_plan,
)
from .drafter import (
    DFlashConfig,
    DFlashDraftModel,
    build_draft,
    load_draft,
    published_names,
)
from .errors import DFlashError, DraftCheckpointError
from .prompts import read_prompts
from .target import check_compatible

# The public names of ``dflash.convert``, those defined in the two modules it was split into
# included, so that imports from here keep working.
__all__ = [
    "DEFAULT_CODEBOOK_BITS", "DEFAULT_MAX_SHARD_BYTES", "DEFAULT_SENSITIVITY_LEVELS", "DTYPES",
    "FIXED_PROMPTS", "RECIPE_HELP", "SUPPORTED_BITS", "SUPPORTED_GROUP_SIZES", "Calibration",
    "Source", "Target", "add_convert_args", "build_calibration", "compare_tau", "convert",
    "dflash2_plan", "format_report", "is_kernel_projection", "linear_paths", "load_target",
    "model_card", "parse_recipe", "parse_size", "plan_quantization", "prompt_token_ids",
    "read_source", "run_convert", "save_weights", "sensitivity_plan", "write_checkpoint",
]

SUPPORTED_GROUP_SIZES = (32, 64, 128)
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DEFAULT_MAX_SHARD_BYTES = 5 << 30


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


# ---------------------------------------------------------------------------------------------
# The acceptance comparison (with a target)


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
