"""The DFlash drafters: a short stack of Qwen3-style layers that fills a whole block in one pass.

It owns no embedding table and no LM head: the loop embeds the block with the target's
``embed_tokens`` and reads logits with the target's head. Conditioning comes from target layer
outputs (``target_layer_ids``), projected by ``fc`` and normalised by ``hidden_norm``; in every layer
those context rows are injected as extra keys/values next to the block's own.

Two architectures, told apart by ``architectures[0]``: v1 (``DFlashDraftModel``) proposes each
position's argmax; DFlash2 (``DFlash2DraftModel``) adds the convolution, selector and windowed
cache of :mod:`dflash.dflash2`. The loop asks either for ``block_logits`` then ``propose``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from . import backend
from .checkpoint import drafter_weights, read_config, read_weights, resolve_path
from .dflash2 import CandidateSelector, DFlash2Cache, GroupedDynamicConv, WindowCache, walk
from .errors import DraftCheckpointError, GenerationConfigError
from .ragged_cache import RaggedKVCache, RaggedWindowCache

V1, V2 = "DFlashDraftModel", "DFlash2DraftModel"
ARCHITECTURES = (V1, V2)


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
    # The draft window: when set, every layer attends to at most this many positions (the
    # checkpoint's own window of sliding layers included); None: each layer as the config says.
    draft_window: int | None = None
    # SpecForge trains sliding layers causal inside the block; a switch because checkpoints vary.
    sliding_block_causal: bool = True
    attention_bias: bool = False
    # Optional: the drafter proposes only these ids (a cut of the target's head). Verification is
    # the target's, so output stays exact; drafting gets cheaper when the vocabulary is large.
    draft_vocab_ids: list[int] | None = None
    architecture: str = V1
    # DFlash2 only (None for v1): convolution taps and channels per dynamic coefficient, the
    # selector's rank and candidates per position, and the scaling of its unary logits.
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    raw: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == V2

    def layer_window(self, layer_type: str) -> int | None:
        """The attention window of a layer of this type: the draft window where one is set,
        else the config's ``sliding_window`` for sliding layers (None: the whole context)."""
        if self.draft_window is not None:
            return self.draft_window
        return self.sliding_window if layer_type == "sliding_attention" else None

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> DFlashConfig:
        """Read every config variant in the wild: fields at the top level or nested."""
        if not isinstance(cfg, dict):
            raise DraftCheckpointError(f"{source}: expected a JSON object")
        dflash = cfg.get("dflash_config") or {}
        rope = cfg.get("rope_parameters") or {}
        archs = cfg.get("architectures") or [V1]
        arch = archs[0] if isinstance(archs, list) and archs else archs
        if arch not in ARCHITECTURES:
            raise DraftCheckpointError(
                f"{source}: `architectures` is {archs!r}; this loader knows "
                f"{' and '.join(ARCHITECTURES)}")

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
        fields = dict(
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            target_layer_ids=[int(i) for i in taps],
            mask_token_id=int(mask_id),
            # DFlash2 moved block_size into dflash_config (8 in the released drafters).
            block_size=int(pick("block_size", dflash, cfg, default=8) if arch == V2
                           else pick("block_size", cfg, dflash, default=16)),
            head_dim=cfg.get("head_dim"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 40960)),
            rope_theta=float(pick("rope_theta", cfg, rope, default=1_000_000.0)),
            rope_scaling=rope_scaling,
            num_target_layers=pick("num_target_layers", cfg, dflash),
            layer_types=cfg.get("layer_types"),
            sliding_window=cfg.get("sliding_window"),
            draft_window=pick("draft_window", dflash),
            sliding_block_causal=bool(pick("sliding_block_causal", dflash, default=True)),
            draft_vocab_ids=pick("draft_vocab_ids", dflash),
            attention_bias=bool(cfg.get("attention_bias", False)),
            raw=cfg,
            architecture=arch,
        )
        if arch == V2:
            fields.update(_dflash2_fields(cfg, dflash, source))
        config = cls(**fields)
        if config.draft_window is not None:
            try:
                check_window(config.draft_window, config.block_size, "dflash_config.draft_window")
            except GenerationConfigError as e:
                raise DraftCheckpointError(f"{source}: {e}") from None
        if arch == V2:
            config.validate_dflash2(source)
        return config

    def validate_dflash2(self, source: str) -> None:
        """The bounds a DFlash2 drafter needs, each error naming its field."""
        def bad(name, value, rule):
            raise DraftCheckpointError(f"{source}: `dflash_config.{name}` = {value!r} {rule}")

        if not 1 <= self.conv_kernel_size <= self.block_size:
            bad("conv_kernel_size", self.conv_kernel_size,
                f"must be in 1..block_size ({self.block_size}): the taps stay inside one block")
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            bad("conv_group_size", self.conv_group_size,
                f"must divide hidden_size ({self.hidden_size})")
        if self.selector_rank < 1:
            bad("selector_rank", self.selector_rank, "must be >= 1")
        if not 1 <= self.selector_top_k <= self.vocab_size:
            bad("selector_top_k", self.selector_top_k,
                f"must be in 1..vocab_size ({self.vocab_size})")
        if self.draft_vocab_ids is not None and len(self.draft_vocab_ids) < self.selector_top_k:
            bad("draft_vocab_ids", f"[{len(self.draft_vocab_ids)} ids]",
                f"must hold at least selector_top_k ({self.selector_top_k}) ids")


