"""Speculative sampling against target-only sampling: τ and throughput per temperature and mode.

For each temperature (default 0, 0.6 and 1.0) with the model card's other settings (top_p 0.95,
top_k 20, min_p 0, repetition penalty 1.05, presence penalty 1.5; ``--settings plain`` drops
everything but the temperature), it runs on the same prompt token ids:

- mlx-lm's ``generate_step`` with ``make_sampler`` + ``make_logits_processors`` (the target alone);
- dflash's ``stream_generate`` with ``proposal="argmax"`` and with ``proposal="sample"``.

and prints decode throughput, speed-up over mlx-lm, τ (tokens per target pass) and the acceptance
of the first block positions. At temperature 0 dflash must reproduce mlx-lm token for token (the
penalties included); the table says whether it did. Neither side stops at EOS: every run decodes
exactly ``--max-tokens`` tokens, so the work compared is the same.

    python scripts/bench_sampling.py [--model PATH --draft PATH] [--limit 4] [--max-tokens 128]
        [--temperatures 0,0.6,1.0] [--modes argmax,sample] [--block-size N] [--json out.json]
"""

from __future__ import annotations

import dflash  # noqa: F401, I001  # isort: skip  (before mlx: routes OpenBLAS)

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from dflash.speculative import stream_generate

CARD = dict(top_p=0.95, top_k=20, min_p=0.0, repetition_penalty=1.05, presence_penalty=1.5)


def target_only(model, ids: list[int], max_tokens: int, temperature: float, settings: dict,
                seed: int) -> dict:
    mx.random.seed(seed)
    sampler = make_sampler(temperature, settings.get("top_p", 1.0), settings.get("min_p", 0.0),
                           top_k=settings.get("top_k", 0))
    procs = make_logits_processors(None, settings.get("repetition_penalty"), 20,
                                   settings.get("presence_penalty"), 20, None, 20)
    tokens = []
    tic = time.perf_counter()
    first = None
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens, sampler=sampler,
                                logits_processors=procs):
        tokens.append(int(tok))
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return {"tokens": tokens, "prompt_s": first - tic, "decode_s": end - first}


def speculative(model, draft, ids: list[int], max_tokens: int, temperature: float,
                settings: dict, proposal: str, block_size: int | None, seed: int) -> dict:
    tokens = []
    tic = time.perf_counter()
    first, last = None, None
    for r in stream_generate(model, draft, None, ids, block_size=block_size,
                             max_tokens=max_tokens, temperature=temperature, seed=seed,
                             proposal=proposal, **settings):
        tokens += r.tokens
        if first is None:
            first = time.perf_counter()
        last = r
    end = time.perf_counter()
    return {"tokens": tokens, "prompt_s": first - tic, "decode_s": end - first,
            "cycles": last.cycles, "tau": last.mean_tau,
            "acceptance_by_position": list(last.acceptance_by_position)}


def load(args):
    """(model, tokenizer, draft): the built-in pair unless --model/--draft are given."""
    from dflash.errors import DFlashError
    from dflash.pair import load_pair

    try:
        pair = load_pair(args.model, args.draft, log=lambda line: print(line, file=sys.stderr))
    except DFlashError as e:
        sys.exit(f"bench_sampling: {e}")
    return pair.model, pair.tokenizer, pair.draft


def prompt_ids(tokenizer, limit: int) -> list[list[int]]:
    from dflash.bench import load_prompts
    from dflash.prompts import encode_prompt

    _, items = load_prompts("builtin", limit)
    return [encode_prompt(tokenizer, item) for item in items]


def summarise(runs: list[dict], base: list[dict] | None) -> dict:
    decode_tokens = sum(len(r["tokens"]) - 1 for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    out = {"tok_s": decode_tokens / decode_s if decode_s else 0.0}
    if "tau" in runs[0]:
        cycles = sum(r["cycles"] for r in runs)
        out["tau"] = sum(r["tau"] * r["cycles"] for r in runs) / cycles if cycles else 0.0
        width = max(len(r["acceptance_by_position"]) for r in runs)
        out["acceptance_by_position"] = [
            statistics.fmean(r["acceptance_by_position"][j] for r in runs
                             if j < len(r["acceptance_by_position"])) for j in range(width)]
    if base is not None:
        out["speedup"] = out["tok_s"] / summarise(base, None)["tok_s"]
        out["identical"] = all(r["tokens"] == b["tokens"] for r, b in zip(runs, base))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="mlx-lm target (default: the built-in one)")
    ap.add_argument("--draft", default=None, help="DFlash drafter (default: the built-in one)")
    ap.add_argument("--limit", type=int, default=4, help="built-in prompts to use")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,0.6,1.0")
    ap.add_argument("--modes", default="argmax,sample")
    ap.add_argument("--settings", choices=("card", "plain"), default="card")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    temperatures = [float(t) for t in args.temperatures.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    settings = CARD if args.settings == "card" else {}

    model, tokenizer, draft = load(args)
    prompts = prompt_ids(tokenizer, args.limit)
    block = args.block_size or draft.block_size
    print(f"{len(prompts)} prompts, {args.max_tokens} tokens each, block {block}, "
          f"settings {args.settings}: {settings}", flush=True)
    # Warm-up (compilation, allocator) on the first prompt.
    target_only(model, prompts[0], 8, 1.0, settings, args.seed)
    speculative(model, draft, prompts[0], 8, 1.0, settings, "argmax", block, args.seed)

    results = []
    for temp in temperatures:
        base, spec = [], {m: [] for m in modes}
        for i, ids in enumerate(prompts):
            order = ["base", *modes]
            if i % 2:
                order.reverse()  # alternate who runs first
            for which in order:
                if which == "base":
                    base.append(target_only(model, ids, args.max_tokens, temp, settings,
                                            args.seed + i))
                else:
                    spec[which].append(speculative(model, draft, ids, args.max_tokens, temp,
                                                   settings, which, block, args.seed + i))
        row = {"temperature": temp, "mlx_lm": summarise(base, None)}
        for m in modes:
            row[m] = summarise(spec[m], base)
        results.append(row)
        print(f"temperature {temp}: done", flush=True)

    print()
    print(f"| temperature | mode | tok/s | speed-up | τ | acceptance at positions 1-4 |"
          f"{' same tokens |' if 0.0 in temperatures else ''}")
    print("|---|---|---|---|---|---|" + ("---|" if 0.0 in temperatures else ""))
    for row in results:
        temp = row["temperature"]
        extra = " |" if 0.0 in temperatures else ""
        print(f"| {temp:g} | mlx-lm (target only) | {row['mlx_lm']['tok_s']:.1f} | 1.00 | 1.00"
              f" | |{extra}")
        for m in modes:
            r = row[m]
            acc = ", ".join(f"{a:.2f}" for a in r["acceptance_by_position"][:4])
            same = (f" {'yes' if r['identical'] else 'NO'} |" if temp == 0 else " |") \
                if 0.0 in temperatures else ""
            print(f"| {temp:g} | dflash {m} | {r['tok_s']:.1f} | {r['speedup']:.2f} | "
                  f"{r['tau']:.2f} | {acc} |{same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "block_size": block, "max_tokens": args.max_tokens,
                       "n_prompts": len(prompts), "results": results}, f, indent=2)
    if any(row["temperature"] == 0 and not row[m]["identical"] for row in results for m in modes):
        sys.exit("bench_sampling: temperature 0 output differs from mlx-lm's")


if __name__ == "__main__":
    main()
