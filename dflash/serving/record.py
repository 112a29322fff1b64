"""``dflash serve --record DIR``: every accepted request written down, to be replayed later.

Why: a benchmark of agent sessions is only as honest as its sessions. A recorded session is what
a real client sent, turn by turn (each request the whole conversation so far), so that
``benchmarks/replay.py`` can send exactly that to ``dflash serve`` and to ``mlx_lm.server`` and
compare first-token and end-to-end times request by request.

One JSON object per line in ``DIR/requests.jsonl``: ``endpoint`` (``chat``, ``completions``,
``messages``, ``responses``), ``body`` (the request as sent, its API key never included: keys
travel in headers), ``scope`` (a digest of the key, or ``-``) and ``time`` (seconds since the
server started). Each line is appended with one write under a lock, so lines never interleave.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from ..errors import ServerConfigError

FILE = "requests.jsonl"


class Recorder:
    """Appends each request to ``folder/requests.jsonl``."""

    def __init__(self, folder: str | Path):
        self.path = Path(folder) / FILE
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8"):
                pass
        except OSError as e:
            raise ServerConfigError(f"--record {folder}: cannot be written "
                                    f"({e.strerror or e})") from None
        self._lock = threading.Lock()
        self._start = time.monotonic()

    def write(self, endpoint: str, body: dict, scope: str | None) -> None:
        line = json.dumps({"endpoint": endpoint, "scope": scope or "-",
                           "time": round(time.monotonic() - self._start, 3), "body": body},
                          ensure_ascii=False) + "\n"
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(line)


def read_session(path: str | Path) -> list[dict]:
    """The requests of a recorded session (``requests.jsonl`` or a folder holding one)."""
    from ..errors import TraceFileError

    p = Path(path)
    if p.is_dir():
        p = p / FILE
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise TraceFileError(f"{p}: cannot be read ({e.strerror or e})") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFileError(f"{p}:{n}: not JSON ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get("body"), dict) \
                or record.get("endpoint") not in ("chat", "completions", "messages", "responses"):
            raise TraceFileError(f"{p}:{n}: a recorded request needs `endpoint` and `body`")
        out.append(record)
    return out
