"""A new drafter for a target: its config, its first weights, and the exported folder.

The drafter copies the target's layer shapes (so that target layers can seed it, ``--init``) and is
written in the Hugging Face DFlash layout (``config.json`` with ``dflash_config`` + bf16
``model.safetensors``), which :func:`dflash.drafter.load_draft` and ``dflash convert`` read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..drafter import (
    V1,
    V2,
    DFlash2DraftModel,
    DFlashConfig,
    DFlashDraftModel,
    load_draft,
    published_names,
)
from ..errors import DraftCheckpointError, TrainConfigError
from .checkpoints import read_state, write_safetensors

DEFAULT_WINDOW = 2048  # the released DFlash2 drafters' window (all layers sliding)


def target_config(target_path: Path) -> dict:
    """The target's text-model config (a multimodal config nests it under ``text_config``)."""
    cfg = json.loads((Path(target_path) / "config.json").read_text())
    return cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg


def draft_config_dict(parts, tcfg: dict, layers: int, block_size: int, taps: list[int],
                      mask_token_id: int, heads: int | None = None, kv_heads: int | None = None,
                      head_dim: int | None = None, intermediate: int | None = None) -> dict:
    """A Hugging Face DFlash config for a drafter matching the target's layer shapes."""
    hidden = parts.norm.weight.shape[0]
    heads = heads or tcfg.get("num_attention_heads") or max(1, hidden // 64)
    kv_heads = kv_heads or tcfg.get("num_key_value_heads") or heads
    head_dim = head_dim or tcfg.get("head_dim") or hidden // heads
    rope = tcfg.get("rope_parameters") or {}
    theta = tcfg.get("rope_theta", rope.get("rope_theta", 1e6))
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": int(hidden),
        "num_hidden_layers": int(layers),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "intermediate_size": int(intermediate or tcfg.get("intermediate_size") or 4 * hidden),
        "vocab_size": int(parts.vocab_size),
        "rms_norm_eps": float(tcfg.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(tcfg.get("max_position_embeddings", 40960)),
        "rope_theta": float(theta),
        "num_target_layers": int(parts.num_layers),
        "block_size": int(block_size),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "layer_types": ["full_attention"] * int(layers),
        "dflash_config": {"target_layer_ids": list(map(int, taps)),
                          "mask_token_id": int(mask_token_id),
                          "block_size": int(block_size)},
    }


def dflash2_config_dict(cfg: dict, kernel: int, group: int, rank: int, top_k: int,
                       window: int | None) -> dict:
    """A v1 config dict in the released DFlash2 layout: ``architectures``, the DFlash2 fields and
    ``block_size`` inside ``dflash_config``, ``is_causal: false``, every layer sliding (with a
    window) or full attention (``window`` None, as an upgraded v1 drafter without one)."""
    out = json.loads(json.dumps(cfg))
    n = int(out["num_hidden_layers"])
    block_size = out.pop("block_size", None) or out["dflash_config"].get("block_size", 16)
    out["architectures"] = [V2]
    out["is_causal"] = False
    out["dflash_config"].update(block_size=int(block_size), conv_kernel_size=int(kernel),
                                conv_group_size=int(group), selector_rank=int(rank),
                                selector_top_k=int(top_k))
    for name in ("sliding_window", "use_sliding_window", "max_window_layers"):
        out.pop(name, None)
    if window is None:
        out["layer_types"] = ["full_attention"] * n
    else:
        out.update(sliding_window=int(window), use_sliding_window=True, max_window_layers=n,
                   layer_types=["sliding_attention"] * n)
    return out


def read_v1_drafter(path: str) -> tuple[dict, DFlashDraftModel]:
    """The v1 drafter ``--init-from`` names: its config (without quantization and training
    records; its draft vocabulary stays in ``dflash_config``) and its float model."""
    try:
        model = load_draft(path)
    except DraftCheckpointError as e:
        raise TrainConfigError(f"--init-from {path}: not a loadable DFlash drafter ({e})") from None
    if model.config.architecture != V1:
        raise TrainConfigError(
            f"--init-from {path}: architectures is {model.config.architecture!r}; --init-from "
            f"takes a v1 drafter ({V1}) (continue a {V2} run with --resume)")
    cfg = {k: v for k, v in model.config.raw.items()
           if k not in ("quantization", "quantization_config", "dflash_training")}
    cfg = json.loads(json.dumps(cfg))
    # v1 configs keep block_size at the top level; the loader's reading wins over stale copies
    cfg["block_size"] = model.config.block_size
    cfg["dflash_config"]["block_size"] = model.config.block_size
    return cfg, model


def init_dflash2(draft: DFlash2DraftModel, initializer_range: float = 0.02) -> None:
    """DFlash2's new parts at their published initialisation: identity convolutions (tap 0 = 1,
    zero kernel projection), a zero successor codebook (so the selector's scores are the unary
    logits) and a small random predecessor codebook (nonzero, so the successor gets gradients)."""
    for layer in draft.layers:
        layer.attention_conv.identity()
        layer.mlp_conv.identity()
    selector = draft.candidate_selector
    shape = selector.predecessor_codebook.weight.shape
    selector.predecessor_codebook.weight = initializer_range * mx.random.normal(shape)
    selector.successor_codebook.weight = mx.zeros(shape)
    mx.eval(draft.parameters())


def copy_v1_weights(draft: DFlashDraftModel, v1: DFlashDraftModel) -> list[str]:
    """Copy every tensor of a v1 drafter into ``draft`` (a v1 or DFlash2 drafter of the same
    backbone shapes); the names copied. DFlash2's own parts keep their initialisation."""
    src = dict(tree_flatten(v1.parameters()))
    dst = dict(tree_flatten(draft.parameters()))
    for name, value in src.items():
        if name not in dst or tuple(dst[name].shape) != tuple(value.shape):
            raise TrainConfigError(f"--init-from: tensor {name} {tuple(value.shape)} has no "
                                   "counterpart in the new drafter")
    draft.load_weights([(k, v.astype(dst[k].dtype)) for k, v in src.items()], strict=False)
    mx.eval(draft.parameters())
    return sorted(src)


def grown_config(cfg: dict, extra: int) -> dict:
    """A v1 drafter's config with ``extra`` more layers of its last layer's type."""
    cfg = json.loads(json.dumps(cfg))
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["full_attention"] * n
    cfg["num_hidden_layers"] = n + extra
    cfg["layer_types"] = list(types) + [types[-1]] * extra
    return cfg


def grow_identity_layers(draft: DFlashDraftModel, kept: int) -> None:
    """Layers ``kept..`` become copies of layer ``kept - 1`` whose attention and MLP output
    projections are zero (block expansion, as LLaMA Pro grows a model): each new layer adds
    nothing to the residual stream, so the drafter's outputs are the ``kept``-layer drafter's
    until training moves the zeroed projections, which get gradients from the first step."""
    last = dict(tree_flatten(draft.layers[kept - 1].parameters()))
    for layer in draft.layers[kept:]:
        weights = [(name, mx.zeros_like(value) if name in ("self_attn.o_proj.weight",
                                                            "mlp.down_proj.weight") else value)
                   for name, value in last.items()]
        layer.load_weights(weights, strict=True)
    mx.eval(draft.parameters())


def new_draft(cfg, v1: DFlashDraftModel | None = None) -> DFlashDraftModel:
    """The drafter a run starts from: random (DFlash2's new parts at :func:`init_dflash2`), then
    ``v1``'s tensors when upgrading or continuing a v1 drafter."""
    if cfg.is_dflash2:
        draft = DFlash2DraftModel(cfg)
        init_dflash2(draft)
    else:
        draft = DFlashDraftModel(cfg)
    if v1 is not None:
        copy_v1_weights(draft, v1)
    return draft


def init_layer_ids(mode: str, n_draft: int, n_target: int,
                   taps: list[int] | None = None) -> list[int]:
    """Which target layers seed the drafter's layers (``first``, ``last``, ``spread``,
    ``aligned`` = the layers right after the deepest tap, or explicit ids)."""
    if mode == "aligned":
        start = min(max(taps or [n_target - 2]) + 1, n_target - n_draft)
        return list(range(max(0, start), max(0, start) + n_draft))
    if mode == "first":
        return list(range(min(n_draft, n_target)))
    if mode == "last":
        return list(range(max(0, n_target - n_draft), n_target))
    if mode == "spread":
        if n_draft == 1:
            return [n_target - 1]
        return [int(round(i * (n_target - 1) / (n_draft - 1))) for i in range(n_draft)]
    try:
        ids = [int(t) for t in mode.split(",") if t]
    except ValueError:
        raise TrainConfigError(f"--init {mode!r}: none, first, last, spread or layer ids") from None
    if len(ids) != n_draft or any(not 0 <= i < n_target for i in ids):
        raise TrainConfigError(f"--init {mode!r}: need {n_draft} target layer ids in 0..{n_target - 1}")
    return ids


def init_from_target(draft, parts, layer_ids: list[int]) -> list[str]:
    """Copy attention/MLP/norm weights of target layers into the drafter's layers.

    Per-head q/k norms, the final norm and ``hidden_norm`` stay at ones, ``fc`` random. Returns the
    names of the copied tensors; raises :class:`TrainConfigError` when shapes do not match.
    """
    if len(layer_ids) != len(draft.layers):
        raise TrainConfigError(f"--init: {len(layer_ids)} target layers given for a drafter of "
                               f"{len(draft.layers)} layers")
    copied = []
    for i, j in enumerate(layer_ids):
        src = dict(tree_flatten(parts.layers[j].parameters()))
        dst = dict(tree_flatten(draft.layers[i].parameters()))
        new = []
        for name, value in src.items():
            if name not in dst:
                continue
            if tuple(dst[name].shape) != tuple(value.shape):
                raise TrainConfigError(
                    f"--init: target layer {j} tensor {name} has shape {tuple(value.shape)}, "
                    f"drafter layer {i} needs {tuple(dst[name].shape)} (use --init none)")
            new.append((name, value.astype(dst[name].dtype)))
            copied.append(f"layers.{i}.{name}")
        if not any(n.startswith("self_attn.q_proj") for n, _ in new):
            raise TrainConfigError(f"--init: target layer {j} has no attention weights to copy")
        draft.layers[i].load_weights(new, strict=False)
    mx.eval(draft.parameters())
    return copied


def align_context(draft, parts, taps: list[int], layer: int) -> None:
    """Start the context path where the copied target layer expects its input.

    ``fc`` selects the deepest tap (identity on its slice) and ``hidden_norm`` takes the copied
    layer's ``input_layernorm`` weights, so that the first drafter layer's context keys/values are
    (up to the per-head k-norm) the target layer's own keys/values of the previous positions.
    """
    hidden = parts.norm.weight.shape[0]
    n = len(taps)
    deepest = int(np.argmax(taps))
    w = np.zeros((hidden, n * hidden), dtype=np.float32)
    w[:, deepest * hidden:(deepest + 1) * hidden] = np.eye(hidden, dtype=np.float32)
    draft.fc.weight = mx.array(w)
    ln = parts.layers[layer].input_layernorm.weight
    if ln.shape == draft.hidden_norm.weight.shape:
        draft.hidden_norm.weight = ln.astype(mx.float32)
    mx.eval(draft.parameters())


def head_matrix(parts):
    """The target's output projection as a dense ``(V, H)`` float32 matrix (frozen)."""
    return parts.head_rows().astype(mx.float32)



def export_draft(draft, cfg_dict: dict, out: Path, extra: dict | None = None) -> Path:
    """Write ``config.json`` + bf16 ``model.safetensors`` (Hugging Face DFlash layout).

    Both files are written whole to a temporary folder first and then moved in with
    ``os.replace``: a reader (or a run stopped by a full disk) never sees half a file.
    ``extra`` (the training run's summary) is recorded as ``dflash_training`` in the config.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.bfloat16)
               for k, v in published_names(dict(tree_flatten(draft.parameters()))).items()}
    tmp_dir = out.parent / f".{out.name}.export-tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    cfg = dict(cfg_dict)
    if extra:
        cfg["dflash_training"] = extra
    write_safetensors(tmp_dir / "model.safetensors", weights, metadata={"format": "pt"})
    (tmp_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    os.replace(tmp_dir / "model.safetensors", out / "model.safetensors")
    os.replace(tmp_dir / "config.json", out / "config.json")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    return out



def export_checkpoint(checkpoint: Path, out: Path) -> Path:
    """A training checkpoint (``RUN/train/step-N``) written as a drafter folder: its float
    weights and config, its training vocabulary as ``draft_vocab_ids`` (as the run's own export
    would write it), so that ``dflash train --init-from`` can continue from any kept step."""
    checkpoint = Path(checkpoint)
    state = read_state(checkpoint)
    cfg_dict = json.loads(json.dumps(state["draft_config"]))
    opts = state.get("options", {})
    if opts.get("vocab", "data") == "data" and opts.get("export_vocab", True):
        cfg_dict["dflash_config"]["draft_vocab_ids"] = sorted(int(i) for i in state["vocab_ids"])
    draft = new_draft(DFlashConfig.from_dict(state["draft_config"]))
    draft.load_weights(list(mx.load(str(checkpoint / "draft.safetensors")).items()), strict=True)
    mx.eval(draft.parameters())
    meta = {"step": state["step"], "samples": state.get("data_samples"),
            "exported_from": checkpoint.name}
    return export_draft(draft, cfg_dict, out, meta)
