"""Status lines for people: progress and errors go to stderr, so stdout carries only output."""

from __future__ import annotations

import sys

PROG = "dflash"


def log(message: str, end: str = "\n") -> None:
    """One status line on stderr, prefixed with the program's name."""
    print(f"{PROG}: {message}", file=sys.stderr, end=end, flush=True)


def one_line(e: BaseException) -> str:
    """An exception as one line of text (a ``KeyError`` says which key)."""
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, KeyError):
        text = f"missing key {text}"
    return text
