"""The ``dflash`` command: generate, chat, serve, bench, calibrate (and convert, export, datagen,
magpie, records, train).

Every subcommand has ``--help``. Errors a user can fix (a missing folder, a drafter that does not fit
the target, a setting out of range) print one line on stderr and exit 1; an unavailable subcommand
or a usage error exits 2; Ctrl-C exits 130. Set ``DFLASH_DEBUG=1`` to get tracebacks instead.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
from pathlib import Path

from . import DISTRIBUTION, __version__
from .backend import configure, env_flag
from .console import PROG, log, one_line
from .errors import CLIError, DFlashError
from .files import write_atomic
from .pair import Pair, load_pair
from .policy import POLICIES
from .stats import generation_stats

# Subcommands whose options and behaviour live in other modules, imported only when chosen.
EXTERNAL = {
    "convert": ("dflash.convert", "add_convert_args", "run_convert",
                "convert a DFlash drafter to MLX, optionally quantized"),
    "export": ("dflash.export", "add_export_args", "run_export",
               "write a drafter in the Hugging Face layout vLLM and SGLang serve"),
    "datagen": ("dflash.training.datagen", "add_datagen_args", "run_datagen",
                "regenerate training responses with the target model"),
    "magpie": ("dflash.training.magpie", "add_magpie_args", "run_magpie",
               "write chat prompts with the target itself (Magpie)"),
    "records": ("dflash.training.records", "add_records_args", "run_records_cli",
                "write training records at scale into sealed shards (resumable background job)"),
    "train": ("dflash.training.commands", "add_train_args", "run_train",
              "train a DFlash drafter for a target model"),
}


# ---------------------------------------------------------------------------------------------
# Shared options


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--model", "-m", default=None,
                   help="target: an mlx-lm model folder or Hugging Face repo id "
                        "(default: the built-in SmolLM2-135M-Instruct)")
    g.add_argument("--draft", "-d", default=None,
                   help="DFlash drafter folder or repo id (default: the built-in drafter)")
    g.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch: split the target by layers (mlx-lm's "
                        "pipeline-parallel; qwen3_5, qwen3_next) instead of tensor-parallel")


def add_draft_window_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-window", type=int, default=None, metavar="N",
                   help="tokens of target context the drafter attends to (its context cache "
                        "keeps at most N - 1 rows per layer, flat however long the context; at "
                        "least the block size). Output is unchanged; only proposals differ "
                        "(default: the drafter's own, usually the whole context)")


def load_pair_for(args: argparse.Namespace) -> Pair:
    """The pair ``--model``/``--draft`` name, its drafter bounded by ``--draft-window``."""
    window = getattr(args, "draft_window", None)
    if window is not None and window < 1:
        raise CLIError(f"--draft-window {window}: must be >= 1", code=2)
    pair = load_pair(args.model, args.draft, log=log)
    if window is not None:
        pair.draft.set_window(window, "--draft-window")
    return pair


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"most tokens to generate (default {max_tokens})")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per draft block (default: the drafter's)")
    add_policy_args(g)
    g.add_argument("--temperature", "--temp", type=float, default=0.0,
                   help="0 = greedy, exactly the target's output (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0: off)")
    g.add_argument("--top-k", type=int, default=0, help="top-k sampling (default 0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="min-p sampling (default 0: off)")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="penalise recently seen tokens (e.g. 1.1; default off)")
    g.add_argument("--repetition-context-size", type=int, default=20,
                   help="tokens the repetition penalty looks back over (default 20)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="(default 0)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="(default 0)")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    g.add_argument("--proposal", choices=("argmax", "sample"), default=None,
                   help="how the drafter proposes when sampling: sample (default; rejection "
                        "sampling, accepted more on the built-in pair) or argmax; both exact")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when the text contains TEXT (repeatable)")
    g.add_argument("--prefill-step-size", type=int, default=2048,
                   help="prompt tokens per prefill chunk (default 2048)")


def add_kv_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target KV cache (mlx-lm's options)")
    # (dflash.target.KV_BITS and KV_GROUP_SIZES; checked here, before any model loads)
    g.add_argument("--kv-bits", type=int, default=None, metavar="BITS", choices=(2, 3, 4, 5, 6, 8),
                   help="quantize the target's KV cache to BITS (2, 3, 4, 5, 6 or 8; default: "
                        "float); greedy output is mlx-lm's with the same settings "
                        "(docs/long-context.md)")
    g.add_argument("--kv-group-size", type=int, default=64, choices=(32, 64, 128),
                   help="group size of the KV quantization (32, 64 or 128; default 64)")
    g.add_argument("--quantized-kv-start", type=int, default=None, metavar="TOKENS",
                   help="quantize once the context holds TOKENS tokens, as mlx-lm counts them "
                        "(default: mlx-lm's generate_step default, 5000 in mlx-lm 0.32; 0: "
                        "after the first prefill chunk)")


def kv_kwargs(args: argparse.Namespace) -> dict:
    """The ``--kv-*`` options as :func:`~dflash.speculative.stream_generate` settings (none
    without ``--kv-bits``)."""
    if getattr(args, "kv_bits", None) is None:
        return {}
    kv = {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size}
    if args.quantized_kv_start is not None:  # otherwise mlx-lm's default, on both sides
        kv["quantized_kv_start"] = args.quantized_kv_start
    return kv


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompt format")
    g.add_argument("--system", default=None, help="system message")
    g.add_argument("--no-chat-template", action="store_true",
                   help="feed the raw text, without the tokenizer's chat template")
    g.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="ask the chat template for a thinking (or non-thinking) answer "
                        "(default: the template's own default)")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists "
                        "(default: the target folder's name)")
    g.add_argument("--max-context", type=int, default=None,
                   help="longest prompt + answer in tokens (default: the positions the "
                        "target reads: max_position_embeddings, or as its RoPE scaling "
                        "stretches it)")
    g.add_argument("--default-max-tokens", type=int, default=512,
                   help="answer length when a request gives no max_tokens (default 512)")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per draft block (default: the drafter's)")
    g.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for the model before new ones get 429 "
                        "(default 64)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="sequences that may decode together (default: as many full-context "
                        "caches as fit in half the memory the weights leave, 1 to 16)")
    g.add_argument("--reasoning", choices=("auto", "on", "off"), default="auto",
                   help="split <think>…</think> into reasoning_content: auto (when the "
                        "tokenizer knows thinking tags), on, off (default auto)")
    g.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn log level (default info)")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="a key clients must send (Authorization: Bearer KEY or x-api-key: KEY) "
                        "on every route but /health; repeat for several (default: none, anyone "
                        "who reaches the port may use the server)")
    g.add_argument("--api-keys-file", default=None, metavar="PATH",
                   help="a file of keys, one per line (blank lines and # comments skipped), "
                        "with or instead of --api-key")
    g.add_argument("--share", choices=("key", "all", "none"), default="key",
                   help="whose earlier text may speed up a request (the continuation index and "
                        "the prefix cache): key (default: the same API key's only), all (one "
                        "shared by every client: single-user machines), none (no reuse across "
                        "requests)")
    g.add_argument("--keepalive", type=float, default=10.0, metavar="SECONDS",
                   help="a stream with no output yet (queued, or a long prompt being processed) "
                        "sends a keepalive every SECONDS, in a form its clients skip, so that "
                        "clients with an idle timeout keep waiting (default 10)")
    g.add_argument("--rank-timeout", type=float, default=20.0, metavar="SECONDS",
                   help="a target sharded under mlx.launch: seconds a generation may go without "
                        "finishing a cycle before the other ranks count as gone and every "
                        "client gets a 503 (default 20)")
    g.add_argument("--index-budget", type=int, default=None, metavar="TOKENS",
                   help="tokens each continuation index holds, the oldest dropped first "
                        "(default 262144)")
    add_prompt_cache_args(g)
    add_pair_memory_arg(g)
    g.add_argument("--record", default=None, metavar="DIR",
                   help="append every accepted request to DIR/requests.jsonl (a session to "
                        "replay with benchmarks/replay.py)")


def add_prompt_cache_args(g) -> None:
    g.add_argument("--prompt-cache-size", type=int, default=10, metavar="N",
                   help="conversations (prompt and reply) the prefix cache keeps, the least "
                        "recently used dropped first, as mlx_lm.server's (default 10; with API "
                        "keys, per key)")
    g.add_argument("--prompt-cache-bytes", type=byte_size, default=None, metavar="SIZE",
                   help="bytes the prefix cache's conversations may hold, e.g. 8GB or 500MB "
                        "(default: no bound but --prompt-cache-size)")
    add_prompt_cache_dir_args(g)


def add_prompt_cache_dir_args(g) -> None:
    g.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                   help="also keep the cached conversations on disk in DIR (one folder per API "
                        "key), so that a restart finds them (default: memory only)")
    g.add_argument("--prompt-cache-dir-bytes", type=byte_size, default=16 * 10**9,
                   metavar="SIZE", help="bytes --prompt-cache-dir may hold per API key, the "
                                        "least recently used files removed first (default 16GB)")


def byte_size(text: str) -> int:
    """``8GB``, ``500MB``, ``1.5G`` or a plain count of bytes (argparse names the flag)."""
    import re

    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]?)B?\s*", text, re.IGNORECASE)
    size = 0 if found is None else \
        float(found[1]) * 1000 ** " KMGT".index(found[2].upper() or " ")
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size such as 8GB, 500MB or 1000000")
    return int(size)


def add_policy_args(g) -> None:
    g.add_argument("--policy", choices=POLICIES, default=None,
                   help="how many drafted tokens each cycle verifies: auto (default: from this "
                        "machine's measured costs; plain steps while speculation loses), fixed "
                        "(the whole block), confidence (see --min-confidence) or tree (draft "
                        "trees, see --tree-budget); never changes the output")
    g.add_argument("--tree-budget", type=int, default=None,
                   help="nodes of the draft tree with --policy tree (default 16); with auto, the "
                        "largest tree considered")
    g.add_argument("--no-lookup", action="store_true",
                   help="with auto: verify only the drafter's proposals, never the context's own "
                        "continuation (prompt lookup); for measuring the drafter alone")
    g.add_argument("--min-confidence", type=float, default=None,
                   help="with the confidence policy (implied when given): verify drafted tokens "
                        "only while the drafter's running confidence stays at or above this")
    add_pair_memory_arg(g)


def add_pair_memory_arg(g) -> None:
    g.add_argument("--pair-memory", metavar="PATH", default=None,
                   help="with auto: start from what the pair's earlier generations taught, "
                        "stored in PATH (created when missing), and save what these teach there "
                        "(default: nothing read or written)")


def pair_memory(args: argparse.Namespace):
    """The pair memory ``--pair-memory`` names (``None``: none)."""
    if getattr(args, "pair_memory", None) is None:
        return None
    from .policy.memory import PairMemory

    memory = PairMemory.open(args.pair_memory)
    log(f"pair memory: {memory.source}")
    return memory


def generation_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        block_size=args.block_size, max_tokens=args.max_tokens, temperature=args.temperature,
        min_confidence=args.min_confidence, policy=args.policy, tree_budget=args.tree_budget,
        lookup=not args.no_lookup, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        repetition_context_size=args.repetition_context_size,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.seed, proposal=args.proposal, stop=args.stop,
        prefill_step_size=args.prefill_step_size, memory=pair_memory(args), **kv_kwargs(args))


def template_kwargs(args: argparse.Namespace) -> dict:
    from .prompts import thinking_kwargs

    return thinking_kwargs(args.enable_thinking)


def encode(pair: Pair, item: dict, args: argparse.Namespace) -> list[int]:
    from .prompts import encode_prompt

    return encode_prompt(pair.tokenizer, item, chat_template=not args.no_chat_template,
                         system=args.system, **template_kwargs(args))


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


def add_grammar_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured output (docs/structured-outputs.md)")
    one = g.add_mutually_exclusive_group()
    one.add_argument("--json-schema", default=None, metavar="FILE",
                     help="the answer is a JSON document valid under the JSON schema in FILE")
    one.add_argument("--json-object", action="store_true",
                     help="the answer is a JSON object (any keys)")
    one.add_argument("--regex", default=None, metavar="R",
                     help="the answer matches the regular expression R (Rust regex syntax)")
    one.add_argument("--grammar", default=None, metavar="FILE",
                     help="the answer derives from the Lark grammar in FILE (llguidance's "
                          "dialect; rule `start`)")


def grammar_from_args(args: argparse.Namespace):
    """The :class:`~dflash.grammar.Grammar` the options ask for (``None``: unconstrained)."""
    from .grammar import Grammar

    def read(option: str, path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError as e:
            raise CLIError(f"{option} {path}: {e.strerror or e}") from None

    if getattr(args, "json_schema", None) is not None:
        return Grammar.json_schema(read("--json-schema", args.json_schema),
                                   field=f"--json-schema {args.json_schema}")
    if getattr(args, "json_object", False):
        return Grammar.json_object(field="--json-object")
    if getattr(args, "regex", None) is not None:
        return Grammar.regex(args.regex, field="--regex")
    if getattr(args, "grammar", None) is not None:
        return Grammar.lark(read("--grammar", args.grammar), field=f"--grammar {args.grammar}")
    return None


# ---------------------------------------------------------------------------------------------
# chat

CHAT_HELP = "/reset clears the conversation, /stats shows acceptance, /exit quits"


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
        totals["turns"] += 1
        totals["tokens"] += last.generation_tokens
        totals["cycles"] += last.cycles
        totals["cycle_tokens"] += last.mean_tau * last.cycles
        totals["time"] += time.perf_counter() - tic
        totals["draft"] += last.draft_time
        totals["verify"] += last.verify_time
        if not args.quiet:
            print(f"[τ {last.mean_tau:.2f} · {last.generation_tps:.1f} tok/s · "
                  f"{last.generation_tokens} tokens]", file=sys.stderr, flush=True)


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
# serve, bench


# create_server's settings that are serve options of the same name
SERVE_SETTINGS = ("block_size", "draft_window", "kv_bits", "kv_group_size", "quantized_kv_start",
                  "max_concurrency")


def as_option(message: str, names: tuple[str, ...]) -> str:
    """A message that starts with one of the settings ``names`` (``kv_group_size=128: ...``)
    naming its option instead (``--kv-group-size=128: ...``)."""
    head = message.partition("=")[0]
    return f"--{message.replace('_', '-', head.count('_'))}" if head in names else message


def cmd_serve(args: argparse.Namespace) -> int:
    """Load, then serve until Ctrl-C (sharded under mlx.launch: rank 0 serves, the others
    follow its generations)."""
    for name in ("port", "default_max_tokens", "max_queue"):
        if getattr(args, name) < (0 if name == "port" else 1):
            raise CLIError(f"--{name.replace('_', '-')} {getattr(args, name)}: out of range",
                           code=2)
    if args.max_context is not None and args.max_context < 2:
        raise CLIError(f"--max-context {args.max_context}: must be >= 2", code=2)
    if args.block_size is not None and args.block_size < 2:
        raise CLIError(f"--block-size {args.block_size}: must be >= 2", code=2)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise CLIError(f"--max-concurrency {args.max_concurrency}: must be >= 1", code=2)
    if args.draft_window is not None and args.draft_window < 1:
        raise CLIError(f"--draft-window {args.draft_window}: must be >= 1", code=2)
    if args.index_budget is not None and args.index_budget < 1:
        raise CLIError(f"--index-budget {args.index_budget}: must be a positive number of "
                       "tokens", code=2)
    if args.prompt_cache_size < 1:
        raise CLIError(f"--prompt-cache-size {args.prompt_cache_size}: must be >= 1", code=2)
    if args.rank_timeout <= 0:
        raise CLIError(f"--rank-timeout {args.rank_timeout}: must be > 0 seconds", code=2)
    if not args.keepalive > 0:
        raise CLIError(f"--keepalive {args.keepalive}: must be > 0 seconds", code=2)
    from . import distributed
    from .errors import RankLost
    from .lookup import DEFAULT_BUDGET
    from .serving.scopes import read_keys_file

    keys = list(args.api_key or [])
    if args.api_keys_file is not None:
        keys += read_keys_file(args.api_keys_file)
    from .serving import create_server, follow_server, run  # MLX and the server: `serve` only

    if distributed.launched() and distributed.join().rank != 0:  # a sharded target's follower
        follow_server(args.model, args.draft, share=args.share,
                      index_budget=args.index_budget or DEFAULT_BUDGET,
                      prompt_cache_size=args.prompt_cache_size,
                      prompt_cache_bytes=args.prompt_cache_bytes,
                      prompt_cache_dir=args.prompt_cache_dir,
                      prompt_cache_dir_bytes=args.prompt_cache_dir_bytes,
                      draft_window=args.draft_window, **kv_kwargs(args))
        return 0
    try:  # settings every request would be refused with: refused here, before the port is bound
        server = create_server(args.model, args.draft, served_model_name=args.served_model_name,
                               max_context=args.max_context,
                               default_max_tokens=args.default_max_tokens,
                               block_size=args.block_size, max_queue=args.max_queue,
                               max_concurrency=args.max_concurrency, reasoning=args.reasoning,
                               pair_memory=args.pair_memory, api_keys=keys, share=args.share,
                               **kv_kwargs(args), index_budget=args.index_budget or DEFAULT_BUDGET,
                               prompt_cache_size=args.prompt_cache_size,
                               prompt_cache_bytes=args.prompt_cache_bytes,
                               prompt_cache_dir=args.prompt_cache_dir,
                               prompt_cache_dir_bytes=args.prompt_cache_dir_bytes,
                               draft_window=args.draft_window, rank_timeout=args.rank_timeout,
                               keepalive=args.keepalive, record=args.record)
    except DFlashError as e:
        raise CLIError(as_option(one_line(e), SERVE_SETTINGS), code=1) from None
    try:
        run(server, host=args.host, port=args.port, log_level=args.log_level)
    except RankLost as e:
        raise CLIError(str(e), code=1) from None
    return 0


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


# ---------------------------------------------------------------------------------------------
# Parser


def _chosen_command(argv: list[str]) -> str | None:
    for a in argv:
        if not a.startswith("-"):
            return a
    return None


def _external(name: str):
    """``(add_args, run)`` of an external subcommand, or a one-line reason it is unavailable."""
    module_name, add_name, run_name, _ = EXTERNAL[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        return None, f"`{PROG} {name}` is not available: {module_name} cannot be imported ({one_line(e)})"
    add, run = getattr(module, add_name, None), getattr(module, run_name, None)
    if add is None or run is None:
        missing = add_name if add is None else run_name
        return None, f"`{PROG} {name}` is not available: {module_name} has no {missing}()"
    return (add, run), None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="DFlash block-diffusion speculative decoding on MLX: the target "
        "model's exact output in fewer target passes.")
    # The distribution's name too: z-lab's `dflash` installs a `dflash` package and command as well.
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {__version__} ({DISTRIBUTION})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

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

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/messages (Anthropic), /v1/models, "
                       "/health and /metrics (Prometheus).")
    add_model_args(p)
    add_serve_args(p)
    add_kv_args(p)
    add_draft_window_arg(p)
    p.set_defaults(func=cmd_serve)

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

    chosen = _chosen_command(argv or [])
    for name, (_, _, _, help_text) in EXTERNAL.items():
        funcs = _external(name)[0] if name == chosen else None
        if funcs is None:  # not chosen (or unavailable: main() reports it before parsing)
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        add, run = funcs
        p = sub.add_parser(name, help=help_text,
                           description=help_text[:1].upper() + help_text[1:] + ".")
        add(p)
        p.set_defaults(func=run)
    return parser


def _unavailable(reason: str) -> int:
    print(f"{PROG}: {reason}", file=sys.stderr, flush=True)
    return 2


def _store_learnt_costs() -> None:
    """What the command's generations learnt about pass costs, stored for the next process."""
    costs = sys.modules.get(f"{__package__}.cost_model")
    if costs is not None:
        costs.flush_all()


