"""Where a batched cycle's time goes, against the cost model and mlx-lm's batching.

Why: at 4-8 clients the batched engine (:mod:`dflash.batch`) ran at about mlx-lm's batching
although a pass of ``B * 2`` rows costs about what ``B`` rows cost on this CPU. This script
breaks the engine's cycles into phases, each timed to its end (``mx.eval`` at every boundary, so
the phases add up; the engine itself overlaps some of them):

* ``sync`` (the drafter's context fed with committed features), ``draft`` (the drafter's block
  pass), ``cand`` (top candidates, one host read), ``propose``, ``verify`` (the target pass),
  ``accept`` (per-sequence acceptance), ``rollback``, ``emit`` (detokenise, stats), and
  ``other`` (the cycle's own Python: the rest of its wall time);
* against the cost model's ``draft(B * rows)`` and ``verify(B * width)`` for the same shapes;
* passes counted by width (rows per sequence).

Two parts: ``--mode workload`` runs the closed loop of ``dflash bench --concurrency N`` through
the instrumented engine; ``--mode steps`` puts ``N`` prompts in both engines and times steady
plain batched steps (ours unsynchronised, as it runs) and mlx-lm ``BatchGenerator.next()``
steps at the same batch, interleaved in rounds, then our speculative cycles at forced widths.

    python scripts/profile_batch.py --mode workload --concurrency 8 --limit 16
    python scripts/profile_batch.py --mode steps --concurrency 8 --rounds 5
    python scripts/profile_batch.py --mode shapes --rounds 5
    python scripts/profile_batch.py --mode ab --base 7d8983c --concurrency 4 --limit 8 --rounds 2

``--mode shapes`` times target passes of ``(B, n)`` tokens against the cost model's
``verify(B * n)`` (the model is measured on one sequence); ``--mode ab`` runs mlx-lm's batching,
the engine at ``--base`` and this checkout's round-robin in one process (outputs checked equal).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

# isort: off
import dflash  # noqa: F401  (OpenBLAS before mlx)
# isort: on
import mlx.core as mx

from dflash import batch as batch_module
from dflash import bench
from dflash.pair import load_pair
from dflash.prompts import encode_prompt
from dflash.sampling import BlockSampler

PHASES = ("sync", "draft", "cand", "propose", "verify", "accept", "rollback", "emit")


class Timer:
    """Wall milliseconds per phase of the current cycle, each phase evaluated at its end."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)
        self.cycles: list[dict] = []

    def wrap(self, phase: str, fn, sync=lambda out: out):
        def timed(*args, **kwargs):
            tic = time.perf_counter()
            out = fn(*args, **kwargs)
            arrays = sync(out)
            if arrays is not None:
                mx.eval(arrays)
            self.current[phase] += 1e3 * (time.perf_counter() - tic)
            return out
        return timed


TIMER = Timer()
_patched: set[int] = set()


def instrument(engine) -> Timer:
    """Time the engine's phases (the patched names are this script's run only)."""
    timer = TIMER
    timer.cycles = []
    if not _patched:
        _patch_once(engine.draft)
        _patched.add(id(engine))
    engine._sync_drafter = timer.wrap("sync", engine._sync_drafter,
                                      lambda _: [c.state for c in engine.dcache])
    cycle = engine._cycle

    def timed_cycle(events):
        timer.current = defaultdict(float)
        batch = len(engine.rows)
        context = max(len(s.state.fed) for s in engine.rows)
        tic = time.perf_counter()
        cycle(events)
        total = 1e3 * (time.perf_counter() - tic)
        record = dict(timer.current)
        record["total"] = total
        record["other"] = total - sum(record.get(p, 0.0) for p in PHASES)
        record["batch"], record["context"] = batch, context
        record.setdefault("drafted", 0)
        record.setdefault("width", 1)
        timer.cycles.append(record)
    engine._cycle = timed_cycle
    return timer


def _patch_once(draft) -> None:
    timer = TIMER
    block_pass = draft.block_scores_batch

    def counted(target, anchors, block_len, cache):
        timer.current["drafted"] = block_len
        return block_pass(target, anchors, block_len, cache)
    draft.block_scores_batch = timer.wrap("draft", counted, lambda out: out[0])
    draft.propose = timer.wrap("propose", draft.propose, lambda out: out[0])
    batch_module.draft_candidates = timer.wrap("cand", batch_module.draft_candidates,
                                               lambda out: None)
    target_pass, rollback = batch_module.forward, batch_module.rollback_rows

    def verify(parts, tokens, cache, *args):
        timer.current["width"] = tokens.shape[1]
        return target_pass(parts, tokens, cache, *args)

    def roll_back(cache, *args):
        rollback(cache, *args)
        return [c.state for c in cache]
    batch_module.forward = timer.wrap("verify", verify, lambda out: list(out))
    batch_module.rollback_rows = timer.wrap("rollback", roll_back)
    batch_module.emit = timer.wrap("emit", batch_module.emit, lambda out: None)
    batch_module.count_step = timer.wrap("emit", batch_module.count_step, lambda out: None)
    BlockSampler.accept = timer.wrap("accept", BlockSampler.accept, lambda out: None)


