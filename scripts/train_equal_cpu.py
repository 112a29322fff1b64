"""Train a drafter for a fixed amount of *training* CPU time (``time.process_time``, all threads,
measured from the first step: loading the target and the data is not counted), then export it.

Why: on a shared machine wall time says little; two architectures (DFlash2 vs v1, issue 12) are
compared at equal CPU time spent on optimizer steps. Every ``dflash train`` flag after ``--``::

    nice -n 10 python scripts/train_equal_cpu.py --cpu-seconds 150 -- \\
        --data D --feature-cache D/features --only-cached \\
        --init-from dflash/assets/smollm2-135m-dflash-6bit --arch dflash2 --out OUT ...

Prints one JSON line: steps taken, training CPU seconds, wall seconds, the last step's stats.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import dflash  # noqa: F401  (OpenBLAS before mlx)


def main(argv=None) -> int:
    from dflash.console import log
    from dflash.default_pair import default_target_path
    from dflash.training.commands import add_train_args
    from dflash.training.options import TrainOptions, from_args
    from dflash.training.trainer import Trainer

    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-seconds", type=float, required=True)
    p.add_argument("--log-every", type=int, default=5)
    args = p.parse_args(argv[:split])
    train_args = add_train_args(argparse.ArgumentParser()).parse_args(argv[split + 1:])
    opts = from_args(train_args)
    opts["target"] = opts.get("target") or str(default_target_path())

    tr = Trainer(TrainOptions(**opts))
    cpu0, wall0 = time.process_time(), time.time()
    history = []
    while tr.step < tr.opts.steps and time.process_time() - cpu0 < args.cpu_seconds:
        stats = tr.train_step(tr.make_batch(tr._next_samples(), tr._step_rng()))
        tr.step += 1
        record = {"step": tr.step, "cpu_s": round(time.process_time() - cpu0, 1),
                  **{k: round(v, 4) for k, v in stats.items()}}
        history.append(record)
        if tr.step % args.log_every == 0:
            log(json.dumps(record))
    cpu, wall = time.process_time() - cpu0, time.time() - wall0
    tr.history = history
    tr.export()
    print(json.dumps({"arch": tr.opts.arch, "out": tr.opts.out, "steps": tr.step,
                      "train_cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
                      "last": history[-1] if history else None}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
