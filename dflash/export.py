"""``dflash export``: a drafter -> the Hugging Face layout of the published DFlash checkpoints.

Servers that run DFlash on GPUs (vLLM's ``speculative_config`` method ``dflash``, SGLang's
``--speculative-algorithm DFLASH``) read the layout z-lab publishes its drafters in: one bf16
``model.safetensors`` with the drafter's own tensors (no embedding, no LM head: the server lends the
target's) and a ``config.json`` with the DFlash fields (``architectures``, ``block_size``,
``dflash_config.target_layer_ids`` / ``mask_token_id``, the Qwen3 layer shapes). This command writes
any drafter dflash reads (a ``dflash train`` export, a ``dflash convert`` output, quantized or not,
v1 or DFlash2) in that layout, so a drafter trained here can be served elsewhere.

It is a separate command rather than a ``dflash convert`` target: convert goes the other way (into
MLX, with quantization recipes and calibration), and none of its options apply here.

What changes on the way:

- Quantized drafters are dequantized (mlx affine quantization only); every float tensor is stored in
  bfloat16, the dtype of the published checkpoints.
- ``dflash_config.draft_vocab_ids`` (a drafter that proposes from a cut of the target's vocabulary)
  is dropped: the layout has no such field, and the drafter owns no head whose rows could be
  masked (it borrows the target's head, over the whole vocabulary, in every server). The export
  proposes each position's argmax over the full vocabulary. Where that argmax lies inside the draft
  vocabulary it is the original's proposal; elsewhere the export proposes a token the original
  could not (training with ``--negatives`` pushes those ids down, so this is rare). Output stays
  exactly the target's either way: proposals only decide how many tokens a verify pass keeps.
- Quantization blocks leave the config; every other field is kept (including dflash's own, such as
  ``dflash_training``, which servers ignore), and the fields the servers read are written where the
  published checkpoints have them.

The folder is written into a temporary folder next to the destination and renamed into place once
the files read back as written (:func:`dflash.drafter.load_draft` on the new folder gives the same
tensors): on any failure nothing is left at the destination.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from . import console
from .checkpoint import resolve_path, write_atomically
from .convert import read_source
from .drafter import DFlashConfig, load_draft, published_names
from .errors import DraftCheckpointError, ExportError

WEIGHTS_FILE = "model.safetensors"
EXPORT_DTYPE = mx.bfloat16
DROPPED_FIELDS = ("quantization", "quantization_config")


def hf_layout(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the published layout for ``cfg``, name -> shape, from the config alone."""
    hidden, head_dim, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out = cfg.num_attention_heads * head_dim
    kv_out = cfg.num_key_value_heads * head_dim
    out: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, cfg.num_taps * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out[p + "input_layernorm.weight"] = (hidden,)
        out[p + "post_attention_layernorm.weight"] = (hidden,)
        for name, rows in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            out[p + f"self_attn.{name}.weight"] = (rows, hidden)
            if cfg.attention_bias:
                out[p + f"self_attn.{name}.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (hidden, q_out)
        out[p + "self_attn.q_norm.weight"] = (head_dim,)
        out[p + "self_attn.k_norm.weight"] = (head_dim,)
        out[p + "mlp.gate_proj.weight"] = (inter, hidden)
        out[p + "mlp.up_proj.weight"] = (inter, hidden)
        out[p + "mlp.down_proj.weight"] = (hidden, inter)
        if cfg.is_dflash2:
            taps, groups = cfg.conv_kernel_size, hidden // cfg.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                out[p + f"{conv}.base_kernel"] = (2, taps, hidden)
                out[p + f"{conv}.kernel_projection.weight"] = (2 * taps * groups, hidden)
    if cfg.is_dflash2:
        rank = cfg.selector_rank
        out["candidate_selector.hidden_projection.weight"] = (rank, hidden)
        out["candidate_selector.predecessor_codebook"] = (cfg.vocab_size, rank)
        out["candidate_selector.successor_codebook"] = (cfg.vocab_size, rank)
    return out


def export_config(raw: dict, cfg: DFlashConfig) -> dict:
    """The source's ``config.json`` as the published layout has it: quantization blocks and
    ``draft_vocab_ids`` dropped, the fields servers read written from the parsed config."""
    out = {k: v for k, v in raw.items() if k not in DROPPED_FIELDS}
    dflash = {k: v for k, v in (raw.get("dflash_config") or {}).items() if k != "draft_vocab_ids"}
    dflash.update(target_layer_ids=list(cfg.target_layer_ids), mask_token_id=cfg.mask_token_id,
                  block_size=cfg.block_size)
    out.update(
        architectures=[cfg.architecture],
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        block_size=cfg.block_size,
        layer_types=list(cfg.layer_types),
        tie_word_embeddings=False,
        attention_bias=cfg.attention_bias,
        torch_dtype="bfloat16",
        dflash_config=dflash,
    )
    out.setdefault("model_type", "qwen3")
    if "dtype" in out:
        out["dtype"] = "bfloat16"
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = cfg.rope_scaling
    if cfg.num_target_layers is not None:
        out["num_target_layers"] = int(cfg.num_target_layers)
    if cfg.sliding_window is not None:
        out["sliding_window"] = cfg.sliding_window
        if "sliding_attention" in cfg.layer_types:
            # Qwen3's config class drops sliding_window unless this is set
            out["use_sliding_window"] = True
            out.setdefault("max_window_layers", cfg.num_hidden_layers)
    return out


def _checked_destination(src: Path, out: str | Path, force: bool) -> Path:
    dst = Path(out).expanduser()
    if dst.exists() and not dst.is_dir():
        raise ExportError(f"out={dst}: exists and is not a folder")
    if dst.resolve() == src.resolve() or dst.resolve() in src.resolve().parents \
            or src.resolve() in dst.resolve().parents:
        raise ExportError(f"out={dst}: overlaps the source folder {src}")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise ExportError(f"out={dst}: already exists and is not empty; pass --force "
                          "(force=True) to replace it")
    return dst


def _check_layout(weights: dict[str, mx.array], cfg: DFlashConfig, where: str) -> None:
    """Names and shapes against :func:`hf_layout`; ``ExportError`` naming the first tensor off."""
    want = hf_layout(cfg)
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    if missing or extra:
        raise ExportError(f"{where}: tensors do not match the published layout (missing: "
                          f"{', '.join(missing[:4]) or 'none'}; unexpected: "
                          f"{', '.join(extra[:4]) or 'none'})")
    for name, shape in want.items():
        if tuple(weights[name].shape) != shape:
            raise ExportError(f"{where}: tensor {name} has shape {tuple(weights[name].shape)}, "
                              f"the layout needs {shape}")


def export(drafter: str | Path, out: str | Path, force: bool = False, log=None) -> dict:
    """Write ``drafter`` at ``out`` in the published Hugging Face layout; return a report.

    ``drafter``: any folder (or hub id) :func:`dflash.drafter.load_draft` reads. ``out`` must not
    exist or be empty, unless ``force``. Raises :class:`~dflash.errors.ExportError` for the
    destination and the layout, :class:`~dflash.errors.DraftCheckpointError` for an unreadable
    source; on failure nothing is left at ``out``.
    """
    log = log or (lambda *_: None)
    src = resolve_path(drafter)
    dst = _checked_destination(src, out, force)
    log(f"[export] reading {src}")
    source = read_source(src, dequantize=True)
    cfg = source.cfg
    weights = {k: v.astype(EXPORT_DTYPE) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in published_names(dict(tree_flatten(source.model.parameters()))).items()}
    mx.eval(weights)
    _check_layout(weights, cfg, str(src))
    config = export_config(source.raw, cfg)
    notes = []
    if cfg.draft_vocab_ids is not None:
        notes.append(f"draft vocabulary of {len(cfg.draft_vocab_ids)} ids lifted: the export "
                     f"proposes from all {cfg.vocab_size} ids of the target's head")
    if cfg.draft_window is not None:
        notes.append(f"dflash_config.draft_window={cfg.draft_window} kept, but servers ignore "
                     "it: they attend to the whole context")
    if cfg.num_target_layers is None:
        notes.append("num_target_layers is unknown (not in the source config); servers take it "
                     "from the target")
    report: dict[str, Any] = {
        "source": str(drafter), "destination": str(dst), "architecture": cfg.architecture,
        "source_quantization": source.quantization, "dtype": "bfloat16",
        "tensors": len(weights), "parameters": sum(int(v.size) for v in weights.values()),
        "draft_vocab_ids": None if cfg.draft_vocab_ids is None else len(cfg.draft_vocab_ids),
        "notes": notes,
    }

    def fill(folder: Path) -> None:
        path = folder / WEIGHTS_FILE
        try:
            mx.save_safetensors(str(path), weights, metadata={"format": "pt"})
        except RuntimeError as e:
            raise OSError(f"{path}: cannot write ({e})") from None
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _check_readback(folder, cfg, weights)
        report["files"] = sorted(f.name for f in folder.iterdir())
        report["size"] = path.stat().st_size

    write_atomically(dst, fill)
    log(f"[export] wrote {dst}")
    return report


def _check_readback(folder: Path, cfg: DFlashConfig, weights: dict[str, mx.array]) -> None:
    """The written folder as our loader reads it: same config fields, same tensors."""
    stored = mx.load(str(folder / WEIGHTS_FILE))
    _check_layout(stored, cfg, str(folder / WEIGHTS_FILE))
    for name, v in weights.items():
        if stored[name].dtype != v.dtype or not mx.array_equal(stored[name], v).item():
            raise ExportError(f"{folder / WEIGHTS_FILE}: tensor {name} does not read back as "
                              "written")
    try:
        back = load_draft(folder)
    except DraftCheckpointError as e:
        raise ExportError(f"{folder}: the export does not load back ({e})") from None
    for name in ("architecture", "hidden_size", "num_hidden_layers", "target_layer_ids",
                 "mask_token_id", "block_size", "layer_types", "sliding_window", "rope_theta",
                 "rope_scaling", "draft_window"):
        if getattr(back.config, name) != getattr(cfg, name):
            raise ExportError(f"{folder / 'config.json'}: field {name} reads back as "
                              f"{getattr(back.config, name)!r}, not {getattr(cfg, name)!r}")


def format_report(r: dict) -> str:
    """The human summary printed at the end of ``dflash export``."""
    quant = r["source_quantization"]
    lines = [f"[export] {r['source']} -> {r['destination']}",
             f"  {r['architecture']}, {r['tensors']} tensors, {r['parameters']:,} parameters in "
             f"{r['dtype']} ({', '.join(r['files'])}; {r['size'] / 1e6:.1f} MB)"]
    if quant:
        lines.append(f"  dequantized from {quant.get('bits', '?')}-bit")
    lines += [f"  note: {n}" for n in r["notes"]]
    return "\n".join(lines)


def add_export_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``dflash export``."""
    parser.add_argument("drafter", metavar="DRAFTER",
                        help="drafter folder or Hugging Face repo id (a `dflash train` export, "
                             "a `dflash convert` output, quantized or not)")
    parser.add_argument("out", metavar="OUT", help="destination folder (must be new or empty)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    parser.add_argument("--report-json", default=None, help="also write the report as JSON here")
    return parser


def run_export(args: argparse.Namespace) -> int:
    """Run ``dflash export`` from parsed arguments; errors propagate as ``DFlashError``."""
    report = export(args.drafter, args.out, force=args.force, log=console.log)
    print(format_report(report), flush=True)
    if args.report_json:
        Path(args.report_json).write_text(json.dumps(report, indent=2, default=str))
    return 0
