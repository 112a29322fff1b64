"""How far a multi-row verify pass is from one-row steps in floating point.

A verify pass computes its rows in one matrix product; mlx-lm's decoding computes one row per
step. The two sum in different orders, so their logits differ in the last bits, and a greedy
near-tie closer than that difference can resolve differently (docs/how-it-works.md, "What
identical means in floating point"). With a quantized KV cache a last-bit difference in a key can
move it to the next quantization level, which magnifies the difference
(docs/long-context.md). This script measures both on the target: two caches prefilled alike
with mlx-lm's own forward and cache conversion, then ``--rows`` single steps on one and one
``--rows``-row pass on the other over the same tokens, and prints the largest logit difference
per row.

    python benchmarks/verify_rounding.py --context 600
    python benchmarks/verify_rounding.py --context 600 --kv-bits 8
"""

from __future__ import annotations

import argparse

from dflash.backend import configure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target folder (default: the built-in one)")
    ap.add_argument("--context", type=int, default=600, help="tokens cached before the rows")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--kv-bits", type=int, default=None, choices=(2, 3, 4, 5, 6, 8))
    ap.add_argument("--kv-group-size", type=int, default=64, choices=(32, 64, 128))
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    args = ap.parse_args()
    configure()
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache

    from dflash.default_pair import default_target_path

    model, _ = load(args.model or str(default_target_path()))
    n, rows = args.context, args.rows
    ids = mx.array([(i * 7919) % 40000 + 100 for i in range(n + rows)])

    def prefilled() -> list:
        cache = make_prompt_cache(model)
        for start in range(0, n, args.prefill_step_size):
            model(ids[start:min(start + args.prefill_step_size, n)][None], cache=cache)
            if args.kv_bits is not None:  # as mlx-lm's generate_step converts, from the start
                maybe_quantize_kv_cache(cache, quantized_kv_start=0,
                                        kv_group_size=args.kv_group_size, kv_bits=args.kv_bits)
            mx.eval([c.state for c in cache])
        return cache

    stepped = prefilled()
    singles = []
    for j in range(rows):
        singles.append(model(ids[n + j:n + j + 1][None], cache=stepped)[0, -1])
        mx.eval(singles[-1])
    passed = model(ids[n:n + rows][None], cache=prefilled())[0]
    mx.eval(passed)
    diffs = [mx.abs(singles[j] - passed[j]).max().item() for j in range(rows)]
    cache = "float" if args.kv_bits is None else f"kv_bits={args.kv_bits}"
    print(f"context {n}, {cache}: largest logit difference per row, {rows}-row pass against "
          f"{rows} single steps")
    print(" ".join(f"{d:.1e}" for d in diffs))
    print(f"max {max(diffs):.2e}")


if __name__ == "__main__":
    main()
