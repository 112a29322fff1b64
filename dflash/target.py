"""The target side: a forward pass that taps decoder-layer outputs, and roll-back of its caches.

We walk the target's own layers (embed -> layers -> norm -> head) instead of patching mlx-lm
classes, so two generations in two threads never share state. "Tap k" is the output of decoder
layer k (0-based), i.e. Hugging Face's ``hidden_states[k + 1]``.

Roll-back after a partial acceptance: attention caches trim. GatedDeltaNet layers (Qwen3.5,
Qwen3-Next) keep a recurrent state that cannot be trimmed, so their verify pass records its
per-step inputs and the state it started from; roll-back replays the accepted prefix of the
recurrence from that state and takes the conv window from the recorded conv input.

A target split by layers (mlx-lm's pipeline-parallel ``sharded_load``: qwen3_5, qwen3_next): each
rank holds one stage, a run of consecutive layers, and its caches for those only. The walk runs
the stage's layers with mlx-lm's schedule around them (receive the hidden state from the previous
stage, send the result to the next, keep the send in the caches' graph) and ends with the one
all-gather mlx-lm ends with, into which every stage folds the taps it holds (:class:`Stage`), so
every rank leaves the pass with the final hidden state and every tap at no extra collective.

Quantized KV caches (mlx-lm's ``kv_bits``): the promise is mlx-lm's own decoding with the same KV
settings, so the cache must switch from float to quantized at the offset where mlx-lm's
``maybe_quantize_kv_cache`` switches it (after the first forward call whose end reaches
``quantized_kv_start``): tokens before that offset attend to float keys and values, tokens after
it to quantized ones. :class:`QuantizingCache` carries that offset; :func:`forward` splits a pass
that crosses it and :func:`rollback` returns to the float cache when the accepted rows end before
it. Rotating (sliding-window) caches are rolled back by cutting the rows a multi-row pass appended
(such a pass leaves the cache in temporal order), which works after the window has wrapped.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from . import backend
from .errors import GenerationConfigError, IncompatibleDraftError, UnsupportedTargetError
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


@dataclass(frozen=True)
class Stage:
    """This rank's share of a target mlx-lm split by layers (pipeline-parallel): layers
    ``starts[rank]`` up to the next stage's start, of ``total``. mlx-lm splits in reverse: rank
    ``size - 1`` holds the first layers, rank 0 the last, and a stage receives from ``rank + 1``
    and sends to ``rank - 1``. ``starts`` holds every rank's first layer (where each tap lives)."""

    rank: int
    size: int
    starts: tuple[int, ...]
    total: int
    group: object

    @property
    def start(self) -> int:
        return self.starts[self.rank]

    def owner(self, layer: int) -> int:
        """The rank whose stage holds ``layer``."""
        return next(r for r in range(self.size) if self.starts[r] <= layer
                    and (r == 0 or layer < self.starts[r - 1]))


def pipeline_starts(size: int, layers: int) -> tuple[int, ...]:
    """Each rank's first layer under mlx-lm's default pipeline split of ``layers`` over
    ``size`` ranks (what ``sharded_load`` makes), read from mlx-lm's own ``pipeline()``."""
    from mlx_lm.models.pipeline import PipelineMixin

    class _Rank:  # the two methods pipeline() asks a group for
        def __init__(self, rank: int) -> None:
            self._rank = rank

        def rank(self) -> int:
            return self._rank

        def size(self) -> int:
            return size

    starts = []
    for rank in range(size):
        probe = PipelineMixin()
        probe.layers = [None] * layers
        probe.pipeline(_Rank(rank))
        starts.append(probe.start_idx)
    return tuple(starts)