def _dflash2_fields(cfg: dict, dflash: dict, source: str) -> dict:
    """DFlash2's ``dflash_config`` fields: the four shape fields are required, the three scalings
    default to no-ops."""
    out = {}
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        value = dflash.get(name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise DraftCheckpointError(
                f"{source}: `dflash_config.{name}` is missing or not an integer (DFlash2 needs it)")
        out[name] = value
    for name, default in (("output_multiplier", 1.0), ("input_embedding_scale", 1.0),
                          ("final_logit_softcapping", None)):
        value = dflash.get(name, cfg.get(name, default))
        if value is not None and not isinstance(value, (int, float)):
            raise DraftCheckpointError(f"{source}: `dflash_config.{name}` must be a number")
        out[name] = None if value is None else float(value)
    # is_causal: false (the released drafters): every block token sees the whole block.
    out["sliding_block_causal"] = bool(dflash.get("sliding_block_causal",
                                                  cfg.get("is_causal", False)))
    return out


def check_window(window, block_size: int, name: str = "sliding_window_size") -> None:
    """A draft window is an integer of at least one block (``GenerationConfigError`` naming
    ``name`` otherwise): a smaller one would leave a block's last rows no context at all."""
    if not isinstance(window, (int, np.integer)) or isinstance(window, bool):
        raise GenerationConfigError(f"{name}={window!r}: must be an integer number of tokens")
    if window < max(block_size, 1):
        raise GenerationConfigError(f"{name}={window}: must be at least the drafter's block size "
                                    f"({block_size})")


class DraftAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, sliding_window: int | None,
                 block_causal: bool | None = None):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = sliding_window
        # Causal inside the block only where the checkpoint says so (its sliding layers); a draft
        # window set on a full-attention layer bounds its context and nothing else.
        self.block_causal = (sliding_window is not None and cfg.sliding_block_causal
                             if block_causal is None else block_causal)
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
                 block_start: int, mask: mx.array | None,
                 ctx_rows: list[int] | None = None) -> mx.array:
        """Attention of the block rows ``x`` over ``[context ; block]``.

        ``ctx_keys`` / ``ctx_values`` hold one context per row of ``x``; or, with ``ctx_rows``
        (training: many blocks of a few sequences), one per *sequence*, shared by the next
        ``ctx_rows[s]`` rows of ``x`` — see :func:`shared_context_attention`.
        """
        B, L, _ = x.shape
        queries = self.rope(self.q_norm(self._heads(x, self.q_proj, self.n_heads)),
                            offset=block_start)
        keys = self.rope(self.k_norm(self._heads(x, self.k_proj, self.n_kv_heads)),
                         offset=block_start)
        values = self._heads(x, self.v_proj, self.n_kv_heads)
        if ctx_rows is not None:
            out = shared_context_attention(queries, keys, values, ctx_keys, ctx_values, ctx_rows,
                                           self.scale, mask)
        else:
            keys = mx.concatenate([ctx_keys, keys], axis=2)
            values = mx.concatenate([ctx_values, values], axis=2)
            out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale,
                                                       mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def shared_context_attention(queries: mx.array, keys: mx.array, values: mx.array,
                             ctx_keys: mx.array, ctx_values: mx.array, ctx_rows: list[int],
                             scale: float, mask: mx.array | None) -> mx.array:
    """Attention of many blocks over ``[their sequence's context ; their own rows]``.

    ``queries (n, Hq, L, d)``, ``keys`` / ``values (n, Hk, L, d)``: the blocks' own; ``ctx_keys``
    / ``ctx_values (S, Hk, T, d)``: sequence ``s``'s context, shared by ``ctx_rows[s]``
    consecutive blocks; ``mask (n, 1, L, T + L)`` (boolean, True = visible). The same result as
    giving every block its own copy of its sequence's context, but the context scores of all
    blocks of a sequence are one matmul and no copy is made: a training step of 4 sequences x 48
    blocks of 16 over a 480-row context took 1.28 s forward + backward per layer that way and takes
    0.61 s this way (2-core CPU).
    """
    n, n_heads, L, d = queries.shape
    n_kv, T = ctx_keys.shape[1], ctx_keys.shape[2]
    group = n_heads // n_kv  # query heads per key/value head, consecutive as in SDPA
    q = (queries * scale).reshape(n, n_kv, group, L, d)

    def by_sequence(x, start, m, width):  # (m, Hk, g, L, width) -> (1, Hk, g*m*L, width)
        return x[start:start + m].transpose(1, 2, 0, 3, 4).reshape(1, n_kv, group * m * L, width)

    def by_block(x, m, width):  # (1, Hk, g*m*L, width) -> (m, Hq, L, width)
        return x.reshape(n_kv, group, m, L, width).transpose(2, 0, 1, 3, 4).reshape(
            m, n_heads, L, width)

    spans, start = [], 0
    for s, m in enumerate(ctx_rows):
        if m:
            spans.append((s, start, m))
        start += m
    context_scores = mx.concatenate(
        [by_block(by_sequence(q, start, m, d) @ ctx_keys[s:s + 1].swapaxes(-1, -2), m, T)
         for s, start, m in spans])
    block_scores = (q.reshape(n, n_kv, group * L, d) @ keys.swapaxes(-1, -2)).reshape(
        n, n_heads, L, L)
    scores = mx.concatenate([context_scores, block_scores], axis=-1)
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    probs = mx.softmax(scores, axis=-1, precise=True)
    p_context = probs[..., :T].reshape(n, n_kv, group, L, T)
    out = (probs[..., T:].reshape(n, n_kv, group * L, L) @ values).reshape(n, n_heads, L, d)
    return out + mx.concatenate(
        [by_block(by_sequence(p_context, start, m, T) @ ctx_values[s:s + 1], m, d)
         for s, start, m in spans])


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
        window = cfg.layer_window(layer_type)
        self.self_attn = DraftAttention(cfg, window, _block_causal(cfg, layer_type, window))
        self.mlp = DraftMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x, ctx_keys, ctx_values, block_start, mask, ctx_rows=None):
        h = x + self.self_attn(self.input_layernorm(x), ctx_keys, ctx_values, block_start, mask,
                               ctx_rows)
        return h + self.mlp(self.post_attention_layernorm(h))


