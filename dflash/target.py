"""The target side: a forward pass that taps decoder-layer outputs, and roll-back of its caches.

We walk the target's own layers (embed -> layers -> norm -> head) instead of patching mlx-lm
classes, so two generations in two threads never share state. "Tap k" is the output of decoder
layer k (0-based), i.e. Hugging Face's ``hidden_states[k + 1]``.

Roll-back after a partial acceptance: attention caches trim. GatedDeltaNet layers (Qwen3.5) keep a
recurrent state that cannot be trimmed, so their verify pass records its per-step inputs and the
state it started from; roll-back replays the accepted prefix of the recurrence from that state and
takes the conv window from the recorded conv input.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from . import backend
from .errors import IncompatibleDraftError, UnsupportedTargetError
from .tree import DraftTree


def load_target(path_or_hf_repo: str, tokenizer_config: dict | None = None, **kwargs):
    """Load a target model and its tokenizer through mlx-lm, ready for this machine's backend
    (float32 and dequantized on the CPU; as stored on Metal and CUDA)."""
    from mlx_lm import load as mlx_lm_load

    backend.configure()
    model, tokenizer = mlx_lm_load(str(path_or_hf_repo), tokenizer_config=tokenizer_config or {},
                                   **kwargs)
    backend.prepare_for_backend(model)
    return model, tokenizer


@dataclass
class TargetParts:
    """The pieces of an mlx-lm model that speculative decoding needs."""

    model: nn.Module
    embed_tokens: nn.Module
    layers: list
    norm: nn.Module
    lm_head: nn.Module | None  # None: tied embeddings
    sliding_window: int | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.embed_tokens.weight.shape[-1] if not hasattr(self.embed_tokens, "scales") \
            else self.norm.weight.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.weight.shape[0]

    def embed(self, tokens: mx.array) -> mx.array:
        return self.embed_tokens(tokens)

    def head_rows(self, ids: mx.array | None = None) -> mx.array:
        """Float rows ``ids`` (default: all) of the output head, dequantized when quantized."""
        layer = self.lm_head if self.lm_head is not None else self.embed_tokens
        if ids is None:
            ids = slice(None)
        if hasattr(layer, "scales"):
            return mx.dequantize(layer.weight[ids], layer.scales[ids], layer.get("biases")[ids]
                                 if "biases" in layer else None, layer.group_size, layer.bits,
                                 mode=getattr(layer, "mode", "affine"))
        return layer.weight[ids]

    def head(self, hidden: mx.array) -> mx.array:
        """Logits from final-normed hidden states (the target's own head, tied or not)."""
        if self.lm_head is None:
            return self.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)


def target_parts(model: nn.Module) -> TargetParts:
    """Find embed/layers/norm/head in an mlx-lm model (plain or ``language_model``-wrapped)."""
    owner = model
    if hasattr(owner, "language_model"):
        owner = owner.language_model
    inner = getattr(owner, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        raise UnsupportedTargetError(
            f"target {type(model).__module__}.{type(model).__name__}: cannot find "
            "embed_tokens/layers/norm to tap its decoder layers")
    for i, layer in enumerate(inner.layers):
        if hasattr(layer, "linear_attn") and not hasattr(layer.linear_attn, "in_proj_qkv"):
            raise UnsupportedTargetError(
                f"target layer {i}: linear attention of type {type(layer.linear_attn).__name__} "
                "cannot be rolled back")
        if not hasattr(layer, "linear_attn") and not hasattr(layer, "self_attn"):
            raise UnsupportedTargetError(f"target layer {i} ({type(layer).__name__}) has no "
                                         "attention this engine knows how to roll back")
    return TargetParts(
        model=model, embed_tokens=inner.embed_tokens, layers=list(inner.layers), norm=inner.norm,
        lm_head=getattr(owner, "lm_head", None),
        sliding_window=getattr(inner, "sliding_window", None),
    )


def check_compatible(parts: TargetParts, draft) -> None:
    """Raise ``IncompatibleDraftError`` naming the first field where drafter and target disagree."""
    cfg = draft.config
    hidden = parts.norm.weight.shape[0]
    if cfg.hidden_size != hidden:
        raise IncompatibleDraftError(
            f"drafter hidden_size={cfg.hidden_size} but the target's hidden size is {hidden}")
    if cfg.vocab_size != parts.vocab_size:
        raise IncompatibleDraftError(
            f"drafter vocab_size={cfg.vocab_size} but the target's vocabulary has "
            f"{parts.vocab_size} rows")
    if cfg.num_target_layers is not None and cfg.num_target_layers != parts.num_layers:
        raise IncompatibleDraftError(
            f"drafter num_target_layers={cfg.num_target_layers} but the target has "
            f"{parts.num_layers} decoder layers")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < parts.num_layers]
    if bad:
        raise IncompatibleDraftError(
            f"drafter target_layer_ids {bad} out of range for a target with "
            f"{parts.num_layers} layers")
    ids = cfg.draft_vocab_ids
    if ids is not None and (not ids or min(ids) < 0 or max(ids) >= parts.vocab_size):
        raise IncompatibleDraftError(
            "drafter dflash_config.draft_vocab_ids must be non-empty ids inside the target "
            f"vocabulary (0..{parts.vocab_size - 1})")
    if not 0 <= cfg.mask_token_id < parts.vocab_size:
        raise IncompatibleDraftError(
            f"drafter mask_token_id={cfg.mask_token_id} outside the target vocabulary")


