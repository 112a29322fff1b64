"""OpenAI's response shapes: whole responses, streamed chunks (SSE lines), usage, model cards.

Pure formatting: given the text and the last ``DFlashResponse`` of a generation, build the JSON a
client of the OpenAI API expects; an ``AnswerSplitter`` splits a chat answer into reasoning,
content and tool calls. Every response and final chunk also carries the generation's statistics in
the ``dflash`` extension field; ``usage`` keeps OpenAI's fields (the reused prompt prefix as
``prompt_tokens_details.cached_tokens``) plus a compact ``usage.dflash`` (τ, cycles).
"""

from __future__ import annotations

import json
import time
import uuid

from .. import __version__
from .logprobs_format import LogprobFormat, join_legacy
from .tools import AnswerSplitter

SYSTEM_FINGERPRINT = f"dflash-{__version__}"


def sse(data: dict | str) -> str:
    """One server-sent event: a JSON object, or a literal such as ``[DONE]``."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n"


def usage(n_prompt: int, last) -> dict:
    """OpenAI's token counts of a generation, and its acceptance (``dflash``: τ = mean tokens per
    verify cycle, drafted or the context's continuation, i.e. accepted + 1; plain steps aside)."""
    generated = last.generation_tokens
    return {"prompt_tokens": n_prompt, "completion_tokens": generated,
            "total_tokens": n_prompt + generated,
            "prompt_tokens_details": {"cached_tokens": last.reused_prompt_tokens},
            "dflash": {"tau": round(last.mean_tau, 4), "cycles": last.cycles,
                       "rows_per_pass": round(last.rows_per_pass, 3),
                       "reused_prompt_tokens": last.reused_prompt_tokens}}


def tool_call_deltas(calls: list[dict], first_index: int) -> list[dict]:
    """Streamed ``delta.tool_calls`` entries: each call's id and name, then its arguments."""
    out = []
    for k, c in enumerate(calls, first_index):
        out.append({"index": k, "id": c["id"], "type": "function",
                    "function": {"name": c["name"], "arguments": ""}})
        out.append({"index": k, "function": {"arguments": c["arguments"]}})
    return out


def model_card(model_id: str, created: int, root: str, extra: dict) -> dict:
    """An entry of ``/v1/models``; ``extra`` goes into the ``dflash`` field."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "dflash",
            "root": root, "dflash": extra}


def full_response(endpoint: str, model: str, n_prompt: int, text: str, last, stats: dict,
                  splitter: AnswerSplitter | None = None, logprobs: LogprobFormat | None = None,
                  echo: tuple[list[int], str] | None = None) -> dict:
    """The body of a non-streamed chat completion (``splitter`` reads the answer) or completion.
    ``logprobs``: the answer's log-probabilities (``last.logprobs``: every token's) written;
    ``echo``: a completion's prompt ids and text, repeated before its answer."""
    created = int(time.time())
    tail = {"usage": usage(n_prompt, last), "system_fingerprint": SYSTEM_FINGERPRINT,
            "dflash": stats}
    if endpoint == "completions":
        scores = None
        if logprobs is not None:
            parts = []
            if echo is not None:
                parts.append(logprobs.legacy_prompt(echo[0], last.prompt_logprobs or [], echo[1]))
            scores = join_legacy(*parts, logprobs.legacy(last.logprobs or [], text))
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": created, "model": model,
                "choices": [{"index": 0, "text": (echo[1] if echo else "") + text,
                             "logprobs": scores, "finish_reason": last.finish_reason}], **tail}
    splitter = splitter or AnswerSplitter()
    reasoning, content, calls = splitter.feed(text, final=True)
    message = {"role": "assistant", "content": content or (None if calls else "")}
    if splitter.think is not None:
        message["reasoning_content"] = reasoning or None
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in calls]
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": created, "model": model,
            "choices": [{"index": 0, "message": message,
                         "logprobs": None if logprobs is None else
                         logprobs.chat(last.logprobs or []),
                         "finish_reason": splitter.finish_reason(last.finish_reason)}], **tail}


