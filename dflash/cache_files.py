"""Conversations' caches on disk: one safetensors file per :class:`~dflash.prompt_cache.CacheEntry`.

Why: a server restarted between working sessions prefilled every conversation again (a coding
agent's system prompt and tools alone are thousands of tokens). With a cache folder the next
turn after a restart loads its conversation's caches instead of recomputing them.

A file holds the target's caches, the drafter's, the GatedDeltaNet snapshots (Qwen3.5), and in
its safetensors header the token ids they hold and the pair's fingerprint, so a folder is
scanned by reading headers only and an entry is loaded when a prompt first needs it. The cache
classes are mlx-lm's own (their ``state``, as ``save_prompt_cache`` writes them) plus the
drafter's window cache; what is not one of them (a quantizing wrapper mid-switch) is not saved.
Files are written through a temporary name then renamed, so a killed process or a full disk
leaves the old file or none, never half of one. A file that does not read back (truncated,
corrupt, another version, caches that do not fit the pair) is skipped with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from .dflash2 import DFlash2Cache, WindowCache
from .errors import PromptCacheDirError

FORMAT = "dflash-prompt-cache/1"
SUFFIX = ".safetensors"
_CLASSES = {c.__name__: c for c in (KVCache, RotatingKVCache, ArraysCache, QuantizedKVCache)}


class CacheFileError(Exception):
    """A cache file that cannot be used; the reason names the file (skipped, never raised to a
    request)."""


@dataclass
class Header:
    """What a file's header says: enough to pick an entry without loading its arrays."""

    path: Path
    tokens: np.ndarray
    points: list[int]  # snapshot points (hybrid targets)
    recurrent: bool
    trimmable: bool
    nbytes: int


def pair_fingerprint(parts, draft) -> str:
    """A digest of the pair's configs and weights (each parameter's shape, dtype and sum), so
    that a folder written by other weights, or by another rank's stage, is never used."""
    h = hashlib.sha256()
    for module in (parts.model, draft):
        config = getattr(module, "args", None) or getattr(module, "config", None)
        h.update(json.dumps(_plain(config), sort_keys=True, default=str).encode())
        params = sorted(tree_flatten(module.parameters()), key=lambda kv: kv[0])
        sums = mx.stack([mx.sum(p.astype(mx.float32)) for _, p in params]) if params else None
        for (name, p), s in zip(params, [] if sums is None else np.array(sums).tolist()):
            h.update(f"{name}:{p.shape}:{p.dtype}:{s!r};".encode())
    if parts.stage is not None:
        h.update(repr(parts.stage).encode())
    return h.hexdigest()[:32]


def _plain(config) -> object:
    if config is None:
        return None
    return vars(config) if hasattr(config, "__dict__") else config


def entry_name(tokens: list[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, np.int64).tobytes()).hexdigest()[:32] + SUFFIX


# -- writing -----------------------------------------------------------------------------------


def encode(entry, fingerprint: str) -> tuple[dict[str, mx.array], dict[str, str]] | None:
    """The arrays and header metadata of ``entry``; ``None`` where a cache is of a class this
    format does not hold."""
    arrays: dict[str, mx.array] = {}
    target = [_encode_cache(c, f"t{i}", arrays) for i, c in enumerate(entry.target)]
    draft = [_encode_cache(c, f"d{i}", arrays) for i, c in enumerate(entry.draft)]
    if None in target or None in draft:
        return None
    for point, states in entry.snapshots.items():
        for k, state in enumerate(states):
            for j, a in enumerate(state):
                if a is not None:
                    arrays[f"s{point}.{k}.{j}"] = a
    meta = {"format": FORMAT, "fingerprint": fingerprint, "tokens": list(entry.tokens),
            "target": target, "draft": draft, "draft_class": type(entry.draft).__name__,
            "snapshots": {str(p): [[a is not None for a in s] for s in states]
                          for p, states in entry.snapshots.items()},
            "recurrent": bool(entry._recurrent()), "trimmable": entry.is_trimmable(),
            "nbytes": entry.nbytes}
    return arrays, {"dflash": json.dumps(meta)}


