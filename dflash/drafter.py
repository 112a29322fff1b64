"""The DFlash drafter: a short stack of Qwen3-style layers that fills a whole block in one pass.

It owns no embedding table and no LM head: the loop embeds the block with the target's
``embed_tokens`` and reads logits with the target's head. Conditioning comes from target layer
outputs (``target_layer_ids``), projected by ``fc`` and normalised by ``hidden_norm``; in every layer
those context rows are injected as extra keys/values next to the block's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from . import backend
from .checkpoint import drafter_weights, read_config, read_weights, resolve_path
from .errors import DraftCheckpointError


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    num_target_layers: int | None = None
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # SpecForge trains sliding layers causal inside the block; a switch because checkpoints vary.
    sliding_block_causal: bool = True
    attention_bias: bool = False
    # Optional: the drafter proposes only these ids (a cut of the target's head). Verification is
    # the target's, so output stays exact; drafting gets cheaper when the vocabulary is large.
    draft_vocab_ids: list[int] | None = None
    raw: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> DFlashConfig:
        """Read every config variant in the wild: fields at the top level or nested."""
        if not isinstance(cfg, dict):
            raise DraftCheckpointError(f"{source}: expected a JSON object")
        dflash = cfg.get("dflash_config") or {}
        rope = cfg.get("rope_parameters") or {}

        def pick(name, *places, default=None):
            for place in places:
                if isinstance(place, dict) and place.get(name) is not None:
                    return place[name]
            return default

        taps = pick("target_layer_ids", dflash, cfg)
        mask_id = pick("mask_token_id", dflash, cfg)
        if taps is None:
            raise DraftCheckpointError(
                f"{source}: `dflash_config.target_layer_ids` is missing: not a DFlash drafter")
        if mask_id is None:
            raise DraftCheckpointError(f"{source}: `dflash_config.mask_token_id` is missing")
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "vocab_size")
        for name in required:
            if not isinstance(cfg.get(name), int):
                raise DraftCheckpointError(f"{source}: field `{name}` is missing or not an integer")
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", rope.get("type", "default")) != "default":
            rope_scaling = rope
        return cls(
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            target_layer_ids=[int(i) for i in taps],
            mask_token_id=int(mask_id),
            block_size=int(pick("block_size", cfg, dflash, default=16)),
            head_dim=cfg.get("head_dim"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 40960)),
            rope_theta=float(pick("rope_theta", cfg, rope, default=1_000_000.0)),
            rope_scaling=rope_scaling,
            num_target_layers=pick("num_target_layers", cfg, dflash),
            layer_types=cfg.get("layer_types"),
            sliding_window=cfg.get("sliding_window"),
            sliding_block_causal=bool(pick("sliding_block_causal", dflash, default=True)),
            draft_vocab_ids=pick("draft_vocab_ids", dflash),
            attention_bias=bool(cfg.get("attention_bias", False)),
            raw=cfg,
        )


class DraftAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, sliding_window: int | None):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = sliding_window
        self.block_causal = sliding_window is not None and cfg.sliding_block_causal
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(self.head_dim, base=cfg.rope_theta, traditional=False,
                                    scaling_config=cfg.rope_scaling,
                                    max_position_embeddings=cfg.max_position_embeddings)

    def _heads(self, x, proj, n):
        B, L, _ = x.shape
        return proj(x).reshape(B, L, n, self.head_dim).transpose(0, 2, 1, 3)

    def context_kv(self, context: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """Keys/values of context rows at positions ``offset...``; they skip the input norm."""
        keys = self.rope(self.k_norm(self._heads(context, self.k_proj, self.n_kv_heads)),
                         offset=offset)
        return keys, self._heads(context, self.v_proj, self.n_kv_heads)

    def __call__(self, x: mx.array, ctx_keys: mx.array, ctx_values: mx.array,
                 block_start: int, mask: mx.array | None) -> mx.array:
        B, L, _ = x.shape
        queries = self.rope(self.q_norm(self._heads(x, self.q_proj, self.n_heads)),
                            offset=block_start)
        keys = self.rope(self.k_norm(self._heads(x, self.k_proj, self.n_kv_heads)),
                         offset=block_start)
        values = self._heads(x, self.v_proj, self.n_kv_heads)
        keys = mx.concatenate([ctx_keys, keys], axis=2)
        values = mx.concatenate([ctx_values, values], axis=2)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale,
                                                   mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DraftMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_type: str):
        super().__init__()
        window = cfg.sliding_window if layer_type == "sliding_attention" else None
        self.self_attn = DraftAttention(cfg, window)
        self.mlp = DraftMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x, ctx_keys, ctx_values, block_start, mask):
        h = x + self.self_attn(self.input_layernorm(x), ctx_keys, ctx_values, block_start, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def block_mask(n_context: int, block_len: int, window: int | None, causal: bool,
               block_start: int, context_start: int = 0) -> mx.array | None:
    """Boolean visibility of ``[context ; block]`` keys for block queries (None = all visible)."""
    if window is None or (not causal and block_start + block_len - 1 - context_start < window):
        return None
    q_pos = mx.arange(block_start, block_start + block_len)[:, None]
    k_pos = mx.concatenate([mx.arange(context_start, context_start + n_context),
                            mx.arange(block_start, block_start + block_len)])[None]
    visible = (q_pos - k_pos) < window
    if causal:
        in_block = mx.arange(n_context + block_len)[None] >= n_context
        visible = visible & (~in_block | (k_pos <= q_pos))
    return visible


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [DraftLayer(cfg, t) for t in cfg.layer_types]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def project_context(self, taps: mx.array) -> mx.array:
        """Concatenated target layer outputs ``(B, T, n_taps*hidden)`` -> context rows."""
        return self.hidden_norm(self.fc(taps))

    def block_logits(self, target, anchor: int, block_len: int, cache: list[KVCache]) -> mx.array:
        """Logits ``(block_len - 1, V)`` for the masked positions of ``[anchor, MASK, ...]``.

        ``target`` lends its embedding and head (:class:`dflash.target.TargetParts`).
        """
        block = mx.array([anchor] + [self.mask_token_id] * (block_len - 1))[None]
        hidden = self(target.embed(block), cache)[0, 1:]
        if self.config.draft_vocab_ids is None:
            return target.head(hidden)
        ids, rows = self.head_cut(target)
        logits = mx.full((hidden.shape[0], target.vocab_size), -mx.inf, dtype=hidden.dtype)
        logits[:, ids] = hidden @ rows.T
        return logits

    def head_cut(self, target) -> tuple[mx.array, mx.array]:
        """``(ids, rows)``: the draft vocabulary and the target head's rows for it, cut once per
        target and vocabulary."""
        vocab = self.config.draft_vocab_ids
        cached = getattr(self, "_head_cut", None)
        if cached is None or cached[0] is not target.model or cached[1] is not vocab:
            ids = mx.array(vocab, dtype=mx.int32)
            cached = (target.model, vocab, ids, target.head_rows(ids))
            self._head_cut = cached
        return cached[2], cached[3]

    def append_context(self, taps: mx.array, cache: list[KVCache]) -> None:
        """Add target features of newly committed tokens to the drafter's context cache."""
        context = self.project_context(taps)
        for layer, layer_cache in zip(self.layers, cache):
            layer_cache.update_and_fetch(*layer.self_attn.context_kv(context, layer_cache.offset))

    def __call__(self, block_embeds: mx.array, cache: list[KVCache]) -> mx.array:
        """Hidden states (after the final norm) of one block that starts right after the context.

        Every cached context row is visible; the block's own keys/values are transient.
        """
        block_start = cache[0].offset
        x = block_embeds
        for layer, layer_cache in zip(self.layers, cache):
            attn = layer.self_attn
            ctx_keys, ctx_values = layer_cache.keys_and_values()
            mask = block_mask(ctx_keys.shape[2], x.shape[1], attn.sliding_window,
                              attn.block_causal, block_start)
            x = layer(x, ctx_keys, ctx_values, block_start, mask)
        return self.norm(x)


