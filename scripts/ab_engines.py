"""mlx-lm, a previous commit's engine and this checkout's, interleaved in one process.

On a shared, loaded machine two runs of the same generation differ by up to 2x; comparing engines
run minutes apart says nothing about a few per cent. Here the previous engine (``--base``, a git
ref: its ``dflash/`` extracted with ``git archive`` and imported as ``dflash_base``) and this
checkout's run the same prompt ids on the same loaded pair, round-robin per prompt (the order
alternating), and every greedy output is checked against mlx-lm's.

    python scripts/make_random_drafter.py $DFLASH_HOME/bench/random-drafter   # once
    python scripts/ab_engines.py --draft $DFLASH_HOME/bench/random-drafter --limit 4 --rounds 3
    python scripts/ab_engines.py --ids chat-heldout --rounds 1
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

# isort: off
import dflash  # noqa: F401  (OpenBLAS before mlx)
# isort: on
from dflash import backend, bench
from dflash.pair import load_pair
from dflash.prompts import encode_prompt

GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


def import_base(ref: str, into: Path):
    """``dflash/`` at ``ref``, imported as ``dflash_base`` (its imports inside are relative)."""
    archive = subprocess.run(["git", "archive", ref, "dflash"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "dflash").rename(into / "dflash_base")
    sys.path.append(str(into))
    # Imported after mlx, the copy finds OpenBLAS "too late", so its cost model would call the
    # cached calibration another machine's and re-measure (and overwrite) it; the process's BLAS
    # is this one's.
    importlib.import_module("dflash_base.backend").blas_status = backend.blas_status
    return importlib.import_module("dflash_base.bench")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--base", default="HEAD~1", help="git ref of the previous engine")
    ap.add_argument("--prompts", default="docs/bench/heldout-mix.jsonl")
    ap.add_argument("--ids", default="", help="comma-separated id prefixes (default: --limit)")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    base_bench = import_base(args.base, Path(tempfile.mkdtemp()))
    pair = load_pair(args.model, args.draft)
    _, items = bench.load_prompts(args.prompts, None)
    if args.ids:
        wanted = args.ids.split(",")
        items = [i for i in items if any(i["id"].startswith(w) for w in wanted)]
    else:
        items = items[:args.limit]
    n, bs = args.max_tokens, args.block_size
    engines = {
        "mlx-lm": lambda ids: bench._run_baseline(pair, ids, n, GREEDY, 0),
        "base": lambda ids: base_bench._run_dflash(pair, ids, n, bs, GREEDY, 0),
        "new": lambda ids: bench._run_dflash(pair, ids, n, bs, GREEDY, 0),
    }
    encoded = [encode_prompt(pair.tokenizer, item) for item in items]
    for run in engines.values():  # warm-up
        run(encoded[0][:64])
    ratios: dict[str, list[float]] = {"base": [], "new": [], "new/base": []}
    totals = {k: [0.0, 0] for k in engines}
    for r in range(args.rounds):
        for i, (item, ids) in enumerate(zip(items, encoded)):
            order = list(engines) if (r + i) % 2 == 0 else list(engines)[::-1]
            res = {k: engines[k](ids) for k in order}
            for k, out in res.items():
                if out["tokens"] != res["mlx-lm"]["tokens"]:
                    print(f"MISMATCH: {k} differs from mlx-lm on {item['id']}")
                totals[k][0] += out["decode_time"]
                totals[k][1] += out["decode_tokens"]
            tps = {k: out["decode_tps"] for k, out in res.items()}
            ratios["base"].append(tps["base"] / tps["mlx-lm"])
            ratios["new"].append(tps["new"] / tps["mlx-lm"])
            ratios["new/base"].append(tps["new"] / tps["base"])
            print(f"{item['id']} (round {r + 1}): tok/s "
                  + ", ".join(f"{k} {v:.2f}" for k, v in tps.items())
                  + f"; plain steps / cycles: base {res['base']['plain_steps']} / "
                  f"{res['base']['cycles']}, new {res['new']['plain_steps']} / "
                  f"{res['new']['cycles']}", flush=True)
    for k, v in ratios.items():
        name = k if "/" in k else f"{k}/mlx-lm"
        print(f"{name}: median {statistics.median(v):.3f} (min {min(v):.3f}, max {max(v):.3f}, "
              f"n {len(v)})")
    tps = {k: tokens / seconds for k, (seconds, tokens) in totals.items()}
    print("all tokens: " + ", ".join(f"{k} {v:.2f} tok/s" for k, v in tps.items())
          + f"; base/mlx-lm {tps['base'] / tps['mlx-lm']:.3f}, "
          f"new/mlx-lm {tps['new'] / tps['mlx-lm']:.3f}")


if __name__ == "__main__":
    main()
