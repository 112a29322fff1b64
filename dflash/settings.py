"""Every generation setting in one frozen, keyword-only object: fields, defaults, docs, checks.

The Python API (:func:`~dflash.speculative.stream_generate`, ``generate``), the batched engine
(:class:`~dflash.batch.BatchGenerator`) and the server all build a :class:`GenerationSettings`
and pass it on, so a new setting is written here once: its field, default and doc below, its
range check in :meth:`GenerationSettings.__post_init__`, and (for the few that the batched
engine fixes for all its rows) where the batch takes it instead in :data:`ENGINE_HOME`.
Keyword calls keep working: ``stream_generate(..., max_tokens=64, temperature=0.7)`` builds
one with :meth:`GenerationSettings.from_call`.

Checks that need the pair (the vocabulary for ``logit_bias`` and ``logprobs``, the draft window
for ``block_size``, the target for ``kv_bits`` and trees) run when a request is built
(:func:`dflash.request.build_request`); everything else is checked here, when the object is made,
with a typed :class:`~dflash.errors.GenerationConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import GenerationConfigError
from .grammar import BoundGrammar, Grammar
from .lookup import ContinuationIndex
from .policy import check_policy
from .policy.memory import PairMemory
from .sampling import SamplingConfig, check_decode_settings
from .target import QUANTIZED_KV_START, KVQuantization

# The order of ``stream_generate``'s positional settings after the prompt (mlx-lm's order).
POSITIONAL = ("block_size", "max_tokens", "temperature", "top_p", "top_k", "min_p",
              "repetition_penalty", "repetition_context_size", "presence_penalty",
              "frequency_penalty", "seed")

# Settings of the whole batched engine, not of one of its rows: where BatchGenerator takes each
# (None: it has none; ``stream_generate`` does).
ENGINE_HOME = {"block_size": "BatchGenerator(block_size=...)",
               "policy": "BatchGenerator(policy=...)",
               "prefill_step_size": "BatchGenerator(prefill_chunk=...)",
               "memory": "BatchGenerator(memory=...)",
               "min_confidence": None, "tree_budget": None}


@dataclass(frozen=True, kw_only=True)
class GenerationSettings:
    """How to generate one answer. Every field has the default a plain call gets."""

    # -- length and stops ---------------------------------------------------------------------
    max_tokens: int = 256
    """Most tokens generated (0: prefill only)."""
    stop: str | Sequence[str] | None = None
    """Stop strings: the answer ends before the first one (not included)."""
    stop_token_ids: Sequence[int] | None = None
    """Token ids that end the answer, besides the tokenizer's end-of-sequence ids."""

    # -- sampling (mlx-lm's names and meanings; docs/sampling.md) -----------------------------
    temperature: float = 0.0
    """0 is greedy."""
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    """Seeds the sampler (None: the global MLX random state)."""
    sampler: Callable | None = None
    """A custom mlx-lm sampler (logprobs -> tokens); drafts are then proposed by argmax."""
    logits_processors: Sequence[Callable] | None = None
    """mlx-lm logits processors, applied to every verified row in order."""
    proposal: str | None = None
    """How the drafter proposes: 'sample' (rejection sampling) or 'argmax' (None: 'sample',
    or 'argmax' with a custom ``sampler``)."""

    # -- speculation --------------------------------------------------------------------------
    block_size: int | None = None
    """Tokens per drafted block (None: the drafter's)."""
    policy: str | None = None
    """How many drafted tokens a cycle verifies: 'auto', 'fixed', 'confidence', 'tree'
    (None: 'auto', or 'confidence' when ``min_confidence`` is given)."""
    min_confidence: float | None = None
    """The 'confidence' policy's threshold on the product of the drafter's top probabilities."""
    tree_budget: int | None = None
    """Nodes per verified tree (policy 'tree'; None: 16)."""
    lookup: bool = True
    """Whether 'auto' may verify the context's own continuation instead of a drafted block."""
    memory: PairMemory | None = None
    """What earlier generations of the pair measured (None: the drafter's ``policy_memory``)."""
    index: ContinuationIndex | None = None
    """Earlier requests' text the lookup proposals may continue (dflash.lookup)."""
    prefill_step_size: int = 2048
    """Prompt tokens per prefill pass."""
    prompt_progress_callback: Callable[[int, int], None] | None = None
    """Called with (tokens prefilled, prompt tokens) after each prefill pass."""

    # -- the target's KV cache (mlx-lm's names and meanings) ----------------------------------
    kv_bits: int | None = None
    """Quantize the target's KV cache to this many bits (None: float)."""
    kv_group_size: int = 64
    quantized_kv_start: int = QUANTIZED_KV_START

    # -- structured outputs and log-probabilities ---------------------------------------------
    grammar: Grammar | BoundGrammar | None = None
    """What the answer must match (dflash.grammar; docs/structured-outputs.md)."""
    logprobs: int | None = None
    """Return each token's log-probability with this many alternatives (None: none)."""
    prompt_logprobs: bool = False
    """Also score the prompt's own tokens (completions' ``echo`` with ``logprobs``)."""

    def __post_init__(self) -> None:
        self.sampling_config()  # its own checks, vocabulary aside
        check_decode_settings(2 if self.block_size is None else self.block_size,
                              self.max_tokens, self.prefill_step_size,
                              0.0 if self.min_confidence is None else self.min_confidence)
        if self.policy is not None:
            check_policy(self.policy)
        for name, kind, what in (("memory", PairMemory, "dflash.policy.memory.PairMemory"),
                                 ("index", ContinuationIndex, "dflash.lookup.ContinuationIndex"),
                                 ("grammar", (Grammar, BoundGrammar), "dflash.grammar.Grammar "
                                  "(Grammar.json_schema, Grammar.regex, Grammar.lark, "
                                  "Grammar.json_object)")):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise GenerationConfigError(f"{name}={type(value).__name__}: a {what} (or None)")
        self.kv_quantization()
        self.stop_strings()
        if not isinstance(self.prompt_logprobs, bool):
            raise GenerationConfigError(
                f"prompt_logprobs={self.prompt_logprobs!r}: must be True or False")
        if self.prompt_progress_callback is not None and not callable(
                self.prompt_progress_callback):
            raise GenerationConfigError("prompt_progress_callback: must be callable (or None)")

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_call(cls, args: Sequence[Any] = (), settings: GenerationSettings | None = None,
                  **kwargs) -> GenerationSettings:
        """The settings of a call such as ``stream_generate(model, draft, tok, prompt, *args,
        settings=..., **kwargs)``: positional values in :data:`POSITIONAL` order, keywords
        over ``settings`` (else the defaults). An unknown keyword names itself."""
        if len(args) > len(POSITIONAL):
            raise GenerationConfigError(
                f"{len(args)} positional settings: at most {len(POSITIONAL)} "
                f"({', '.join(POSITIONAL)}); give the rest by keyword")
        given = dict(zip(POSITIONAL, args))
        for name in kwargs:
            if name in given:
                raise GenerationConfigError(f"{name}: given both by position and by keyword")
        given.update(kwargs)
        unknown = sorted(set(given) - FIELDS)
        if unknown:
            raise GenerationConfigError(f"{unknown[0]}: not a generation setting")
        if settings is None:
            return cls(**given)
        if not isinstance(settings, GenerationSettings):
            raise GenerationConfigError(
                f"settings={type(settings).__name__}: a dflash.GenerationSettings (or None)")
        return dataclasses.replace(settings, **given) if given else settings

    def replace(self, **changes) -> GenerationSettings:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their defaults (what a call gave), by name."""
        changed = {}
        for f in dataclasses.fields(self):
            value, default = getattr(self, f.name), _default(f)
            if value is not default and value != default:
                changed[f.name] = value
        return changed

    # -- derived ------------------------------------------------------------------------------

    @property
    def resolved_policy(self) -> str:
        """The policy these settings select (``policy``, else from ``min_confidence``)."""
        if self.policy is not None:
            return self.policy
        return "auto" if self.min_confidence is None else "confidence"

    def sampling_config(self, vocab_size: int | None = None) -> SamplingConfig:
        """The sampler's settings, checked (``logit_bias`` ids against ``vocab_size`` if given)."""
        proposal = self.proposal
        if proposal is None:
            # Sampled proposals accept more at T > 0 (docs/sampling.md); at T = 0 both modes are
            # the same. A custom sampler has no q to reject against.
            proposal = "argmax" if self.sampler is not None else "sample"
        cfg = SamplingConfig(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
            presence_penalty=self.presence_penalty,
            presence_context_size=self.presence_context_size,
            frequency_penalty=self.frequency_penalty,
            frequency_context_size=self.frequency_context_size,
            logit_bias=self.logit_bias,  # validate() checks it into a new dict
            sampler=self.sampler, logits_processors=self.logits_processors, proposal=proposal,
            seed=self.seed)
        cfg.validate(vocab_size)
        return cfg

    def kv_quantization(self) -> KVQuantization | None:
        """The target's quantized KV cache these settings ask for (None: a float cache)."""
        return KVQuantization.from_settings(self.kv_bits, self.kv_group_size,
                                            self.quantized_kv_start)

    def stop_strings(self) -> list[str]:
        """``stop`` as a list of non-empty strings."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not isinstance(s, str) or not s for s in stops):
            raise GenerationConfigError(f"stop={self.stop!r}: stop strings must be non-empty strings")
        return stops

    def engine_settings_given(self) -> dict[str, Any]:
        """The whole-batch settings (:data:`ENGINE_HOME`) these settings change from default."""
        return {name: value for name, value in self.changed().items() if name in ENGINE_HOME}

    def per_request(self) -> GenerationSettings:
        """These settings with the whole-batch ones (:data:`ENGINE_HOME`) at their defaults."""
        return self.replace(**{name: _default(FIELD_BY_NAME[name]) for name in ENGINE_HOME})


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


FIELD_BY_NAME = {f.name: f for f in dataclasses.fields(GenerationSettings)}
FIELDS = frozenset(FIELD_BY_NAME)
