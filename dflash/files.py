"""Writing files so that a reader, a killed run or a full disk never leaves half a file.

Every file dflash writes that something else reads back (shard manifests, held-out splits,
feature caches, bench results written after each step of a long run) goes through a temporary
file beside it, flushed to disk, then ``os.replace``d over the name: the old content or the new,
never a mix. A failed write removes its temporary file.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path


def write_atomic(path: str | Path, data: bytes | str, durable: bool = True) -> None:
    """``data`` to ``path`` (its folder made if missing) through a temporary file beside it, then
    renamed; the temporary name is this process's and thread's, so that two writers of one file
    never share one. ``durable``: synced to disk before the rename; ``False`` for what a
    generation saves while it decodes (learnt costs, the pair's memory: still never half a
    file, but no disk flush on the decoding thread, and a crash loses only the last seconds)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.{threading.get_ident()}")
    try:
        with tmp.open("wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_json_atomic(path: str | Path, obj, **dumps) -> None:
    """``obj`` as JSON (``indent=1`` unless given), atomically (:func:`write_atomic`)."""
    write_atomic(path, json.dumps(obj, **({"indent": 1} | dumps)) + "\n")
