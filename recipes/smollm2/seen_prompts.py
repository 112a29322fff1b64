"""Prompts the built-in drafter trained on, for τ on its own training records.

Held-out τ says how well the drafter generalises; τ on records it trained on (final-v4 saw each
of the 2,600 kept records ~8 times) says how well it can fit at all. Where the two are close
more records cannot help much, and where even the fitted τ is below a target no amount of
records at this drafter size reaches it. Measured for final-v4 in docs/drafter-data.md.

Each line is a kept record's prompt as the target saw it (chat template applied, so run the bench
with ``--no-chat-template``); greedy decoding writes the record's own response again. Ids are
``seen<domain>-<n>`` so ``dflash bench --tau`` reports each domain on its own line.

    python recipes/smollm2/seen_prompts.py OUT.jsonl [--n 24] [--seed 0]
    dflash bench --tau --draft DRAFTER --prompts OUT.jsonl --no-chat-template \
        --block-size 16 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def seen_prompts(n: int, seed: int, domains: tuple[str, ...] = ("math", "chat", "code")) -> list[dict]:
    from transformers import AutoTokenizer

    from dflash.default_pair import default_target_path
    from dflash.training.records import legacy_records

    tokenizer = AutoTokenizer.from_pretrained(str(default_target_path()))
    kept = legacy_records()
    out = []
    for domain in domains:
        records = [r for r in kept if r["domain"] == domain]
        random.Random(seed).shuffle(records)
        out += [{"id": f"seen{domain}-{i}", "record": r["id"],
                 "prompt": tokenizer.decode(r["prompt_ids"])}
                for i, r in enumerate(records[:n])]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the prompt file to write (JSONL)")
    ap.add_argument("--n", type=int, default=24, help="prompts a domain (default 24)")
    ap.add_argument("--seed", type=int, default=0, help="which records (a seeded shuffle)")
    args = ap.parse_args(argv)
    from dflash.files import write_atomic

    rows = seen_prompts(args.n, args.seed)
    write_atomic(args.out, "".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
