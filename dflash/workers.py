"""One single-threaded process per core: on these CPUs it beats one process with BLAS threads."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable


def run_per_core(fn: Callable, jobs: list[tuple], name: str, kwargs: dict | None = None) -> None:
    """Run ``fn(*job, **kwargs)`` for each job in its own spawned process and wait for all."""
    old = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # read by each child's OpenBLAS at load
    try:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=fn, args=job, kwargs=kwargs or {}) for job in jobs]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    finally:
        if old is None:
            os.environ.pop("OPENBLAS_NUM_THREADS", None)
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = old
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad:
        raise RuntimeError(f"{name} worker failed with exit code {bad[0]}")
