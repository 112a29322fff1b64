"""What the stored pair memory is worth to one-shot processes (the card's snippet, `dflash generate`).

Each prompt runs as its own `dflash generate --json` process, twice over the prompt file: first
with ``DFLASH_PAIR_MEMORY=0`` (every process starts from the drafter's raw confidence, as before
the memory was stored), then with it on, after forgetting what was stored (the first process
starts fresh, each later one from what the earlier ones stored). Greedy: both sides produce the
same tokens (checked), so what differs is the passes the ``auto`` policy chose: each generation's
``priced_ms`` (its passes at the pair's calibrated costs, summed by the engine) is deterministic,
so the ratio does not depend on what else the machine runs. Prints per-domain ratios (prompt
ids' prefix before the first ``-``/``/``).

    python scripts/bench_pair_memory.py [--prompts docs/bench/heldout-mix.jsonl] [--out FILE]

Model and drafter: the built-in pair unless ``--model``/``--draft`` are given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import dflash  # noqa: F401  (OpenBLAS before mlx)


def one_shot(prompt: str, args, store: bool) -> dict:
    command = [sys.executable, "-m", "dflash", "generate", "--json", "--no-speedup-estimate",
               "--max-tokens", str(args.max_tokens), "--block-size", str(args.block_size),
               "-p", prompt]
    for flag in ("model", "draft"):
        if getattr(args, flag):
            command += [f"--{flag}", getattr(args, flag)]
    env = dict(os.environ, DFLASH_PAIR_MEMORY="1" if store else "0")
    p = subprocess.run(command, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"dflash generate failed: {p.stderr.strip().splitlines()[-1]}")
    return json.loads(p.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="docs/bench/heldout-mix.jsonl")
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", help="JSON with every generation's statistics")
    args = ap.parse_args(argv)

    from dflash.pair import load_pair
    from dflash.pair_memory import forget_stored
    from dflash.prompts import prompt_domain, read_prompts

    pair = load_pair(args.model, args.draft)
    os.environ["DFLASH_PAIR_MEMORY"] = "1"
    print(f"forgot {forget_stored(pair.model, pair.draft)}", flush=True)
    items = read_prompts(args.prompts)
    runs: dict[str, dict] = {}
    for mode in ("fresh", "stored"):
        for item in items:
            r = one_shot(item["prompt"], args, store=mode == "stored")
            runs.setdefault(item["id"], {})[mode] = {
                "tokens": r["tokens"], **r["stats"]}
            print(f"{item['id']} {mode}: {runs[item['id']][mode]['priced_ms']:.0f} ms priced, "
                  f"{r['stats']['cycles']} cycles, {r['stats']['plain_steps']} plain steps",
                  flush=True)
    same = all(r["fresh"]["tokens"] == r["stored"]["tokens"] for r in runs.values())
    domains: dict[str, list[str]] = {}
    for key in runs:
        domains.setdefault(prompt_domain(key), []).append(key)
    print(f"\noutputs identical: {same}\n\n| prompts | fresh (ms) | stored (ms) | fresh / stored |"
          "\n|---|---:|---:|---:|")
    for name, keys in [*domains.items(), ("all", list(runs))]:
        fresh = sum(runs[k]["fresh"]["priced_ms"] for k in keys)
        stored = sum(runs[k]["stored"]["priced_ms"] for k in keys)
        print(f"| {name} ({len(keys)}) | {fresh:.0f} | {stored:.0f} | {fresh / stored:.3f}× |")
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
