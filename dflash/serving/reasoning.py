"""The reasoning split: ``<think>…</think>`` text goes to ``reasoning_content``, the rest to content.

Pure text processing, apart from reading the tags a tokenizer declares, so that it can be tested
without a model or an HTTP stack. Works on streamed text: a tag split across chunks is held back
until it can be decided.
"""

from __future__ import annotations

from collections.abc import Sequence


class ThinkSplitter:
    """Splits streamed text into reasoning (inside ``<think>…</think>``) and content.

    A reasoning block opens only before any content has been emitted; ``in_reasoning`` starts the
    stream inside a block (templates that put the opening tag into the prompt). Tags split across
    chunks are held back until they can be decided.
    """

    def __init__(self, start: str = "<think>", end: str = "</think>", in_reasoning: bool = False):
        self.start, self.end = start, end
        self.in_reasoning = in_reasoning
        self.buf = ""
        self.content_started = False
        self.strip_content = False
        self.strip_reasoning = in_reasoning

    @staticmethod
    def _partial(buf: str, tag: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
        for k in range(min(len(tag) - 1, len(buf)), 0, -1):
            if buf.endswith(tag[:k]):
                return k
        return 0

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """``(reasoning, content)`` newly decided by ``text``; ``final`` flushes what is held."""
        self.buf += text
        reasoning, content = "", ""
        while self.buf:
            if self.in_reasoning:
                i = self.buf.find(self.end)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf = self.buf[i + len(self.end):]
                    self.in_reasoning = False
                    self.strip_content = True
                    continue
                keep = 0 if final else self._partial(self.buf, self.end)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            if not self.content_started:
                stripped = self.buf.lstrip()
                if stripped.startswith(self.start):
                    self.buf = stripped[len(self.start):]
                    self.in_reasoning = True
                    self.strip_reasoning = True
                    continue
                if not final and (not stripped or self.start.startswith(stripped)):
                    break  # could still become an opening tag
            content += self.buf
            self.buf = ""
        if self.strip_reasoning and reasoning:
            reasoning = reasoning.lstrip("\n")
            self.strip_reasoning = not reasoning
        if self.strip_content and content:
            content = content.lstrip()
            self.strip_content = not content
        if content:
            self.content_started = True
        return reasoning, content


def think_tags(tokenizer, mode: str = "auto") -> tuple[str, str] | None:
    """The ``(start, end)`` tags to split on, or ``None`` for no split.

    ``auto`` splits when the tokenizer declares thinking tags (mlx-lm's ``has_thinking``), ``on``
    always (``<think>`` tags where the tokenizer names none), ``off`` never.
    """
    if mode == "on" or (mode == "auto" and bool(getattr(tokenizer, "has_thinking", False))):
        return (getattr(tokenizer, "think_start", None) or "<think>",
                getattr(tokenizer, "think_end", None) or "</think>")
    return None


def prompt_opens_reasoning(tokenizer, prompt_ids: Sequence[int],
                           tags: tuple[str, str] | None) -> bool:
    """Whether the prompt ends inside a reasoning block (a template that writes ``<think>``)."""
    if tags is None:
        return False
    tail = tokenizer.decode(list(prompt_ids[-16:]))
    return tail.rfind(tags[0]) > tail.rfind(tags[1])
