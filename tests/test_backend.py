"""dflash.backend: OpenBLAS routed in with the kernels the CPU can run."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from dflash.backend import openblas_coretype

SKYLAKEX_FLAGS = {"sse2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                  "avx512cd"}


def test_kernels_named_from_the_instruction_set():
    assert openblas_coretype(SKYLAKEX_FLAGS) == "SkylakeX"
    assert openblas_coretype(SKYLAKEX_FLAGS | {"avx512_bf16", "amx_tile"}) == "SkylakeX"
    assert openblas_coretype({"sse2", "avx", "avx2", "fma"}) == "Haswell"
    assert openblas_coretype({"avx512f", "avx2"}) is None  # partial AVX-512 and no FMA: unsure
    assert openblas_coretype({"sse2", "avx"}) is None  # older: OpenBLAS's own detection
    assert openblas_coretype(set()) is None  # not x86 (aarch64 lists "Features")


def _probe(env: dict) -> dict:
    code = ("import dflash, os, dflash.backend as b; import json; print(json.dumps("
            "{'status': b.blas_status, 'core': b.blas_core, "
            "'env': os.environ.get('OPENBLAS_CORETYPE')}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                    reason="OpenBLAS is routed in on Linux; the kernel names are x86-64's")
def test_openblas_loads_the_kernels_of_this_cpu():
    """A CPU newer than the OpenBLAS build made it fall back to SSE3 ("Prescott") kernels, 6x
    slower here; the flags now name the kernels. A user's OPENBLAS_CORETYPE is kept."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "LD_PRELOAD")}
    got = _probe(env)
    if got["status"] != "openblas":
        pytest.skip(f"OpenBLAS not routed in here ({got['status']})")
    with open("/proc/cpuinfo") as f:
        flags = next((set(line.split(":", 1)[1].split()) for line in f
                      if line.startswith("flags")), set())
    expected = openblas_coretype(flags)
    if expected:
        assert got["env"] == expected and got["core"].lower() == expected.lower()
    chosen = _probe({**env, "OPENBLAS_CORETYPE": "Haswell"})
    assert chosen["env"] == "Haswell" and chosen["core"].lower() == "haswell"
