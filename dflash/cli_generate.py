"""``dflash generate`` and ``dflash chat``: one prompt, or a conversation in the terminal, streamed,
with statistics.

Their parsers, their commands and what they share (the prompt's context check, prefill progress,
the statistics line); the options both take come from :mod:`dflash.cli_args`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from .cli_args import (
    add_draft_window_arg,
    add_grammar_args,
    add_kv_args,
    add_model_args,
    add_prompt_args,
    add_prompt_cache_dir_args,
    add_sampling_args,
    agreed,
    encode,
    generation_kwargs,
    grammar_from_args,
    load_pair_for,
)
from .console import PROG, log, one_line
from .errors import CLIError, DFlashError
from .pair import Pair
from .stats import generation_stats

CHAT_HELP = "/reset clears the conversation, /stats shows acceptance, /exit quits"


def add_generate_parser(sub) -> None:
    """``dflash generate``: its options and command."""
    p = sub.add_parser("generate", help="generate text for one prompt, with statistics",
                       description="Generate text for one prompt (from --prompt or stdin), "
                       "streamed to stdout; statistics go to stderr (or into --json).")
    add_model_args(p)
    p.add_argument("--prompt", "-p", default=None, help="the prompt (default: read stdin)")
    add_prompt_args(p)
    add_sampling_args(p)
    add_kv_args(p)
    add_draft_window_arg(p)
    add_grammar_args(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, tokens, stats) instead of streaming")
    p.add_argument("--no-speedup-estimate", action="store_true",
                   help="skip the short target-only probe behind the speed-up estimate")
    p.set_defaults(func=cmd_generate)


def add_chat_parser(sub) -> None:
    """``dflash chat``: its options and command."""
    p = sub.add_parser("chat", help="chat in the terminal",
                       description="Multi-turn chat in the terminal, streamed. " + CHAT_HELP + ".")
    add_model_args(p)
    add_prompt_args(p)
    add_sampling_args(p, max_tokens=1024)
    add_kv_args(p)
    add_draft_window_arg(p)
    add_prompt_cache_dir_args(p)
    p.add_argument("--quiet", "-q", action="store_true", help="no statistics after each answer")
    p.set_defaults(func=cmd_chat)


# ---------------------------------------------------------------------------------------------
# generate


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = args.prompt
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise CLIError("give the prompt with --prompt TEXT or on stdin", code=2)
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise CLIError("the prompt is empty", code=2)
    grammar = grammar_from_args(args)  # a missing file or bad JSON: before the models load
    pair = load_pair_for(args)
    ids = encode(pair, {"prompt": prompt}, args)
    check_context(pair, len(ids))
    from .speculative import stream_generate

    responses = stream_generate(
        pair.model, pair.draft, pair.tokenizer, ids,
        prompt_progress_callback=prefill_progress(len(ids), args.prefill_step_size),
        grammar=grammar, **agreed(generation_kwargs(args)))
    text, tokens, last = [], [], None
    for r in responses:
        text.append(r.text)
        tokens.extend(r.tokens)
        last = r
        if not args.json and r.text:
            sys.stdout.write(r.text)
            sys.stdout.flush()
    target_tps = None
    if not args.no_speedup_estimate and last.generation_tokens > 1:
        target_tps = probe_target_tps(pair.model, ids[-1])
    stats = stats_dict(last, target_tps)
    if args.json:
        print(json.dumps({"model": pair.model_path, "draft": pair.draft_path,
                          "text": "".join(text), "tokens": tokens,
                          "finish_reason": last.finish_reason, "stats": stats},
                         ensure_ascii=False))
    else:
        if text and not "".join(text).endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
        print(stats_line(stats), file=sys.stderr, flush=True)
    return 0


def probe_target_tps(model, token: int, steps: int = 8) -> float:
    """Plain one-token decode speed of the target alone, measured at a short context."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    y = mx.array([[int(token)]])

    def step(y):
        logits = model(y, cache=cache)
        y = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
        mx.eval(y)
        return y

    y = step(y)
    tic = time.perf_counter()
    for _ in range(steps):
        y = step(y)
    return steps / max(time.perf_counter() - tic, 1e-9)


# ---------------------------------------------------------------------------------------------
# chat


