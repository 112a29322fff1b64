"""One single-threaded process per core: on these CPUs it beats one process with BLAS threads."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable

from .errors import WorkerFailedError


def start_per_core(fn: Callable, jobs: list[tuple], kwargs: dict | None = None,
                   daemon: bool = False) -> list[mp.Process]:
    """Start ``fn(*job, **kwargs)`` for each job in its own spawned, single-threaded process."""
    old = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # read by each child's OpenBLAS at load
    try:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=fn, args=job, kwargs=kwargs or {}, daemon=daemon)
                 for job in jobs]
        for p in procs:
            p.start()
    finally:
        if old is None:
            os.environ.pop("OPENBLAS_NUM_THREADS", None)
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = old
    return procs


def run_per_core(fn: Callable, jobs: list[tuple], name: str, kwargs: dict | None = None) -> None:
    """Run ``fn(*job, **kwargs)`` for each job in its own spawned process and wait for all."""
    procs = start_per_core(fn, jobs, kwargs)
    for p in procs:
        p.join()
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad:
        raise WorkerFailedError(f"{name} worker failed with exit code {bad[0]}")
