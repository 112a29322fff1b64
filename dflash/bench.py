"""``dflash bench``: DFlash against mlx-lm's plain decoding of the same target, on the same tokens.

For every prompt, both run from the same prompt token ids: mlx-lm's ``stream_generate`` (the
target alone) and DFlash's ``stream_generate`` at each block size of the sweep. A warm-up comes
first, the order alternates between prompts and repeats, and both are timed the same way (wall
clock to the first token = prompt time; the rest = decode time). At temperature 0 the outputs must
be identical token for token; the report says whether they were.

With ``reuse_prefill`` (the context bench's mode) each side prefills a prompt once and every
repeat decodes from a copy of those caches: at long context a prefill takes minutes, and two
decodes minutes apart on a shared machine measure its drift (±20 % here) more than either side;
decodes seconds apart, alternating, measure the sides.

``run_bench(...)`` returns everything as a dict and, given ``out``, writes ``bench.json``,
``bench.md``, ``speedup.png`` and ``acceptance.png`` there.

``run_trace_bench(...)`` (``dflash bench --trace``) replays multi-turn agent conversations
(:mod:`dflash.traces`) turn by turn, the whole history each turn, and reports per-turn and total
end-to-end speed-ups, time to first token with and without the prefix cache, and which proposal
source won each pass.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .errors import install_hint
from .files import write_atomic
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
            raise ValueError("expected an integer or a comma-separated list like 4,8,16") \
                from None
    else:
        values = [int(v) for v in text]
    if not values:
        raise ValueError("no block size given")
    if any(v < 2 for v in values):
        raise ValueError("block sizes must be >= 2")
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
            raise ValueError(f"limit={limit}: must be >= 1")
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
# Aggregation


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _summarise_prompt(item: dict, n_prompt: int, base_runs: list[dict], runs: list[dict],
                      greedy: bool, plain_ms: Callable[[int, int], float] | None = None) -> dict:
    b_time = sum(r["decode_time"] for r in base_runs)
    b_tok = sum(r["decode_tokens"] for r in base_runs)
    d_time = sum(r["decode_time"] for r in runs)
    d_tok = sum(r["decode_tokens"] for r in runs)
    cycles = sum(r["cycles"] for r in runs)
    b_tps = b_tok / b_time if b_time > 0 else 0.0
    d_tps = d_tok / d_time if d_time > 0 else 0.0
    width = max((len(r["acceptance_by_position"]) for r in runs), default=0)
    acc = [0.0] * width
    for r in runs:
        for j, a in enumerate(r["acceptance_by_position"]):
            acc[j] += a * r["cycles"]
    acc = [a / cycles if cycles else 0.0 for a in acc]
    # The passes each side took, at the calibrated costs (None where dflash's policy has none).
    priced = plain_priced = None
    if plain_ms is not None and all(r.get("priced_ms") is not None for r in runs):
        priced = sum(r["priced_ms"] for r in runs)
        plain_priced = sum(plain_ms(n_prompt, r["decode_tokens"]) for r in runs)
    identical = None
    first_diff = None
    if greedy:
        pairs = [(b["tokens"], d["tokens"]) for b in base_runs for d in runs]
        identical = all(b == d for b, d in pairs)
        if not identical:
            first_diff = next(_first_difference(b, d) for b, d in pairs if b != d)
    return {
        "id": item["id"],
        "prompt_tokens": n_prompt,
        "generated_tokens": len(runs[-1]["tokens"]),
        "baseline": {
            "tokens_per_s": b_tps,
            "prompt_time": statistics.median(r["prompt_time"] for r in base_runs),
            "decode_time": statistics.median(r["decode_time"] for r in base_runs),
            "generated_tokens": len(base_runs[-1]["tokens"]),
            "priced_ms": plain_priced,
            "peak_memory_gb": max(r.get("peak_memory_gb", 0.0) for r in base_runs),
        },
        "dflash": {
            "tokens_per_s": d_tps,
            "prompt_time": statistics.median(r["prompt_time"] for r in runs),
            "decode_time": statistics.median(r["decode_time"] for r in runs),
            "tau": sum(r["cycle_tokens"] for r in runs) / cycles if cycles else 0.0,
            "cycles": cycles / len(runs),
            "draft_time": statistics.median(r["draft_time"] for r in runs),
            "verify_time": statistics.median(r["verify_time"] for r in runs),
            "peak_memory_gb": max(r["peak_memory_gb"] for r in runs),
            "acceptance_by_position": acc,
            "priced_ms": priced,
        },
        "speedup": d_tps / b_tps if b_tps > 0 else None,
        # Each repeat's own (its mlx-lm run against its dflash run): the spread of the above.
        "repeat_speedups": [_ratio(b["decode_time"] / max(b["decode_tokens"], 1),
                                   d["decode_time"] / max(d["decode_tokens"], 1))
                            for b, d in zip(base_runs, runs)],
        "priced_speedup": plain_priced / priced if priced else None,
        "identical": identical,
        "first_difference": first_diff,
        "_totals": {"b_time": b_time, "b_tok": b_tok, "d_time": d_time, "d_tok": d_tok,
                    "cycles": cycles, "cycle_tokens": sum(r["cycle_tokens"] for r in runs),
                    "b_prompt": sum(r["prompt_time"] for r in base_runs),
                    "d_prompt": sum(r["prompt_time"] for r in runs),
                    "draft": sum(r["draft_time"] for r in runs),
                    "verify": sum(r["verify_time"] for r in runs),
                    "verified": sum(r["verified_tokens"] for r in runs),
                    "plain": sum(r["plain_steps"] for r in runs),
                    "trees": sum(r["tree_cycles"] for r in runs),
                    "lookups": sum(r.get("lookup_cycles", 0) for r in runs),
                    "rows": sum(r["rows_per_pass"] * (r["cycles"] + r["plain_steps"])
                                for r in runs),
                    "priced": priced, "plain_priced": plain_priced},
    }


def _overall(prompts: list[dict]) -> dict:
    priced = [(p["_totals"]["plain_priced"], p["_totals"]["priced"]) for p in prompts]
    priced_speedup = None
    if all(d is not None for _, d in priced) and sum(d for _, d in priced) > 0:
        priced_speedup = sum(b for b, _ in priced) / sum(d for _, d in priced)
    t = {k: sum(p["_totals"][k] for p in prompts) for k in prompts[0]["_totals"]
         if k not in ("priced", "plain_priced")}
    b_tps = t["b_tok"] / t["b_time"] if t["b_time"] > 0 else 0.0
    d_tps = t["d_tok"] / t["d_time"] if t["d_time"] > 0 else 0.0
    width = max(len(p["dflash"]["acceptance_by_position"]) for p in prompts)
    acc, weight = [0.0] * width, 0.0
    for p in prompts:
        c = p["_totals"]["cycles"]
        weight += c
        for j, a in enumerate(p["dflash"]["acceptance_by_position"]):
            acc[j] += a * c
    speedups = [p["speedup"] for p in prompts if p["speedup"]]
    identical = [p["identical"] for p in prompts if p["identical"] is not None]
    return {
        "tau": t["cycle_tokens"] / t["cycles"] if t["cycles"] else 0.0,
        "verified_per_cycle": t["verified"] / t["cycles"] if t["cycles"] else 0.0,
        "plain_share": t["plain"] / (t["cycles"] + t["plain"]) if t["cycles"] + t["plain"] else 0.0,
        "tree_share": t["trees"] / (t["cycles"] + t["plain"]) if t["cycles"] + t["plain"] else 0.0,
        "lookup_share": (t["lookups"] / (t["cycles"] + t["plain"])
                         if t["cycles"] + t["plain"] else 0.0),
        "rows_per_pass": t["rows"] / (t["cycles"] + t["plain"]) if t["cycles"] + t["plain"] else 0.0,
        "baseline_tokens_per_s": b_tps,
        "dflash_tokens_per_s": d_tps,
        "speedup": d_tps / b_tps if b_tps > 0 else None,
        "priced_speedup": priced_speedup,
        "mean_prompt_speedup": statistics.mean(speedups) if speedups else None,
        "baseline_prompt_time": t["b_prompt"],
        "dflash_prompt_time": t["d_prompt"],
        "baseline_decode_time": t["b_time"],
        "dflash_decode_time": t["d_time"],
        "draft_time": t["draft"],
        "verify_time": t["verify"],
        "acceptance_by_position": [a / weight if weight else 0.0 for a in acc],
        "identical": all(identical) if identical else None,
    }


# ---------------------------------------------------------------------------------------------
# The benchmark


def run_bench(model: str | None = None, draft: str | None = None,
              prompts: str | Path | Sequence[dict] = "builtin",
              block_sizes: Sequence[int | None] | str | int | None = None,
              max_tokens: int = 256, repeats: int = 1, warmup: bool = True,
              temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
              seed: int = 0, chat_template: bool = True, system: str | None = None,
              template_kwargs: dict | None = None, limit: int | None = None,
              out: str | Path | None = None, log: Callable[[str], None] | None = None,
              pair=None, min_confidence: float | None = None,
              policy: str | None = None, tree_budget: int | None = None,
              lookup: bool | Sequence[bool] = True, pair_memory: str | Path | None = None,
              kv: dict | None = None, reuse_prefill: bool = False) -> dict:
    """Benchmark DFlash against mlx-lm on the same target and prompt tokens; see the module doc.

    ``pair`` (a :class:`dflash.pair.Pair`) skips loading; otherwise ``model``/``draft`` are loaded
    (the built-in pair where ``None``). The ``auto`` policy's runs share one pair memory, empty
    at the start unless ``pair_memory`` names a file (read, and saved back at the end). ``kv``:
    the target's quantized KV cache settings (``kv_bits``, ...), for both engines.
    ``reuse_prefill``: each side prefills a prompt once and its repeats decode from copies (see
    the module doc; attention-only targets with float caches, else ignored). ``lookup``: the
    context's continuations on or off, or both (``(True, False)``): one run per block size and
    setting, each with its own pair memory, all decoding from the same prefill and timed
    against the same mlx-lm decodes (``pair_memory`` is read by each; the first saves it).
    """
    say = log or (lambda _msg: None)
    if isinstance(block_sizes, (list, tuple)) and None in block_sizes:
        rest = [b for b in block_sizes if b is not None]
        block_sizes = [None, *(parse_block_sizes(rest) if rest else [])]
    else:
        block_sizes = parse_block_sizes(block_sizes)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}: must be an integer >= 1")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: must be an integer >= 1")
    source, items = load_prompts(prompts, limit)
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}
    from .sampling import SamplingConfig

    SamplingConfig(**sampling, seed=seed).validate()
    if pair is None:
        from .pair import load_pair

        pair = load_pair(model, draft, log=log)
    from . import distributed

    ranks = distributed.join()  # sharded: the policy every rank plans alike with
    policy = distributed.agreed_settings(
        ranks, {"policy": policy, "min_confidence": min_confidence, "seed": seed})["policy"]
    sizes = [b or pair.draft.block_size for b in block_sizes]
    sizes = list(dict.fromkeys(sizes))
    lookups = list(dict.fromkeys([lookup] if isinstance(lookup, bool) else lookup))
    if not lookups or not all(isinstance(x, bool) for x in lookups):
        raise ValueError(f"lookup={lookup!r}: must be True, False or a sequence of them")
    arms = [(bs, lk) for lk in lookups for bs in sizes]

    policy_used = policy or ("auto" if min_confidence is None else "confidence")
    from .prompts import encode_prompt

    encoded = [encode_prompt(pair.tokenizer, item, chat_template=chat_template, system=system,
                             **(template_kwargs or {})) for item in items]
    greedy = temperature == 0

    from .policy.memory import PairMemory

    # What the auto policy starts from: nothing, or what a stored memory says. (Sampled runs
    # here are seeded, and a seeded generation never uses the memory: the same seed must give
    # the same text.)
    rows = pair.draft.block_size - 1
    memories = {lk: PairMemory(rows) if pair_memory is None else PairMemory.open(pair_memory, rows)
                for lk in lookups}
    memory = memories[lookups[0]].source if greedy else "not used (seeded sampling)"
    say(f"pair memory: {memory}")
    if warmup:
        say("warming up ...")
        n = min(16, max_tokens)
        _run_baseline(pair, encoded[0], n, sampling, seed, kv)
        for bs, lk in arms:
            _run_dflash(pair, encoded[0], n, bs, sampling, seed, min_confidence, policy,
                        tree_budget, lk, memories[lk], kv=kv)

    base_runs: list[list[dict]] = [[] for _ in items]
    runs: dict[tuple[int, bool], list[list[dict]]] = {arm: [[] for _ in items] for arm in arms}
    total = repeats * len(items) * (1 + len(arms))
    done = 0
    tic = time.perf_counter()
    reuse_prefill = reuse_prefill and Prefilled.possible(pair, kv)
    # Prompts outer with reused prefills (each prompt's caches live through its repeats only),
    # repeats outer otherwise.
    schedule = ([(rep, i) for i in range(len(items)) for rep in range(repeats)] if reuse_prefill
                else [(rep, i) for rep in range(repeats) for i in range(len(items))])
    prefilled = None
    for rep, i in schedule:
        item, ids = items[i], encoded[i]
        if reuse_prefill and rep == 0:
            prefilled = None  # the previous prompt's caches go first
            say(f"{item['id']}: prefilling {len(ids)} tokens on each side ...")
            prefilled = Prefilled(pair, ids, sampling, seed)
        # None: the baseline. Rotated from one decode round to the next, so that every side
        # takes every place in the round equally often (the first after a prefill runs slower
        # here; a side always in the middle would be measured apart from the others).
        order: list[tuple[int, bool] | None] = [None, *arms]
        turn = (rep + i) % len(order)
        order = order[turn:] + order[:turn]
        for which in order:
            done += 1
            if which is None:
                r = (_run_baseline(pair, ids, max_tokens, sampling, seed, kv) if prefilled is None
                     else prefilled.run_baseline(pair, ids, max_tokens, sampling, seed))
                base_runs[i].append(r)
                what = f"mlx-lm: {len(r['tokens'])} tokens, {r['decode_tps']:.1f} tok/s"
            else:
                bs, lk = which
                args = (pair, ids, max_tokens, bs, sampling, seed, min_confidence, policy,
                        tree_budget, lk, memories[lk])
                r = _run_dflash(*args, kv=kv) if prefilled is None else prefilled.run_dflash(*args)
                runs[which][i].append(r)
                arm = "" if len(lookups) == 1 else f", continuations {'on' if lk else 'off'}"
                what = (f"dflash block {bs}{arm}: {len(r['tokens'])} tokens, "
                        f"{r['decode_tps']:.1f} tok/s, τ {r['mean_tau']:.2f}")
            say(f"[{done}/{total}] {item['id']} (repeat {rep + 1}/{repeats}) {what}")
    prefilled = None
    elapsed = time.perf_counter() - tic
    memories[lookups[0]].save()
    from .policy import policy_class

    plain_ms = _plain_pricer(pair) if policy_class(policy_used).needs_cost else None

    result_runs = []
    for bs, lk in arms:
        per_prompt = []
        for i, item in enumerate(items):
            p = _summarise_prompt(item, len(encoded[i]), base_runs[i], runs[bs, lk][i], greedy,
                                  plain_ms)
            p["text"] = pair.tokenizer.decode(runs[bs, lk][i][-1]["tokens"])
            per_prompt.append(p)
        overall = _overall(per_prompt)
        for p in per_prompt:
            p.pop("_totals")
        result_runs.append({"block_size": bs, "lookup": lk, "prompts": per_prompt,
                            "overall": overall})
    identical = [r["overall"]["identical"] for r in result_runs]
    from .cost_model import cost_model
    from .cost_model import report as cost_report
    from .target import KVQuantization, target_parts

    # The costs a kv_bits run priced with are the quantized cache's (keyed by its settings).
    priced_kv = KVQuantization.from_settings(**kv) if kv else None
    pass_costs = cost_report(cost_model(target_parts(pair.model), pair.draft, priced_kv))
    say(pass_costs["describe"])
    result = {
        "config": _environment(pair) | {
            "prompts": source, "n_prompts": len(items), "max_tokens": max_tokens,
            "repeats": repeats, "warmup": warmup, "temperature": temperature, "top_p": top_p,
            "top_k": top_k, "min_p": min_p, "seed": seed, "chat_template": chat_template,
            "block_sizes": sizes, "policy": policy_used, "min_confidence": min_confidence,
            "tree_budget": tree_budget, "lookup": lookups[0] if len(lookups) == 1 else lookups,
            "pair_memory": memory, "kv": kv or None,
            "elapsed_s": elapsed, "ranks": ranks.size, "reuse_prefill": reuse_prefill,
            "split": distributed.split_name(pair.model) if ranks.distributed else None},
        "runs": result_runs,
        "identical": all(identical) if greedy else None,
        "pass_costs": pass_costs,  # what the policy priced with; learnt against calibrated
    }
    best = max(result_runs, key=lambda r: r["overall"]["speedup"] or 0.0)
    result["best"] = {"block_size": best["block_size"], **{
        k: best["overall"][k] for k in ("tau", "speedup", "baseline_tokens_per_s",
                                        "dflash_tokens_per_s")}}
    if greedy and not result["identical"]:
        bad = [f"{p['id']} ({_arm(r)}, token {p['first_difference']})"
               for r in result_runs for p in r["prompts"] if p["identical"] is False]
        say("WARNING: greedy outputs differ from mlx-lm's on " + ", ".join(bad))
    if out is not None and ranks.is_main:
        write_outputs(result, out, log=say)
    return result


def _plain_pricer(pair) -> Callable[[int, int], float]:
    """``(prompt tokens, tokens) -> ms`` of plain decoding at the calibrated costs (mlx-lm's
    pipelined one-token steps), the yardstick of the priced speed-up."""
    from .cost_model import cost_model
    from .target import target_parts

    cost = cost_model(target_parts(pair.model), pair.draft)
    return lambda n_prompt, n: sum(cost.step(n_prompt + i) for i in range(n))


def _environment(pair) -> dict:
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


# ---------------------------------------------------------------------------------------------
# Reports


def _f(x, digits=2, suffix="") -> str:
    return "n/a" if x is None else f"{x:.{digits}f}{suffix}"


def _same(x) -> str:
    return "n/a" if x is None else ("yes" if x else "**no**")


def _policy_text(cfg: dict) -> str:
    from .policy import policy_class

    return policy_class(cfg.get("policy", "confidence")).describe(cfg)


def shown_path(path: str) -> str:
    """``path`` as a report shows it: inside the package as ``dflash/...``, inside the cache as
    ``$DFLASH_HOME/...`` (reports are committed and read on other machines), else as given."""
    from .default_pair import cache_dir

    resolved = Path(path).expanduser().resolve()
    for base, name in ((Path(__file__).parent, "dflash"), (cache_dir(), "$DFLASH_HOME")):
        base = base.expanduser().resolve()
        if resolved == base or base in resolved.parents:
            return str(Path(name) / resolved.relative_to(base))
    return str(path)


def markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        "# dflash bench",
        "",
        f"- target: `{shown_path(cfg['model'])}`",
        f"- drafter: `{shown_path(cfg['draft'])}`",
        f"- prompts: {cfg['prompts']} ({cfg['n_prompts']}), max tokens {cfg['max_tokens']}, "
        f"temperature {cfg['temperature']}, repeats {cfg['repeats']}"
        f"{', after a warm-up' if cfg['warmup'] else ''}",
        f"- verify policy: {_policy_text(cfg)}",
        f"- device: {cfg['device']} · {cfg['platform']} · mlx {cfg['mlx']} · "
        f"mlx-lm {cfg['mlx_lm']} · dflash {cfg['dflash']}",
        "- tokens/s are decode speeds (after the first token), same prompt token ids for both",
        "",
    ]
    if len(result["runs"]) > 1:
        lines += ["## Block size sweep", "",
                  "| block size | τ | mlx-lm tok/s | dflash tok/s | speed-up | identical |",
                  "|---:|---:|---:|---:|---:|:---:|"]
        for r in result["runs"]:
            o = r["overall"]
            lines.append(f"| {_arm(r)[len('block '):]} | {_f(o['tau'])} | "
                         f"{_f(o['baseline_tokens_per_s'], 1)} | {_f(o['dflash_tokens_per_s'], 1)} | "
                         f"{_f(o['speedup'], 2, '×')} | {_same(o['identical'])} |")
        lines.append("")
    for r in result["runs"]:
        o = r["overall"]
        lines += [f"## Block size {_arm(r)[len('block '):]}", "",
                  "| prompt | prompt tokens | tokens | mlx-lm tok/s | dflash tok/s | speed-up | τ "
                  "| prompt time mlx-lm / dflash (s) | identical |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|:---:|"]
        for p in r["prompts"]:
            lines.append(
                f"| {p['id']} | {p['prompt_tokens']} | {p['generated_tokens']} | "
                f"{_f(p['baseline']['tokens_per_s'], 1)} | {_f(p['dflash']['tokens_per_s'], 1)} | "
                f"{_f(p['speedup'], 2, '×')} | {_f(p['dflash']['tau'])} | "
                f"{_f(p['baseline']['prompt_time'], 3)} / {_f(p['dflash']['prompt_time'], 3)} | "
                f"{_same(p['identical'])} |")
        lines.append(
            f"| **all** | | | **{_f(o['baseline_tokens_per_s'], 1)}** | "
            f"**{_f(o['dflash_tokens_per_s'], 1)}** | **{_f(o['speedup'], 2, '×')}** | "
            f"**{_f(o['tau'])}** | {_f(o['baseline_prompt_time'], 3)} / "
            f"{_f(o['dflash_prompt_time'], 3)} | {_same(o['identical'])} |")
        busy = o["draft_time"] + o["verify_time"]
        share = f" ({100 * o['draft_time'] / busy:.0f}% drafting)" if busy > 0 else ""
        acc = " · ".join(f"{j + 1}: {a:.2f}" for j, a in enumerate(o["acceptance_by_position"]))
        if o.get("priced_speedup"):
            lines += ["", f"Priced speed-up {o['priced_speedup']:.2f}× (the passes each side "
                      "took, at this machine's calibrated costs: does not depend on what else "
                      "ran)."]
        lines += ["", f"Draft {o['draft_time']:.2f} s / verify {o['verify_time']:.2f} s{share}; "
                      f"{o.get('verified_per_cycle', 0.0):.1f} drafted tokens verified per cycle; "
                      f"{o.get('rows_per_pass', 0.0):.1f} target rows per pass; "
                      f"{100 * o.get('plain_share', 0.0):.0f}% plain steps (no drafting), "
                      f"{100 * o.get('tree_share', 0.0):.0f}% draft trees, "
                      f"{100 * o.get('lookup_share', 0.0):.0f}% context continuations (no "
                      "drafting).",
                  "", f"Acceptance by block position: {acc}", ""]
    return "\n".join(lines) + "\n"


def _arm(run: dict) -> str:
    """A run's name: ``block 16``, or ``block 16, continuations off``."""
    return f"block {run['block_size']}" + ("" if run.get("lookup", True) else
                                            ", continuations off")