def _encode_cache(c, prefix: str, arrays: dict) -> dict | None:
    if isinstance(c, WindowCache):
        state = (None if c._keys is None else c._keys[..., :c.used, :],
                 None if c._values is None else c._values[..., :c.used, :])
        extra = {"size": c.size, "used": c.used, "offset": c.offset}
        name = "WindowCache"
    elif type(c).__name__ in _CLASSES:
        state, extra, name = c.state, {}, type(c).__name__
        if isinstance(c, (KVCache, QuantizedKVCache)) and c.keys is not None:
            # only the rows in use: a trimmed cache's buffer runs past its offset
            cut = c.offset
            state = (*(_rows(x, cut) for x in state[:2]), *state[2:])
    else:
        return None
    return {"class": name, "state": _pack(list(state), prefix, arrays), "extra": extra}


def _pack(value, name: str, arrays: dict):
    """A state as JSON: lists and tuples nested, arrays by their name in ``arrays``, scalars
    and ``None`` as they are."""
    if isinstance(value, (list, tuple)):
        return {"items": [_pack(v, f"{name}.{i}", arrays) for i, v in enumerate(value)],
                "tuple": isinstance(value, tuple)}
    if isinstance(value, mx.array):
        arrays[name] = value
        return {"array": name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise CacheFileError(f"a cache state holds a {type(value).__name__}")


def _unpack(packed: dict, arrays: dict):
    if "items" in packed:
        items = [_unpack(v, arrays) for v in packed["items"]]
        return tuple(items) if packed["tuple"] else items
    if "array" in packed:
        return arrays[packed["array"]]
    return packed["value"]


def _rows(x, n: int):
    if isinstance(x, (tuple, list)):
        return type(x)(a[..., :n, :] for a in x)
    return x[..., :n, :]


def write_entry(path: Path, arrays: dict[str, mx.array], metadata: dict[str, str]) -> int:
    """``arrays`` to ``path`` through a temporary file beside it, then renamed; the bytes
    written. A failure (a full disk) removes the temporary file and raises ``OSError``."""
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.{threading.get_ident()}{SUFFIX}")
    try:
        mx.save_safetensors(str(tmp), arrays, metadata)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


# -- reading -----------------------------------------------------------------------------------


def read_header(path: Path) -> Header:
    """The header of a cache file (its first bytes only)."""
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 1 << 30:
                raise CacheFileError(f"{path}: not a safetensors file")
            raw = json.loads(f.read(n))
        meta = json.loads(raw["__metadata__"]["dflash"])
    except CacheFileError:
        raise
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise CacheFileError(f"{path}: unreadable header ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CacheFileError(f"{path}: not a {FORMAT} file")
    return Header(path, np.asarray(meta["tokens"], np.int64),
                  sorted(int(p) for p in meta["snapshots"]), bool(meta["recurrent"]),
                  bool(meta["trimmable"]), int(meta["nbytes"]))


def read_entry(path: Path, fingerprint: str, fresh_target: list,
               fresh_draft: list) -> tuple[list, list, list[int], dict[int, list]]:
    """The target caches, drafter caches, tokens and snapshots in ``path``, checked against the
    pair's ``fingerprint`` and its fresh caches (same classes, offsets equal to the tokens)."""
    try:
        arrays, raw = mx.load(str(path), return_metadata=True)
        meta = json.loads(raw["dflash"])
    except Exception as e:  # noqa: BLE001  (mx.load raises bare RuntimeError / ValueError)
        raise CacheFileError(f"{path}: does not read back ({e})") from None
    if meta.get("format") != FORMAT or meta.get("fingerprint") != fingerprint:
        raise CacheFileError(f"{path}: written for other weights")
    tokens = list(meta["tokens"])
    try:
        target = [_decode_cache(m, arrays) for m in meta["target"]]
        draft = [_decode_cache(m, arrays) for m in meta["draft"]]
        snapshots = {int(p): [[arrays[f"s{p}.{k}.{j}"] if held else None
                               for j, held in enumerate(state)]
                              for k, state in enumerate(states)]
                     for p, states in meta["snapshots"].items()}
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CacheFileError(f"{path}: malformed ({e!r})") from None
    _check_fits(path, target, fresh_target, tokens)
    _check_fits(path, draft, fresh_draft, tokens)
    if meta["draft_class"] == DFlash2Cache.__name__:
        draft = DFlash2Cache(draft)
    return target, draft, tokens, snapshots


def _decode_cache(meta: dict, arrays: dict):
    state = _unpack(meta["state"], arrays)
    if meta["class"] == "WindowCache":
        extra = meta["extra"]
        c = WindowCache(int(extra["size"]))
        c._keys, c._values = state
        c.used, c.offset = int(extra["used"]), int(extra["offset"])
        return c
    return _CLASSES[meta["class"]].from_state(list(state))


def _check_fits(path: Path, caches: list, fresh: list, tokens: list[int]) -> None:
    if [type(c) for c in caches] != [type(c) for c in fresh]:
        raise CacheFileError(f"{path}: its caches do not fit this pair's layers")
    for c in caches:
        if not isinstance(c, ArraysCache) and c.offset != len(tokens):
            raise CacheFileError(f"{path}: a cache holds {c.offset} positions, the header "
                                 f"{len(tokens)} tokens")


def check_writable(folder: Path) -> None:
    """Make ``folder`` and write a probe file in it: a folder that cannot hold the cache is a
    :class:`~dflash.errors.PromptCacheDirError` naming it, at start, not a warning per reply."""
    probe = folder / f".probe{os.getpid()}.{threading.get_ident()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise PromptCacheDirError(f"prompt cache folder {folder}: cannot be written "
                                  f"({e.strerror or e})") from None


def servable(length: int, n: int, trimmable: bool, recurrent: bool, points) -> int:
    """The longest prefix of at most ``n`` of an entry's ``length`` tokens it can go back to:
    all of them, any prefix (attention caches), the latest snapshot point (recurrent states), or
    none (a wrapped sliding window)."""
    if n >= length:
        return length
    if not trimmable:
        return 0
    if recurrent:
        return max((k for k in points if k <= n), default=0)
    return n


# -- a folder of entries -----------------------------------------------------------------------


class CacheFolder:
    """The cache files of one scope: ``root/<pair fingerprint>/<tokens digest>.safetensors``, at
    most ``max_bytes`` of them on disk, least recently used (file times) removed first.

    Writes run one at a time on a thread of their own (the arrays are evaluated before they are
    handed over, and MLX arrays are immutable), so a reply is never held up by the disk and two
    writes never evict at once.

    ``defer``: :meth:`save` only queues an entry, and :meth:`write_queued` (called when the
    caller is idle) or :meth:`flush` writes it. Why: an entry of a 4.8k-token conversation is
    ~220 MB here, and writing it while the next turn prefills took that prefill from 0.92-1.05x
    mlx_lm.server's time to 1.25-1.41x on 2 cores. A queued entry that a newer one of the same
    conversation can serve is dropped (it would be removed once the newer one is written), so a
    busy conversation is written once, when it pauses."""

    def __init__(self, root: str | Path, max_bytes: int, defer: bool = False):
        self.root, self.max_bytes, self.defer = Path(root), max_bytes, defer
        self._queued: list[tuple[str, Header, object]] = []  # (fingerprint, header, entry)
        check_writable(self.root)
        self._headers: dict[str, dict[Path, Header]] = {}
        self._sizes: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-cache-write")
        self._pending: list[Future] = []
        for tmp in self.root.glob(f"*/.*.tmp*{SUFFIX}"):  # left by a killed writer
            tmp.unlink(missing_ok=True)
        for f in self.root.glob(f"*/*{SUFFIX}"):
            self._sizes[f] = f.stat().st_size

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def headers(self, fingerprint: str) -> list[Header]:
        """The entries written for this pair (headers read on first use, bad files skipped)."""
        with self._lock:
            known = self._headers.get(fingerprint)
            if known is None:
                known = self._headers[fingerprint] = {}
                for f in sorted((self.root / fingerprint).glob(f"*{SUFFIX}")):
                    try:
                        known[f] = read_header(f)
                    except CacheFileError as e:
                        _warn(f"prompt cache: {e}; skipped")
            return list(known.values())

    def load(self, header: Header, fingerprint: str, fresh_target: list, fresh_draft: list):
        """:func:`read_entry` of ``header``'s file, its time touched (recently used); ``None``
        with a warning, the file removed, where it does not read back."""
        try:
            found = read_entry(header.path, fingerprint, fresh_target, fresh_draft)
        except CacheFileError as e:
            _warn(f"prompt cache: {e}; skipped and removed")
            self._forget(fingerprint, header.path, unlink=True)
            return None
        os.utime(header.path)
        return found

    def save(self, fingerprint: str, entry) -> None:
        """Write ``entry`` (a :class:`~dflash.prompt_cache.CacheEntry`) in the background (or,
        with ``defer``, queue it); files of shorter entries it can serve go, then the oldest past
        the byte budget."""
        path = self.root / fingerprint / entry_name(entry.tokens)
        header = Header(path, np.asarray(entry.tokens, np.int64), sorted(entry.snapshots),
                        bool(entry._recurrent()), entry.is_trimmable(), entry.nbytes)
        if not self.defer:
            self._submit(fingerprint, header, entry)
            return
        with self._lock:
            self._queued = [q for q in self._queued
                            if not (q[0] == fingerprint and _serves(header, q[1]))]
            self._queued.append((fingerprint, header, entry))

    def write_queued(self, keep=None) -> None:
        """Start writing the queued entries (``keep``: a test of an entry; those it passes stay
        queued). Evaluates their arrays in the calling thread, the one that made them."""
        go, stay = [], []
        with self._lock:
            for q in self._queued:
                (stay if keep is not None and keep(q[2]) else go).append(q)
            self._queued = stay
        for fingerprint, header, entry in go:
            self._submit(fingerprint, header, entry)

    @property
    def queued(self) -> int:
        """How many entries wait to be written (``defer``)."""
        with self._lock:
            return len(self._queued)

    def _submit(self, fingerprint: str, header: Header, entry) -> None:
        encoded = encode(entry, fingerprint)
        if encoded is None:
            return
        arrays, metadata = encoded
        mx.eval(list(arrays.values()))
        self.headers(fingerprint)  # scanned before the new file appears
        written = self._writer.submit(self._write, fingerprint, header, arrays, metadata)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [written]

    def flush(self) -> int:
        """Write what is queued and wait for the writes started so far; how many were queued."""
        queued = self.queued
        self.write_queued()
        with self._lock:
            pending = list(self._pending)
        for f in pending:
            f.result()
        return queued

    def _write(self, fingerprint: str, header: Header, arrays: dict, metadata: dict) -> None:
        path = header.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            size = write_entry(path, arrays, metadata)
        except OSError as e:
            _warn(f"prompt cache: {path} could not be written ({e}); serving goes on")
            return
        with self._lock:
            self._sizes[path] = size
            held = self._headers.setdefault(fingerprint, {})
            held[path] = header
            shorter = [h.path for h in held.values() if _serves(header, h)]
        for p in shorter:
            self._forget(fingerprint, p, unlink=True)
        self._evict()

    def _evict(self) -> None:
        """Oldest first until within the budget (the newest too, if it alone exceeds it)."""
        with self._lock:
            files = sorted(self._sizes, key=_mtime)
            total = sum(self._sizes.values())
        for f in files:
            if total <= self.max_bytes:
                break
            total -= self._sizes.get(f, 0)
            self._forget(f.parent.name, f, unlink=True)

    def _forget(self, fingerprint: str, path: Path, unlink: bool) -> None:
        with self._lock:
            self._sizes.pop(path, None)
            self._headers.get(fingerprint, {}).pop(path, None)
        if unlink:
            path.unlink(missing_ok=True)


def _serves(longer: Header, shorter: Header) -> bool:
    """Whether ``longer``'s entry holds all of ``shorter``'s tokens and can go back to them."""
    n, k = len(longer.tokens), len(shorter.tokens)
    return (k < n and np.array_equal(shorter.tokens, longer.tokens[:k])
            and servable(n, k, longer.trimmable, longer.recurrent, longer.points) == k)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _warn(message: str) -> None:
    import warnings

    warnings.warn(f"dflash: {message}", stacklevel=2)