# ---------------------------------------------------------------------------------------------
# Forward with taps


@dataclass
class DeltaTrace:
    """What a GatedDeltaNet verify pass needs to be rolled back to any prefix."""

    conv_input: mx.array
    q: mx.array
    k: mx.array
    v: mx.array
    a: mx.array
    b: mx.array
    state0: mx.array | None
    A_log: mx.array
    dt_bias: mx.array


@dataclass
class VerifyTrace:
    deltas: dict[int, DeltaTrace] = field(default_factory=dict)


def _gated_delta_forward(mod: nn.Module, x: mx.array, cache: ArraysCache,
                         trace: VerifyTrace | None, layer_idx: int) -> mx.array:
    """mlx-lm's ``GatedDeltaNet.__call__`` for one unpadded sequence, recording its inputs.

    Kept in step with mlx_lm.models.qwen3_5.GatedDeltaNet (same ops, same order) so that the
    outputs are bit-identical to the target's own forward.
    """
    B, S, _ = x.shape
    qkv = mod.in_proj_qkv(x)
    z = mod.in_proj_z(x).reshape(B, S, mod.num_v_heads, mod.head_v_dim)
    b = mod.in_proj_b(x)
    a = mod.in_proj_a(x)
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, mod.conv_kernel_size - 1, mod.conv_dim), dtype=x.dtype)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    cache[0] = mx.contiguous(conv_input[:, -(mod.conv_kernel_size - 1):, :])
    conv_out = nn.silu(mod.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [mod.key_dim, 2 * mod.key_dim], -1),
            [mod.num_k_heads, mod.num_k_heads, mod.num_v_heads],
            [mod.head_k_dim, mod.head_k_dim, mod.head_v_dim],
        )
    ]
    state0 = cache[1]
    q, k = normalize_qk(q, k, inv_scale=mod.head_k_dim**-0.5, eps=1e-6)
    out, state = gated_delta_update(q, k, v, a, b, mod.A_log, mod.dt_bias, state0, None,
                                    use_kernel=not mod.training)
    cache[1] = state
    if trace is not None:
        trace.deltas[layer_idx] = DeltaTrace(conv_input, q, k, v, a, b, state0,
                                                mod.A_log, mod.dt_bias)
    out = mod.norm(out, z)
    return mod.out_proj(out.reshape(B, S, -1))


