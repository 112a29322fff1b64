"""``dflash bench`` and ``dflash calibrate``: measure the speed-up, and this machine's pass costs.

``bench`` checks which of its modes the options ask for (prompts, ``--context``, ``--trace``,
``--concurrency``, ``--tau``, ``--bound``) and refuses the combinations that mean nothing before
any model loads; the measuring itself is :mod:`dflash.bench`, :mod:`dflash.contexts`,
:mod:`dflash.tau` and :mod:`dflash.bound`'s. ``calibrate`` prints :mod:`dflash.cost_model`'s table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

from .cli_args import (
    add_draft_window_arg,
    add_kv_args,
    add_model_args,
    add_policy_args,
    add_prompt_args,
    kv_kwargs,
    load_pair_for,
    single_process_only,
    template_kwargs,
)
from .console import log
from .errors import CLIError
from .files import write_atomic
from .pair import Pair, load_pair


def add_bench_parser(sub) -> None:
    """``dflash bench``: its options and command."""
    p = sub.add_parser("bench", help="measure the speed-up over plain mlx-lm decoding",
                       description="Run mlx-lm's plain decoding and dflash on the same prompt "
                       "tokens, alternating, after a warm-up; report τ, tokens/s, speed-up, "
                       "acceptance by block position, and whether greedy outputs are identical.")
    add_model_args(p)
    p.add_argument("--prompts", default="builtin",
                   help="JSONL file (one object a line with `prompt` or `messages`) or "
                        "`builtin` (math word problems and coding tasks; default)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="replay multi-turn agent conversations (JSONL, one conversation a "
                        "line; `agent`: the shipped ones) turn by turn, the whole history each "
                        "turn, greedy; per-turn and total speed-up end to end, time to first "
                        "token with and without the prefix cache, passes by proposal source "
                        "(docs/benchmarks.md#trace-benchmark)")
    p.add_argument("--no-index", action="store_true",
                   help="with --trace: no continuation index across requests (each turn "
                        "proposes only from its own text and the drafter)")
    p.add_argument("--context", default=None, metavar="LENGTHS",
                   help="the prompts at each context length, e.g. 512,2k,4k,8k (prompt + "
                        "--max-tokens; unrelated documentation text put first): speed-up with "
                        "and without continuations (only without: --no-lookup), τ, drafter "
                        "share, prefill time and peak memory per length; with --out, "
                        "contexts.json is written after each length (docs/long-context.md)")
    p.add_argument("--limit", type=int, default=None,
                   help="use only the first N prompts (with --trace: conversations)")
    p.add_argument("--block-size", default=None,
                   help="block size or comma-separated list to sweep, e.g. 4,8,16 "
                        "(default: the drafter's)")
    add_policy_args(p)
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per answer (default 256)")
    p.add_argument("--concurrency", type=int, default=None, metavar="N",
                   help="serve the prompts N at a time through the batched engine and through "
                        "mlx-lm's batching (greedy); report aggregate tokens/s, their ratio and "
                        "time to first token")
    p.add_argument("--max-batch", type=int, default=None, metavar="B",
                   help="with --concurrency: the batched engine's max batch (default N); "
                        "--concurrency 1 --max-batch 4 compares one client through the batched "
                        "engine with the single-sequence engine")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs per prompt (default 1; with --context 3: each side prefills "
                        "a prompt once and its repeats decode from copies of those caches)")
    add_draft_window_arg(p)
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up runs")
    p.add_argument("--temperature", "--temp", type=float, default=0.0, help="(default 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    add_prompt_args(p)
    p.add_argument("--out", default=None,
                   help="folder for bench.json, bench.md and the PNG plots")
    add_kv_args(p)
    g = p.add_argument_group("drafters (instead of the speed-up)")
    g.add_argument("--tau", action="store_true",
                   help="held-out τ per prompt domain of each drafter in --draft A,B,... "
                        "(`builtin`: the built-in drafter), whole blocks verified, greedy; "
                        "fails when their outputs differ")
    g.add_argument("--quantize", action="store_true",
                   help="with --tau: also each float drafter's 6-bit / group-64 conversion")
    g.add_argument("--bound", default=None, metavar="BENCH_JSON",
                   help="the speed-up bounds (best chain, oracle, batched) from a whole-block "
                        "bench JSON and this machine's pass costs for the pair")
    p.set_defaults(func=cmd_bench)


def add_calibrate_parser(sub) -> None:
    """``dflash calibrate``: its options and command."""
    p = sub.add_parser("calibrate", help="measure this machine's verify and draft costs",
                       description="Print the cost model the auto policy decides with: one "
                       "target pass over N rows (ms, and in one-token steps) at each measured "
                       "context, and one drafter pass per block length. Measured once per "
                       "machine and pair, then read from $DFLASH_HOME/calibration.")
    add_model_args(p)
    p.add_argument("--refresh", action="store_true",
                   help="measure again, even if cached; and forget what the pair's earlier "
                        "generations stored for the auto policy ($DFLASH_HOME/calibration/"
                        "memory-*.json)")
    p.add_argument("--out", default=None,
                   help="folder for calibration.json and calibration.png (verify cost "
                        "against rows; needs matplotlib)")
    p.add_argument("--compare-learned", action="store_true",
                   help="first one greedy generation that learns the pass costs from nothing "
                        "(what a new machine's first generation does), then print its learnt "
                        "costs next to the calibration's")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="with --compare-learned: tokens of that generation (default 256)")
    add_kv_args(p)
    p.set_defaults(func=cmd_calibrate)


# ---------------------------------------------------------------------------------------------
# bench


def cmd_bench(args: argparse.Namespace) -> int:
    if (args.trace is not None or args.tau or args.bound or args.concurrency is not None
            or args.context is not None):
        single_process_only("dflash bench with --trace, --tau, --bound, --concurrency or --context")
    if args.repeats is None:  # a context bench prefills once per prompt: its repeats are cheap
        args.repeats = 3 if args.context is not None else 1
    from .bench import (
        format_concurrency,
        format_summary,
        parse_block_sizes,
        run_bench,
        run_concurrency_bench,
    )

    if kv_kwargs(args) and (args.trace or args.tau or args.bound or args.concurrency):
        raise CLIError("--kv-bits: only with the prompts and context benchmarks (not with "
                       "--trace, --tau, --bound or --concurrency)", code=2)
    if args.trace is not None:
        return _bench_trace(args)
    if args.tau or args.bound:  # drafters side by side / what the drafter allows at most
        from . import bound, tau

        if args.draft_window is not None:
            raise CLIError("--draft-window: not with --tau or --bound (they load their own "
                           "drafters)", code=2)

        return (tau if args.tau else bound).run_from_args(args, log)
    if args.concurrency is not None:
        if args.concurrency < 1:
            raise CLIError(f"--concurrency {args.concurrency}: must be >= 1", code=2)
        if args.max_batch is not None and args.max_batch < 1:
            raise CLIError(f"--max-batch {args.max_batch}: must be >= 1", code=2)
        result = run_concurrency_bench(
            model=args.model, draft=args.draft, prompts=args.prompts,
            concurrency=args.concurrency, max_tokens=args.max_tokens, limit=args.limit,
            chat_template=not args.no_chat_template, system=args.system,
            template_kwargs=template_kwargs(args), policy=args.policy,
            warmup=not args.no_warmup, log=log, max_batch=args.max_batch,
            pair=None if args.draft_window is None else load_pair_for(args))
        print(format_concurrency(result), flush=True)
        if args.out is not None:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            batch = "" if args.max_batch is None else f"-batch{args.max_batch}"
            (out / f"concurrency-{args.concurrency}{batch}.json").write_text(
                json.dumps(result, indent=1, default=str) + "\n")
        return 0
    if args.no_index:
        raise CLIError("--no-index: only with --trace", code=2)
    if args.context is not None:
        return _bench_contexts(args)
    try:
        block_sizes = parse_block_sizes(args.block_size)
    except ValueError as e:
        raise CLIError(f"--block-size {args.block_size}: {e}", code=2) from None
    result = run_bench(
        model=args.model, draft=args.draft, prompts=args.prompts, block_sizes=block_sizes,
        max_tokens=args.max_tokens, repeats=args.repeats, warmup=not args.no_warmup,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.seed, chat_template=not args.no_chat_template, system=args.system,
        template_kwargs=template_kwargs(args), limit=args.limit, out=args.out, log=log,
        min_confidence=args.min_confidence, policy=args.policy, tree_budget=args.tree_budget,
        lookup=not args.no_lookup, pair_memory=args.pair_memory, kv=kv_kwargs(args),
        pair=None if args.draft_window is None else load_pair_for(args))
    print(format_summary(result), flush=True)
    return 0


def _bench_contexts(args: argparse.Namespace) -> int:
    """``dflash bench --context 512,2k,4k,8k``: the prompts at each context length."""
    from .contexts import format_context_summary, parse_contexts, plot_contexts, run_context_bench

    lengths = parse_contexts(args.context)  # before any model is loaded
    pair = load_pair_for(args)

    def save(result: dict) -> None:  # after every length: a run stopped later keeps them
        out = Path(args.out)
        write_atomic(out / "contexts.json", json.dumps(result, indent=1, default=str) + "\n")
        with contextlib.suppress(ImportError):
            plot_contexts(result, out / "contexts.png")

    result = run_context_bench(
        lengths, pair=pair, prompts=args.prompts, max_tokens=args.max_tokens, limit=args.limit,
        say=log, lookups=(False,) if args.no_lookup else (True, False), repeats=args.repeats,
        block_sizes=args.block_size, chat_template=not args.no_chat_template,
        system=args.system, policy=args.policy, tree_budget=args.tree_budget,
        min_confidence=args.min_confidence, kv=kv_kwargs(args),
        on_row=None if args.out is None else save)
    print(format_context_summary(result), flush=True)
    return 0


def _bench_trace(args: argparse.Namespace) -> int:
    """``dflash bench --trace``: greedy, one block size; the trace is read (and any error in it
    reported) before a model loads. Exit 1 where an output differs from mlx-lm's."""
    from .bench import format_trace_summary, parse_block_sizes, run_trace_bench
    from .traces import load_trace

    for name in ("concurrency", "tau", "bound", "pair_memory"):
        if getattr(args, name) not in (None, False):
            raise CLIError(f"--trace takes no --{name.replace('_', '-')} (each run starts from "
                           "an empty pair memory; one conversation at a time)", code=2)
    if args.prompts != "builtin":
        raise CLIError("--trace replaces --prompts: give one of them", code=2)
    if args.temperature != 0:
        raise CLIError("--trace is greedy (the histories hold the target's own answers): "
                       "no --temperature", code=2)
    if args.system is not None:
        raise CLIError("--trace: the system message is the trace's own (`system`)", code=2)
    if args.repeats < 1:
        raise CLIError(f"--repeats {args.repeats}: must be >= 1", code=2)
    block_size = None
    if args.block_size is not None:
        try:
            sizes = parse_block_sizes(args.block_size)
        except ValueError as e:
            raise CLIError(f"--block-size {args.block_size}: {e}", code=2) from None
        if len(sizes) > 1:
            raise CLIError("--trace takes one --block-size, not a sweep", code=2)
        block_size = sizes[0]
    load_trace(args.trace, args.limit)  # a bad trace fails here, before the models load
    result = run_trace_bench(
        args.trace, model=args.model, draft=args.draft, repeats=args.repeats,
        warmup=not args.no_warmup, index=not args.no_index, lookup=not args.no_lookup,
        block_size=block_size, policy=args.policy, tree_budget=args.tree_budget,
        min_confidence=args.min_confidence, limit=args.limit,
        chat_template=not args.no_chat_template, template_kwargs=template_kwargs(args),
        out=args.out, log=log, pair=None if args.draft_window is None else load_pair_for(args))
    print(format_trace_summary(result), flush=True)
    return 0 if result["identical"] else 1


