"""Tiny random DFlash2 drafters in the published Hugging Face layout.

``config.json`` carries ``architectures: ["DFlash2DraftModel"]`` and the DFlash2 fields inside
``dflash_config`` (block_size there too); the safetensors hold the v1 tensors plus
``layers.{i}.attention_conv`` / ``mlp_conv`` (``base_kernel (2, K, H)``,
``kernel_projection.weight (2*K*G, H)``) and the selector's ``hidden_projection.weight (r, H)`` and
two codebooks ``(V, r)`` stored *without* ``.weight``, as released checkpoints store them.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from dflash.drafter import published_names


def dflash2_config(v1_config: dict, taps: int = 2, group: int = 16, rank: int = 64,
                   top_k: int = 8, sliding_window: int | None = 2048, **dflash_extra) -> dict:
    """A v1 drafter config turned into a DFlash2 one (fields where the release puts them)."""
    cfg = json.loads(json.dumps(v1_config))
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["is_causal"] = False
    block_size = cfg.pop("block_size", 8)
    cfg["dflash_config"].update(block_size=block_size, conv_kernel_size=taps,
                                conv_group_size=group, selector_rank=rank, selector_top_k=top_k,
                                **dflash_extra)
    if sliding_window is not None:
        cfg.update(sliding_window=sliding_window, use_sliding_window=True,
                   max_window_layers=cfg["num_hidden_layers"],
                   layer_types=["sliding_attention"] * cfg["num_hidden_layers"])
    return cfg


def write_dflash2_drafter(path: Path, v1_draft: Path, seed: int = 3, identity: bool = False,
                          zero_successor: bool = False, dtype: str = "bfloat16",
                          weights_edit=None, **config) -> Path:
    """A DFlash2 drafter sharing ``v1_draft``'s backbone weights, with new parts random (or, with
    ``identity``/``zero_successor``, as a v1 upgrade initialises them). ``weights_edit(weights)``
    may change the published tensors before they are written."""
    from dflash.drafter import DFlash2DraftModel, DFlashConfig

    v1_dir = Path(v1_draft)
    cfg = dflash2_config(json.loads((v1_dir / "config.json").read_text()), **config)
    mx.random.seed(seed)
    model = DFlash2DraftModel(DFlashConfig.from_dict(cfg))
    for layer in model.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.identity()
            if not identity:
                shape = conv.base_kernel.shape
                conv.base_kernel = conv.base_kernel + 0.3 * mx.random.normal(shape)
                w = conv.kernel_projection.weight
                conv.kernel_projection.weight = 0.3 * mx.random.normal(w.shape) * w.shape[1]**-0.5
    selector = model.candidate_selector
    if not identity:  # transitions strong enough to move some argmaxes
        for book in (selector.predecessor_codebook, selector.successor_codebook):
            book.weight = 4.0 * book.weight
    if zero_successor:
        selector.successor_codebook.weight = mx.zeros(selector.successor_codebook.weight.shape)
    weights = dict(tree_flatten(model.parameters()))
    weights.update(mx.load(str(v1_dir / "model.safetensors")))
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in published_names(weights).items()}
    if weights_edit is not None:
        weights_edit(weights)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path
