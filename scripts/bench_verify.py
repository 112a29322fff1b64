"""What a verify pass costs on this machine: the numbers that decide the default block size.

Prints, for a target (default: the built-in SmolLM2), the time of one target pass over R rows
(R = 1, 2, 4, ..., 16) relative to a one-token step at the same context length, and the drafter's
cost per block. Speculation pays when tau > (verify(R) + draft) / step(1).

    python scripts/bench_verify.py [--model PATH] [--draft PATH] [--context 256] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

# isort: off
import dflash  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
# isort: on

from dflash import backend
from dflash.model_mlx import load, load_draft
from dflash.target import forward, make_cache, target_parts


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    best = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t)
    best.sort()
    return best[len(best) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if args.model is None:
        from dflash.default_pair import default_draft_path, default_target_path

        args.model = str(default_target_path())
        try:
            args.draft = args.draft or str(default_draft_path())
        except FileNotFoundError:
            args.draft = None
    model, _ = load(args.model)
    parts = target_parts(model)
    draft = load_draft(args.draft) if args.draft else None
    print(f"backend: device={mx.default_device()} blas={backend.blas_status} "
          f"dtype={parts.norm.weight.dtype}")
    prompt = mx.array([list(range(1, args.context + 1))]) % parts.vocab_size
    cache = make_cache(parts)
    logits, taps = forward(parts, prompt, cache, draft.target_layer_ids if draft else [])
    mx.eval(logits, [c.state for c in cache])

    def verify(rows: int):
        def run():
            out, _ = forward(parts, mx.arange(rows)[None] + 5, cache, [])
            mx.eval(out)
            for c in cache:
                c.trim(rows)
        return run

    step = timed(verify(1), args.repeats)
    print(f"one-token step: {step * 1e3:.2f} ms at context {args.context}")
    print("rows  verify_ms  x_step")
    for rows in (2, 4, 6, 8, 10, 12, 14, 16):
        t = timed(verify(rows), args.repeats)
        print(f"{rows:4d}  {t * 1e3:9.2f}  {t / step:6.2f}")
    if draft is not None:
        dcache = draft.make_cache()
        draft.append_context(taps, dcache)
        print("block  draft_ms  x_step")
        for bs in (4, 8, 16):
            t = timed(lambda bs=bs: mx.eval(draft.block_logits(parts, 5, bs, dcache)), args.repeats)
            print(f"{bs:5d}  {t * 1e3:8.2f}  {t / step:6.2f}")


if __name__ == "__main__":
    main()
