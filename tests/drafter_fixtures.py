"""Tiny random DFlash drafters in the Hugging Face layout, for tests that need a checkpoint folder.

``write_hf_drafter`` writes ``config.json`` (fields named as public DFlash checkpoints name them)
and bf16 ``*.safetensors`` weights (one file, or shards with ``model.safetensors.index.json``).
Weights are random but scaled like a trained network (``N(0, 1/fan_in)``, norms near 1), so that
outputs have a healthy magnitude and quantization error is measurable.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def hf_drafter_weights(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                       n_taps=2, dtype="bfloat16", seed=0) -> dict[str, mx.array]:
    """Random weights named as in a Hugging Face DFlash drafter (no ``model.`` prefix)."""
    key = mx.random.key(seed)
    dt = DTYPES[dtype]
    weights: dict[str, mx.array] = {}

    def linear(name, out_dim, in_dim):
        nonlocal key
        key, sub = mx.random.split(key)
        weights[name] = (mx.random.normal((out_dim, in_dim), key=sub) * in_dim**-0.5).astype(dt)

    def norm(name, dim):
        nonlocal key
        key, sub = mx.random.split(key)
        weights[name] = (1.0 + 0.1 * mx.random.normal((dim,), key=sub)).astype(dt)

    linear("fc.weight", hidden, n_taps * hidden)
    norm("hidden_norm.weight", hidden)
    norm("norm.weight", hidden)
    for i in range(layers):
        p = f"layers.{i}."
        norm(p + "input_layernorm.weight", hidden)
        norm(p + "post_attention_layernorm.weight", hidden)
        linear(p + "self_attn.q_proj.weight", heads * head_dim, hidden)
        linear(p + "self_attn.k_proj.weight", kv_heads * head_dim, hidden)
        linear(p + "self_attn.v_proj.weight", kv_heads * head_dim, hidden)
        linear(p + "self_attn.o_proj.weight", hidden, heads * head_dim)
        norm(p + "self_attn.q_norm.weight", head_dim)
        norm(p + "self_attn.k_norm.weight", head_dim)
        linear(p + "mlp.gate_proj.weight", intermediate, hidden)
        linear(p + "mlp.up_proj.weight", intermediate, hidden)
        linear(p + "mlp.down_proj.weight", hidden, intermediate)
    mx.eval(weights)
    return weights


def hf_drafter_config(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                      vocab=512, taps=(0, 2), block_size=8, mask_token_id=None,
                      dtype="bfloat16", extra_config=None) -> dict:
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 1_000_000.0,
        "num_target_layers": max(taps) + 2,
        "block_size": block_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "dflash_config": {
            "target_layer_ids": list(taps),
            "mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id,
        },
    }
    if extra_config:
        cfg.update(extra_config)
    return cfg


def write_weights(path: Path, weights: dict[str, mx.array], shards: int = 1,
                  prefix: str = "") -> list[Path]:
    """One ``model.safetensors`` or ``shards`` files plus the HF index; returns the files."""
    names = sorted(weights)
    if shards <= 1:
        f = path / "model.safetensors"
        mx.save_safetensors(str(f), {prefix + k: weights[k] for k in names},
                            metadata={"format": "pt"})
        return [f]
    chunks = [names[i::shards] for i in range(shards)]
    weight_map, files = {}, []
    for i, chunk in enumerate(chunks):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(path / fname), {prefix + k: weights[k] for k in chunk},
                            metadata={"format": "pt"})
        weight_map.update({prefix + k: fname for k in chunk})
        files.append(path / fname)
    total = sum(v.nbytes for v in weights.values())
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        indent=2))
    return files


def write_hf_drafter(path, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                     intermediate=128, vocab=512, taps=(0, 2), block_size=8, mask_token_id=None,
                     dtype="bfloat16", shards=1, extra_config=None, seed=0,
                     prefix="") -> Path:
    """Write a tiny random drafter folder in the Hugging Face layout and return its path.

    ``mask_token_id`` defaults to ``vocab - 1``; ``prefix="model."`` nests the tensor names as some
    exports do; ``extra_config`` is merged into config.json at the top level.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_drafter_config(hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, taps,
                            block_size, mask_token_id, dtype, extra_config)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = hf_drafter_weights(hidden, layers, heads, kv_heads, head_dim, intermediate,
                                 len(taps), dtype, seed)
    write_weights(path, weights, shards=shards, prefix=prefix)
    return path