def _block_causal(cfg: DFlashConfig, layer_type: str, window: int | None) -> bool:
    return layer_type == "sliding_attention" and window is not None and cfg.sliding_block_causal


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


def _ragged_block_mask(cache: RaggedKVCache, block_len: int, window: int | None,
                       causal: bool = False) -> mx.array:
    """``(B, 1, L, context + L)``: each row's own context slots (with a window: only those
    fewer than ``window`` positions behind each query), then its block (causal or whole)."""
    context = cache.context_mask(block_len, window)
    own = mx.ones((block_len, block_len), dtype=mx.bool_)
    if causal:
        own = mx.tril(own)
    return mx.concatenate([context, mx.broadcast_to(own, (context.shape[0], 1, block_len,
                                                          block_len))], axis=-1)


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [self.make_layer(cfg, t) for t in self.layer_types()]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def make_layer(self, cfg: DFlashConfig, layer_type: str) -> nn.Module:
        return DraftLayer(cfg, layer_type)

    def layer_types(self) -> list[str]:
        return self.config.layer_types

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    @property
    def window(self) -> int | None:
        """The draft window set on every layer (None: each layer as its checkpoint says)."""
        return self.config.draft_window

    def set_window(self, window: int | None, name: str = "sliding_window_size") -> None:
        """Bound every layer's context to the last ``window`` positions (None: back to the
        checkpoint's own windows). Caches made afterwards hold at most ``window - 1`` rows;
        ``GenerationConfigError`` naming ``name`` for a window that is not an integer of at
        least one block."""
        if window is not None:
            check_window(window, self.block_size, name)
            window = int(window)
        self.config.draft_window = window
        for layer, kind in zip(self.layers, self.layer_types()):
            attn = layer.self_attn
            attn.sliding_window = self.config.layer_window(kind)
            attn.block_causal = _block_causal(self.config, kind, attn.sliding_window)

    def make_cache(self) -> list:
        """One context cache per layer: a layer with a window keeps only the ``window - 1``
        positions a block's anchor can see (:class:`~dflash.dflash2.WindowCache`)."""
        return [KVCache() if layer.self_attn.sliding_window is None
                else WindowCache(layer.self_attn.sliding_window - 1) for layer in self.layers]

    def make_batch_cache(self) -> list[RaggedKVCache]:
        """:meth:`make_cache` for the batched engine: one ragged context cache per layer, a
        windowed layer's keeping each row's last ``window - 1`` positions only."""
        return [RaggedKVCache() if layer.self_attn.sliding_window is None
                else RaggedWindowCache(layer.self_attn.sliding_window - 1)
                for layer in self.layers]

    def project_context(self, taps: mx.array) -> mx.array:
        """Concatenated target layer outputs ``(B, T, n_taps*hidden)`` -> context rows."""
        return self.hidden_norm(self.fc(taps))

    def block_scores(self, target, anchor: int, block_len: int,
                     cache: list[KVCache]) -> tuple[mx.array, mx.array | None]:
        """``(scores, ids)``: logits ``(block_len - 1, n)`` for the masked positions of
        ``[anchor, MASK, ...]`` over the draft vocabulary ``ids`` (``None``: the whole vocabulary).

        ``target`` lends its embedding and head (:class:`dflash.target.TargetParts`). The loop reads
        these: a cut vocabulary never pays for a full-vocabulary row of ``-inf``.
        """
        block = mx.array([anchor] + [self.mask_token_id] * (block_len - 1))[None]
        return self.head_scores(target, self(target.embed(block), cache)[0, 1:])

    def block_scores_batch(self, target, anchors: list[int], block_len: int,
                           cache: list[RaggedKVCache]) -> tuple[mx.array, mx.array | None]:
        """``(scores, ids)``: :meth:`block_scores` ``(B, block_len - 1, n)`` for every row of a
        ragged context cache at once, each block right after its own row's context."""
        block = mx.array([[a] + [self.mask_token_id] * (block_len - 1) for a in anchors])
        return self.head_scores(target, self(target.embed(block), cache)[:, 1:])

    def head_scores(self, target, hidden: mx.array) -> tuple[mx.array, mx.array | None]:
        """``(scores, ids)``: the target head's logits of draft hidden states over the draft
        vocabulary ``ids`` (``None``: the whole vocabulary)."""
        if self.config.draft_vocab_ids is None:
            return target.head(hidden), None
        ids, rows = self.head_cut(target)
        return hidden @ rows.T, ids

    def head_logits(self, target, hidden: mx.array) -> mx.array:
        """:meth:`head_scores` as full-vocabulary logits (``-inf`` outside the draft vocabulary:
        never proposed)."""
        return full_logits(*self.head_scores(target, hidden), target.vocab_size)

    def block_logits(self, target, anchor: int, block_len: int, cache: list[KVCache]) -> mx.array:
        """:meth:`block_scores` as full-vocabulary logits ``(block_len - 1, V)`` (``-inf`` outside
        the draft vocabulary)."""
        return full_logits(*self.block_scores(target, anchor, block_len, cache),
                           target.vocab_size)

    def propose(self, draft_logits: mx.array, anchor: int, cache: list, sampler,
                history: list[int]) -> tuple[mx.array, list | None]:
        """Proposals ``(P,)`` for the first ``P`` rows of :meth:`block_logits`, and their ``q``
        when sampled: each row's own (processed) distribution (:meth:`BlockSampler.propose`)."""
        return sampler.propose(draft_logits, history)

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

    def append_context(self, taps: mx.array, cache: list) -> None:
        """Add target features of newly committed tokens to the drafter's context cache.

        Rows that fall out of a bounded layer's window before any block sees them are skipped
        (a long prompt projects only the rows some layer keeps)."""
        n = taps.shape[1]
        keep = [min(n, c.size) if isinstance(c, WindowCache) else n for c in cache]
        first = n - max(keep)
        context = self.project_context(taps[:, first:] if first else taps)
        for layer, layer_cache, k in zip(self.layers, cache, keep):
            if k < n:
                layer_cache.skip(n - k)
            rows = context[:, context.shape[1] - k:] if k < context.shape[1] else context
            layer_cache.update_and_fetch(*layer.self_attn.context_kv(rows, layer_cache.offset))

    def __call__(self, block_embeds: mx.array, cache: list[KVCache]) -> mx.array:
        """Hidden states (after the final norm) of one block that starts right after the context.

        Every cached context row is visible; the block's own keys/values are transient.
        """
        block_start = cache[0].offset
        x = block_embeds
        for layer, layer_cache in zip(self.layers, cache):
            attn = layer.self_attn
            ctx_keys, ctx_values = layer_cache.keys_and_values()
            n_context = ctx_keys.shape[2]  # a bounded cache holds the last rows only
            if isinstance(layer_cache, RaggedKVCache):
                mask = _ragged_block_mask(layer_cache, x.shape[1], attn.sliding_window,
                                          attn.block_causal)
            else:
                mask = block_mask(n_context, x.shape[1], attn.sliding_window,
                                  attn.block_causal, block_start, block_start - n_context)
            x = layer(x, ctx_keys, ctx_values, block_start, mask)
        return self.norm(x)


