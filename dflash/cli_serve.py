"""``dflash serve``: check the options, then start the OpenAI-compatible server of
:mod:`dflash.serving` (or, on a sharded target's other ranks, follow it).

The server's options are in :func:`dflash.cli_args.add_serve_args`; this module turns them into
:func:`dflash.serving.create_server` settings and names the option in any error about one.
"""

from __future__ import annotations

import argparse

from .cli_args import add_draft_window_arg, add_kv_args, add_model_args, add_serve_args, kv_kwargs
from .console import one_line
from .errors import CLIError, DFlashError


def add_serve_parser(sub) -> None:
    """``dflash serve``: its options and command."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/messages (Anthropic), /v1/models, "
                       "/health and /metrics (Prometheus).")
    add_model_args(p)
    add_serve_args(p)
    add_kv_args(p)
    add_draft_window_arg(p)
    p.set_defaults(func=cmd_serve)


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