@dataclass
class TargetParts:
    """The pieces of an mlx-lm model that speculative decoding needs. Split by layers
    (``stage``), ``layers`` are this rank's stage's, in the order of its caches."""

    model: nn.Module
    embed_tokens: nn.Module
    layers: list
    norm: nn.Module
    lm_head: nn.Module | None  # None: tied embeddings
    sliding_window: int | None = None
    head_group: object | None = None  # the ranks the head's vocabulary is split over, if any
    max_positions: int | None = None  # positions the target reads (None: not stated)
    stage: Stage | None = None  # split by layers: this rank's stage (None: every layer here)

    @property
    def num_layers(self) -> int:
        """Decoder layers of the whole target (every stage's)."""
        return self.stage.total if self.stage is not None else len(self.layers)

    @property
    def first_layer(self) -> int:
        """The target layer number of ``layers[0]``."""
        return self.stage.start if self.stage is not None else 0

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
        if self.head_group is not None:
            raise UnsupportedTargetError(
                "the target's output head is split over ranks: a drafter with draft_vocab_ids "
                "(or a conversion) needs the whole head on one process")
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
        if self.head_group is not None:  # each rank holds a slice of the vocabulary (mlx-lm's)
            from mlx_lm.models.base import gather_last_axis

            return gather_last_axis(self.lm_head(hidden), self.head_group)
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
    stage, layers = pipeline_stage(owner, inner), list(inner.layers)
    if stage is not None:
        layers = list(inner.pipeline_layers)
    for i, layer in enumerate(layers, start=stage.start if stage is not None else 0):
        if hasattr(layer, "linear_attn") and not any(
                hasattr(layer.linear_attn, a) for a in ("in_proj_qkv", "in_proj_qkvz")):
            raise UnsupportedTargetError(
                f"target layer {i}: linear attention of type {type(layer.linear_attn).__name__} "
                "cannot be rolled back")
        if not hasattr(layer, "linear_attn") and not hasattr(layer, "self_attn"):
            raise UnsupportedTargetError(f"target layer {i} ({type(layer).__name__}) has no "
                                         "attention this engine knows how to roll back")
    return TargetParts(
        model=model, embed_tokens=inner.embed_tokens, layers=layers, norm=inner.norm,
        lm_head=getattr(owner, "lm_head", None),
        sliding_window=getattr(inner, "sliding_window", None),
        head_group=getattr(owner, "sharding_group", None) if hasattr(owner, "lm_head") else None,
        max_positions=max_positions(model), stage=stage,
    )


def pipeline_stage(owner: nn.Module, inner: nn.Module) -> Stage | None:
    """This rank's :class:`Stage` of a model mlx-lm split by layers (``None``: not split)."""
    size = getattr(inner, "pipeline_size", 1)
    if not isinstance(size, int) or size <= 1:
        return None
    total = getattr(getattr(owner, "args", None), "num_hidden_layers", None)
    if not isinstance(total, int):
        raise UnsupportedTargetError(
            f"target {type(owner).__name__} is split by layers but states no num_hidden_layers")
    rank, starts = int(inner.pipeline_rank), pipeline_starts(size, total)
    if starts[rank] != inner.start_idx or \
            inner.end_idx != (total if rank == 0 else starts[rank - 1]):
        raise UnsupportedTargetError(
            f"target split by layers at layers {inner.start_idx}-{inner.end_idx} on rank {rank}: "
            "not mlx-lm's default split (sharded_load's), the only one the taps are read from")
    return Stage(rank, size, starts, total, mx.distributed.init())


# RoPE scalings that let a model read past the positions it was pre-trained on (mlx-lm's
# initialize_rope names; "su" is longrope's older name). Others (default, mrope, proportional)
# change the frequencies only.
CONTEXT_SCALINGS = frozenset({"linear", "dynamic", "yarn", "deepseek_yarn", "telechat3-yarn",
                              "llama3", "longrope", "su"})


def max_positions(model: nn.Module) -> int | None:
    """Positions the target reads (None: its config does not say): :func:`config_positions` of
    the arguments mlx-lm built it from (a wrapped model's language model first), so a RoPE
    scaling counts only where the model's mlx-lm class reads it."""
    for owner in (getattr(model, "language_model", None), model):
        limit = config_positions(getattr(owner, "args", None))
        if limit is not None:
            return limit
    return None