def summarise(cycles: list[dict], cost) -> None:
    by = defaultdict(list)
    for c in cycles:
        by[(c["batch"], c["width"])].append(c)
    print(f"{'B':>2} {'w':>2} {'n':>4} " + " ".join(f"{p:>8}" for p in PHASES + ("other", "total"))
          + f" {'pred':>7}")
    for (b, w), cs in sorted(by.items()):
        med = {p: statistics.median(c.get(p, 0.0) for c in cs) for p in PHASES
               + ("other", "total")}
        ctx = int(statistics.median(c["context"] for c in cs))
        drafted = statistics.median(c["drafted"] for c in cs)
        pred = cost.verify(b * w, ctx) + cost.draft(b * drafted)
        print(f"{b:>2} {w:>2} {len(cs):>4} " + " ".join(f"{med[p]:8.2f}" for p in PHASES
                                                    + ("other", "total")) + f" {pred:7.2f}")
    widths = Counter(c["width"] for c in cycles)
    print("passes by width:", dict(sorted(widths.items())))


def workload(pair, encoded, clients: int, max_tokens: int) -> None:
    engine = batch_module.BatchGenerator(pair.model, pair.draft, pair.tokenizer,
                                         max_batch=clients)
    timer = instrument(engine)

    def step():
        return [(e.uid, e.tokens, e.finish_reason is not None, e.stats) for e in engine.step()]

    out = bench._closed_loop(lambda ids: engine.insert(ids, max_tokens=max_tokens), step,
                             encoded, clients)
    print(f"workload: {out['generated']} tokens, {out['wall_s']:.1f} s wall, "
          f"{out['cpu_s']:.1f} CPU-s, {out['tokens_per_s']:.1f} tok/s")
    summarise(timer.cycles, engine.cost)


def fill(engine, encoded, max_tokens: int) -> None:
    for ids in encoded:
        engine.insert(ids, max_tokens=max_tokens)
    while engine.pending or engine.prefilling is not None:
        engine.step()


def step_ms(step, n_steps: int) -> float:
    """Wall ms per step over ``n_steps`` steps, after 3 unmeasured ones."""
    for _ in range(3):
        step()
    tic = time.perf_counter()
    for _ in range(n_steps):
        step()
    return 1e3 * (time.perf_counter() - tic) / n_steps


def steps(pair, encoded, clients: int, rounds: int, n_steps: int) -> None:
    """Steady plain batched steps: ours against mlx-lm's, interleaved; then forced widths."""
    from mlx_lm.generate import BatchGenerator as LMBatchGenerator

    ours_ms, theirs_ms = [], []
    for _ in range(rounds):
        engine = batch_module.BatchGenerator(pair.model, pair.draft, pair.tokenizer,
                                             max_batch=clients)
        fill(engine, encoded, 10_000)
        engine.backoff = 10 ** 9  # plain steps only
        ours_ms.append(step_ms(engine.step, n_steps))
        gen = LMBatchGenerator(pair.model, max_tokens=10_000, stop_tokens=[],
                               completion_batch_size=clients, prefill_batch_size=clients)
        gen.insert(encoded, [10_000] * len(encoded))
        while True:
            _, responses = gen.next()
            if len(responses) == clients:
                break
        theirs_ms.append(step_ms(gen.next, n_steps))
        gen.close()
        print(f"plain step at B={clients}: ours {ours_ms[-1]:.2f} ms, mlx-lm {theirs_ms[-1]:.2f} ms")
    print(f"median plain step: ours {statistics.median(ours_ms):.2f} ms, mlx-lm "
          f"{statistics.median(theirs_ms):.2f} ms, ratio "
          f"{statistics.median(ours_ms) / statistics.median(theirs_ms):.3f}")
    engine = batch_module.BatchGenerator(pair.model, pair.draft, pair.tokenizer,
                                         max_batch=clients, policy="fixed")
    fill(engine, encoded, 10_000)
    timer = instrument(engine)
    for block in (1, 2, 3, 4, 6):
        engine.block_size = block
        for _ in range(n_steps):
            engine.step()
    print(f"phases at B={clients}, forced widths (policy fixed, block = width; synced):")
    summarise(timer.cycles, batch_module.cost_model(engine.parts, engine.draft))


