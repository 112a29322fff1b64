"""Status lines for people: progress and errors go to stderr, so stdout carries only output."""

from __future__ import annotations

import sys

PROG = "dflash"


def log(message: str, end: str = "\n") -> None:
    """One status line on stderr, prefixed with the program's name."""
    print(f"{PROG}: {message}", file=sys.stderr, end=end, flush=True)


_said: set[str] = set()


def say_once(key: str, message: str) -> None:
    """:func:`log` ``message`` the first time this process meets ``key`` (a file and what is
    wrong with it, say), so that a problem met every generation is said once."""
    if key not in _said:
        _said.add(key)
        log(message)


def one_line(e: BaseException) -> str:
    """An exception as one line of text (a ``KeyError`` says which key)."""
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, KeyError):
        text = f"missing key {text}"
    return text