def full_logits(scores: mx.array, ids: mx.array | None, vocab_size: int) -> mx.array:
    """Scores over the draft vocabulary ``ids`` as logits over all ``vocab_size`` ids."""
    if ids is None:
        return scores
    logits = mx.full((*scores.shape[:-1], vocab_size), -mx.inf, dtype=scores.dtype)
    logits[..., ids] = scores
    return logits


class DFlash2Layer(DraftLayer):
    """A v1 layer with a grouped dynamic convolution on both sides of each sublayer. Only the
    block's own tokens are convolved; context keys/values enter the attention unconvolved."""

    def __init__(self, cfg: DFlashConfig, layer_type: str):
        super().__init__(cfg, layer_type)
        taps, group = cfg.conv_kernel_size, cfg.conv_group_size
        self.attention_conv = GroupedDynamicConv(cfg.hidden_size, taps, group)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, taps, group)

    def __call__(self, x, ctx_keys, ctx_values, block_start, mask, ctx_rows=None):
        def attend(a):
            return self.self_attn(a, ctx_keys, ctx_values, block_start, mask, ctx_rows)

        h = x + self.attention_conv(self.input_layernorm(x), attend)
        return h + self.mlp_conv(self.post_attention_layernorm(h), self.mlp)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2: the v1 backbone with convolutions, every layer sliding (when the config gives a
    window) over a context cache bounded by it, and a candidate selector choosing the chain."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(
            cfg.hidden_size, cfg.selector_rank, cfg.vocab_size, cfg.selector_top_k,
            cfg.output_multiplier, cfg.final_logit_softcapping)

    def make_layer(self, cfg: DFlashConfig, layer_type: str) -> nn.Module:
        return DFlash2Layer(cfg, layer_type)

    def layer_types(self) -> list[str]:
        kind = "full_attention" if self.config.sliding_window is None else "sliding_attention"
        return [kind] * self.config.num_hidden_layers

    def make_cache(self) -> DFlash2Cache:
        return DFlash2Cache(super().make_cache())

    def block_scores(self, target, anchor: int, block_len: int,
                     cache: list) -> tuple[mx.array, None]:
        return self.block_logits(target, anchor, block_len, cache), None

    def block_logits(self, target, anchor: int, block_len: int, cache: list) -> mx.array:
        """The selector's unary logits ``U`` ``(block_len - 1, V)``; the hidden states stay in
        ``cache`` for :meth:`propose`."""
        block = mx.array([anchor] + [self.mask_token_id] * (block_len - 1))[None]
        embeds = target.embed(block) * self.config.input_embedding_scale
        hidden = self(embeds, cache)[0, 1:]
        cache.block_hidden = hidden
        return self.candidate_selector.unary(self.head_logits(target, hidden))

    def propose(self, draft_logits: mx.array, anchor: int, cache: list, sampler,
                history: list[int]) -> tuple[mx.array, list | None]:
        """The selector's walk over the first ``P`` rows: argmax, or (sampled proposals at T > 0)
        a draw from softmax(score / T) over each row's candidates, whose distribution is the
        ``q`` returned for rejection sampling. Filters and penalties stay on the target side."""
        rows = draft_logits.shape[0]
        ids, values, first, rest = self.candidate_selector.lattice(
            cache.block_hidden[:rows], draft_logits, anchor)
        if not sampler.samples_proposals:
            return mx.array(walk(ids, values, first, rest, lambda _, s: int(np.argmax(s)))), None
        qs = []

        def draw(candidates, scores):
            index, q = sampler.draw_scores(candidates, scores)
            qs.append(q)
            return index

        return mx.array(walk(ids, values, first, rest, draw)), qs