def shapes(pair, encoded, batches: list[int], widths: list[int], rounds: int) -> None:
    """One target pass of ``(B, n)`` tokens on the ragged caches of ``B`` prefilled prompts
    (rolled back after each pass), against the cost model's ``verify(B * n)``; fastest of
    ``rounds`` interleaved timings, wall and this process's CPU time."""
    parts = batch_module.target_parts(pair.model)
    cost = batch_module.cost_model(parts, pair.draft)
    engines = {}
    for b in batches:
        engine = batch_module.BatchGenerator(pair.model, pair.draft, pair.tokenizer,
                                             max_batch=max(b, 2))
        fill(engine, encoded[:b], 10_000)
        engine._to_batch()
        engines[b] = engine
    best: dict = defaultdict(lambda: (float("inf"), float("inf")))
    for _ in range(rounds):
        for b, engine in engines.items():
            for n in widths:
                tokens = mx.array([[s.state.history[-1]] * n for s in engine.rows])
                tic, cpu = time.perf_counter(), time.process_time()
                logits, taps = batch_module.forward(engine.parts, tokens, engine.cache,
                                                    engine.draft.target_layer_ids)
                mx.eval(logits, taps, [c.state for c in engine.cache])
                wall, cpu = time.perf_counter() - tic, time.process_time() - cpu
                for c in engine.cache:
                    c.set_lengths([length - n for length in c.lengths])
                w0, c0 = best[(b, n)]
                best[(b, n)] = (min(w0, 1e3 * wall), min(c0, 1e3 * cpu))
    print(f"{'B':>2} {'n':>2} {'rows':>4} {'wall ms':>8} {'cpu ms':>7} {'x(B,1)':>7} "
          f"{'model x':>7}")
    for (b, n), (wall, cpu) in sorted(best.items()):
        context = max(len(s.state.fed) for s in engines[b].rows)
        print(f"{b:>2} {n:>2} {b * n:>4} {wall:8.1f} {cpu:7.1f} {wall / best[(b, 1)][0]:7.2f} "
              f"{cost.verify(b * n, context) / cost.verify(b, context):7.2f}")


def ab(pair, encoded, clients: int, max_tokens: int, base: str, rounds: int) -> None:
    """mlx-lm's batching, the engine at git ref ``base`` and this checkout's, the closed loop
    of ``dflash bench --concurrency`` each, round-robin in one process (order alternating)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from ab_engines import import_base

    base_bench = import_base(base, Path(tempfile.mkdtemp()))
    # Its own drafter class (the engine calls the drafter's methods of its commit).
    base_pair = importlib.import_module("dflash_base.pair").load_pair()
    engines = {"mlx-lm": lambda prompts, n: bench._mlx_lm(pair, prompts, clients, n),
               "base": lambda prompts, n: base_bench._ours(base_pair, prompts, clients, n,
                                                           "auto"),
               "new": lambda prompts, n: bench._ours(pair, prompts, clients, n, "auto")}
    for run in engines.values():  # warm-up
        run(encoded[:clients], 8)
    results: dict[str, list[dict]] = defaultdict(list)
    for r in range(rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for name in order:
            results[name].append(engines[name](encoded, max_tokens))
            out = results[name][-1]
            print(f"round {r} {name:>6}: {out['tokens_per_s']:.1f} tok/s, "
                  f"{out['tokens_per_cpu_s']:.1f} tok/CPU-s, speculative "
                  f"{out.get('speculative_share', 0):.0%}, tau {out.get('tau') or 0:.2f}, "
                  f"load {open('/proc/loadavg').read().split()[0]}", flush=True)
        for name in ("base", "new"):
            assert results[name][-1]["tokens"] == results["mlx-lm"][-1]["tokens"], name
    for key in ("tokens_per_s", "tokens_per_cpu_s"):
        total = {k: sum(o["generated"] for o in v) / sum(
            o["wall_s" if key == "tokens_per_s" else "cpu_s"] for o in v)
            for k, v in results.items()}
        print(f"{key}: new/mlx-lm {total['new'] / total['mlx-lm']:.3f}, base/mlx-lm "
              f"{total['base'] / total['mlx-lm']:.3f}, new/base {total['new'] / total['base']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("workload", "steps", "shapes", "ab"), default="workload")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompts", default="docs/bench/heldout-mix.jsonl")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--base", default="HEAD", help="git ref of the engine to compare (ab)")
    args = ap.parse_args()
    pair = load_pair()
    _, items = bench.load_prompts(args.prompts, args.limit)
    encoded = [encode_prompt(pair.tokenizer, item) for item in items]
    print(f"load average {open('/proc/loadavg').read().split()[:3]}")
    if args.mode == "workload":
        workload(pair, encoded[:args.concurrency], args.concurrency, 8)  # warm-up
        workload(pair, encoded, args.concurrency, args.max_tokens)
    elif args.mode == "ab":
        ab(pair, encoded, args.concurrency, args.max_tokens, args.base, args.rounds)
    elif args.mode == "shapes":
        shapes(pair, encoded, [1, 4, 8], [1, 2, 3, 4, 6], args.rounds)
    else:
        steps(pair, encoded[:args.concurrency], args.concurrency, args.rounds, args.steps)


if __name__ == "__main__":
    main()
