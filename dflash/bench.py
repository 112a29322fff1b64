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

This module measures and summarises the prompt bench; its pieces live beside it, each bench in
the module that owns it (all importable from here too):

- :mod:`dflash.bench_runs`: the prompts, one timed run of each side, the machine's description;
- :mod:`dflash.bench_report`: ``bench.md``, ``bench.json``, the plots, the terminal summary;
- :mod:`dflash.bench_trace`: ``run_trace_bench`` (``dflash bench --trace``), multi-turn agent
  conversations (:mod:`dflash.traces`) replayed turn by turn;
- :mod:`dflash.bench_concurrency`: ``run_concurrency_bench`` (``dflash bench --concurrency``),
  the batched engine against mlx-lm's batching.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .bench_concurrency import format_concurrency, run_concurrency_bench
from .bench_report import _arm, format_summary, markdown, plot, shown_path, write_outputs
from .bench_runs import (
    BUILTIN_PROMPTS,
    Prefilled,
    _environment,
    _first_difference,
    _ratio,
    _run_baseline,
    _run_dflash,
    load_prompts,
    parse_block_sizes,
)
from .bench_trace import format_trace_summary, run_trace_bench, trace_markdown, write_trace_outputs
from .errors import BenchConfigError, GenerationConfigError

__all__ = [  # the names callers import from here; each lives in the module that owns it
    "BUILTIN_PROMPTS", "Prefilled", "format_concurrency", "format_summary",
    "format_trace_summary", "load_prompts", "markdown", "parse_block_sizes", "plot",
    "run_bench", "run_concurrency_bench", "run_trace_bench", "shown_path", "trace_markdown",
    "write_outputs", "write_trace_outputs",
]


# ---------------------------------------------------------------------------------------------
# Aggregation


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
    block_sizes, lookups = _check_settings(block_sizes, max_tokens, repeats, lookup)
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
    sizes = list(dict.fromkeys(b or pair.draft.block_size for b in block_sizes))
    arms = [(bs, lk) for lk in lookups for bs in sizes]
    policy_used = policy or ("auto" if min_confidence is None else "confidence")
    from .policy.memory import PairMemory
    from .prompts import encode_prompt

    encoded = [encode_prompt(pair.tokenizer, item, chat_template=chat_template, system=system,
                             **(template_kwargs or {})) for item in items]
    greedy = temperature == 0
    # What the auto policy starts from: nothing, or what a stored memory says. (Sampled runs
    # here are seeded, and a seeded generation never uses the memory: the same seed must give
    # the same text.)
    rows = pair.draft.block_size - 1
    memories = {lk: PairMemory(rows) if pair_memory is None else PairMemory.open(pair_memory, rows)
                for lk in lookups}
    memory = memories[lookups[0]].source if greedy else "not used (seeded sampling)"
    say(f"pair memory: {memory}")
    sides = _Sides(pair, sampling, seed, kv, min_confidence, policy, tree_budget, memories)
    if warmup:
        say("warming up ...")
        sides.baseline(encoded[0], min(16, max_tokens))
        for arm in arms:
            sides.dflash(encoded[0], min(16, max_tokens), arm)
    tic = time.perf_counter()
    reuse_prefill = reuse_prefill and Prefilled.possible(pair, kv)
    base_runs, runs = _measure(sides, items, encoded, arms, max_tokens, repeats, reuse_prefill,
                               say)
    elapsed = time.perf_counter() - tic
    memories[lookups[0]].save()
    from .policy import policy_class

    plain_ms = _plain_pricer(pair) if policy_class(policy_used).needs_cost else None
    result_runs = [_summarise_arm(arm, items, encoded, base_runs, runs[arm], greedy, plain_ms,
                                  pair.tokenizer) for arm in arms]
    pass_costs = _pass_costs(pair, kv)
    say(pass_costs["describe"])
    config = _environment(pair) | {
        "prompts": source, "n_prompts": len(items), "max_tokens": max_tokens,
        "repeats": repeats, "warmup": warmup, "temperature": temperature, "top_p": top_p,
        "top_k": top_k, "min_p": min_p, "seed": seed, "chat_template": chat_template,
        "block_sizes": sizes, "policy": policy_used, "min_confidence": min_confidence,
        "tree_budget": tree_budget, "lookup": lookups[0] if len(lookups) == 1 else lookups,
        "pair_memory": memory, "kv": kv or None,
        "elapsed_s": elapsed, "ranks": ranks.size, "reuse_prefill": reuse_prefill,
        "split": distributed.split_name(pair.model) if ranks.distributed else None}
    result = _result(config, result_runs, greedy, pass_costs, say)
    if out is not None and ranks.is_main:
        write_outputs(result, out, log=say)
    return result