def config_positions(args: object) -> int | None:
    """Positions a model config (a dict or mlx-lm's model arguments, or its ``text_config``)
    says the model reads. ``max_position_embeddings`` alone, unless ``rope_scaling`` (or
    transformers 5's ``rope_parameters``) stretches the context by its ``factor``: over
    ``original_max_position_embeddings`` where the scaling states it (Qwen3's documented yarn:
    ``factor`` 4 over 32,768 reads 131,072; Llama 3.1's 8 over 8,192 leaves its own 131,072),
    else over ``max_position_embeddings``, which is then the pre-trained length (Hugging Face's
    meaning for linear, dynamic and yarn scaling without it). The larger of the two counts."""
    if args is None:
        return None
    get = args.get if isinstance(args, dict) else (lambda k, a=args: getattr(a, k, None))
    limit = get("max_position_embeddings")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        text = get("text_config")
        return config_positions(text) if text is not None and text is not args else None
    for scaling in (get("rope_scaling"), get("rope_parameters")):
        if not isinstance(scaling, dict):
            continue
        kind = scaling.get("type") or scaling.get("rope_type") or "default"
        factor = scaling.get("factor")
        if kind not in CONTEXT_SCALINGS or isinstance(factor, bool) \
                or not isinstance(factor, (int, float)) or factor <= 1:
            continue
        original = scaling.get("original_max_position_embeddings")
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            original = limit
        limit = max(limit, int(factor * original))
    return limit


def check_prompt_length(parts: TargetParts, n_prompt: int) -> None:
    """``GenerationConfigError`` naming ``prompt`` for a prompt longer than the target reads."""
    if parts.max_positions is not None and n_prompt > parts.max_positions:
        raise GenerationConfigError(
            f"prompt={n_prompt} tokens: longer than the {parts.max_positions} positions the target "
            "reads (max_position_embeddings, or as its rope_scaling stretches it)")


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
# Quantized KV caches (mlx-lm's kv_bits, kv_group_size, quantized_kv_start)

KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize's affine mode accepts
KV_GROUP_SIZES = (32, 64, 128)
# mlx-lm's own default, read from the installed mlx-lm so that ``kv_bits`` alone means here what
# it means to mlx-lm's ``generate_step``
QUANTIZED_KV_START: int = inspect.signature(generate_step).parameters["quantized_kv_start"].default


