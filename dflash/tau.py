"""Held-out τ of several drafters for one target, per prompt domain, side by side
(``dflash bench --tau --draft A,B [--quantize]``).

Why: whether a newly trained drafter replaces another is decided on the same measurement for both,
on the same prompts: through the real engine, greedy, whole blocks verified (``policy="fixed"``,
so τ is a property of the drafter, not of the verify policy), split by domain (the prompt id's
prefix: ``gsm8k``, ``chat``, ``HumanEval`` in the held-out mix), because a drafter can win on chat
and lose on math. ``--quantize`` adds each float drafter's 6-bit / group-64 conversion, to show
what quantizing costs in τ. Greedy outputs must be the target's whatever the drafter: a run whose
outputs differ across drafters fails.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from .files import write_json_atomic

BUILTIN = "builtin"
QUANTIZED = " 6-bit"


def resolve_draft(name: str) -> str:
    """A drafter folder from a name: ``builtin`` is the built-in drafter."""
    if name == BUILTIN:
        from .default_pair import default_draft_path

        return str(default_draft_path())
    return name


def is_quantized(path: str | Path) -> bool:
    """Whether a drafter folder's config says its weights are quantized."""
    config = json.loads((Path(path) / "config.json").read_text())
    return "quantization" in config or "quantization_config" in config


def quantized_copy(path: str, work: Path) -> str:
    """``path`` converted to 6-bit / group 64 under ``work`` (made once, reused when there)."""
    from .convert import convert

    out = work / (Path(path).name + "-6bit")
    if not (out / "config.json").is_file():
        convert(path, out, quantize=True, q_bits=6, q_group_size=64)
    return str(out)


def compare_drafters(drafts: list[str], target: str | None = None,
                     prompts: str | Path = "heldout-mix", block_size: int = 16,
                     max_tokens: int = 96, limit: int | None = None, quantize: bool = False,
                     work: str | Path = "compare-drafters",
                     log: Callable[[str], None] | None = None, chat_template: bool = True,
                     system: str | None = None, template_kwargs: dict | None = None) -> dict:
    """τ per domain of each drafter in ``drafts`` (folders, or ``builtin``) on ``target``; the
    prompts are encoded as every other bench mode encodes them (``chat_template``, ``system``,
    ``template_kwargs``: ``--no-chat-template`` measures prompts that are already templated).

    Returns ``{"target", "prompts", "block_size", "max_tokens", "domains": {domain: n},
    "drafters": {name: {"path", "all", <domain>: τ, "outputs"}}, "identical": bool}``; ``all``
    weighs each domain by its cycles.
    """
    from .acceptance import measure_tau
    from .bench import load_prompts, shown_path
    from .drafter import load_draft
    from .model_mlx import load
    from .prompts import encode_prompt, prompt_domain

    if target is None:
        from .default_pair import default_target_path

        target = str(default_target_path())
    model, tokenizer = load(target)
    source, items = load_prompts(prompts, limit)
    domains: dict[str, list[list[int]]] = {}
    for item in items:
        domains.setdefault(prompt_domain(item["id"]), []).append(encode_prompt(
            tokenizer, item, chat_template=chat_template, system=system,
            **(template_kwargs or {})))
    # named as reports show them ($DFLASH_HOME/..., not this machine's paths)
    named = [(name if name == BUILTIN else shown_path(name), resolve_draft(name))
             for name in drafts]
    if quantize:
        folder = Path(work)
        folder.mkdir(parents=True, exist_ok=True)
        named += [(name + QUANTIZED, quantized_copy(path, folder)) for name, path in list(named)
                  if not is_quantized(path)]
    results: dict[str, dict] = {}
    for name, path in named:
        draft = load_draft(path)
        per = {d: measure_tau(model, tokenizer, draft, ids, block_size, max_tokens)
               for d, ids in domains.items()}
        cycles = sum(r["cycles"] for r in per.values())
        emitted = sum(r["tau"] * r["cycles"] for r in per.values())
        results[name] = {"path": path, "all": emitted / cycles if cycles else 0.0,
                         **{d: r["tau"] for d, r in per.items()},
                         "outputs": {d: r["outputs"] for d, r in per.items()}}
        if log is not None:
            log(f"{name}: " + ", ".join(f"{d} {r['tau']:.3f}" for d, r in per.items()))
    first = next(iter(results.values()))["outputs"]
    return {"target": target, "prompts": source, "block_size": block_size,
            "max_tokens": max_tokens, "domains": {d: len(v) for d, v in domains.items()},
            "drafters": results,
            "identical": all(r["outputs"] == first for r in results.values())}


def format_tau(result: dict) -> str:
    """The markdown table of :func:`compare_drafters`' result, the 6-bit cost and the check."""
    names = list(result["domains"])
    lines = [f"held-out τ, block {result['block_size']}, whole blocks verified, greedy, "
             f"{result['max_tokens']} tokens, prompts {result['prompts']}", "",
             f"| drafter | {' | '.join(f'{d} ({n})' for d, n in result['domains'].items())} | all |",
             "|---|" + "---:|" * (len(names) + 1)]
    drafters = result["drafters"]
    for name, r in drafters.items():
        lines.append(f"| {name} | " + " | ".join(f"{r[d]:.3f}" for d in names)
                     + f" | {r['all']:.3f} |")
    for name, r in drafters.items():
        base = drafters.get(name.removesuffix(QUANTIZED)) if name.endswith(QUANTIZED) else None
        if base and base["all"]:
            lines += ["", f"{name}: {100 * (r['all'] / base['all'] - 1):+.1f} % τ against its "
                      "unquantized original"]
    lines += ["", f"outputs identical across drafters: {result['identical']}"]
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    """``dflash bench --tau``: measure, print the table, write ``OUT/tau.json``; exit 1 when
    greedy outputs differ across drafters (an exactness failure)."""
    from .prompts import thinking_kwargs

    result = compare_drafters(
        (args.draft or BUILTIN).split(","), target=args.model, prompts=args.prompts,
        block_size=int(args.block_size or 16), max_tokens=args.max_tokens, limit=args.limit,
        quantize=args.quantize, work=Path(args.out or ".") / "drafters", log=log,
        chat_template=not args.no_chat_template, system=args.system,
        template_kwargs=thinking_kwargs(args.enable_thinking))
    print(format_tau(result), flush=True)
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / "tau.json", result)
    return 0 if result["identical"] else 1
