"""Turn a llama-architecture GGUF file into an mlx-lm model folder (float32 safetensors).

MLX reads GGUF tensors directly (quantized Q4_0/Q4_1/Q8_0 come back packed with scales and biases);
the `gguf` package reads the metadata. The tokenizer is rebuilt from the GGUF vocabulary and merges
with `tokenizers`, so no hub or PyTorch is needed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import gguf

from .errors import GGUFImportError

TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# GGML quantization type -> (bits, group size) as MLX unpacks them.
GGML_QUANT = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q8_0": (8, 32)}


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    suffix = parts[-1]
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{TENSOR_NAMES[parts[2]]}.{suffix}"
    return f"{TENSOR_NAMES[parts[0]]}.{suffix}"


def _unpermute_rope(weight, n_heads: int):
    """llama.cpp interleaves q/k rows for its rope; mlx-lm (like HF) uses the half-split layout."""
    out_dim = weight.shape[0]
    head_dim = out_dim // n_heads
    return (weight.reshape(n_heads, head_dim // 2, 2, -1)
            .swapaxes(1, 2).reshape(out_dim, -1))


def _tokenizer_files(reader: gguf.GGUFReader, out: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    model_kind = _field(reader, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise GGUFImportError(f"GGUF tokenizer.ggml.model={model_kind!r}: only byte-level BPE "
                              "(gpt2) is supported")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    gpt2_split = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
    steps = [pre_tokenizers.Split(Regex(gpt2_split), behavior="isolated")]
    if _field(reader, "tokenizer.ggml.pre") in ("smollm", "qwen2", "llama-bpe"):
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    special = [t for t, kind in zip(tokens, types) if kind == gguf.TokenType.CONTROL]
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(out / "tokenizer.json"))

    def token(key):
        idx = _field(reader, key)
        return None if idx is None else tokens[int(idx)]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length", 8192)),
        "additional_special_tokens": special,
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32") -> Path:
    """Write an mlx-lm model folder for a llama-architecture GGUF; atomic (temp folder, rename)."""
    import mlx.core as mx

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFImportError(f"{gguf_path}: architecture {arch!r} is not supported (llama only)")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    hidden = int(_field(reader, "llama.embedding_length"))
    qtypes = {t.name: t.tensor_type.name for t in reader.tensors}

    raw = mx.load(str(gguf_path))
    target_dtype = getattr(mx, dtype)
    weights = {}
    for name, qtype in qtypes.items():
        if qtype in GGML_QUANT:
            bits, group = GGML_QUANT[qtype]
            base = name[: -len(".weight")]
            w = mx.dequantize(raw[name], raw[base + ".scales"], raw[base + ".biases"], group, bits)
        elif qtype in ("F32", "F16", "BF16"):
            w = raw[name]
        else:
            raise GGUFImportError(f"{gguf_path}: tensor {name} has unsupported type {qtype}")
        w = w.astype(target_dtype)
        if name.endswith("attn_q.weight"):
            w = _unpermute_rope(w, n_heads)
        elif name.endswith("attn_k.weight"):
            w = _unpermute_rope(w, n_kv)
        weights[_hf_name(name)] = w
    tied = "lm_head.weight" not in weights
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "vocab_size": int(weights["model.embed_tokens.weight"].shape[0]),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 8192)),
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        "source_gguf": gguf_path.name,
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        _tokenizer_files(reader, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
