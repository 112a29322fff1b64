"""Carry a training run's newest checkpoint to another machine, and restore final-v4's.

A run's checkpoints live under ``$DFLASH_HOME`` on the machine that made them. This packs the
newest one small (float16 weights, bfloat16 optimizer moments, ``$DFLASH_HOME``-relative paths in
its state, the metrics so far) into a folder you can copy, and ``--restore`` puts a pack back as
``RUN/train/step-N`` so ``dflash train --resume`` continues it. The features are not carried: the
recipe recomputes them from the token records.

final-v4's float checkpoint at step 5,250 is kept in the repository's history, not in its tree:
``--from-commit`` (default ``datasets/smollm2/MANIFEST.json``'s commit) reads the pack out of
git, so a clone with full history can continue that run.

    python recipes/smollm2/carry_checkpoint.py RUN --store DIR             # pack the newest
    python recipes/smollm2/carry_checkpoint.py RUN --store DIR --restore   # into RUN/train
    python recipes/smollm2/carry_checkpoint.py RUN --restore --from-commit # final-v4, step 5,250
    python recipes/smollm2/carry_checkpoint.py RUN --export OUT            # the newest, as a
        # float drafter folder (for `dflash train --init-from OUT`); with --restore, once restored
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "datasets" / "smollm2" / "MANIFEST.json"
PACK_FILES = ("PACKED", "state.json", "draft.safetensors", "optimizer.safetensors",
              "metrics.jsonl")


def packed_from_git(dest: Path, commit: str | None = None, path: str | None = None) -> Path:
    """Write the packed checkpoint held by ``commit`` (at ``path`` in that commit) into ``dest``."""
    kept = json.loads(MANIFEST.read_text())["checkpoint"]
    commit, path = commit or kept["commit"], path or kept["path"]
    dest.mkdir(parents=True, exist_ok=True)
    for name in PACK_FILES:
        blob = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:{path}/{name}"],
                              capture_output=True, check=False)
        if blob.returncode != 0:
            raise SystemExit(f"git show {commit}:{path}/{name} failed (a clone with full history "
                             f"is needed): {blob.stderr.decode().strip()}")
        tmp = dest / f".{name}.tmp"
        tmp.write_bytes(blob.stdout)
        tmp.replace(dest / name)
    return dest


def main(argv: list[str] | None = None) -> Path:
    from dflash.backend import configure

    configure()  # the CPU backend's BLAS, before mlx loads
    from dflash.training.checkpoints import pack_checkpoint, unpack_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="the run's output folder (checkpoints in RUN/train)")
    ap.add_argument("--store", type=Path, default=None, help="the packed checkpoint's folder")
    ap.add_argument("--home", type=Path,
                    default=Path(os.environ.get("DFLASH_HOME", Path.home() / ".cache/dflash")))
    ap.add_argument("--restore", action="store_true")
    ap.add_argument("--from-commit", nargs="?", const="", default=None, metavar="COMMIT",
                    help="with --restore: read the pack from git history (default: the commit "
                         "datasets/smollm2/MANIFEST.json names)")
    ap.add_argument("--export", type=Path, default=None, metavar="OUT",
                    help="write the run's newest checkpoint (with --restore: the restored one) "
                         "as a drafter folder: bf16 weights, its training vocabulary as "
                         "draft_vocab_ids")
    args = ap.parse_args(argv)
    if args.export is not None and not args.restore and args.store is None:
        from dflash.training.checkpoints import list_checkpoints
        from dflash.training.initialise import export_checkpoint

        have = list_checkpoints(args.run / "train")
        if not have:
            raise SystemExit(f"{args.run / 'train'}: no checkpoint to export")
        print(f"exported: {export_checkpoint(have[-1], args.export)}")
        return args.export
    if args.from_commit is not None:
        if not args.restore:
            raise SystemExit("--from-commit needs --restore")
        with tempfile.TemporaryDirectory() as tmp:
            store = packed_from_git(Path(tmp) / "pack", args.from_commit or None)
            path = unpack_checkpoint(store, args.run / "train", args.home)
    elif args.store is None:
        raise SystemExit("--store DIR is needed (or --restore --from-commit)")
    elif args.restore:
        path = unpack_checkpoint(args.store, args.run / "train", args.home)
    else:
        path = pack_checkpoint(args.run / "train", args.store, args.home)
    size = sum(f.stat().st_size for f in path.iterdir()) / 1e6
    print(f"{'restored' if args.restore else 'packed'}: {path} ({size:.1f} MB)")
    if args.export is not None:
        from dflash.training.initialise import export_checkpoint

        print(f"exported: {export_checkpoint(path, args.export)}")
    return path


if __name__ == "__main__":
    main()
