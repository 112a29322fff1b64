"""The ``dflash`` command: generate, chat, serve, bench, calibrate (and convert, export, datagen,
magpie, records, train).

Every subcommand has ``--help``. Errors a user can fix (a missing folder, a drafter that does not fit
the target, a setting out of range) print one line on stderr and exit 1; an unavailable subcommand
or a usage error exits 2; Ctrl-C exits 130. Set ``DFLASH_DEBUG=1`` to get tracebacks instead.

The subcommands' options and work live in the modules that own them: :mod:`dflash.cli_generate`
(generate, chat), :mod:`dflash.cli_serve`, :mod:`dflash.cli_bench` (bench, calibrate), with the
options they share in :mod:`dflash.cli_args`; the others are :data:`EXTERNAL`. This module builds
the parser from them and runs the chosen command with the exit codes above.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

from . import DISTRIBUTION, __version__
from .backend import configure, env_flag
from .cli_bench import add_bench_parser, add_calibrate_parser
from .cli_generate import add_chat_parser, add_generate_parser
from .cli_serve import add_serve_parser
from .console import PROG, one_line
from .errors import CLIError, DFlashError

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
    """The ``dflash`` parser; of the :data:`EXTERNAL` subcommands only the one ``argv`` chooses
    imports its module and gets its options."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="DFlash block-diffusion speculative decoding on MLX: the target "
        "model's exact output in fewer target passes.")
    # The distribution's name too: z-lab's `dflash` installs a `dflash` package and command as well.
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {__version__} ({DISTRIBUTION})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add_parser in (add_generate_parser, add_chat_parser, add_serve_parser, add_bench_parser,
                       add_calibrate_parser):
        add_parser(sub)
    _add_external_parsers(sub, _chosen_command(argv or []))
    return parser


def _add_external_parsers(sub, chosen: str | None) -> None:
    """The :data:`EXTERNAL` subcommands: their options only for ``chosen`` (the others are not
    imported, so that their dependencies cost nothing unless asked for)."""
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