def format_summary(result: dict) -> str:
    """A few lines for the terminal."""
    out = []
    if result["config"].get("ranks", 1) > 1:
        split = result["config"].get("split") or "tensor-parallel"
        out.append(f"target sharded {split} over {result['config']['ranks']} ranks; "
                   "mlx-lm: its own sharded generation in the same launch")
    for r in result["runs"]:
        o = r["overall"]
        priced = f" (priced {o['priced_speedup']:.2f}×)" if o.get("priced_speedup") else ""
        out.append(f"{_arm(r)}: τ {_f(o['tau'])}, mlx-lm "
                   f"{_f(o['baseline_tokens_per_s'], 1)} tok/s, dflash "
                   f"{_f(o['dflash_tokens_per_s'], 1)} tok/s, speed-up {_f(o['speedup'], 2, '×')}"
                   f"{priced}, {o.get('rows_per_pass', 0.0):.1f} rows/pass, "
                   f"{100 * o.get('plain_share', 0.0):.0f}% plain steps, "
                   f"{100 * o.get('tree_share', 0.0):.0f}% trees, "
                   f"{100 * o.get('lookup_share', 0.0):.0f}% lookups"
                   f", identical at T=0: {_same(o['identical']).strip('*')}")
        if o.get("baseline_prompt_time") and o.get("dflash_prompt_time"):
            out.append(f"  first token (models loaded): mlx-lm {o['baseline_prompt_time']:.3f} s, "
                       f"dflash {o['dflash_prompt_time']:.3f} s "
                       f"({o['dflash_prompt_time'] / o['baseline_prompt_time']:.2f}x), "
                       "summed over prompts and repeats")
    if result.get("pass_costs"):
        out.append(result["pass_costs"]["describe"])
    return "\n".join(out)