# Commands that run a pair loaded by load_pair, sharded under mlx.launch (dflash.distributed).
SHARDED_COMMANDS = ("generate", "chat", "serve", "bench", "calibrate")


def agreed(settings: dict) -> dict:
    """Generation settings every rank of a sharded launch decides alike under (unchanged when
    not launched; :func:`dflash.distributed.agreed_settings`)."""
    from . import distributed

    return distributed.agreed_settings(distributed.join(), settings)


def single_process_only(what: str) -> None:
    """Refuse, on every rank alike, what does not run on a sharded target yet."""
    from . import distributed

    if distributed.launched() and distributed.join().distributed:
        raise CLIError(f"{what} does not run on a target sharded over ranks yet (generate, "
                       "chat, serve and bench do; docs/distributed.md)", code=2)


def _errors():
    """stderr, or the real one on a rank whose output :mod:`dflash.distributed` dropped."""
    from .distributed import error_stream

    return error_stream()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    for stream in (sys.stdout, sys.stderr):  # model text and "τ" on a non-UTF-8 terminal
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="replace")
    chosen = _chosen_command(argv)
    if chosen in EXTERNAL:
        reason = _external(chosen)[1]
        if reason is not None:
            return _unavailable(reason)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    name = f"{PROG} {args.command}"
    debug = env_flag("DFLASH_DEBUG")
    if args.command in SHARDED_COMMANDS:  # under mlx.launch: rank 0 prints, the others fail aloud
        from .distributed import choose_pipeline, quiet_other_ranks

        rank = quiet_other_ranks()
        choose_pipeline(getattr(args, "pipeline", False))
        name = f"{name} (rank {rank})" if rank else name
    try:
        configure()  # before any command imports mlx.core: OpenBLAS is bound as MLX loads
        rc = func(args)
        _store_learnt_costs()
        return rc if isinstance(rc, int) else 0  # commands may return what they wrote
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"\n{name}: interrupted", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 1
    except CLIError as e:
        if debug:
            raise
        print(f"{name}: error: {one_line(e)}", file=_errors(), flush=True)
        return e.code
    except (DFlashError, FileNotFoundError, ValueError, OSError, KeyError) as e:
        if debug:
            raise
        print(f"{name}: error: {one_line(e)}", file=_errors(), flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
