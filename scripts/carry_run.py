"""Carry a long training run to another machine through the repository.

$DFLASH_HOME stays on the machine that made it; a session may start on a new one (session 10 did:
the final-v2 run, 10.6 training CPU-h, was gone with its machine). This packs the run's newest
checkpoint (~50 MB: float16 weights, bfloat16 optimizer moments, the state and metrics) into
``datasets/<name>/runs/<run>/``, and ``--restore`` puts it back so ``dflash train --resume``
continues it. The features are not carried (GBs): ``scripts/train_builtin_drafter.sh`` recomputes
them from the token records first (~50 min on the 2-core machine for 2,600 records, 835k tokens).

    python scripts/carry_run.py $DFLASH_HOME/runs/final-v4            # pack (commit the result)
    python scripts/carry_run.py $DFLASH_HOME/runs/final-v4 --restore  # unpack on a new machine
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import dflash  # noqa: F401  (before mlx: the CPU backend's BLAS)
from dflash.training.checkpoints import pack_checkpoint, unpack_checkpoint

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="the run's output folder (checkpoints in RUN/train)")
    ap.add_argument("--name", default="smollm2")
    ap.add_argument("--store", type=Path, default=None,
                    help="the packed checkpoint's folder (default datasets/NAME/runs/RUN)")
    ap.add_argument("--home", type=Path,
                    default=Path(os.environ.get("DFLASH_HOME", Path.home() / ".cache/dflash")))
    ap.add_argument("--restore", action="store_true")
    args = ap.parse_args(argv)
    store = args.store or REPO / "datasets" / args.name / "runs" / args.run.name
    if args.restore:
        path = unpack_checkpoint(store, args.run / "train", args.home)
    else:
        path = pack_checkpoint(args.run / "train", store, args.home)
    size = sum(f.stat().st_size for f in path.iterdir()) / 1e6
    print(f"{'restored' if args.restore else 'packed'}: {path} ({size:.1f} MB)")
    return path


if __name__ == "__main__":
    main()