def write_outputs(result: dict, out: str | Path, log: Callable[[str], None] | None = None) -> dict:
    """Write ``bench.json``, ``bench.md`` and the PNG plots into ``out``; return their paths."""
    say = log or (lambda _msg: None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "bench.json", "markdown": out / "bench.md"}
    files["json"].write_text(json.dumps(result, indent=2, ensure_ascii=False))
    files["markdown"].write_text(markdown(result))
    try:
        files.update(plot(result, out))
    except ImportError:
        say(f"matplotlib is not installed: no plots ({install_hint('bench')})")
    say("wrote " + ", ".join(str(p) for p in files.values()))
    return files


def plot(result: dict, out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    runs = result["runs"]
    ids = [p["id"] for p in runs[0]["prompts"]]
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(ids) + 2), 4))
    for k, r in enumerate(runs):
        xs = [i + (k - (len(runs) - 1) / 2) * width for i in range(len(ids))]
        ax.bar(xs, [p["speedup"] or 0.0 for p in r["prompts"]], width,
               label=f"{_arm(r)} (all: {_f(r['overall']['speedup'], 2, '×')})")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(ids)))
    ax.set_xticklabels(ids, rotation=30, ha="right")
    ax.set_ylabel("speed-up over mlx-lm (decode tok/s)")
    ax.set_title("dflash speed-up per prompt")
    ax.legend()
    fig.tight_layout()
    paths["speedup_png"] = out / "speedup.png"
    fig.savefig(paths["speedup_png"], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        acc = r["overall"]["acceptance_by_position"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o",
                label=f"{_arm(r)} (τ {_f(r['overall']['tau'])})")
    ax.set_xlabel("draft position in the block")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance by block position")
    ax.legend()
    fig.tight_layout()
    paths["acceptance_png"] = out / "acceptance.png"
    fig.savefig(paths["acceptance_png"], dpi=120)
    plt.close(fig)
    return paths


# ---------------------------------------------------------------------------------------------
# ``dflash bench --concurrency N``: the batched engine against mlx-lm's batching


def _closed_loop(insert: Callable, step: Callable, prompts: list[list[int]],
                 clients: int) -> dict:
    """``clients`` clients, each sending its next prompt when its answer is complete.

    ``insert(ids) -> uid``; ``step() -> [(uid, new tokens, finished, stats)]``. Per request: its
    tokens and its time to first token (from its insertion); overall: generated tokens / wall.
    """
    queue = list(range(len(prompts)))
    index: dict = {}
    sent: dict = {}
    first: dict = {}
    tokens: dict = {}
    stats: dict = {}
    tic, cpu = time.perf_counter(), time.process_time()
    while queue or index:
        while queue and len(index) - len(stats) < clients:
            i = queue.pop(0)
            uid = insert(prompts[i])
            index[uid], sent[uid], tokens[uid] = i, time.perf_counter(), []
        for uid, new, finished, st in step():
            if new and uid not in first:
                first[uid] = time.perf_counter()
            tokens[uid] += new
            if finished:
                stats[uid] = st
        if len(stats) == len(index) and not queue:
            break
    wall, cpu = time.perf_counter() - tic, time.process_time() - cpu
    by_prompt = {index[u]: u for u in index}
    ordered = [by_prompt[i] for i in range(len(prompts))]
    ttft = sorted(first[u] - sent[u] for u in ordered if u in first)
    generated = sum(len(tokens[u]) for u in ordered)
    return {"tokens": [tokens[u] for u in ordered], "stats": [stats[u] for u in ordered],
            "wall_s": wall, "cpu_s": cpu, "generated": generated,
            "tokens_per_s": generated / wall if wall > 0 else 0.0,
            # On a shared machine, wall time follows the other tenants' load; the process's own
            # CPU time much less so.
            "tokens_per_cpu_s": generated / cpu if cpu > 0 else 0.0,
            "ttft_p50": _percentile(ttft, 50), "ttft_p95": _percentile(ttft, 95)}


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _ours(pair, prompts: list[list[int]], clients: int, max_tokens: int, policy: str,
          max_batch: int | None = None, memory=None) -> dict:
    from .batch import BatchGenerator

    engine = BatchGenerator(pair.model, pair.draft, pair.tokenizer,
                            max_batch=max_batch or clients, policy=policy, memory=memory)

    def step():
        return [(e.uid, e.tokens, e.finish_reason is not None, e.stats) for e in engine.step()]

    out = _closed_loop(lambda ids: engine.insert(ids, max_tokens=max_tokens), step, prompts,
                       clients)
    cycles = sum(s.cycles for s in out["stats"])
    out["tau"] = (sum(s.mean_tau * s.cycles for s in out["stats"]) / cycles) if cycles else None
    plain = sum(s.plain_steps for s in out["stats"])
    out["speculative_share"] = cycles / (cycles + plain) if cycles + plain else 0.0
    out.pop("stats")
    return out


def _mlx_lm(pair, prompts: list[list[int]], clients: int, max_tokens: int) -> dict:
    """mlx-lm's continuous batching (``mlx_lm.generate.BatchGenerator``), greedy."""
    from mlx_lm.generate import BatchGenerator as LMBatchGenerator

    gen = LMBatchGenerator(pair.model, max_tokens=max_tokens,
                           stop_tokens=[[t] for t in pair.tokenizer.eos_token_ids],
                           completion_batch_size=clients, prefill_batch_size=clients)

    def step():
        _, responses = gen.next()
        return [(r.uid, [] if r.finish_reason == "stop" else [int(r.token)],
                 r.finish_reason is not None, None) for r in responses]

    try:
        out = _closed_loop(lambda ids: gen.insert([ids], [max_tokens])[0], step, prompts,
                           clients)
    finally:
        gen.close()
    out.pop("stats")
    return out


def _single(pair, prompts: list[list[int]], max_tokens: int, policy: str, memory=None) -> dict:
    """The single-sequence engine, one prompt after another (the one-client reference)."""
    from .speculative import stream_generate

    def insert(ids):
        insert.streams.append(stream_generate(pair.model, pair.draft, pair.tokenizer, ids,
                                              max_tokens=max_tokens, policy=policy,
                                              memory=memory))
        return len(insert.streams) - 1

    insert.streams = []

    def step():
        uid = len(insert.streams) - 1
        r = next(insert.streams[uid])
        return [(uid, r.tokens, r.finish_reason is not None, r)]

    out = _closed_loop(insert, step, prompts, 1)
    out.pop("stats")
    return out


def run_concurrency_bench(model: str | None = None, draft: str | None = None,
                          prompts: str | Path | Sequence[dict] = "builtin",
                          concurrency: int = 4, max_tokens: int = 96, limit: int | None = None,
                          chat_template: bool = True, system: str | None = None,
                          template_kwargs: dict | None = None, policy: str | None = None,
                          warmup: bool = True, log: Callable[[str], None] | None = None,
                          pair=None, max_batch: int | None = None) -> dict:
    """Greedy answers to every prompt, ``concurrency`` clients at a time, through the batched
    engine (:mod:`dflash.batch`) and through mlx-lm's batching on the same target, in this
    process; with one client also through the single-sequence engine.

    ``max_batch``: the batched engine's (default ``concurrency``). One client with
    ``max_batch > 1`` is what a server with room for more sees when one user is on it (with
    ``max_batch=1`` the batched engine is the single-sequence engine by construction)."""
    say = log or (lambda _msg: None)
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency={concurrency!r}: must be an integer >= 1")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}: must be an integer >= 1")
    max_batch = concurrency if max_batch is None else max_batch
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch={max_batch!r}: must be an integer >= 1")
    source, items = load_prompts(prompts, limit)
    if pair is None:
        from .pair import load_pair

        pair = load_pair(model, draft, log=log)
    from .prompts import encode_prompt

    encoded = [encode_prompt(pair.tokenizer, item, chat_template=chat_template, system=system,
                             **(template_kwargs or {})) for item in items]
    policy = policy or "auto"
    from .policy.memory import PairMemory

    memory = PairMemory(pair.draft.block_size - 1)  # the run's own: nothing earlier runs taught
    if warmup:
        say("warming up ...")
        _ours(pair, encoded[:concurrency], concurrency, 8, policy, max_batch, memory)
        _mlx_lm(pair, encoded[:concurrency], concurrency, 8)
    say(f"dflash batched engine, {concurrency} at a time ...")
    ours = _ours(pair, encoded, concurrency, max_tokens, policy, max_batch, memory)
    say(f"mlx-lm batching, {concurrency} at a time ...")
    theirs = _mlx_lm(pair, encoded, concurrency, max_tokens)
    result = {"config": _environment(pair) | {"prompts": source, "n_prompts": len(items),
                                              "concurrency": concurrency,
                                              "max_batch": max_batch,
                                              "max_tokens": max_tokens, "policy": policy},
              "dflash": ours, "mlx_lm": theirs,
              "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"]
              if theirs["tokens_per_s"] else None,
              "cpu_ratio": ours["tokens_per_cpu_s"] / theirs["tokens_per_cpu_s"]
              if theirs["tokens_per_cpu_s"] else None}
    if concurrency == 1:
        say("single-sequence engine, one at a time ...")
        single = _single(pair, encoded, max_tokens, policy, memory)
        result["single"] = single
        result["batched_vs_single"] = ours["tokens_per_s"] / single["tokens_per_s"] \
            if single["tokens_per_s"] else None
        result["batched_vs_single_cpu"] = ours["tokens_per_cpu_s"] / single["tokens_per_cpu_s"] \
            if single["tokens_per_cpu_s"] else None
    diffs = [item["id"] for item, a, b in zip(items, ours["tokens"], theirs["tokens"]) if a != b]
    result["identical"] = not diffs
    result["differing"] = diffs
    if diffs:
        say("greedy outputs differ from mlx-lm's batching on " + ", ".join(diffs))
    return result


