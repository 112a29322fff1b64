"""What every ``dflash bench`` is built from: its prompts, one timed run of each side, the machine.

The prompt bench (:mod:`dflash.bench`), the trace bench (:mod:`dflash.bench_trace`) and the
concurrency bench (:mod:`dflash.bench_concurrency`) time mlx-lm and dflash the same way; the
pieces they share live here, below all three, so that none of them imports another.

Both sides are timed alike: wall clock to the first token = prompt time, the rest = decode time.
:class:`Prefilled` holds each side's caches after one prefill, for the context bench's
``reuse_prefill`` mode (see :mod:`dflash.bench`).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Sequence
from pathlib import Path

from .errors import BenchConfigError
from .stats import generation_stats

# A small built-in prompt set, written for this project: grade-school math word problems (where
# DFlash drafters accept long runs) and short coding tasks.
BUILTIN_PROMPTS: list[dict] = [
    {"id": "math-apples", "prompt": "Mia picks 14 apples in the morning and twice as many in "
     "the afternoon. She gives 9 apples to her neighbour and bakes 3 pies that use 4 apples "
     "each. How many apples does she have left? Think step by step."},
    {"id": "math-train", "prompt": "A train leaves at 9:40 and travels 210 km at an average "
     "speed of 84 km per hour. At what time does it arrive? Explain your reasoning."},
    {"id": "math-savings", "prompt": "Leo saves 15 dollars every week. He already has 48 "
     "dollars and wants to buy a bike that costs 213 dollars. How many weeks does he need to "
     "save? Show your work."},
    {"id": "math-garden", "prompt": "A rectangular garden is 12 metres long and 7 metres wide. "
     "A path 1 metre wide runs around the outside of it. What is the area of the path? Solve "
     "it step by step."},
    {"id": "math-books", "prompt": "A library has 360 books. One third are novels, a quarter "
     "of the rest are science books, and the remaining books are split equally between history "
     "and art. How many art books are there? Think step by step."},
    {"id": "code-fizzbuzz", "prompt": "Write a Python function fizzbuzz(n) that returns a list "
     "of strings for the numbers 1 to n, using Fizz, Buzz and FizzBuzz. Include a docstring."},
    {"id": "code-palindrome", "prompt": "Write a Python function that checks whether a string "
     "is a palindrome, ignoring case, spaces and punctuation. Add three example calls."},
    {"id": "code-reverse-list", "prompt": "Explain how to reverse a singly linked list in "
     "place, then write the code in Python with a small Node class."},
]


def parse_block_sizes(text: str | int | Sequence[int] | None) -> list[int | None]:
    """``None`` (the drafter's), ``8``, ``"4,8,16"`` or ``[4, 8]`` -> a list of block sizes."""
    if text is None:
        return [None]
    if isinstance(text, int):
        values = [text]
    elif isinstance(text, str):
        try:
            values = [int(v) for v in text.replace(" ", "").split(",") if v]
        except ValueError:
            raise BenchConfigError(
                "expected an integer or a comma-separated list like 4,8,16") from None
    else:
        values = [int(v) for v in text]
    if not values:
        raise BenchConfigError("no block size given")
    if any(v < 2 for v in values):
        raise BenchConfigError("block sizes must be >= 2")
    return list(dict.fromkeys(values))


def load_prompts(prompts: str | Path | Sequence[dict] = "builtin",
                 limit: int | None = None) -> tuple[str, list[dict]]:
    """``(source name, items)`` from ``"builtin"``, a JSONL file or a list of prompt dicts."""
    if isinstance(prompts, (str, Path)) and str(prompts) == "builtin":
        source, items = "builtin", [dict(p) for p in BUILTIN_PROMPTS]
    elif isinstance(prompts, (str, Path)):
        from .prompts import read_prompts

        source, items = str(prompts), read_prompts(prompts)
    else:
        source, items = "list", [dict(p, id=str(p.get("id", f"prompt-{i}")))
                                 for i, p in enumerate(prompts)]
    if limit is not None:
        if limit < 1:
            raise BenchConfigError(f"limit={limit}: must be >= 1")
        items = items[:limit]
    return source, items


# ---------------------------------------------------------------------------------------------
# One timed run of each side


def _run_baseline(pair, ids: list[int], max_tokens: int, sampling: dict, seed: int,
                  kv: dict | None = None, prompt_cache: list | None = None,
                  cached: int = 0) -> dict:
    """mlx-lm's plain decoding of the target (``mlx_lm.generate.stream_generate``; ``kv``: its
    quantized KV cache settings; ``prompt_cache``: mlx-lm's caches, holding the first
    ``cached`` tokens of ``ids`` already)."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate as lm_stream_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    mx.reset_peak_memory()
    sampler = make_sampler(temp=sampling["temperature"], top_p=sampling["top_p"],
                           min_p=sampling["min_p"], top_k=sampling["top_k"])
    tokens: list[int] = []
    tic = time.perf_counter()
    first = None
    for r in lm_stream_generate(pair.model, pair.tokenizer, list(ids[cached:]),
                                max_tokens=max_tokens, sampler=sampler, prompt_cache=prompt_cache,
                                **(kv or {})):
        if first is None:
            first = time.perf_counter()
        if r.finish_reason is None or r.finish_reason == "length":
            tokens.append(int(r.token))
    end = time.perf_counter()
    return _timing(tokens, tic, first or end, end) | {"peak_memory_gb": mx.get_peak_memory() / 1e9}


def _run_dflash(pair, ids: list[int], max_tokens: int, block_size: int | None, sampling: dict,
                seed: int, min_confidence: float | None = None,
                policy: str | None = None, tree_budget: int | None = None,
                lookup: bool = True, memory=None, index=None, prompt_cache=None,
                kv: dict | None = None) -> dict:
    from .speculative import stream_generate

    tokens: list[int] = []
    tic = time.perf_counter()
    first, last = None, None
    for r in stream_generate(pair.model, pair.draft, pair.tokenizer, list(ids),
                             block_size=block_size, max_tokens=max_tokens, seed=seed,
                             min_confidence=min_confidence, policy=policy,
                             tree_budget=tree_budget, lookup=lookup, memory=memory,
                             index=index, prompt_cache=prompt_cache, **sampling, **(kv or {})):
        if first is None:
            first = time.perf_counter()
        tokens.extend(r.tokens)
        last = r
    end = time.perf_counter()
    out = _timing(tokens, tic, first or end, end)
    out.update(generation_stats(last, rounded=False),
               cycle_tokens=last.mean_tau * last.cycles)
    return out


class Prefilled:
    """Each side's caches after prefilling one prompt once (``reuse_prefill``), copied for every
    decode, with the prefill's time and peak. mlx-lm's hold the prompt but its last token,
    computed in its own chunks (its decoding of the whole prompt, trimmed); dflash's are its
    prompt cache, which feeds the last token again (as a conversation's next turn does)."""

    def __init__(self, pair, ids: list[int], sampling: dict, seed: int):
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        from .prompt_cache import PromptCache

        self.held_before = mx.get_active_memory()
        self.baseline = make_prompt_cache(pair.model)
        r = _run_baseline(pair, ids, 1, sampling, seed, prompt_cache=self.baseline)
        for c in self.baseline:
            c.trim(c.offset - (len(ids) - 1))
        self.baseline_prompt_time, self.baseline_peak = r["prompt_time"], r["peak_memory_gb"]
        self.dflash = PromptCache()
        held = self.held_gb()
        r = _run_dflash(pair, ids, 0, None, sampling, seed, prompt_cache=self.dflash)
        self.dflash_prompt_time, self.dflash_peak = r["prompt_time"], r["peak_memory_gb"] - held

    @staticmethod
    def possible(pair, kv: dict | None) -> bool:
        """Whether both sides' caches can be copied and cut back: attention-only targets, float
        caches (a quantized cache's content depends on where its prompt switched)."""
        from mlx_lm.models.cache import make_prompt_cache

        return not kv and all(c.is_trimmable() for c in make_prompt_cache(pair.model))

    def held_gb(self) -> float:
        """Memory this bench holds beyond what a lone generation would (the copies kept here):
        taken off each peak, so that peaks compare as if each run were alone."""
        import mlx.core as mx

        return (mx.get_active_memory() - self.held_before) / 1e9

    def run_baseline(self, pair, ids: list[int], max_tokens: int, sampling: dict,
                     seed: int) -> dict:
        """:func:`_run_baseline` from a copy of mlx-lm's caches, timed as if alone."""
        import copy

        held = self.held_gb()
        r = _run_baseline(pair, ids, max_tokens, sampling, seed,
                          prompt_cache=copy.deepcopy(self.baseline), cached=len(ids) - 1)
        return r | {"prompt_time": self.baseline_prompt_time,
                    "peak_memory_gb": max(r["peak_memory_gb"] - held, self.baseline_peak)}

    def run_dflash(self, *args) -> dict:
        """:func:`_run_dflash` (its positional ``args``) from a copy of dflash's prompt cache,
        timed as if alone."""
        import copy

        held = self.held_gb()
        r = _run_dflash(*args, prompt_cache=copy.deepcopy(self.dflash))
        return r | {"prompt_time": self.dflash_prompt_time,
                    "peak_memory_gb": max(r["peak_memory_gb"] - held, self.dflash_peak)}


def _timing(tokens: list[int], tic: float, first: float, end: float) -> dict:
    decode_time = end - first
    decode_tokens = max(len(tokens) - 1, 0)
    return {"tokens": tokens, "prompt_time": first - tic, "decode_time": decode_time,
            "decode_tokens": decode_tokens,
            "decode_tps": decode_tokens / decode_time if decode_time > 0 else 0.0}



# ---------------------------------------------------------------------------------------------
# Shared by the summaries


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Where two token lists part (the shorter one's length where one extends the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _environment(pair) -> dict:
    """The pair and the machine a result was measured on (a report's ``config``)."""
    import mlx.core as mx

    from . import __version__

    try:
        import mlx_lm

        lm_version = mlx_lm.__version__
    except (ImportError, AttributeError):
        lm_version = None
    return {"model": pair.model_path, "draft": pair.draft_path,
            "device": str(mx.default_device()), "mlx": getattr(mx, "__version__", None),
            "mlx_lm": lm_version, "dflash": __version__, "platform": platform.platform(),
            "machine": platform.machine(), "python": platform.python_version()}
