"""How MLX runs on this machine, set up explicitly by :func:`configure` (never at import).

On Linux the ``mlx[cpu]`` wheel links a reference BLAS (a few GFLOP/s). Speculative decoding only
pays when a 16-row verify costs about as much as a one-token step, which needs a real BLAS, so
:func:`configure` routes MLX's ``cblas_*``/LAPACK calls to the system OpenBLAS. Before ``mlx.core``
is loaded it loads OpenBLAS with ``RTLD_GLOBAL``, so that the dynamic linker binds MLX to it; once
``mlx.core`` is loaded (a script that imported it first, or ``from dflash.model_mlx import ...``,
which imports it) it rebinds the slots through which ``libmlx.so`` calls them: the wheel binds
those calls through its writable PLT slots, so writing OpenBLAS's addresses there is what an
``LD_PRELOAD`` would have done. Each slot is checked before it is written (it must hold the
symbol it is named after) and read back after; :func:`mlx_blas` says which library MLX's
``cblas_sgemm`` calls, whichever way it was bound. Where neither works (another MLX build, no
OpenBLAS when one is required) :class:`~dflash.errors.BackendSetupError` names what to do.

``DFLASH_BLAS`` chooses: ``auto`` (default: OpenBLAS where found, else the reference BLAS with a
warning), ``openblas`` (required: an error when it cannot be routed in) or ``reference`` (leave
MLX as it is; ``DFLASH_NO_OPENBLAS=1`` means the same). ``DFLASH_OPENBLAS`` names the library.

The same reasoning makes float32 the compute dtype on the CPU (:func:`compute_dtype`, applied by
the loaders): MLX's own fp16/bf16 and quantized CPU kernels are single-threaded and scale
linearly with rows.

:func:`generation_context` is what mlx-lm's ``generate.py`` wraps decoding in on Metal: the
wired-memory limit and a dedicated generation stream (mlx-lm's own where importable), and the
buffer cache cleared when a generation ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import platform
import struct
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

from .errors import BackendSetupError

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
BLAS_MODES = ("auto", "openblas", "reference")

# What :func:`configure` did: "unconfigured" (not yet called), "openblas", "reference" (asked
# for), "missing" (no OpenBLAS found), "not-linux". ``blas_route`` says how OpenBLAS got in:
# "preloaded" (before mlx.core), "rebound" (after it), "already" (LD_PRELOAD or an earlier load).
blas_status = "unconfigured"
blas_route = ""
blas_core = ""  # OpenBLAS's kernel set once loaded (openblas_get_corename), e.g. "SkylakeX"
OFF_WORDS = ("", "0", "off", "false", "no")

_configure_lock = threading.Lock()


def env_flag(name: str, default: bool = False) -> bool:
    """A yes/no setting from the environment: unset gives ``default``; ``0``, ``off``, ``false``,
    ``no`` (or empty) turn it off, anything else on."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in OFF_WORDS


def blas_mode() -> str:
    """``DFLASH_BLAS`` (``auto``, ``openblas`` or ``reference``); ``DFLASH_NO_OPENBLAS=1`` is
    ``reference``."""
    if env_flag("DFLASH_NO_OPENBLAS"):
        return "reference"
    mode = os.environ.get("DFLASH_BLAS", "auto").strip().lower() or "auto"
    if mode not in BLAS_MODES:
        raise BackendSetupError(f"DFLASH_BLAS={mode!r}: expected one of {', '.join(BLAS_MODES)}")
    return mode


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
    falls back to "Prescott", its SSE3 kernels (docs/how-it-works.md measures how much slower).
    The instruction set is what decides the single-precision kernels, so it names them.
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


# ---------------------------------------------------------------------------------------------
# The PLT slots through which libmlx.so calls BLAS and LAPACK


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


class _LinkMap(ctypes.Structure):  # the public head of glibc's struct link_map (<link.h>)
    _fields_ = [("l_addr", ctypes.c_size_t), ("l_name", ctypes.c_char_p),
                ("l_ld", ctypes.c_void_p), ("l_next", ctypes.c_void_p),
                ("l_prev", ctypes.c_void_p)]


RTLD_DI_LINKMAP = 2
SHT_RELA = 4