def format_concurrency(result: dict) -> str:
    cfg, ours, theirs = result["config"], result["dflash"], result["mlx_lm"]
    lines = [f"{cfg['n_prompts']} prompts ({cfg['prompts']}), {cfg['concurrency']} at a time "
             f"(max_batch {cfg.get('max_batch', cfg['concurrency'])}), "
             f"{cfg['max_tokens']} tokens, greedy, policy {cfg['policy']}",
             f"{'':24}{'tokens/s':>10}{'tok/CPU-s':>10}{'TTFT p50':>10}{'TTFT p95':>10}"]
    rows = [("dflash batched", ours), ("mlx-lm batching", theirs)]
    if "single" in result:
        rows.append(("dflash single-sequence", result["single"]))
    for name, r in rows:
        lines.append(f"{name:24}{r['tokens_per_s']:>10.1f}{r['tokens_per_cpu_s']:>10.1f}"
                     f"{_f(r['ttft_p50'], 2, ' s'):>10}{_f(r['ttft_p95'], 2, ' s'):>10}")
    lines.append(f"ratio dflash / mlx-lm: {_f(result['ratio'])}x (per CPU-second: "
                 f"{_f(result['cpu_ratio'])}x) · τ {_f(ours['tau'])} · "
                 f"speculative cycles {ours['speculative_share']:.0%} of passes · identical "
                 f"greedy outputs: {'yes' if result['identical'] else 'no'}")
    if "batched_vs_single" in result:
        lines.append(f"batched / single-sequence engine: {_f(result['batched_vs_single'], 3)}x "
                     f"(per CPU-second: {_f(result['batched_vs_single_cpu'], 3)}x)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# ``dflash bench --trace FILE``: agent conversations replayed turn by turn (dflash.traces)

SOURCES = ("chain", "tree", "context", "index", "plain")  # what a pass verified
SIDE_NAMES = {"mlx_lm": "mlx-lm", "dflash": "dflash",
              "dflash_prompt_cache": "dflash with the prefix cache"}


def _passes(r: dict) -> dict[str, int | None]:
    """One dflash generation's passes by what they verified: the drafter's chain or tree, the
    sequence's own continuation, the cross-request index's, or a plain step (``index`` is
    ``None`` where the engine does not count it apart)."""
    lookups, index = r.get("lookup_cycles", 0), r.get("index_cycles")
    return {"chain": r["cycles"] - r["tree_cycles"] - lookups, "tree": r["tree_cycles"],
            "context": lookups - (index or 0), "index": index, "plain": r["plain_steps"]}


def _shares(passes: dict[str, int | None]) -> dict[str, float | None]:
    total = sum(v for v in passes.values() if v is not None)
    return {k: None if v is None else (v / total if total else 0.0) for k, v in passes.items()}


def _add_passes(a: dict, b: dict) -> dict:
    return {k: None if a[k] is None or b[k] is None else a[k] + b[k] for k in SOURCES}


def _side(runs: list[dict]) -> dict:
    """One side of a turn, per run (the mean over the repeats): time to first token, decode,
    end to end."""
    n = len(runs)
    ttft = sum(r["prompt_time"] for r in runs) / n
    decode = sum(r["decode_time"] for r in runs) / n
    tokens = sum(r["decode_tokens"] for r in runs) / n
    return {"ttft_s": ttft, "decode_s": decode, "total_s": ttft + decode,
            "decode_tokens": tokens, "decode_tokens_per_s": tokens / decode if decode > 0 else 0.0}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _trace_row(conversation: str, k: int, turn, n_prompt: int, base: list[dict],
               scratch: list[dict], cached: list[dict], text: str) -> dict:
    passes = {k_: 0 for k_ in SOURCES}
    for r in scratch:
        passes = _add_passes(passes, _passes(r))
    cycles = sum(r["cycles"] for r in scratch)
    differ = {}
    for name, runs in (("dflash", scratch), ("dflash_prompt_cache", cached)):
        diffs = [_first_difference(b["tokens"], d["tokens"]) for b, d in zip(base, runs)
                 if b["tokens"] != d["tokens"]]
        differ[name] = diffs[0] if diffs else None
    b, d, c = _side(base), _side(scratch), _side(cached)
    d.update(tau=sum(r["cycle_tokens"] for r in scratch) / cycles if cycles else 0.0,
             passes=passes, shares=_shares(passes))
    c["reused_prompt_tokens"] = cached[-1]["reused_prompt_tokens"]
    return {"conversation": conversation, "turn": k + 1, "retry": turn.retry,
            "prompt_tokens": n_prompt, "max_tokens": turn.max_tokens,
            "generated_tokens": len(base[-1]["tokens"]),
            "mlx_lm": b, "dflash": d, "dflash_prompt_cache": c,
            "speedup": _ratio(b["total_s"], d["total_s"]),
            "decode_speedup": _ratio(d["decode_tokens_per_s"], b["decode_tokens_per_s"]),
            "prompt_cache_speedup": _ratio(b["total_s"], c["total_s"]),
            "identical": all(v is None for v in differ.values()),
            "first_difference": differ, "text": text}


def _trace_totals(rows: list[dict]) -> dict | None:
    """Sums over ``rows`` (per run): end-to-end and decode speed-ups, first-token times both
    ways, and the share of passes each source won."""
    if not rows:
        return None
    sums = {side: {k: sum(r[side][k] for r in rows) for k in ("ttft_s", "decode_s", "total_s",
                                                               "decode_tokens")}
            for side in ("mlx_lm", "dflash", "dflash_prompt_cache")}
    for s in sums.values():
        s["decode_tokens_per_s"] = s["decode_tokens"] / s["decode_s"] if s["decode_s"] else 0.0
    passes = {k: 0 for k in SOURCES}
    for r in rows:
        passes = _add_passes(passes, r["dflash"]["passes"])
    b, d, c = sums["mlx_lm"], sums["dflash"], sums["dflash_prompt_cache"]
    return {"turns": len(rows), "generated_tokens": sum(r["generated_tokens"] for r in rows),
            **sums, "speedup": _ratio(b["total_s"], d["total_s"]),
            "decode_speedup": _ratio(d["decode_tokens_per_s"], b["decode_tokens_per_s"]),
            "prompt_cache_speedup": _ratio(b["total_s"], c["total_s"]),
            "ttft_prompt_cache_speedup": _ratio(d["ttft_s"], c["ttft_s"]),
            "passes": passes, "shares": _shares(passes),
            "identical": all(r["identical"] for r in rows)}


def run_trace_bench(trace, model: str | None = None, draft: str | None = None, *,
                    repeats: int = 1, warmup: bool = True, index: bool = True,
                    lookup: bool = True, block_size: int | None = None,
                    policy: str | None = None, tree_budget: int | None = None,
                    min_confidence: float | None = None, limit: int | None = None,
                    chat_template: bool = True, template_kwargs: dict | None = None,
                    out: str | Path | None = None, log: Callable[[str], None] | None = None,
                    pair=None) -> dict:
    """Replay the conversations of ``trace`` (a file, a shipped trace's name such as ``agent``,
    or conversation dicts: :mod:`dflash.traces`) as an agent sends them, greedy, and time each
    turn through mlx-lm and dflash.

    Every turn sends the whole history (the assistant turns: the target's own earlier answers);
    a retry turn sends the previous request again. Each turn runs three times: mlx-lm's
    ``stream_generate`` and dflash, both from scratch (the end-to-end figures), and dflash with a
    :class:`~dflash.prompt_cache.PromptCache` carried across the turns of the conversation (time
    to first token with the prefix cache). Each repeat is a run: both dflash sides start from an
    empty :class:`~dflash.lookup.ContinuationIndex` (``index=False``: none) and an empty pair
    memory, their own, shared by all turns of all conversations of the run in order, so a turn
    uses only earlier turns of the same run. Outputs must be identical token for token; the
    result says where they were not.
    """
    say = log or (lambda _msg: None)
    from .traces import Replay, load_trace

    source, conversations = load_trace(trace, limit)  # bad input fails before a model loads
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: must be an integer >= 1")
    if block_size is not None:
        parse_block_sizes(block_size)
    if pair is None:
        from .pair import load_pair

        pair = load_pair(model, draft, log=log)
    from .lookup import ContinuationIndex
    from .policy.memory import PairMemory
    from .prompt_cache import PromptCache
    from .prompts import encode_prompt

    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    rows_per_block = pair.draft.block_size - 1
    positions = pair.max_context  # RoPE scaling counted

    def dflash(ids, max_tokens, memory, index_=None, cache=None):
        return _run_dflash(pair, ids, max_tokens, block_size, sampling, 0, min_confidence, policy,
                           tree_budget, lookup, memory, index=index_, prompt_cache=cache)

    def encode(messages):
        return encode_prompt(pair.tokenizer, {"messages": messages}, chat_template=chat_template,
                             **(template_kwargs or {}))

    if warmup:  # its own memory and no index: the runs start from nothing
        say("warming up ...")
        first = conversations[0]
        ids = encode(Replay(first).request(first.turns[0]))
        _run_baseline(pair, ids, 16, sampling, 0)
        dflash(ids, 16, PairMemory(rows_per_block))

    sides = ("mlx_lm", "dflash", "dflash_prompt_cache")
    runs: dict[tuple[int, int], dict] = {}
    total = repeats * sum(len(c.turns) for c in conversations) * len(sides)
    done, step = 0, 0
    tic = time.perf_counter()
    for rep in range(repeats):
        indexes = {s: ContinuationIndex() if index else None for s in sides[1:]}
        memories = {s: PairMemory(rows_per_block) for s in sides[1:]}
        for ci, conv in enumerate(conversations):
            replay, cache = Replay(conv), PromptCache()
            for k, turn in enumerate(conv.turns):
                ids = encode(replay.request(turn))
                if positions and len(ids) + turn.max_tokens > positions:
                    say(f"WARNING: {conv.id} turn {k + 1}: {len(ids)} prompt tokens + "
                        f"{turn.max_tokens} exceed the target's {positions} positions")
                got = runs.setdefault((ci, k), {"n_prompt": len(ids), **{s: [] for s in sides}})
                order = list(sides) if step % 2 == 0 else list(reversed(sides))
                step += 1
                for side in order:
                    done += 1
                    if side == "mlx_lm":
                        r = _run_baseline(pair, ids, turn.max_tokens, sampling, 0)
                    else:
                        r = dflash(ids, turn.max_tokens, memories[side], indexes[side],
                                   cache if side == "dflash_prompt_cache" else None)
                    got[side].append(r)
                    more = "" if side == "mlx_lm" else (
                        f", τ {r['mean_tau']:.2f}, {r['lookup_cycles']} continuations"
                        + (f", {r['reused_prompt_tokens']} prompt tokens cached"
                           if side == "dflash_prompt_cache" else ""))
                    say(f"[{done}/{total}] {conv.id} turn {k + 1}"
                        f"{' (retry)' if turn.retry else ''} (repeat {rep + 1}/{repeats}) "
                        f"{SIDE_NAMES[side]}: {len(r['tokens'])} tokens, first token "
                        f"{r['prompt_time']:.3f} s, {r['decode_tps']:.1f} tok/s{more}")
                got["text"] = pair.tokenizer.decode(got["mlx_lm"][-1]["tokens"])
                replay.answered(turn, got["text"])  # the target's own answer
    elapsed = time.perf_counter() - tic

    rows = [_trace_row(conv.id, k, turn, runs[ci, k]["n_prompt"], runs[ci, k]["mlx_lm"],
                       runs[ci, k]["dflash"], runs[ci, k]["dflash_prompt_cache"],
                       runs[ci, k]["text"])
            for ci, conv in enumerate(conversations) for k, turn in enumerate(conv.turns)]
    from .cost_model import cost_model
    from .cost_model import report as cost_report
    from .policy import policy_class
    from .target import target_parts

    policy_used = policy or ("auto" if min_confidence is None else "confidence")
    result = {
        "mode": "trace",
        "config": _environment(pair) | {
            "trace": source, "conversations": [c.id for c in conversations],
            "turns": len(rows), "repeats": repeats, "warmup": warmup, "temperature": 0.0,
            "chat_template": chat_template,
            "block_size": block_size or pair.draft.block_size, "policy": policy_used,
            "min_confidence": min_confidence, "tree_budget": tree_budget, "lookup": lookup,
            "index": index, "pair_memory": "fresh", "elapsed_s": elapsed},
        "turns": rows,
        "conversations": [{"id": c.id, **_trace_totals([r for r in rows
                                                        if r["conversation"] == c.id])}
                          for c in conversations],
        "first_sends": _trace_totals([r for r in rows if not r["retry"]]),
        "retries": _trace_totals([r for r in rows if r["retry"]]),
        "overall": _trace_totals(rows),
    }
    result["identical"] = result["overall"]["identical"]
    result["differing"] = [f"{r['conversation']} turn {r['turn']} ({name}, token {i})"
                           for r in rows for name, i in r["first_difference"].items()
                           if i is not None]
    if policy_class(policy_used).needs_cost:
        result["pass_costs"] = cost_report(cost_model(target_parts(pair.model), pair.draft))
    if result["differing"]:
        say("WARNING: greedy outputs differ from mlx-lm's on " + ", ".join(result["differing"]))
    if out is not None:
        write_trace_outputs(result, out, log=say)
    return result


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _shares_text(shares: dict) -> str:
    names = {"chain": "drafter chains", "tree": "drafter trees", "context": "own continuation",
             "index": "cross-request index", "plain": "plain steps"}
    return ", ".join(f"{names[k]} {_pct(shares[k])}" for k in SOURCES)


def format_trace_summary(result: dict) -> str:
    """The per-turn table and the totals, for the terminal."""
    cfg = result["config"]
    lines = [f"{len(cfg['conversations'])} conversations, {cfg['turns']} turns ({cfg['trace']}), "
             f"greedy, block {cfg['block_size']}, policy {cfg['policy']}, cross-request index "
             f"{'on' if cfg['index'] else 'off'}, {cfg['repeats']} repeat(s)",
             f"{'turn':<18}{'prompt':>7}{'tokens':>7}{'speed-up':>9}{'decode':>8}"
             f"{'TTFT mlx-lm':>12}{'dflash':>8}{'cached':>8}{'τ':>6}  identical"]
    for r in result["turns"]:
        name = f"{r['conversation']} {r['turn']}{' retry' if r['retry'] else ''}"
        lines.append(f"{name:<18}{r['prompt_tokens']:>7}{r['generated_tokens']:>7}"
                     f"{_f(r['speedup'], 2, '×'):>9}{_f(r['decode_speedup'], 2, '×'):>8}"
                     f"{r['mlx_lm']['ttft_s']:>11.3f}s{r['dflash']['ttft_s']:>7.3f}s"
                     f"{r['dflash_prompt_cache']['ttft_s']:>7.3f}s{r['dflash']['tau']:>6.2f}"
                     f"  {'yes' if r['identical'] else 'NO'}")
    for label, key in (("all turns", "overall"), ("first sends", "first_sends"),
                       ("retries", "retries")):
        t = result.get(key)
        if t is None:
            continue
        lines.append(f"{label}: end to end {_f(t['speedup'], 2, '×')} mlx-lm (prompt "
                     f"processing counted on both sides), decode {_f(t['decode_speedup'], 2, '×')}"
                     f"; first token {t['mlx_lm']['ttft_s']:.2f} s mlx-lm, "
                     f"{t['dflash']['ttft_s']:.2f} s dflash, "
                     f"{t['dflash_prompt_cache']['ttft_s']:.2f} s with the prefix cache")
    lines.append("passes won: " + _shares_text(result["overall"]["shares"]))
    lines.append("identical greedy outputs: " + ("yes" if result["identical"] else
                                                 "NO: " + ", ".join(result["differing"])))
    return "\n".join(lines)


def trace_markdown(result: dict) -> str:
    cfg = result["config"]
    lines = ["# dflash bench --trace", "",
             f"- target: `{shown_path(cfg['model'])}`",
             f"- drafter: `{shown_path(cfg['draft'])}`",
             f"- trace: {cfg['trace']} ({', '.join(cfg['conversations'])}), {cfg['turns']} turns, "
             f"greedy, repeats {cfg['repeats']}{', after a warm-up' if cfg['warmup'] else ''}",
             f"- verify policy: {_policy_text(cfg)}; cross-request index "
             f"{'on' if cfg['index'] else 'off'}; context continuations "
             f"{'on' if cfg['lookup'] else 'off'}",
             f"- device: {cfg['device']} · {cfg['platform']} · mlx {cfg['mlx']} · "
             f"mlx-lm {cfg['mlx_lm']} · dflash {cfg['dflash']}",
             "- speed-up: end to end (first token + decode, prompts processed from scratch on "
             "both sides); decode: tokens/s after the first token; TTFT: time to first token",
             "",
             "| turn | prompt tokens | tokens | speed-up | decode | TTFT mlx-lm | TTFT dflash "
             "| TTFT prefix cache | τ | chain / tree / own / index / plain | identical |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|:---:|"]

    def passes(shares):
        return " / ".join(_pct(shares[k]) for k in SOURCES)

    for r in result["turns"]:
        lines.append(f"| {r['conversation']} {r['turn']}{' (retry)' if r['retry'] else ''} | "
                     f"{r['prompt_tokens']} | {r['generated_tokens']} | "
                     f"{_f(r['speedup'], 2, '×')} | {_f(r['decode_speedup'], 2, '×')} | "
                     f"{r['mlx_lm']['ttft_s']:.3f} s | {r['dflash']['ttft_s']:.3f} s | "
                     f"{r['dflash_prompt_cache']['ttft_s']:.3f} s | {r['dflash']['tau']:.2f} | "
                     f"{passes(r['dflash']['shares'])} | {_same(r['identical'])} |")
    for label, t in [(f"**{c['id']}**", c) for c in result["conversations"]] + [
            ("**first sends**", result["first_sends"]), ("**retries**", result["retries"]),
            ("**all**", result["overall"])]:
        if t is None:
            continue
        lines.append(f"| {label} | | {t['generated_tokens']} | **{_f(t['speedup'], 2, '×')}** | "
                     f"{_f(t['decode_speedup'], 2, '×')} | {t['mlx_lm']['ttft_s']:.3f} s | "
                     f"{t['dflash']['ttft_s']:.3f} s | {t['dflash_prompt_cache']['ttft_s']:.3f} s "
                     f"| | {passes(t['shares'])} | {_same(t['identical'])} |")
    lines += ["", "TTFT columns of the totals are sums over the turns."]
    if result["differing"]:
        lines += ["", "**Outputs differ from mlx-lm's** on " + ", ".join(result["differing"])]
    return "\n".join(lines) + "\n"


def write_trace_outputs(result: dict, out: str | Path,
                        log: Callable[[str], None] | None = None) -> dict[str, Path]:
    """``bench.json`` (every per-turn row) and ``bench.md`` (the table) in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "bench.json", "markdown": out / "bench.md"}
    write_atomic(files["json"], json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    write_atomic(files["markdown"], trace_markdown(result))
    (log or (lambda _msg: None))("wrote " + ", ".join(str(p) for p in files.values()))
    return files