# ---------------------------------------------------------------------------------------------
# calibrate


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure (or read) this machine's verify and draft costs for the pair; print the table.
    With ``--compare-learned``: first one generation that learns the costs from nothing, then
    its learnt costs against the calibration."""
    from . import cost_model as costs  # MLX loads only for the commands that run models
    from .distributed import launch_rank
    from .target import target_parts

    # Under mlx.launch every rank measures (its collectives are the pass's); rank 0 writes --out.
    writes_out = args.out is not None and launch_rank() == 0
    pair = load_pair(args.model, args.draft, log=log)
    parts = target_parts(pair.model)
    learned = _learn_from_one_generation(pair, parts, args) if args.compare_learned else None
    kv = None
    if kv_kwargs(args):
        from .target import KVQuantization

        kv = KVQuantization.from_settings(**kv_kwargs(args))
    model = costs.calibrate(parts, pair.draft, refresh=args.refresh, kv=kv)
    if args.refresh:  # its per-ms parts were measured against the old costs
        from .policy.memory import forget_stored

        forgotten = forget_stored(pair.model, pair.draft)
        if forgotten is not None:
            log(f"forgot what earlier generations stored ({forgotten})")
    log(f"calibration {costs.calibration_file(model.key)} (measured {model.measured_at})")
    print(costs.format_table(model), flush=True)
    print(kv_cost_line(pair.model), flush=True)
    if learned is not None:
        table = costs.compare_learned(learned, model)
        print("\nlearnt in one generation from the prior, against the calibration:", flush=True)
        print(costs.format_comparison(table), flush=True)
        if writes_out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "compare-learned.json").write_text(json.dumps(table, indent=1))
    if writes_out:
        files = costs.write_calibration(model, args.out)
        log("wrote " + ", ".join(str(p) for p in files.values()))
    return 0


def kv_cost_line(model) -> str:
    """The target's KV cache per 1,000 tokens of context: float and quantized (``--kv-bits``)."""
    from .serving.worker import kv_bytes_per_token

    parts = [f"float {kv_bytes_per_token(model) * 1000 / 2**20:.1f} MiB"]
    parts += [f"kv_bits={b} {kv_bytes_per_token(model, b) * 1000 / 2**20:.1f} MiB" for b in (8, 4)]
    return "target KV cache per 1k tokens: " + ", ".join(parts) + " (kv_group_size 64)"


COMPARE_PROMPT = "Write a Python function that checks whether a number is prime, and explain it."


def _learn_from_one_generation(pair: Pair, parts, args: argparse.Namespace):
    """The costs one greedy ``--max-tokens`` generation learns from the prior (nothing stored is
    read or written), with the pair's calibration out of the way while it runs."""
    from . import cost_model as costs
    from .model_mlx import generate

    learned = costs.fresh_cost_model(parts, pair.draft)
    prompt = pair.tokenizer.apply_chat_template(
        [{"role": "user", "content": COMPARE_PROMPT}], tokenize=False, add_generation_prompt=True)
    log(f"one {args.max_tokens}-token generation, pass costs learnt from the prior ...")
    tic = time.perf_counter()
    out = generate(pair.model, pair.draft, pair.tokenizer, prompt, max_tokens=args.max_tokens)
    log(f"generated {len(out.tokens)} tokens in {time.perf_counter() - tic:.1f} s; "
        f"{learned.observed} passes timed")
    costs.fresh_cost_model(parts, pair.draft, calibrated=True)  # the learning run is over
    return learned