def cmd_chat(args: argparse.Namespace) -> int:
    from . import distributed

    pair = load_pair_for(args)
    ranks = distributed.join()  # sharded: rank 0 reads each line, every rank runs the turn
    from .lookup import ContinuationIndex
    from .prompt_cache import PromptCache
    from .speculative import stream_generate

    # later turns prefill only what the conversation added; with a folder, also after a restart
    folder = args.prompt_cache_dir
    if folder is not None and ranks.distributed:
        folder = Path(folder) / f"rank-{ranks.rank}"  # each rank holds its own stage's caches
    try:
        prompt_cache = PromptCache(directory=folder,
                                   directory_bytes=args.prompt_cache_dir_bytes)
    except DFlashError as e:
        raise CLIError(one_line(e), code=1) from None
    # What earlier turns wrote, proposed again where a turn repeats it (kept across /reset: a
    # question asked again is answered at the speed of verifying its earlier answer).
    index = ContinuationIndex()
    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
    log(f"chatting with {pair.name}; {CHAT_HELP}")
    messages: list[dict] = []
    totals = {"turns": 0, "tokens": 0, "cycles": 0, "cycle_tokens": 0.0, "time": 0.0,
              "draft": 0.0, "verify": 0.0}
    last_stats: dict | None = None
    kwargs = agreed(generation_kwargs(args))
    while True:
        line = distributed.text_from_main(ranks, lambda: input(">>> " if interactive else ""))
        if line is None:
            if interactive:
                print()
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit", "/bye"):
            return 0
        if line in ("/help", "/?"):
            print(CHAT_HELP, flush=True)
            continue
        if line == "/reset":
            messages.clear()
            prompt_cache.clear()
            print("[conversation cleared]", flush=True)
            continue
        if line == "/stats":
            print(chat_stats(totals, last_stats), flush=True)
            continue
        if line.startswith("/"):
            print(f"[unknown command {line.split()[0]}; {CHAT_HELP}]", flush=True)
            continue
        messages.append({"role": "user", "content": line})
        ids = encode(pair, {"messages": messages}, args)
        try:
            check_context(pair, len(ids))
        except CLIError as e:
            messages.pop()
            print(f"[{e}; /reset to start over]", flush=True)
            continue
        answer, last = [], None
        tic = time.perf_counter()
        try:
            for r in stream_generate(
                    pair.model, pair.draft, pair.tokenizer, ids, prompt_cache=prompt_cache,
                    index=index, prompt_progress_callback=prefill_progress(len(ids), args.prefill_step_size),
                    **kwargs):
                answer.append(r.text)
                last = r
                sys.stdout.write(r.text)
                sys.stdout.flush()
        except KeyboardInterrupt:
            messages.pop()  # the unfinished turn is dropped
            print("\n[interrupted]", flush=True)
            continue
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(answer)})
        last_stats = stats_dict(last)
        _count_turn(totals, last, time.perf_counter() - tic)
        if not args.quiet:
            print(f"[τ {last.mean_tau:.2f} · {last.generation_tps:.1f} tok/s · "
                  f"{last.generation_tokens} tokens]", file=sys.stderr, flush=True)


def _count_turn(totals: dict, last, seconds: float) -> None:
    """Add one answer (its last ``DFlashResponse``) to the conversation's ``totals``."""
    totals["turns"] += 1
    totals["tokens"] += last.generation_tokens
    totals["cycles"] += last.cycles
    totals["cycle_tokens"] += last.mean_tau * last.cycles
    totals["time"] += seconds
    totals["draft"] += last.draft_time
    totals["verify"] += last.verify_time


def chat_stats(totals: dict, last: dict | None) -> str:
    if last is None:
        return "[no answers yet]"
    tau = totals["cycle_tokens"] / totals["cycles"] if totals["cycles"] else 0.0
    acc = " ".join(f"{a:.2f}" for a in last["acceptance_by_position"])
    return (f"[conversation: {totals['turns']} answers, {totals['tokens']} tokens, mean τ "
            f"{tau:.2f}, draft {totals['draft']:.2f} s / verify {totals['verify']:.2f} s]\n"
            f"[last answer: {stats_line(last)}]\n"
            f"[last answer acceptance by block position: {acc}]")


# ---------------------------------------------------------------------------------------------
# shared by both (the context check; prefill progress; the statistics)


def check_context(pair: Pair, n_prompt: int) -> None:
    limit = pair.max_context
    if limit is not None and n_prompt >= limit:
        raise CLIError(f"the prompt has {n_prompt} tokens; the target's context holds {limit}")


def prefill_progress(n_prompt: int, step: int):
    """A callback that shows prefill progress on a terminal, for prompts of several chunks."""
    if n_prompt <= step:
        return None
    log(f"prefill of {n_prompt} prompt tokens ...")
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        end = "\n" if done >= total else "\r"
        print(f"\r{PROG}: prefill {done}/{total}", file=sys.stderr, end=end, flush=True)

    return show


def stats_dict(r, target_tps: float | None = None) -> dict:
    """The statistics of a finished generation (its last ``DFlashResponse``), for people."""
    stats = {"prompt_tokens": r.prompt_tokens, "generation_tokens": r.generation_tokens,
             "finish_reason": r.finish_reason, **generation_stats(r)}
    if target_tps:
        stats["target_only_tps_estimate"] = round(target_tps, 2)
        stats["speedup_estimate"] = round(r.generation_tps / target_tps, 3)
    return stats


def stats_line(s: dict) -> str:
    busy = s["draft_time"] + s["verify_time"]
    share = f" ({100 * s['draft_time'] / busy:.0f}% drafting)" if busy > 0 else ""
    parts = [f"τ {s['mean_tau']:.2f} over {s['cycles']} cycles",
             f"{s['generation_tokens']} tokens at {s['generation_tps']:.1f} tok/s"]
    if "speedup_estimate" in s:
        parts.append(f"speed-up ≈ {s['speedup_estimate']:.2f}× "
                     f"(target alone ≈ {s['target_only_tps_estimate']:.1f} tok/s)")
    parts += [f"prompt {s['prompt_tokens']} tokens at {s['prompt_tps']:.0f} tok/s",
              f"draft {s['draft_time']:.2f} s / verify {s['verify_time']:.2f} s{share}",
              f"peak {s['peak_memory_gb']:.2f} GB", f"finish: {s['finish_reason']}"]
    return " | ".join(parts)