class StreamFormat:
    """The SSE lines of one streamed response: one id and creation time for all its chunks."""

    def __init__(self, endpoint: str, model: str, splitter: AnswerSplitter | None = None,
                 include_usage: bool = False, logprobs: LogprobFormat | None = None,
                 echo: tuple[list[int], str] | None = None):
        self.chat = endpoint == "chat"
        # Log-probabilities asked: the entries of tokens not yet sent go with the next chunk (a
        # chat chunk waits for text the splitter lets out); ``echo``: the prompt goes first.
        self.logprobs, self.echo = logprobs, echo
        self.pending: list = []
        self.include_usage = include_usage
        self.model = model
        self.splitter = splitter or AnswerSplitter()
        self.calls = 0
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, choice: dict, **extra) -> str:
        return sse({"id": self.id, "object": self.object, "created": self.created,
                    "model": self.model, "system_fingerprint": SYSTEM_FINGERPRINT,
                    "choices": [choice], **extra})

    def opening(self, n_prompt: int = 0, first=None) -> str:
        """The first event, sent once the generation has started (``""``: none for completions,
        unless they echo the prompt: its text, and its log-probabilities from ``first``)."""
        if not self.chat and self.echo is not None:
            scores = None if self.logprobs is None else self.logprobs.legacy_prompt(
                self.echo[0], getattr(first, "prompt_logprobs", None) or [], self.echo[1])
            return self._chunk({"index": 0, "text": self.echo[1], "logprobs": scores,
                                "finish_reason": None})
        if not self.chat:
            return ""
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def add(self, r) -> list[str]:
        """The events for one step (``DFlashResponse``) of the generation."""
        if self.logprobs is not None:
            self.pending += r.logprobs or []
        return self.delta(r.text, r.finish_reason is not None)

    def _scores(self, text: str = ""):
        """The pending tokens' log-probabilities in this endpoint's shape (``None``: not asked,
        or, in chat, none pending); ``text``: the completion chunk they go with."""
        if self.logprobs is None or (self.chat and not self.pending):
            return None
        pending, self.pending = self.pending, []
        return self.logprobs.chat(pending) if self.chat else \
            self.logprobs.legacy(pending, text or None)

    def delta(self, text: str, final: bool) -> list[str]:
        """The events for newly generated ``text`` (none while a split tag is undecided)."""
        if not self.chat:
            return [self._chunk({"index": 0, "text": text, "logprobs": self._scores(text),
                                 "finish_reason": None})] if text or self.pending else []
        reasoning, content, calls = self.splitter.feed(text, final)
        d = {}
        if reasoning:
            d["reasoning_content"] = reasoning
        if content:
            d["content"] = content
        events = [self._chunk({"index": 0, "delta": d, "logprobs": self._scores(),
                               "finish_reason": None})] if d else []
        for entry in tool_call_deltas(calls, self.calls):
            events.append(self._chunk({"index": 0, "delta": {"tool_calls": [entry]},
                                       "logprobs": self._scores(), "finish_reason": None}))
        self.calls += len(calls)
        return events

    def error(self, e) -> str:
        """An error after the headers went out: in-band, as OpenAI does."""
        return sse(e.body())

    def closing(self, n_prompt: int, last, stats: dict) -> list[str]:
        """The final chunk (finish reason, statistics), the usage chunk if asked, ``[DONE]``."""
        # (Tokens whose text never came out: a stop string's, a stop token's none.)
        final = {"index": 0, "logprobs": self._scores() if self.pending else None,
                 "finish_reason": self.splitter.finish_reason(last.finish_reason)}
        if self.chat:
            final["delta"] = {}
        else:
            final["text"] = ""
        counts = usage(n_prompt, last)
        events = [self._chunk(final, dflash=stats,
                              **({} if self.include_usage else {"usage": counts}))]
        if self.include_usage:
            events.append(sse({"id": self.id, "object": self.object, "created": self.created,
                               "model": self.model, "choices": [], "usage": counts,
                               "dflash": stats}))
        events.append(sse("[DONE]"))
        return events
