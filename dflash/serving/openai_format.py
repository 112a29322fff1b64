"""OpenAI's response shapes: whole responses, streamed chunks (SSE lines), usage, model cards.

Pure formatting: given the text and the last ``DFlashResponse`` of a generation, build the JSON a
client of the OpenAI API expects. Every response and final chunk also carries the generation's
statistics in the ``dflash`` extension field.
"""

from __future__ import annotations

import json
import time
import uuid

from .. import __version__
from .reasoning import ThinkSplitter

SYSTEM_FINGERPRINT = f"dflash-{__version__}"


def sse(data: dict | str) -> str:
    """One server-sent event: a JSON object, or a literal such as ``[DONE]``."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n"


def usage(n_prompt: int, generated: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": generated,
            "total_tokens": n_prompt + generated}


def model_card(model_id: str, created: int, root: str, extra: dict) -> dict:
    """An entry of ``/v1/models``; ``extra`` goes into the ``dflash`` field."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "dflash",
            "root": root, "dflash": extra}


def full_response(endpoint: str, model: str, n_prompt: int, text: str, last, stats: dict,
                  think_tags: tuple[str, str] | None, opens_reasoning: bool) -> dict:
    """The body of a non-streamed chat completion or text completion."""
    created = int(time.time())
    tail = {"usage": usage(n_prompt, last.generation_tokens),
            "system_fingerprint": SYSTEM_FINGERPRINT, "dflash": stats}
    if endpoint == "completions":
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": last.finish_reason}], **tail}
    message = {"role": "assistant", "content": text}
    if think_tags is not None:
        splitter = ThinkSplitter(*think_tags, in_reasoning=opens_reasoning)
        reasoning, content = splitter.feed(text, final=True)
        message = {"role": "assistant", "content": content,
                   "reasoning_content": reasoning or None}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": last.finish_reason}], **tail}


class StreamFormat:
    """The SSE lines of one streamed response: one id and creation time for all its chunks."""

    def __init__(self, endpoint: str, model: str, splitter: ThinkSplitter | None = None):
        self.chat = endpoint == "chat"
        self.model = model
        self.splitter = splitter
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, choice: dict, **extra) -> str:
        return sse({"id": self.id, "object": self.object, "created": self.created,
                    "model": self.model, "system_fingerprint": SYSTEM_FINGERPRINT,
                    "choices": [choice], **extra})

    def opening(self) -> str:
        """The first event, sent once the generation has started (``""``: none for completions)."""
        if not self.chat:
            return ""
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def delta(self, text: str, final: bool) -> list[str]:
        """The events for newly generated ``text`` (none while a split tag is undecided)."""
        if not self.chat:
            return [self._chunk({"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": None})] if text else []
        reasoning, content = self.splitter.feed(text, final) if self.splitter else ("", text)
        d = {}
        if reasoning:
            d["reasoning_content"] = reasoning
        if content:
            d["content"] = content
        return [self._chunk({"index": 0, "delta": d, "logprobs": None,
                             "finish_reason": None})] if d else []

    def closing(self, n_prompt: int, last, stats: dict, include_usage: bool) -> list[str]:
        """The final chunk (finish reason, statistics), the usage chunk if asked, ``[DONE]``."""
        final = {"index": 0, "logprobs": None, "finish_reason": last.finish_reason}
        if self.chat:
            final["delta"] = {}
        else:
            final["text"] = ""
        counts = usage(n_prompt, last.generation_tokens)
        events = [self._chunk(final, dflash=stats, **({} if include_usage else {"usage": counts}))]
        if include_usage:
            events.append(sse({"id": self.id, "object": self.object, "created": self.created,
                               "model": self.model, "choices": [], "usage": counts,
                               "dflash": stats}))
        events.append(sse("[DONE]"))
        return events
