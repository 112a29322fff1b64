"""dflash.backend: set up explicitly (never at import), OpenBLAS routed in with the kernels the CPU
can run whether ``mlx.core`` was imported before dflash or not; the generation context."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

import dflash.backend as backend
from dflash.backend import openblas_coretype
from dflash.errors import BackendSetupError

LINUX = platform.system() == "Linux"
OPENBLAS_FOUND = LINUX and backend._find_openblas() is not None

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
    code = ("import os, dflash.backend as b; import json; b.configure(); print(json.dumps("
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


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_CORETYPE", "LD_PRELOAD", "DFLASH_BLAS", "DFLASH_NO_OPENBLAS")}
    return {**env, **extra}


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=_clean_env(**env),
                          capture_output=True, text=True, timeout=600)


def _last_json(run: subprocess.CompletedProcess) -> dict:
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_import_dflash_changes_nothing():
    """No BLAS loaded, no MLX imported, no environment variable set by ``import dflash``."""
    got = _last_json(_run(
        "import json, os, sys; import dflash, dflash.model_mlx\n"
        "maps = open('/proc/self/maps').read() if os.path.exists('/proc/self/maps') else ''\n"
        "import dflash.backend as b\n"
        "print(json.dumps({'openblas': 'libopenblas' in maps, 'status': b.blas_status,\n"
        "                  'coretype': os.environ.get('OPENBLAS_CORETYPE')}))"))
    assert got == {"openblas": False, "status": "unconfigured", "coretype": None}


LOAD_AFTER_MLX = """
import json, sys
import mlx.core as mx  # before dflash: the wheel's reference BLAS is bound now
from dflash.model_mlx import load
import dflash.backend as b
model, tokenizer = load(sys.argv[1])
print(json.dumps({"status": b.blas_status, "route": b.blas_route, "mlx_blas": b.mlx_blas(),
                  "lapack": b.mlx_blas("sgetrf_")}))
"""


@pytest.mark.skipif(not OPENBLAS_FOUND, reason="OpenBLAS is routed in on Linux, where installed")
def test_a_script_that_imported_mlx_first_runs_on_openblas(tiny_pair):
    """``load`` sets the backend up after the fact: MLX's BLAS and LAPACK slots are rebound."""
    target, _ = tiny_pair("llama")
    run = subprocess.run([sys.executable, "-c", LOAD_AFTER_MLX, str(target)], env=_clean_env(),
                         capture_output=True, text=True, timeout=600)
    got = _last_json(run)
    assert got["status"] == "openblas" and got["route"] == "rebound"
    assert "libopenblas" in got["mlx_blas"] and "libopenblas" in got["lapack"]


@pytest.mark.skipif(not OPENBLAS_FOUND, reason="OpenBLAS is routed in on Linux, where installed")
def test_configure_before_mlx_preloads_and_reference_leaves_mlx_alone():
    code = ("import json, dflash.backend as b; s = b.configure(); import mlx.core as mx; "
            "print(json.dumps({'route': s.route, 'mlx_blas': b.mlx_blas(), "
            "'again': b.configure() == s}))")
    got = _last_json(_run(code))
    assert got["route"] == "preloaded" and "libopenblas" in got["mlx_blas"] and got["again"]
    code = ("import json, mlx.core as mx, dflash.backend as b; s = b.configure(); "
            "print(json.dumps({'blas': s.blas, 'mlx_blas': b.mlx_blas()}))")
    got = _last_json(_run(code, DFLASH_BLAS="reference"))
    assert got["blas"] == "reference" and "libopenblas" not in got["mlx_blas"]
    assert got["mlx_blas"]  # the slot is read either way


@pytest.mark.skipif(not LINUX, reason="the BLAS switch acts on Linux only")
def test_required_openblas_that_is_missing_is_a_typed_error():
    code = "import mlx.core, dflash.backend as b; b.configure()"
    run = _run(code, DFLASH_BLAS="openblas", DFLASH_OPENBLAS="/nonexistent/libopenblas.so.0")
    assert run.returncode != 0
    assert "BackendSetupError" in run.stderr and "DFLASH_OPENBLAS" in run.stderr
    run = _run(code, DFLASH_BLAS="fast")
    assert run.returncode != 0 and "DFLASH_BLAS='fast'" in run.stderr


@pytest.mark.skipif(not OPENBLAS_FOUND, reason="OpenBLAS is routed in on Linux, where installed")
def test_a_build_whose_blas_cannot_be_rebound_says_what_to_do(monkeypatch):
    """Where MLX's slots cannot be found, the error names the three ways out."""
    import mlx.core  # noqa: F401  (loaded: the after-the-fact path)

    monkeypatch.setattr(backend, "_libmlx_slots", lambda: None)
    monkeypatch.setenv("OPENBLAS_CORETYPE", os.environ.get("OPENBLAS_CORETYPE", "Haswell"))
    monkeypatch.setattr(backend, "blas_core", backend.blas_core)
    with pytest.raises(BackendSetupError) as info:
        backend._route_blas()
    message = str(info.value)
    assert "configure()" in message and "LD_PRELOAD" in message
    assert "DFLASH_BLAS=reference" in message


@pytest.mark.skipif(not LINUX, reason="ELF libraries")
def test_plt_slots_of_the_installed_libmlx():
    import mlx.core  # noqa: F401

    path = backend._loaded_libmlx()
    assert path is not None
    slots = backend.plt_slots(path)
    assert "cblas_sgemm" in slots and all(isinstance(v, int) and v > 0 for v in slots.values())


def test_generation_context_is_harmless_on_this_device():
    """What mlx-lm wraps a generation in (wired limit, generation stream, cache cleared at the
    end): a pass run under the yielded stream computes what the default stream computes."""
    import mlx.core as mx
    import mlx.nn as nn

    model = nn.Linear(8, 8)
    x = mx.arange(16, dtype=mx.float32).reshape(2, 8)
    expected = model(x)
    with backend.generation_context(model) as stream:
        with backend.pass_stream(stream):
            got = model(x)
        assert mx.array_equal(got, expected).item()
    assert mx.get_cache_memory() == 0