@functools.lru_cache(maxsize=1)
def _libc():
    """The library with ``dladdr``/``dlinfo``: the C library (glibc 2.34+), else ``libdl``."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "dlinfo") and hasattr(libc, "dladdr"):
        return libc
    return ctypes.CDLL(ctypes.util.find_library("dl") or "libdl.so.2")


def _symbol_at(address: int) -> tuple[str, str]:
    """``(library path, symbol name)`` of a code address, from ``dladdr``."""
    info = _DlInfo()
    if not address or not _libc().dladdr(ctypes.c_void_p(address), ctypes.byref(info)):
        return "", ""
    return ((info.dli_fname or b"").decode(errors="replace"),
            (info.dli_sname or b"").decode(errors="replace"))


def _loaded_libmlx() -> str | None:
    """The path of the ``libmlx`` this process has loaded, or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith("libmlx.so"):
                    return path
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=4)
def plt_slots(path: str) -> dict[str, int]:
    """``{symbol: offset}`` of the PLT relocations (``.rela.plt``) of an ELF64 little-endian
    shared library: where the address each imported function is called through is stored."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise BackendSetupError(f"{path} is not a 64-bit little-endian ELF library")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    names_off = sections[shstrndx][4]

    def name(off: int, base: int) -> str:
        return data[base + off:data.index(b"\0", base + off)].decode(errors="replace")

    slots: dict[str, int] = {}
    for sh_name, sh_type, _, _, offset, size, link, _, _, entsize in sections:
        if sh_type != SHT_RELA or name(sh_name, names_off) != ".rela.plt":
            continue
        symtab = sections[link]
        strtab_off = sections[symtab[6]][4]
        for pos in range(offset, offset + size, entsize or 24):
            r_offset, r_info, _ = struct.unpack_from("<QQq", data, pos)
            st_name, = struct.unpack_from("<I", data, symtab[4] + (r_info >> 32) * (symtab[9] or 24))
            slots[name(st_name, strtab_off)] = r_offset
    return slots


def _libmlx_slots() -> tuple[int, dict[str, int]] | None:
    """The load address of this process's ``libmlx`` and its PLT slots (None: not found)."""
    path = _loaded_libmlx()
    if path is None or platform.system() != "Linux":
        return None
    handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)._handle
    link_map = ctypes.c_void_p()
    if _libc().dlinfo(ctypes.c_void_p(handle), RTLD_DI_LINKMAP, ctypes.byref(link_map)) != 0:
        return None
    return _LinkMap.from_address(link_map.value).l_addr, plt_slots(path)


def mlx_blas(symbol: str = "cblas_sgemm") -> str:
    """The library whose ``symbol`` MLX calls (``""`` where that cannot be read: not Linux, MLX
    not loaded, another build)."""
    try:
        found = _libmlx_slots() if "mlx.core" in sys.modules else None
    except (OSError, AttributeError, BackendSetupError, struct.error):
        return ""
    if found is None or symbol not in found[1]:
        return ""
    base, slots = found
    return _symbol_at(ctypes.c_void_p.from_address(base + slots[symbol]).value or 0)[0]


def rebind_mlx_blas(lib: ctypes.CDLL, lib_path: str) -> int:
    """Point ``libmlx``'s BLAS/LAPACK slots at ``lib``'s functions; returns how many now do.

    Only slots already bound to the symbol they are named after are written, each read back.
    Raises :class:`~dflash.errors.BackendSetupError` when ``cblas_sgemm`` ends up elsewhere.
    """
    found = _libmlx_slots()
    if found is None:
        raise BackendSetupError("cannot find libmlx.so's PLT slots in this process")
    base, slots = found
    target_name = os.path.realpath(lib_path)
    routed = 0
    for symbol, offset in slots.items():
        if not (symbol.startswith("cblas_") or symbol.endswith("_")):
            continue  # BLAS/LAPACK names only (cblas_* and the Fortran ones)
        try:
            address = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
        except AttributeError:
            continue
        slot = ctypes.c_void_p.from_address(base + offset)
        bound_lib, bound_name = _symbol_at(slot.value or 0)
        if bound_name != symbol:  # not bound yet, or not the slot we think it is
            continue
        if os.path.realpath(bound_lib) != target_name:
            slot.value = address
        routed += _symbol_at(slot.value or 0)[1] == symbol and slot.value == address
    if os.path.realpath(mlx_blas()) != target_name:
        raise BackendSetupError("MLX's cblas_sgemm slot could not be pointed at " + lib_path)
    return routed


# ---------------------------------------------------------------------------------------------
# configure()


@dataclass(frozen=True)
class BackendState:
    """What :func:`configure` set up: ``blas`` (see ``blas_status``), how OpenBLAS got in
    (``route``) and its kernels (``core``). :func:`mlx_blas` says what MLX calls now."""

    blas: str
    route: str
    core: str


