"""Acceptance τ of a drafter on held-out prompts through the real engine (greedy, chat template).

    python scripts/train_eval_tau.py --draft /work/data/drafts/NAME \
        --prompts /work/data/gsm8k-heldout.jsonl --n 20 --block-sizes 16,8 --max-tokens 256

Prints one JSON line per block size: τ (emitted tokens per cycle, over all prompts), acceptance by
position, tokens/s of the speculative path. ``--target`` defaults to the built-in SmolLM2 target.
"""

from __future__ import annotations

import argparse
import json
import time

import dflash  # noqa: F401  (OpenBLAS before mlx)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--draft", required=True)
    p.add_argument("--target", default=None)
    p.add_argument("--prompts", default="/work/data/gsm8k-heldout.jsonl")
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--skip", type=int, default=0, help="start at this prompt")
    p.add_argument("--block-sizes", default="16,8")
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args()

    from dflash.acceptance import measure_tau
    from dflash.drafter import load_draft
    from dflash.model_mlx import load
    from dflash.prompts import encode_prompt, read_prompts

    if args.target is None:
        from dflash.default_pair import default_target_path

        args.target = str(default_target_path())
    model, tok = load(args.target)
    draft = load_draft(args.draft)
    items = read_prompts(args.prompts)[args.skip:args.skip + args.n]
    prompts = [encode_prompt(tok, it) for it in items]
    for bs in [int(b) for b in args.block_sizes.split(",")]:
        t0 = time.time()
        r = measure_tau(model, tok, draft, prompts, bs, args.max_tokens)
        r.update(draft=args.draft, prompts=args.prompts, n=len(prompts),
                 max_tokens=args.max_tokens, wall_s=round(time.time() - t0, 1))
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