@dataclass(frozen=True)
class KVQuantization:
    """mlx-lm's quantized KV cache settings, under mlx-lm's names and meanings: ``bits``
    (``kv_bits``), ``group_size`` (``kv_group_size``) and ``start`` (``quantized_kv_start``: the
    cache is converted once the context has that many tokens; default mlx-lm's,
    :data:`QUANTIZED_KV_START`)."""

    bits: int
    group_size: int = 64
    start: int = QUANTIZED_KV_START

    @classmethod
    def from_settings(cls, kv_bits: int | None, kv_group_size: int = 64,
                      quantized_kv_start: int = QUANTIZED_KV_START) -> KVQuantization | None:
        """Checked settings (``None``: a float cache); typed errors name the field."""
        for name, value in (("kv_group_size", kv_group_size),
                            ("quantized_kv_start", quantized_kv_start)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise GenerationConfigError(f"{name}={value!r}: must be an integer")
        if quantized_kv_start < 0:
            raise GenerationConfigError(
                f"quantized_kv_start={quantized_kv_start}: must be >= 0")
        if kv_group_size not in KV_GROUP_SIZES:
            raise GenerationConfigError(
                f"kv_group_size={kv_group_size}: must be one of {list(KV_GROUP_SIZES)}")
        if kv_bits is None:
            return None
        if isinstance(kv_bits, bool) or not isinstance(kv_bits, int) or kv_bits not in KV_BITS:
            raise GenerationConfigError(
                f"kv_bits={kv_bits!r}: must be one of {list(KV_BITS)} (or None: a float cache)")
        return cls(kv_bits, kv_group_size, quantized_kv_start)

    def switch_offset(self, prompt_tokens: int, prefill_step_size: int) -> int:
        """The context length at which mlx-lm's ``generate_step`` converts the cache for a prompt
        of ``prompt_tokens``: after the first forward call whose end reaches ``start``. Its calls
        are the prompt less its last token in chunks of ``prefill_step_size``, then the last
        prompt token, then one token per step."""
        end = 0
        for end in prefill_calls(prompt_tokens, prefill_step_size):
            if end >= self.start:
                return end
        return max(self.start, end + 1)

    def check_target(self, parts: TargetParts) -> None:
        """Refuse targets mlx-lm cannot quantize (rotating or recurrent caches, head dimensions
        the group size does not divide), before any work starts."""
        for i, c in enumerate(make_prompt_cache(parts.model)):
            if isinstance(c, RotatingKVCache):
                raise GenerationConfigError(
                    f"kv_bits={self.bits}: target layer {i} uses a rotating (sliding-window) "
                    "cache, which mlx-lm does not quantize")
        for i, layer in enumerate(parts.layers):
            attn = getattr(layer, "self_attn", None)
            k_proj = getattr(attn, "k_proj", None)
            heads = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None)
            if k_proj is None or not heads:
                continue
            out = k_proj.weight.shape[0] if not hasattr(k_proj, "scales") else None
            head_dim = getattr(attn, "head_dim", None) or (out // heads if out else None)
            if head_dim and head_dim % self.group_size:
                raise GenerationConfigError(
                    f"kv_group_size={self.group_size}: does not divide target layer {i}'s head "
                    f"dimension {head_dim}")


def prefill_calls(prompt_tokens: int, prefill_step_size: int) -> list[int]:
    """Where mlx-lm's prefill calls end: chunks of ``prefill_step_size`` over all but the last
    prompt token, then the last token alone."""
    ends, done = [], 0
    while prompt_tokens - done > 1:
        done += min(prefill_step_size, prompt_tokens - done - 1)
        ends.append(done)
    ends.append(prompt_tokens)
    return ends


class QuantizingCache(list):
    """The target's per-layer caches, float until the context reaches ``switch_at`` tokens, then
    mlx-lm's ``QuantizedKVCache`` (the attention layers; recurrent layers keep their state)."""

    quantized: bool = False

    def __init__(self, caches: list, kv: KVQuantization, switch_at: int):
        super().__init__(caches)
        self.kv = kv
        self.switch_at = switch_at

    @property
    def offset(self) -> int:
        return next(c.offset for c in self if hasattr(c, "offset"))

    def quantize(self) -> list:
        """Convert the float attention caches (as mlx-lm's ``maybe_quantize_kv_cache``); the
        float caches they were, for a roll-back to before the switch."""
        before = list(self)
        for i, c in enumerate(self):
            if isinstance(c, KVCache):
                self[i] = c.to_quantized(group_size=self.kv.group_size, bits=self.kv.bits)
        self.quantized = True
        return before

    def restore(self, before: list) -> None:
        """Back to the float caches :meth:`quantize` returned (their rows past the roll-back point
        are trimmed by the caller)."""
        for i, c in enumerate(before):
            self[i] = c
        self.quantized = False


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
    # A pass that crossed a quantizing cache's switch: the float caches at the switch and the
    # pass row the switch fell on (a roll-back to before it returns to them).
    float_cache: list | None = None
    switch_row: int = 0


def _gated_delta_forward(mod: nn.Module, x: mx.array, cache: ArraysCache,
                         trace: VerifyTrace | None, layer_idx: int) -> mx.array:
    """mlx-lm's ``GatedDeltaNet.__call__`` for one unpadded sequence, recording its inputs.

    Kept in step with mlx_lm.models.qwen3_5.GatedDeltaNet and, for its front end (two fused
    projections reordered per key head by the module's own ``fix_query_key_value_ordering``),
    mlx_lm.models.qwen3_next.Qwen3NextGatedDeltaNet (same ops, same order) so that the outputs
    are bit-identical to the target's own forward. From the conv input on, the two are one.
    """
    B, S, _ = x.shape
    if hasattr(mod, "in_proj_qkvz"):  # qwen3_next
        q, k, v, z, b, a = mod.fix_query_key_value_ordering(mod.in_proj_qkvz(x),
                                                            mod.in_proj_ba(x))
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)],
                             axis=-1)
    else:  # qwen3_5
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
    out = mod.out_proj(out.reshape(B, S, -1))
    group = getattr(mod, "sharding_group", None)  # tensor-parallel (dflash.distributed)
    return out if group is None else mx.distributed.all_sum(out, group=group)