# ---------------------------------------------------------------------------------------------
# Loading


# DFlash2 checkpoints store the selector's codebooks as bare tensors; here they are embeddings.
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def published_names(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Module parameter names -> the released checkpoints' names (bare float codebooks); the
    inverse of :func:`sanitize`. Quantized codebooks keep ``.weight`` next to their scales."""
    quantized = {k.rsplit(".", 1)[0] for k in weights if k.endswith(".scales")}
    return {k[: -len(".weight")] if k[: -len(".weight")] in CODEBOOKS
            and k[: -len(".weight")] not in quantized else k: v for k, v in weights.items()}


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Checkpoint names -> module parameter names (the codebooks gain ``.weight``; quantized
    folders already store ``.weight``/``.scales``/``.biases`` and are left as they are)."""
    return {f"{k}.weight" if k in CODEBOOKS else k: v for k, v in weights.items()}


def build_draft(cfg: DFlashConfig, weights: dict[str, mx.array], source: str,
                quantization: dict | None = None) -> DFlashDraftModel:
    model = DFlash2DraftModel(cfg) if cfg.is_dflash2 else DFlashDraftModel(cfg)
    weights = sanitize(weights)
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

    ``sliding_window_size``: the draft window, tokens of target context every layer attends to
    (each block query sees the positions fewer than this many behind it; the drafter's context
    cache keeps ``window - 1`` rows per layer); it replaces the window of the config's sliding
    layers and bounds its full-attention layers too. ``None``: the window the checkpoint was
    trained with (``dflash_config.draft_window``), else each layer as its config says. On the CPU
    backend the drafter is dequantized and computed in float32 (see :mod:`dflash.backend`).
    """
    path = resolve_path(path_or_repo)
    raw = read_config(path)
    cfg = DFlashConfig.from_dict(raw, source=str(path / "config.json"))
    if sliding_window_size is not None:
        check_window(sliding_window_size, cfg.block_size)
        cfg.draft_window = int(sliding_window_size)
    quantization = raw.get("quantization") or raw.get("quantization_config")
    weights = drafter_weights(read_weights(path))
    model = build_draft(cfg, weights, str(path), quantization)
    backend.prepare_for_backend(model, dtype)
    mx.eval(model.parameters())
    return model
