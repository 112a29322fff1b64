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

from ..errors import TrainConfigError
from .checkpoints import write_safetensors


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
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(draft.parameters())}
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