def forward(parts: TargetParts, tokens: mx.array, cache: list, tap_ids: list[int],
            trace: VerifyTrace | None = None, logits_rows: slice | None = None
            ) -> tuple[mx.array, mx.array]:
    """Logits ``(B, S, V)`` and the concatenated outputs of layers ``tap_ids`` ``(B, S, n*H)``.

    ``logits_rows`` limits the head to those rows (a long prefill needs only its last row's
    logits; the head is the largest matrix of a small model). A :class:`QuantizingCache` is
    converted when the pass starts at or past its switch; a pass that crosses the switch runs as
    two passes split there (``trace`` keeps the float caches for :func:`rollback`).
    """
    if isinstance(cache, QuantizingCache) and not cache.quantized:
        start, rows = cache.offset, tokens.shape[1]
        if start >= cache.switch_at:
            cache.quantize()
        elif start + rows > cache.switch_at:
            k = cache.switch_at - start
            logits1, taps1 = _forward(parts, tokens[:, :k], cache, tap_ids, trace, None)
            before = cache.quantize()
            first = None
            if trace is not None:
                trace.float_cache, trace.switch_row = before, k
                first, trace.deltas = trace.deltas, {}
            logits2, taps2 = _forward(parts, tokens[:, k:], cache, tap_ids, trace, None)
            if first:
                trace.deltas = {i: _join_deltas(first[i], trace.deltas[i]) for i in first}
            logits = mx.concatenate([logits1, logits2], axis=1)
            taps = mx.concatenate([taps1, taps2], axis=1) if tap_ids else None
            return (logits if logits_rows is None else logits[:, logits_rows]), taps
    return _forward(parts, tokens, cache, tap_ids, trace, logits_rows)


def _join_deltas(a: DeltaTrace, b: DeltaTrace) -> DeltaTrace:
    """One trace for two consecutive GatedDeltaNet passes (the second's conv input starts with
    the window the first left)."""
    window = a.conv_input.shape[1] - a.q.shape[1]
    return DeltaTrace(mx.concatenate([a.conv_input, b.conv_input[:, window:]], axis=1),
                      *(mx.concatenate([x, y], axis=1)
                        for x, y in ((a.q, b.q), (a.k, b.k), (a.v, b.v), (a.a, b.a), (a.b, b.b))),
                      a.state0, a.A_log, a.dt_bias)


