"""Held-out τ of several drafters for one target, per prompt domain, side by side — and, with
``--quantize``, of each candidate's 6-bit / group-64 conversion (the issue's "6-bit within 3 %").

Why: deciding whether a newly trained drafter replaces the built-in one takes the same
measurement for both on the same prompts — through the real engine, greedy, whole blocks verified
(``policy="fixed"``: τ as a property of the drafter), chat template — split by domain (the
prompt id's prefix before ``-`` or ``/``: gsm8k, chat, HumanEval in the held-out mix), since a
drafter can win on chat and lose on math.

    python scripts/compare_drafters.py --drafts builtin,$DFLASH_HOME/runs/final-v4 --quantize \\
        --work $DFLASH_HOME/runs/compare --out compare.json

``builtin`` names the built-in drafter. Prints a markdown table; ``--out`` writes every number.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import dflash  # noqa: F401  (OpenBLAS before mlx)


def resolve(name: str) -> str:
    if name == "builtin":
        from dflash.default_pair import default_draft_path

        return str(default_draft_path())
    return name


def quantized_copy(path: str, work: Path) -> str:
    """``path`` converted to 6-bit / group 64 under ``work`` (made once; reused when there)."""
    from dflash.convert import convert

    out = work / (Path(path).name + "-6bit")
    if not (out / "config.json").is_file():
        convert(path, out, quantize=True, q_bits=6, q_group_size=64)
    return str(out)


def is_quantized(path: str) -> bool:
    config = json.loads((Path(path) / "config.json").read_text())
    return "quantization" in config or "quantization_config" in config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafts", required=True, help="comma-separated drafter folders, or builtin")
    ap.add_argument("--target", default=None, help="default: the built-in target")
    ap.add_argument("--prompts", default="docs/bench/heldout-mix.jsonl")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--quantize", action="store_true",
                    help="also measure each unquantized drafter's 6-bit / group-64 conversion")
    ap.add_argument("--work", default="compare-drafters",
                    help="folder for the 6-bit conversions (default ./compare-drafters)")
    ap.add_argument("--out", default=None, help="JSON file with every number")
    args = ap.parse_args(argv)

    from dflash.acceptance import measure_tau
    from dflash.bench import shown_path
    from dflash.drafter import load_draft
    from dflash.model_mlx import load
    from dflash.prompts import encode_prompt, prompt_domain, read_prompts

    if args.target is None:
        from dflash.default_pair import default_target_path

        args.target = str(default_target_path())
    model, tokenizer = load(args.target)
    items = read_prompts(args.prompts)
    domains: dict[str, list[list[int]]] = {}
    for item in items:
        domains.setdefault(prompt_domain(item["id"]), []).append(encode_prompt(tokenizer, item))

    # named as reports show them ($DFLASH_HOME/..., not this machine's paths)
    drafts = [(name if name == "builtin" else shown_path(name), resolve(name))
              for name in args.drafts.split(",")]
    if args.quantize:
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        drafts += [(f"{name} 6-bit", quantized_copy(path, work)) for name, path in list(drafts)
                   if not is_quantized(path)]
    results: dict[str, dict] = {}
    for name, path in drafts:
        draft = load_draft(path)
        per = {d: measure_tau(model, tokenizer, draft, prompts, args.block_size, args.max_tokens)
               for d, prompts in domains.items()}
        cycles = sum(r["cycles"] for r in per.values())
        emitted = sum(r["tau"] * r["cycles"] for r in per.values())
        results[name] = {"path": path, "all": emitted / cycles if cycles else 0.0,
                         **{d: r["tau"] for d, r in per.items()},
                         "outputs": {d: r["outputs"] for d, r in per.items()}}
        print(f"{name}: " + ", ".join(f"{d} {r['tau']:.3f}" for d, r in per.items()),
              file=sys.stderr, flush=True)
    names = list(domains)
    print(f"\n| drafter | {' | '.join(f'{d} ({len(domains[d])})' for d in names)} | all |")
    print("|---|" + "---:|" * (len(names) + 1))
    for name, r in results.items():
        print(f"| {name} | " + " | ".join(f"{r[d]:.3f}" for d in names) + f" | {r['all']:.3f} |")
    for name, r in results.items():
        if name.endswith(" 6-bit"):
            base = results[name[: -len(" 6-bit")]]
            print(f"\n{name}: {100 * (r['all'] / base['all'] - 1):+.1f} % τ against its "
                  "unquantized original")
    # Greedy: every drafter must give the target's own tokens.
    first = next(iter(results.values()))["outputs"]
    same = all(r["outputs"] == first for r in results.values())
    print(f"\noutputs identical across drafters: {same}")
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"target": args.target, "prompts": args.prompts, "block_size": args.block_size,
             "max_tokens": args.max_tokens, "drafters": results}, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
