"""Latency of one all-reduce (``mx.distributed.all_sum``) for the tensors a sharded target's
decode and verify passes reduce: one token's hidden state up to a 16-row verify block.

A tensor-parallel decoder layer (mlx-lm's llama / qwen3 / qwen3_5 ``shard()``) ends each of its
two halves with an all-sum of a ``(rows, hidden)`` tensor, so a pass over ``L`` layers pays
``2 L`` of these whatever its row count; this measures what one costs on the backend at hand
(docs/distributed.md puts the numbers into the speed-up model).

    python benchmarks/allreduce_latency.py                       # starts 2 ranks on localhost
    mlx.launch -n 2 --backend ring python benchmarks/allreduce_latency.py --hidden 576
    python benchmarks/allreduce_latency.py --json out.json --ranks 2 --repeats 3

Each size is timed ``--iters`` times back to back (each all-sum evaluated before the next is
issued, as a layer's next matmul waits for it), the median of those is one repeat; sizes are
interleaved across ``--repeats`` rounds, and rank 0 prints the median and the spread (min-max
of the repeat medians).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def measure(rows: list[int], hidden: int, dtype: str, iters: int, repeats: int) -> dict:
    import mlx.core as mx
    import numpy as np

    group = mx.distributed.init()
    kind = getattr(mx, dtype)
    tensors = {r: mx.ones((r, hidden), dtype=kind) for r in rows}
    mx.eval(list(tensors.values()))
    for r in rows:  # warm the connections and buffers
        for _ in range(10):
            mx.eval(mx.distributed.all_sum(tensors[r], group=group))
    runs: dict[int, list[float]] = {r: [] for r in rows}
    for rep in range(repeats):
        for r in (rows if rep % 2 == 0 else rows[::-1]):
            times = []
            for _ in range(iters):
                tic = time.perf_counter()
                mx.eval(mx.distributed.all_sum(tensors[r], group=group))
                times.append(time.perf_counter() - tic)
            runs[r].append(float(np.median(times)) * 1e6)
    return {"ranks": group.size(), "rank": group.rank(), "hidden": hidden, "dtype": dtype,
            "iters": iters, "repeats": repeats,
            "sizes": [{"rows": r, "bytes": r * hidden * mx.zeros((), kind).itemsize,
                       "median_us": float(np.median(runs[r])), "min_us": min(runs[r]),
                       "max_us": max(runs[r]), "repeat_medians_us": runs[r]} for r in rows]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16", help="rows of each tensor (comma-separated)")
    p.add_argument("--hidden", type=int, default=576, help="hidden size (SmolLM2-135M: 576)")
    p.add_argument("--dtype", default="float32", help="float32 (the CPU backend) or bfloat16")
    p.add_argument("--iters", type=int, default=200, help="all-sums timed per size and repeat")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds over the sizes")
    p.add_argument("--ranks", type=int, default=2, help="ranks to start when not launched")
    p.add_argument("--backend", default="ring", help="mlx.launch backend when not launched")
    p.add_argument("--json", default=None, help="also write the result to this file (rank 0)")
    args = p.parse_args()
    if not any(v in os.environ for v in ("MLX_RANK", "OMPI_COMM_WORLD_RANK")):
        launcher = shutil.which("mlx.launch")
        if launcher is None:
            print("mlx.launch is not on PATH", file=sys.stderr)
            return 2
        return subprocess.call([launcher, "-n", str(args.ranks), "--backend", args.backend,
                                sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]])
    rows = [int(x) for x in args.rows.split(",")]
    result = measure(rows, args.hidden, args.dtype, args.iters, args.repeats)
    if result["rank"] == 0:
        print(f"all_sum over {result['ranks']} ranks, hidden {args.hidden}, {args.dtype} "
              f"({args.iters} per size, {args.repeats} interleaved repeats)")
        print(f"{'rows':>5} {'bytes':>8} {'median µs':>10} {'spread µs':>16}")
        for s in result["sizes"]:
            print(f"{s['rows']:>5} {s['bytes']:>8} {s['median_us']:>10.1f} "
                  f"{s['min_us']:>7.1f}-{s['max_us']:<8.1f}")
        if args.json:
            out = Path(args.json)
            tmp = out.with_suffix(out.suffix + ".tmp")
            tmp.write_text(json.dumps(result, indent=1) + "\n")
            tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