def _forward(parts: TargetParts, tokens: mx.array, cache: list, tap_ids: list[int],
             trace: VerifyTrace | None, logits_rows: slice | None) -> tuple[mx.array, mx.array]:
    h = parts.embed(tokens)
    attn_cache = next((c for layer, c in zip(parts.layers, cache)
                       if not hasattr(layer, "linear_attn")
                       and not getattr(layer, "use_sliding", False)), None)
    swa_cache = next((c for layer, c in zip(parts.layers, cache)
                      if getattr(layer, "use_sliding", False)), None)
    fa_mask = create_attention_mask(h, attn_cache)
    swa_mask = create_attention_mask(h, swa_cache, window_size=parts.sliding_window) \
        if swa_cache is not None else None

    def run(j: int, layer: nn.Module, c, h: mx.array) -> mx.array:
        if hasattr(layer, "linear_attn"):
            r = _gated_delta_forward(layer.linear_attn, layer.input_layernorm(h), c, trace, j)
            h = h + r
            return h + layer.mlp(layer.post_attention_layernorm(h))
        return layer(h, swa_mask if getattr(layer, "use_sliding", False) else fa_mask, cache=c)

    h, taps = _walk(parts, h, cache, tap_ids, run)
    if logits_rows is not None:
        h = h[:, logits_rows]
    return parts.head(parts.norm(h)), taps


def _gathered(cache: list) -> list:
    """The array of a stage's last cache that holds the previous pass's all-gather (``_walk``
    attaches it), if the cache has one yet."""
    if not cache:
        return []
    last = cache[-1]
    held = last.keys if hasattr(last, "keys") else last[0]
    if isinstance(held, (tuple, list)):  # a quantized cache: (data, scales, biases)
        held = held[0] if held else None
    return [held] if isinstance(held, mx.array) else []


def _hold(cache: list, collective: mx.array) -> None:
    """Keep ``collective`` in the graph of the stage's last cache (its keys, or its first state
    array), so evaluating the cache runs it: mlx-lm's way with a pipeline's send. A quantized
    cache's keys are a tuple of arrays; the tuple stays a tuple."""
    last = cache[-1]
    if not hasattr(last, "keys"):
        if last[0] is not None:
            last[0] = mx.depends(last[0], collective)
    elif isinstance(last.keys, mx.array):
        last.keys = mx.depends(last.keys, collective)
    elif isinstance(last.keys, (tuple, list)) and last.keys:
        last.keys = type(last.keys)(mx.depends(list(last.keys), collective))


def _walk(parts: TargetParts, h: mx.array, cache: list, tap_ids: list[int], run
          ) -> tuple[mx.array, mx.array | None]:
    """The final hidden state and the taps (concatenated in ``tap_ids`` order) after this rank's
    layers, ``run(j, layer, cache, h)`` being the ``j``-th of them. Split by layers, the stage
    works in mlx-lm's schedule (its pipeline forward, e.g. ``Qwen3_5TextModel.__call__``):
    receive the hidden state from the previous stage, run the stage, send the result on (kept in
    the graph of the stage's last cache), then one all-gather; every rank gets rank 0's hidden
    state (the last stage's) and each tap from the stage that holds it, folded into that
    all-gather."""
    stage, first = parts.stage, parts.first_layer
    if stage is not None and stage.rank < stage.size - 1:
        # A receive depends on nothing in the graph, so an evaluation holding this pass and the
        # previous one (a pass queued on the last one's lazy token) could run it before the
        # previous all-gather, which the sending stage runs first: a deadlock. Queue what this
        # pass follows (its tokens, the previous all-gather held by the last cache) before it.
        mx.async_eval(h, *_gathered(cache))
        h = mx.distributed.recv_like(h, stage.rank + 1, group=stage.group)
    wanted = {}
    for j, (layer, c) in enumerate(zip(parts.layers, cache)):
        h = run(j, layer, c, h)
        if first + j in tap_ids:
            wanted[first + j] = h
    if stage is None:
        return h, mx.concatenate([wanted[i] for i in tap_ids], axis=-1) if tap_ids else None
    if stage.rank != 0:
        h = mx.distributed.send(h, stage.rank - 1, group=stage.group)
    # Each rank's [hidden, tap 1, tap 2, ...], its own taps filled and the others' zeros.
    mine = mx.concatenate([h] + [wanted.get(i, mx.zeros_like(h)) for i in tap_ids], axis=-1)
    every = mx.distributed.all_gather(mine, group=stage.group)
    # mlx-lm keeps the send in the graph of the stage's last cache; here the all-gather too, so
    # whatever of the pass a rank evaluates first (its caches, logits or taps) runs every
    # collective of the pass, in the same order on every rank.
    _hold(cache, every)
    rows, width = h.shape[0], h.shape[-1]

    def block(rank: int, k: int) -> mx.array:
        return every[rank * rows:(rank + 1) * rows, ..., k * width:(k + 1) * width]

    taps = mx.concatenate([block(stage.owner(i), 1 + t) for t, i in enumerate(tap_ids)],
                          axis=-1) if tap_ids else None
    return block(0, 0), taps


