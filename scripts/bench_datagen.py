"""Training-data throughput: finished record tokens per second of ``dflash datagen``'s one-pass
capture, beside the target's own batched decoding (mlx-lm's ``BatchGenerator``) on the same
prompts in the same process, at several batch sizes.

A record token is a prompt or response token whose tap features and top-k are stored; the old
pipeline (generation, then a second teacher-forced pass for features) made ~50 per second here.

    python scripts/bench_datagen.py [--prompts FILE.jsonl] [--n 64] [--max-tokens 128]
                                    [--batch-sizes 16,32,64]
"""

from __future__ import annotations

import argparse
import time

# isort: off
import dflash  # noqa: F401  (OpenBLAS before mlx)
# isort: on
from mlx_lm.generate import BatchGenerator

from dflash.default_pair import default_target_path
from dflash.prompts import encode_prompt, read_prompts
from dflash.target import load_target, target_parts
from dflash.training.capture import RolloutEngine
from dflash.training.recipe import default_taps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", default="../shared/datasets/gsm8k-train.jsonl")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="16,32,64")
    args = ap.parse_args()
    model, tokenizer = load_target(args.model or str(default_target_path()))
    parts = target_parts(model)
    items = read_prompts(args.prompts)[: args.n]
    prompts = [encode_prompt(tokenizer, it) for it in items]
    n_prompt = sum(len(p) for p in prompts)
    taps = default_taps(parts.num_layers)
    print(f"{len(prompts)} prompts ({n_prompt} tokens), up to {args.max_tokens} new tokens each, "
          f"taps {taps}")
    print("batch  capture rec tok/s  (gen tok/s)  mlx-lm batch gen tok/s  capture/mlx-lm gen")
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        engine = RolloutEngine(parts, taps=taps, topk=16, max_tokens=args.max_tokens,
                               batch_size=bs, stop_ids=tokenizer.eos_token_ids)
        tic = time.perf_counter()
        n_gen = sum(len(r.response_ids) for r in
                    engine.run((str(i), p) for i, p in enumerate(prompts)))
        cap_s = time.perf_counter() - tic
        gen = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids],
                             completion_batch_size=bs, prefill_batch_size=bs)
        tic = time.perf_counter()
        gen.insert(prompts, [args.max_tokens] * len(prompts))
        base_gen = 0
        while responses := gen.next_generated():
            base_gen += len(responses)
        base_s = time.perf_counter() - tic
        gen.close()
        print(f"{bs:5d}  {(n_prompt + n_gen) / cap_s:18.1f}  ({n_gen / cap_s:9.1f})  "
              f"{base_gen / base_s:22.1f}  {(n_gen / cap_s) / (base_gen / base_s):17.2f}",
              flush=True)


if __name__ == "__main__":
    main()
