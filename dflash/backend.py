"""How MLX runs on this machine.

On Linux the ``mlx[cpu]`` wheel links a reference BLAS (a few GFLOP/s). Speculative decoding only
pays when a 16-row verify costs about as much as a one-token step, which needs a real BLAS: we load
the system OpenBLAS with ``RTLD_GLOBAL`` *before* ``mlx.core`` so that MLX's ``cblas_*`` symbols
resolve to it. The same reasoning makes float32 the compute dtype on the CPU: MLX's own fp16/bf16 and
quantized CPU kernels are single-threaded and scale linearly with rows.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
import warnings

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

blas_status = "not-linux"
blas_core = ""  # OpenBLAS's kernel set once loaded (openblas_get_corename), e.g. "SkylakeX"
OFF_WORDS = ("", "0", "off", "false", "no")


def env_flag(name: str, default: bool = False) -> bool:
    """A yes/no setting from the environment: unset gives ``default``; ``0``, ``off``, ``false``,
    ``no`` (or empty) turn it off, anything else on."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in OFF_WORDS


def _find_openblas() -> str | None:
    override = os.environ.get("DFLASH_OPENBLAS")
    if override:
        return override
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            return path
    return ctypes.util.find_library("openblas")


def openblas_coretype(flags: set[str]) -> str | None:
    """The OpenBLAS kernel set for a CPU with these ``/proc/cpuinfo`` flags (x86-64), or None.

    OpenBLAS picks its kernels from the CPU *model* when it loads; a model newer than the library
    (Debian 12's 0.3.21 on session 10's Xeon, family 6 model 207) falls back to "Prescott", its
    SSE3 kernels: a (256, 576) x (576, 1536) float32 product ran at 31 GFLOP/s instead of 190, a
    drafter training step took 2.7x the CPU, prefill and decoding ~2x the time. The instruction
    set is what decides the single-precision kernels, so it names them.
    """
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _core_name(lib) -> str:
    try:
        lib.openblas_get_corename.restype = ctypes.c_char_p
        return (lib.openblas_get_corename() or b"").decode()
    except (AttributeError, UnicodeDecodeError):
        return ""


def preload_openblas() -> str:
    """Route MLX's CPU matmuls to OpenBLAS on Linux; returns a short status word."""
    global blas_status, blas_core
    if platform.system() != "Linux":
        blas_status = "not-linux"
        return blas_status
    if env_flag("DFLASH_NO_OPENBLAS"):
        blas_status = "disabled"
        return blas_status
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        blas_status = "openblas"
        return blas_status
    path = _find_openblas()
    if "mlx.core" in sys.modules:
        blas_status = "too-late"
    elif path is None:
        blas_status = "missing"
    else:
        if "OPENBLAS_CORETYPE" not in os.environ:  # the user's choice wins
            core = openblas_coretype(_cpu_flags())
            if core:
                os.environ["OPENBLAS_CORETYPE"] = core  # read by OpenBLAS as it loads
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            blas_status = "openblas"
            blas_core = _core_name(lib)
        except OSError:
            blas_status = "missing"
    if blas_status == "missing":
        warnings.warn(
            "dflash: OpenBLAS not found; MLX's CPU backend will use its slow reference BLAS and "
            "speculative decoding will not pay. Install it with "
            "`apt-get install libopenblas0-pthread`.",
            stacklevel=2,
        )
    elif blas_status == "too-late":
        warnings.warn(
            "dflash: mlx was imported before dflash, so OpenBLAS could not be routed in; import "
            "dflash first or run with LD_PRELOAD=libopenblas.so.0 for fast CPU matmuls.",
            stacklevel=2,
        )
    return blas_status


def on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu or not (mx.metal.is_available() or _cuda_available())


def _cuda_available() -> bool:
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def compute_dtype():
    """float32 on the CPU backend; ``None`` (keep the checkpoint's dtype) on Metal and CUDA."""
    import mlx.core as mx

    return mx.float32 if on_cpu() else None


def prepare_for_backend(module, dtype=None) -> None:
    """On the CPU: dequantize and cast floating parameters to float32. Elsewhere: nothing."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import dequantize_model

    dtype = dtype or compute_dtype()
    if dtype is None:
        return
    dequantize_model(module)
    module.update(tree_map(
        lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
        module.parameters(),
    ))
    mx.eval(module.parameters())


def release_thread_streams() -> None:
    """End the MLX streams of the calling thread; call it last in a thread that ran MLX.

    MLX gives each thread its own default stream, served by a native thread of its own. A Python
    thread that ends without releasing them leaves that stream alive until the process exits, and
    tearing it down then aborts the process at random ("terminate called without an active
    exception", exit 134) even after a clean shutdown or a one-line error.
    """
    import mlx.core as mx

    clear_streams = getattr(mx, "clear_streams", None)
    if clear_streams is None:  # older MLX: one process-wide stream, nothing per thread to end
        return
    mx.synchronize()
    clear_streams()
