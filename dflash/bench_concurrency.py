"""``dflash bench --concurrency N``: the batched engine against mlx-lm's batching.

Closed-loop clients (each sends its next prompt when its answer is complete) drive dflash's
batched engine (:mod:`dflash.batch`) and mlx-lm's ``BatchGenerator`` on the same target and
prompt tokens, greedy; with one client the single-sequence engine runs too. Its own module: it
shares only the prompts and the environment (:mod:`dflash.bench_runs`) with the other benches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .bench_report import _f
from .bench_runs import _environment, load_prompts
from .errors import BenchConfigError, GenerationConfigError


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
        raise BenchConfigError(f"concurrency={concurrency!r}: must be an integer >= 1")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise GenerationConfigError(f"max_tokens={max_tokens!r}: must be an integer >= 1")
    max_batch = concurrency if max_batch is None else max_batch
    if not isinstance(max_batch, int) or max_batch < 1:
        raise BenchConfigError(f"max_batch={max_batch!r}: must be an integer >= 1")
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
    """The table for the terminal: each engine's speed and time to first token, the ratios."""
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