def _check_settings(block_sizes, max_tokens, repeats, lookup) -> tuple[list, list[bool]]:
    """The block sizes (``None``: the drafter's) and the ``lookup`` settings to run, or the
    :class:`~dflash.errors.DFlashError` that names the setting at fault; before a model loads."""
    if isinstance(block_sizes, (list, tuple)) and None in block_sizes:
        rest = [b for b in block_sizes if b is not None]
        block_sizes = [None, *(parse_block_sizes(rest) if rest else [])]
    else:
        block_sizes = parse_block_sizes(block_sizes)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise GenerationConfigError(f"max_tokens={max_tokens!r}: must be an integer >= 1")
    if not isinstance(repeats, int) or repeats < 1:
        raise BenchConfigError(f"repeats={repeats!r}: must be an integer >= 1")
    lookups = list(dict.fromkeys([lookup] if isinstance(lookup, bool) else lookup))
    if not lookups or not all(isinstance(x, bool) for x in lookups):
        raise BenchConfigError(f"lookup={lookup!r}: must be True, False or a sequence of them")
    return block_sizes, lookups


@dataclass
class _Sides:
    """How the prompt bench runs each side: the pair and the sampling, dflash's settings and
    its pair memory per ``lookup`` setting; from scratch, or from ``prefilled`` caches."""

    pair: object
    sampling: dict
    seed: int
    kv: dict | None
    min_confidence: float | None
    policy: str | None
    tree_budget: int | None
    memories: dict[bool, object]

    def baseline(self, ids: list[int], max_tokens: int,
                 prefilled: Prefilled | None = None) -> dict:
        if prefilled is None:
            return _run_baseline(self.pair, ids, max_tokens, self.sampling, self.seed, self.kv)
        return prefilled.run_baseline(self.pair, ids, max_tokens, self.sampling, self.seed)

    def dflash(self, ids: list[int], max_tokens: int, arm: tuple[int, bool],
               prefilled: Prefilled | None = None) -> dict:
        """One run of ``arm`` (its block size, its ``lookup`` setting)."""
        bs, lk = arm
        args = (self.pair, ids, max_tokens, bs, self.sampling, self.seed, self.min_confidence,
                self.policy, self.tree_budget, lk, self.memories[lk])
        return _run_dflash(*args, kv=self.kv) if prefilled is None else prefilled.run_dflash(*args)