def forward(parts: TargetParts, tokens: mx.array, cache: list, tap_ids: list[int],
            trace: VerifyTrace | None = None, logits_rows: slice | None = None
            ) -> tuple[mx.array, mx.array]:
    """Logits ``(B, S, V)`` and the concatenated outputs of layers ``tap_ids`` ``(B, S, n*H)``.

    ``logits_rows`` limits the head to those rows (a long prefill needs only its last row's
    logits; the head is the largest matrix of a small model).
    """
    h = parts.embed(tokens)
    attn_cache = next((c for layer, c in zip(parts.layers, cache)
                       if not hasattr(layer, "linear_attn")
                       and not getattr(layer, "use_sliding", False)), None)
    swa_cache = next((c for layer, c in zip(parts.layers, cache)
                      if getattr(layer, "use_sliding", False)), None)
    fa_mask = create_attention_mask(h, attn_cache)
    swa_mask = create_attention_mask(h, swa_cache, window_size=parts.sliding_window) \
        if swa_cache is not None else None
    wanted = {i: None for i in tap_ids}
    for i, (layer, c) in enumerate(zip(parts.layers, cache)):
        if hasattr(layer, "linear_attn"):
            r = _gated_delta_forward(layer.linear_attn, layer.input_layernorm(h), c, trace, i)
            h = h + r
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        else:
            h = layer(h, swa_mask if getattr(layer, "use_sliding", False) else fa_mask, cache=c)
        if i in wanted:
            wanted[i] = h
    if logits_rows is not None:
        h = h[:, logits_rows]
    logits = parts.head(parts.norm(h))
    taps = mx.concatenate([wanted[i] for i in tap_ids], axis=-1) if tap_ids else None
    return logits, taps


# ---------------------------------------------------------------------------------------------
# Caches and roll-back


def make_cache(parts: TargetParts) -> list:
    cache = make_prompt_cache(parts.model)
    for i, c in enumerate(cache):
        if isinstance(c, (KVCache, ArraysCache)):
            continue
        if isinstance(c, RotatingKVCache):
            continue  # trimmable while the window has not wrapped; checked at roll-back
        raise UnsupportedTargetError(
            f"target layer {i}: cache type {type(c).__name__} cannot be rolled back")
    return cache


def rollback(cache: list, trace: VerifyTrace, keep: int, verified: int) -> None:
    """Make every cache look as if only the first ``keep`` of ``verified`` rows had been fed."""
    drop = verified - keep
    if drop == 0:
        return
    for i, c in enumerate(cache):
        if isinstance(c, ArraysCache):
            t = trace.deltas[i]
            n_conv = t.conv_input.shape[1] - verified
            c[0] = mx.contiguous(t.conv_input[:, keep:keep + n_conv, :])
            _, c[1] = gated_delta_update(t.q[:, :keep], t.k[:, :keep], t.v[:, :keep],
                                         t.a[:, :keep], t.b[:, :keep], t.A_log, t.dt_bias,
                                         t.state0, None)
        else:
            if not c.is_trimmable():
                raise UnsupportedTargetError(
                    f"target layer {i}: its rotating cache has wrapped and cannot be trimmed")
            c.trim(drop)


def rollback_rows(cache: list, trace: VerifyTrace, keep: list[int], verified: int) -> None:
    """:func:`rollback` for a batch (:mod:`dflash.ragged_cache`): row ``b`` keeps its first
    ``keep[b]`` of ``verified`` rows. Attention rows just take their new lengths; GatedDeltaNet
    rows take their conv window at their own offset and replay their recurrence from the pass's
    start state, the steps past ``keep[b]`` masked (a masked step leaves the state unchanged)."""
    keep_array = mx.array(keep)
    for i, c in enumerate(cache):
        if i not in trace.deltas:
            c.set_lengths([n - verified + k for n, k in zip(c.lengths, keep)])
            continue
        if min(keep) == verified:
            continue
        t = trace.deltas[i]
        n_conv = t.conv_input.shape[1] - verified
        window = (keep_array[:, None] + mx.arange(n_conv)[None])[..., None]
        c[0] = mx.take_along_axis(t.conv_input, window, axis=1)
        steps = max(keep)
        mask = mx.arange(steps)[None] < keep_array[:, None]
        _, c[1] = gated_delta_update(t.q[:, :steps], t.k[:, :steps], t.v[:, :steps],
                                     t.a[:, :steps], t.b[:, :steps], t.A_log, t.dt_bias,
                                     t.state0, mask)