# ---------------------------------------------------------------------------------------------
# Loading


def build_draft(cfg: DFlashConfig, weights: dict[str, mx.array], source: str,
                quantization: dict | None = None) -> DFlashDraftModel:
    model = DFlashDraftModel(cfg)
    if quantization:
        def predicate(p, m):
            if p in quantization:
                return quantization[p]
            return f"{p}.scales" in weights

        nn.quantize(model, group_size=quantization.get("group_size", 64),
                    bits=quantization.get("bits", 4), mode=quantization.get("mode", "affine"),
                    class_predicate=predicate)
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing:
        raise DraftCheckpointError(f"{source}: weights missing from the checkpoint: {', '.join(missing[:6])}"
                                   + (" ..." if len(missing) > 6 else ""))
    if extra:
        raise DraftCheckpointError(f"{source}: unexpected weights in the checkpoint: {', '.join(extra[:6])}"
                                   + (" ..." if len(extra) > 6 else ""))
    for name, arr in weights.items():
        if tuple(arr.shape) != tuple(expected[name].shape):
            raise DraftCheckpointError(
                f"{source}: tensor {name} has shape {tuple(arr.shape)}, config implies "
                f"{tuple(expected[name].shape)}")
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    return model


def load_draft(path_or_repo: str | Path, sliding_window_size: int | None = None,
               dtype: mx.Dtype | None = None) -> DFlashDraftModel:
    """Load a DFlash drafter: Hugging Face bf16 safetensors or an MLX-quantized checkpoint.

    ``sliding_window_size`` overrides the window of the config's sliding layers. On the CPU backend
    the drafter is dequantized and computed in float32 (see :mod:`dflash.backend`).
    """
    path = resolve_path(path_or_repo)
    raw = read_config(path)
    cfg = DFlashConfig.from_dict(raw, source=str(path / "config.json"))
    if sliding_window_size is not None:
        cfg.sliding_window = int(sliding_window_size)
    quantization = raw.get("quantization") or raw.get("quantization_config")
    weights = drafter_weights(read_weights(path))
    model = build_draft(cfg, weights, str(path), quantization)
    backend.prepare_for_backend(model, dtype)
    mx.eval(model.parameters())
    return model