def _too_late_message(why: str) -> str:
    return (f"mlx.core was imported before dflash set up the CPU backend and {why}, so MLX would "
            "run its matmuls on the slow reference BLAS. Call dflash.backend.configure() (or "
            "load a model through dflash) before importing mlx, or run with "
            "LD_PRELOAD=libopenblas.so.0, or set DFLASH_BLAS=reference to accept the slow path")


def configure() -> BackendState:
    """Set up MLX's CPU backend for dflash, once per process (later calls return the same).

    Called by the loaders (``load``, ``load_draft``, the built-in pair), the ``dflash`` command
    and the training entry points; a library user never needs to, except to route OpenBLAS
    before their own first ``import mlx.core`` (nothing changes either way).
    """
    global blas_status, blas_route, blas_core
    with _configure_lock:
        if blas_status == "unconfigured":
            blas_status, blas_route = _route_blas()
        return BackendState(blas_status, blas_route, blas_core)


def _route_blas() -> tuple[str, str]:
    global blas_core
    if platform.system() != "Linux":
        return "not-linux", ""
    mode = blas_mode()
    if mode == "reference":
        return "reference", ""
    mlx_loaded = "mlx.core" in sys.modules
    if mlx_loaded and "openblas" in os.path.basename(mlx_blas()).lower():
        return "openblas", "already"  # LD_PRELOAD, or loaded by whoever imported mlx
    if not mlx_loaded and "openblas" in os.environ.get("LD_PRELOAD", ""):
        return "openblas", "already"
    path = _find_openblas()
    lib = None
    if path is not None:
        if "OPENBLAS_CORETYPE" not in os.environ:  # the user's choice wins
            core = openblas_coretype(_cpu_flags())
            if core:
                os.environ["OPENBLAS_CORETYPE"] = core  # read by OpenBLAS as it loads
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            lib = None
    if lib is None:
        message = ("OpenBLAS not found; MLX's CPU backend will use its slow reference BLAS and "
                   "speculative decoding will not pay. Install it with `apt-get install "
                   "libopenblas0-pthread` (or name it with DFLASH_OPENBLAS=/path/libopenblas.so)")
        if mode == "openblas":
            raise BackendSetupError(f"DFLASH_BLAS=openblas: {message}")
        warnings.warn(f"dflash: {message}", stacklevel=3)
        return "missing", ""
    blas_core = _core_name(lib)
    if not mlx_loaded:
        return "openblas", "preloaded"
    try:
        rebind_mlx_blas(lib, path)
    except (BackendSetupError, OSError, ValueError, AttributeError, struct.error) as e:
        message = _too_late_message(f"rebinding its BLAS failed ({e})")
        if mode == "openblas" or on_cpu():
            raise BackendSetupError(message) from None
        warnings.warn(f"dflash: {message}", stacklevel=3)  # the GPU runs the matmuls
        return "missing", ""
    return "openblas", "rebound"


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
    """On the CPU: dequantize and cast floating parameters to float32. Elsewhere: nothing.

    Every loader calls it, so it also makes sure the backend is set up (:func:`configure`)."""
    configure()
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


# ---------------------------------------------------------------------------------------------
# Generation as mlx-lm's generate.py runs it

CLEAR_CACHE_EVERY = 256  # tokens between buffer-cache clears in a long generation (mlx-lm's)


def generation_stream():
    """mlx-lm's generation stream (a per-thread stream on the default device), or None."""
    try:
        from mlx_lm.generate import generation_stream as stream
    except ImportError:
        return None
    return stream


@contextlib.contextmanager
def generation_context(model) -> Iterator[object]:
    """Around one generation, as mlx-lm's ``stream_generate`` does it: the recommended wired
    memory limit while ``model`` decodes (Metal; nothing elsewhere), waiting for the generation
    stream before restoring it, and the buffer cache cleared at the end. Yields the stream that
    passes should run under (``with mx.stream(stream)``, per pass: not across a ``yield``)."""
    import mlx.core as mx

    stream = generation_stream()
    try:
        from mlx_lm.generate import wired_limit
    except ImportError:
        wired_limit = None
    limit = wired_limit(model, [stream] if stream is not None else None) \
        if wired_limit is not None else contextlib.nullcontext()
    with limit:
        try:
            yield stream
        finally:
            mx.clear_cache()


def pass_stream(stream) -> contextlib.AbstractContextManager:
    """``mx.stream(stream)``, or nothing for ``None``: the context one pass runs under."""
    if stream is None:
        return contextlib.nullcontext()
    import mlx.core as mx

    return mx.stream(stream)
