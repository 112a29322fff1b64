"""Appending JSONL files that survive an interrupted writer (training metrics, generated records,
open shards)."""

from __future__ import annotations

import os
from pathlib import Path


def open_append(path: Path):
    """A JSONL file opened for appending, after ending a line that an interrupted run (killed,
    or stopped by a full disk) left unfinished: the cut line stays unreadable on its own instead
    of swallowing the next record."""
    f = Path(path).open("a+b")
    if f.tell() > 0:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")
    f.close()
    return Path(path).open("a")