# ---------------------------------------------------------------------------------------------
# Caches and roll-back


def make_cache(parts: TargetParts, kv: KVQuantization | None = None,
               switch_at: int = 0) -> list:
    """The target's fresh caches (mlx-lm's own); with ``kv``, a :class:`QuantizingCache` that
    converts at ``switch_at`` tokens (:meth:`KVQuantization.switch_offset`)."""
    cache = make_prompt_cache(parts.model)
    for i, c in enumerate(cache):
        if isinstance(c, (KVCache, ArraysCache, RotatingKVCache)):
            continue
        raise UnsupportedTargetError(
            f"target layer {i}: cache type {type(c).__name__} cannot be rolled back")
    if kv is not None:
        return QuantizingCache(cache, kv, switch_at)
    return cache


def _cut_rotating(c: RotatingKVCache, drop: int) -> None:
    """Drop the last ``drop`` rows a multi-row pass appended to a rotating cache.

    Such a pass (mlx-lm's concatenating update) leaves the keys in temporal order with the new
    rows last, so cutting them is exact whether or not the window has wrapped; the cache holds
    at most ``max_size - 1`` rows before the pass, so the cut keeps its memory bounded.
    """
    if c.keys is None or c._idx != c.keys.shape[2]:
        if not c.is_trimmable():
            raise UnsupportedTargetError(
                "target rotating cache: not in the order a multi-row pass leaves it")
        c.trim(drop)
        return
    end = c._idx - drop
    c.keys, c.values = c.keys[..., :end, :], c.values[..., :end, :]
    c.offset -= drop
    c._idx = end


def rollback(cache: list, trace: VerifyTrace, keep: int, verified: int) -> None:
    """Make every cache look as if only the first ``keep`` of ``verified`` rows had been fed."""
    drop = verified - keep
    if drop == 0:
        return
    if trace.float_cache is not None and keep < trace.switch_row:
        # The accepted rows end before the switch: back to the float caches, which hold the
        # pass's rows up to the switch (recurrent layers share their state objects).
        cache.restore(trace.float_cache)
        drop = trace.switch_row - keep
    for i, c in enumerate(cache):
        if isinstance(c, ArraysCache):
            t = trace.deltas[i]
            n_conv = t.conv_input.shape[1] - verified
            c[0] = mx.contiguous(t.conv_input[:, keep:keep + n_conv, :])
            _, c[1] = gated_delta_update(t.q[:, :keep], t.k[:, :keep], t.v[:, :keep],
                                         t.a[:, :keep], t.b[:, :keep], t.A_log, t.dt_bias,
                                         t.state0, None)
        elif isinstance(c, RotatingKVCache):
            _cut_rotating(c, drop)
        else:
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
    if isinstance(cache, QuantizingCache):
        return False  # a tree's rows cannot be split at the quantization switch: chains only
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

    def run(j: int, layer: nn.Module, c: KVCache, h: mx.array) -> mx.array:
        mask = swa if getattr(layer, "use_sliding", False) else full
        h = h + _tree_attention(layer.self_attn, layer.input_layernorm(h), positions, mask, c)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    h, taps = _walk(parts, h, cache, tap_ids, run)
    return parts.head(parts.norm(h)), taps


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