def _measure(sides: _Sides, items: list[dict], encoded: list[list[int]],
             arms: list[tuple[int, bool]], max_tokens: int, repeats: int, reuse_prefill: bool,
             say: Callable[[str], None]) -> tuple[list[list[dict]], dict]:
    """Every prompt's decodes, mlx-lm's and each arm's, ``repeats`` times: mlx-lm's runs per
    prompt, and each arm's runs per prompt."""
    base_runs: list[list[dict]] = [[] for _ in items]
    runs: dict[tuple[int, bool], list[list[dict]]] = {arm: [[] for _ in items] for arm in arms}
    several_lookups = len({lk for _, lk in arms}) > 1
    total = repeats * len(items) * (1 + len(arms))
    done = 0
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
            prefilled = Prefilled(sides.pair, ids, sides.sampling, sides.seed)
        # None: the baseline. Rotated from one decode round to the next, so that every side
        # takes every place in the round equally often (the first after a prefill runs slower
        # here; a side always in the middle would be measured apart from the others).
        order: list[tuple[int, bool] | None] = [None, *arms]
        turn = (rep + i) % len(order)
        order = order[turn:] + order[:turn]
        for which in order:
            done += 1
            if which is None:
                r = sides.baseline(ids, max_tokens, prefilled)
                base_runs[i].append(r)
                what = f"mlx-lm: {len(r['tokens'])} tokens, {r['decode_tps']:.1f} tok/s"
            else:
                r = sides.dflash(ids, max_tokens, which, prefilled)
                runs[which][i].append(r)
                bs, lk = which
                arm = f", continuations {'on' if lk else 'off'}" if several_lookups else ""
                what = (f"dflash block {bs}{arm}: {len(r['tokens'])} tokens, "
                        f"{r['decode_tps']:.1f} tok/s, τ {r['mean_tau']:.2f}")
            say(f"[{done}/{total}] {item['id']} (repeat {rep + 1}/{repeats}) {what}")
    return base_runs, runs


def _summarise_arm(arm: tuple[int, bool], items: list[dict], encoded: list[list[int]],
                   base_runs: list[list[dict]], runs: list[list[dict]], greedy: bool,
                   plain_ms: Callable[[int, int], float] | None, tokenizer) -> dict:
    """One arm's result: per prompt (with its text) and over all prompts."""
    per_prompt = []
    for i, item in enumerate(items):
        p = _summarise_prompt(item, len(encoded[i]), base_runs[i], runs[i], greedy, plain_ms)
        p["text"] = tokenizer.decode(runs[i][-1]["tokens"])
        per_prompt.append(p)
    overall = _overall(per_prompt)
    for p in per_prompt:
        p.pop("_totals")
    return {"block_size": arm[0], "lookup": arm[1], "prompts": per_prompt, "overall": overall}


def _result(config: dict, runs: list[dict], greedy: bool, pass_costs: dict,
            say: Callable[[str], None]) -> dict:
    """:func:`run_bench`'s result: the runs, whether greedy outputs matched mlx-lm's (said out
    loud where not) and the best arm."""
    identical = [r["overall"]["identical"] for r in runs]
    result = {
        "config": config,
        "runs": runs,
        "identical": all(identical) if greedy else None,
        "pass_costs": pass_costs,  # what the policy priced with; learnt against calibrated
    }
    best = max(runs, key=lambda r: r["overall"]["speedup"] or 0.0)
    result["best"] = {"block_size": best["block_size"], **{
        k: best["overall"][k] for k in ("tau", "speedup", "baseline_tokens_per_s",
                                        "dflash_tokens_per_s")}}
    if greedy and not result["identical"]:
        bad = [f"{p['id']} ({_arm(r)}, token {p['first_difference']})"
               for r in runs for p in r["prompts"] if p["identical"] is False]
        say("WARNING: greedy outputs differ from mlx-lm's on " + ", ".join(bad))
    return result


def _pass_costs(pair, kv: dict | None) -> dict:
    """The pass costs the policy priced with (a ``kv_bits`` run's are the quantized cache's,
    keyed by its settings), as :func:`dflash.cost_model.report` describes them."""
    from .cost_model import cost_model
    from .cost_model import report as cost_report
    from .target import KVQuantization, target_parts

    priced_kv = KVQuantization.from_settings(**kv) if kv else None
    return cost_report(cost_model(target_parts(pair.model), pair.draft, priced_kv))


def _plain_pricer(pair) -> Callable[[int, int], float]:
    """``(prompt tokens, tokens) -> ms`` of plain decoding at the calibrated costs (mlx-lm's
    pipelined one-token steps), the yardstick of the priced speed-up."""
    from .cost_model import cost_model
    from .target import target_parts

    cost = cost_model(target_parts(pair.model), pair.draft)
    return lambda n_prompt, n: sum(cost.step(n_prompt + i) for i in range(n))