# ---------------------------------------------------------------------------------------------
# Tree verification (attention-only targets)

_TREE_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "scale", "n_heads",
                   "n_kv_heads")
_TREE_BLOCK = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")


def tree_supported(parts: TargetParts, cache: list) -> bool:
    """Trees need every layer to be a plain pre-norm attention block over a ``KVCache``.

    Recurrent layers (Qwen3.5's GatedDeltaNet) cannot isolate sibling branches with a mask: their
    state advances in sequence order; hybrid targets verify chains.
    """
    return all(
        all(hasattr(layer, a) for a in _TREE_BLOCK)
        and all(hasattr(layer.self_attn, a) for a in _TREE_ATTENTION)
        and type(c) is KVCache
        for layer, c in zip(parts.layers, cache))


def _tree_attention(attn: nn.Module, x: mx.array, positions: mx.array, mask: mx.array,
                    cache: KVCache) -> mx.array:
    """The attention module's own projections, norms and RoPE, at per-token ``positions``."""
    _, n, _ = x.shape
    q = attn.q_proj(x).reshape(1, n, attn.n_heads, -1)
    k = attn.k_proj(x).reshape(1, n, attn.n_kv_heads, -1)
    v = attn.v_proj(x).reshape(1, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    # RoPE takes one offset per batch row: put the tokens on the batch axis for their positions.
    q = attn.rope(q.transpose(1, 2, 0, 3), offset=positions).transpose(2, 1, 0, 3)
    k = attn.rope(k.transpose(1, 2, 0, 3), offset=positions).transpose(2, 1, 0, 3)
    keys, values = cache.update_and_fetch(k, v)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, n, -1))


def tree_forward(parts: TargetParts, tree: DraftTree, cache: list,
                 tap_ids: list[int]) -> tuple[mx.array, mx.array]:
    """Logits and taps ``(1, N, ...)`` for a draft tree ``[root, nodes...]`` after the context.

    Node ``i`` sits at position ``P + depths[i]`` and sees the context and its own ancestors
    (sliding-window layers: only context within the window). Every node is appended to the caches;
    :func:`commit_tree_path` keeps the accepted path.
    """
    start = cache[0].offset
    n = len(tree)
    positions = mx.array([start + d for d in tree.depths])
    tree_mask = mx.array(tree.ancestor_mask())
    full = mx.concatenate([mx.ones((n, start), dtype=mx.bool_), tree_mask], axis=1)
    window = parts.sliding_window
    swa = None
    if window is not None and any(getattr(layer, "use_sliding", False) for layer in parts.layers):
        key_pos = mx.concatenate([mx.arange(start), positions])
        swa = full & ((positions[:, None] - key_pos[None]) < window)
    h = parts.embed(mx.array(tree.tokens)[None])
    wanted = {i: None for i in tap_ids}
    for i, (layer, c) in enumerate(zip(parts.layers, cache)):
        mask = swa if getattr(layer, "use_sliding", False) else full
        h = h + _tree_attention(layer.self_attn, layer.input_layernorm(h), positions, mask, c)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if i in wanted:
            wanted[i] = h
    logits = parts.head(parts.norm(h))
    taps = mx.concatenate([wanted[i] for i in tap_ids], axis=-1) if tap_ids else None
    return logits, taps


def commit_tree_path(cache: list, start: int, keep: list[int], fed: int) -> None:
    """After a tree pass of ``fed`` rows at ``start``: keep rows ``keep`` (root first, then the
    accepted nodes in depth order) at ``start, start+1, ...`` and drop the rest. Each kept node was
    rotated at ``start + depth`` = its new slot, so nothing is re-rotated."""
    if keep != list(range(len(keep))):
        idx = mx.array([start + i for i in keep])
        for c in cache:
            c.keys[..., start:start + len(keep), :] = c.keys[..., idx, :]
            c.values[..., start:start + len(keep), :] = c.values[..., idx, :]
    for c in cache:
        c.trim(fed - len(keep))
