"""The options several ``dflash`` subcommands share, and the helpers that turn parsed options
into library settings.

Each subcommand's module (:mod:`dflash.cli_generate`, :mod:`dflash.cli_serve`,
:mod:`dflash.cli_bench`) builds its parser from these groups, so that an option means the same
thing, with the same help, wherever it appears; only the CLI modules import this one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .console import log
from .errors import CLIError
from .pair import Pair, load_pair
from .policy import POLICIES

# ---------------------------------------------------------------------------------------------
# option groups


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


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompt format")
    g.add_argument("--system", default=None, help="system message")
    g.add_argument("--no-chat-template", action="store_true",
                   help="feed the raw text, without the tokenizer's chat template")
    g.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="ask the chat template for a thinking (or non-thinking) answer "
                        "(default: the template's own default)")


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


# ---------------------------------------------------------------------------------------------
# from parsed options to library settings


def load_pair_for(args: argparse.Namespace) -> Pair:
    """The pair ``--model``/``--draft`` name, its drafter bounded by ``--draft-window``."""
    window = getattr(args, "draft_window", None)
    if window is not None and window < 1:
        raise CLIError(f"--draft-window {window}: must be >= 1", code=2)
    pair = load_pair(args.model, args.draft, log=log)
    if window is not None:
        pair.draft.set_window(window, "--draft-window")
    return pair


def kv_kwargs(args: argparse.Namespace) -> dict:
    """The ``--kv-*`` options as :func:`~dflash.speculative.stream_generate` settings (none
    without ``--kv-bits``)."""
    if getattr(args, "kv_bits", None) is None:
        return {}
    kv = {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size}
    if args.quantized_kv_start is not None:  # otherwise mlx-lm's default, on both sides
        kv["quantized_kv_start"] = args.quantized_kv_start
    return kv


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
# sharded launches (dflash.distributed): the same decisions on every rank


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
