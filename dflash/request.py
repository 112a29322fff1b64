"""A generation's validated request: its settings checked against the pair, its prompt as ids.

:func:`build_request` is where the checks that need the pair run (the vocabulary, the draft
window, what the target's caches can do); the rest ran when the
:class:`~dflash.settings.GenerationSettings` was made. The single-sequence engine
(:mod:`dflash.speculative`) and the batched one (:mod:`dflash.batch`) both decode a
:class:`DecodeRequest`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from .cost_model import cost_model
from .errors import GenerationConfigError
from .grammar import BoundGrammar
from .logprobs import TokenLogprob, check_logprobs, log_softmax, read_logprobs
from .lookup import ContinuationIndex
from .policy import check_tree_budget, check_trees_possible, policy_class
from .policy.memory import PairMemory
from .prompts import encode_text
from .sampling import BlockSampler
from .settings import GenerationSettings
from .target import (
    KVQuantization,
    TargetParts,
    check_compatible,
    check_prompt_length,
    make_cache,
    tree_supported,
)


def build_request(parts: TargetParts, draft, tokenizer, prompt: str | Sequence[int] | mx.array,
                  settings: GenerationSettings) -> DecodeRequest:
    """``prompt`` and ``settings`` checked against the pair (typed errors naming the field) into
    a :class:`DecodeRequest`; shared by the single-sequence and batched engines."""
    check_compatible(parts, draft)
    s = settings
    block_size = draft.block_size if s.block_size is None else s.block_size
    policy = s.resolved_policy
    window = getattr(draft, "window", None)
    if isinstance(window, int) and block_size > window:  # its last rows would see no context
        raise GenerationConfigError(
            f"block_size={block_size}: more than the draft window ({window} tokens)")
    if s.tree_budget is not None:  # now, not at the first token: its range is the cost model's
        check_tree_budget(s.tree_budget, cost_model(parts, draft)
                          if policy_class(policy).needs_cost else None)
    cfg = s.sampling_config(parts.vocab_size)
    kv = s.kv_quantization()
    if kv is not None:
        kv.check_target(parts)
        if policy == "tree":
            raise GenerationConfigError(
                f"policy='tree' with kv_bits={s.kv_bits}: a quantized KV cache verifies chains "
                "(policy 'auto', 'fixed' or 'confidence')")
    check_trees_possible(policy, tree_supported(parts, make_cache(parts, kv)))
    bound = _bind_grammar(s.grammar, tokenizer, parts)
    prompt_ids = _prompt_ids(parts, tokenizer, prompt)
    check_logprobs(s.logprobs, parts.vocab_size)
    stop_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    stop_ids |= {int(t) for t in s.stop_token_ids or ()}
    return DecodeRequest(
        prompt_ids=prompt_ids, block_size=block_size, max_tokens=s.max_tokens,
        sampler=BlockSampler(cfg), stops=s.stop_strings(), stop_ids=stop_ids,
        prefill_step_size=s.prefill_step_size, progress=s.prompt_progress_callback,
        min_confidence=0.0 if s.min_confidence is None else float(s.min_confidence),
        policy=policy, tree_budget=s.tree_budget, lookup=bool(s.lookup), memory=s.memory,
        index=s.index, kv=kv, grammar=bound,
        logprobs=None if s.logprobs is None else int(s.logprobs),
        prompt_logprobs=s.prompt_logprobs)


def _prompt_ids(parts: TargetParts, tokenizer, prompt) -> list[int]:
    """The prompt as token ids, checked against the target's vocabulary and context."""
    if isinstance(prompt, str):
        prompt_ids = encode_text(tokenizer, prompt)
    else:
        prompt_ids = [int(t) for t in (prompt.tolist() if isinstance(prompt, mx.array) else prompt)]
    if not prompt_ids:
        raise GenerationConfigError("prompt: must hold at least one token")
    if any(not 0 <= t < parts.vocab_size for t in prompt_ids):
        raise GenerationConfigError("prompt: token id outside the target vocabulary")
    check_prompt_length(parts, len(prompt_ids))
    return prompt_ids


def _bind_grammar(grammar, tokenizer, parts: TargetParts) -> BoundGrammar | None:
    """``grammar`` checked against the tokenizer and the settings it cannot go with (typed errors
    naming the setting: never an answer silently unconstrained)."""
    if grammar is None:
        return None
    if isinstance(grammar, BoundGrammar):
        if grammar.vocab_size != parts.vocab_size:
            raise GenerationConfigError(
                f"grammar: bound to {grammar.vocab_size} token ids, the target has "
                f"{parts.vocab_size}")
        return grammar
    return grammar.bind(tokenizer, parts.vocab_size)


@dataclass
class DecodeRequest:
    """What one generation asks for, validated by :func:`stream_generate`."""

    prompt_ids: list[int]
    block_size: int
    max_tokens: int
    sampler: BlockSampler
    stops: list[str]
    stop_ids: set[int]
    prefill_step_size: int = 2048
    progress: Callable[[int, int], None] | None = None
    min_confidence: float = 0.0
    policy: str = "auto"
    tree_budget: int | None = None
    lookup: bool = True  # auto also verifies the context's own continuation (dflash.lookup)
    memory: PairMemory | None = None  # what earlier generations taught (None: the drafter's)
    index: ContinuationIndex | None = None  # earlier requests' text (dflash.lookup); told this one's
    kv: KVQuantization | None = None  # the target's quantized KV cache (None: float)
    grammar: BoundGrammar | None = None  # what the answer must match (dflash.grammar)
    # Each emitted token's log-probability with this many alternatives (None: not computed);
    # ``prompt_logprobs``: the prompt's too (the same number of alternatives, 0 if None).
    logprobs: int | None = None
    prompt_logprobs: bool = False

    def scored(self, logits: mx.array, tokens: list[int]) -> list[TokenLogprob] | None:
        """The log-probabilities of ``tokens``, row ``i`` of raw ``logits`` ``(R, V)`` scoring
        ``tokens[i]`` (``None``: not asked, nothing computed)."""
        if self.logprobs is None:
            return None
        return read_logprobs(log_softmax(logits[:len(tokens)]), tokens, self.logprobs)

    @property
    def priced_kv(self) -> KVQuantization | None:
        """The cache kind this request's passes cost as: a quantized cache that converts only
        past the last token it will hold (prompt and ``max_tokens``) runs on float keys
        throughout, and is priced so."""
        if self.kv is None:
            return None
        switch = self.kv.switch_offset(len(self.prompt_ids), self.prefill_step_size)
        return self.kv if switch < len(self.prompt_ids) + self.max_tokens else None

    def target_cache(self, parts: TargetParts) -> list:
        """Fresh target caches; quantized ones switch where mlx-lm's decoding switches."""
        if self.kv is None:
            return make_cache(parts)
        return make_cache(parts, self.kv, self.kv.switch_offset(len(self.prompt_ids),
                                                                self.prefill_step_size))
