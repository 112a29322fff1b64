"""Anthropic's Messages API (``POST /v1/messages``): its request body in, its shapes out.

So that agent clients which speak Anthropic's API can use the server. A request is translated into
the chat request the OpenAI endpoint builds (messages, tools, settings; the same checks), and the
answer, split by the same ``AnswerSplitter``, is written as Anthropic's content blocks: ``text``,
``thinking`` (a reasoning split) and ``tool_use``. Streaming follows Anthropic's event sequence:
``message_start``, per block ``content_block_start`` / ``content_block_delta`` /
``content_block_stop``, then ``message_delta`` (stop reason, output tokens) and ``message_stop``.

Unknown top-level fields are ignored and logged once per name (Claude Code sends the newest
fields of Anthropic's API, ``context_management`` say, whatever the server), where Anthropic's own
API would answer "Extra inputs are not permitted". Fields about accounting, routing or Anthropic's
cache (``metadata``, ``service_tier``, ``cache_control``, ``inference_geo``, ``speed``, ...) are
ignored without a word: they change nothing about the answer, and the server's prefix cache is
automatic. A known field with a bad value is still a 400 naming it. What would change
the answer and cannot be honoured is a 400: structured outputs (``output_config.format``), a final
assistant message (prefill), non-text blocks (images, documents), server tools. The sampling fields
of earlier API versions (``temperature`` in [0, 1], ``top_p``, ``top_k``) and the server's own
settings (``seed``, ``logit_bias``, ``policy``, ...) are accepted as on the OpenAI endpoints.
Errors have Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import uuid

from ..errors import APIError
from .requests import (
    CompletionRequest,
    ServedModel,
    chat_request,
    check_model,
    generation_settings,
    ignore_unknown,
    parse_checked_tools,
)
from .tools import AnswerSplitter

FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p",
          "top_k", "stream", "tools", "tool_choice", "thinking", "output_config"}
# Anthropic fields about accounting, routing or Anthropic's own cache: nothing to change here.
IGNORED = {"metadata", "service_tier", "cache_control", "inference_geo", "speed",
           "user_profile_id", "workspace_id", "diagnostics"}
# The server's own settings, accepted here as on the OpenAI endpoints (same names and rules).
EXTENSIONS = {"min_p", "seed", "logit_bias", "repetition_penalty", "presence_penalty",
              "frequency_penalty", "proposal", "block_size", "policy", "tree_budget",
              "min_confidence", "lookup"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _bad(message: str) -> APIError:
    return APIError(400, message, code="invalid_value")


def error_body(e: APIError) -> dict:
    """An ``APIError`` in Anthropic's error shape."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"),
                                       "message": e.message}}


def _text(content, where: str) -> str:
    """A string, or a list of text blocks, as one string (``tool_result`` content, ``system``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "".join(b["text"] for b in content)
    raise _bad(f"{where}: a string or a list of text blocks")


def _message(m, i: int) -> list[dict]:
    """One Anthropic message as chat messages (tool results become ``tool`` messages)."""
    where = f"messages.{i}"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise _bad(f"{where}.role: must be \"user\" or \"assistant\"")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content: a string or a list of content blocks")
    text, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input"), dict):
                raise _bad(f"{at}: a tool_use block needs a string `name` and an object `input`")
            calls.append({"id": block.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
                          "type": "function",
                          "function": {"name": block["name"], "arguments": block["input"]}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise _bad(f"{at}.tool_use_id: required")
            body = _text(block.get("content", ""), f"{at}.content")
            if block.get("is_error"):
                body = f"Error: {body}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": body})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning: templates drop it from the history too
        else:
            raise _bad(f"{at}: {kind!r} blocks are not supported in {role} messages (text, "
                       "tool_use in assistant and tool_result in user messages are)")
    out = list(results)
    if text or calls or not results:
        msg = {"role": role, "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tools(tools, tool_choice):
    """Anthropic's ``tools`` / ``tool_choice`` as a checked ``ToolSpec``."""
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools: must be a list")
    converted = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            raise _bad(f"tools.{i}.type: only custom tools ({{name, description, "
                       f"input_schema}}) are supported")
        if "input_schema" not in t:
            raise _bad(f"tools.{i}.input_schema: Field required")
        converted.append({"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"),
            "parameters": t["input_schema"]}})
    choice = None
    if tool_choice is not None:
        kind = tool_choice.get("type") if isinstance(tool_choice, dict) else None
        if kind == "tool":
            choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
        elif kind in ("auto", "none", "any"):
            choice = "required" if kind == "any" else kind
        else:
            raise _bad("tool_choice: {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}")
    try:
        return parse_checked_tools(converted, choice)
    except APIError as e:  # name Anthropic's fields, not OpenAI's
        message = (e.message.replace(".function.parameters", ".input_schema")
                   .replace(".function.", ".").replace("tools[", "tools.").replace("]", "")
                   .replace("tool_choice.function.name", "tool_choice.name"))
        raise _bad(message) from None


def parse_messages_request(body: dict, tokenizer, served: ServedModel) -> CompletionRequest:
    """Check and encode one ``/v1/messages`` body."""
    ignore_unknown(body, FIELDS | IGNORED | EXTENSIONS, "/v1/messages")
    for name in ("model", "messages", "max_tokens"):
        if name not in body:
            raise _bad(f"{name}: Field required")
    check_model(body, served)
    if not isinstance(body["messages"], list) or not body["messages"]:
        raise _bad("messages: a non-empty list of {role, content} objects is required")
    messages = [msg for i, m in enumerate(body["messages"]) for msg in _message(m, i)]
    if messages[-1]["role"] == "assistant":
        raise _bad("messages: a final assistant message (prefill) is not supported")
    output = body.get("output_config") or {}
    if not isinstance(output, dict) or output.get("format") is not None:
        raise _bad("output_config.format: structured outputs are not supported")
    system = body.get("system")
    if system:
        messages.insert(0, {"role": "system", "content": _text(system, "system")})
    kwargs = {}
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise _bad("thinking.type: \"enabled\", \"disabled\" or \"adaptive\"")
        if kind != "adaptive":  # adaptive: the template's own default
            kwargs["enable_thinking"] = kind == "enabled"
    spec = _tools(body.get("tools"), body.get("tool_choice"))
    req = chat_request(messages, spec, kwargs, tokenizer, served, endpoint="messages")
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not 0 <= temperature <= 1:
        raise _bad(f"temperature: {temperature!r} is outside [0, 1]")
    stops = body.get("stop_sequences")
    settings_body = {"max_tokens": body["max_tokens"], "stop": stops or None,
                     **{k: body[k] for k in ("temperature", "top_p", "top_k", *EXTENSIONS)
                        if k in body}}
    try:
        req.settings = generation_settings(settings_body, served, len(req.prompt_ids),
                                           "messages")
    except APIError as e:
        if e.param == "stop":
            raise _bad("stop_sequences: a list of non-empty strings") from None
        raise
    req.stream = bool(body.get("stream", False))
    return req


def matched_stop(tokenizer, tokens: list[int], stops: list[str] | None) -> str | None:
    """The stop sequence that ended a generation (``None``: it ended on an end-of-turn token)."""
    if not stops:
        return None
    text = tokenizer.decode(tokens)
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found)[1] if found else None


def stop_reason(finish: str | None, stop_sequence: str | None) -> str | None:
    if stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish, finish)


def usage(n_prompt: int, last) -> dict:
    """Anthropic's usage: ``input_tokens`` excludes the reused prefix (``cache_read_input_tokens``),
    as Anthropic counts cache reads; ``dflash`` holds the acceptance (τ) as on the OpenAI side."""
    reused = last.reused_prompt_tokens
    return {"input_tokens": n_prompt - reused, "output_tokens": last.generation_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": reused,
            "dflash": {"tau": round(last.mean_tau, 4), "cycles": last.cycles,
                       "rows_per_pass": round(last.rows_per_pass, 3)}}


def _tool_use(call: dict) -> dict:
    call_id = call["id"]
    if call_id.startswith("call_"):
        call_id = "toolu_" + call_id[len("call_"):]
    return {"type": "tool_use", "id": call_id, "name": call["name"],
            "input": json.loads(call["arguments"])}


def message_response(model: str, n_prompt: int, text: str, last, stats: dict,
                     splitter: AnswerSplitter, stop_sequence: str | None) -> dict:
    """The body of a non-streamed ``/v1/messages`` answer."""
    reasoning, content, calls = splitter.feed(text, final=True)
    blocks = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if content or not calls:
        blocks.append({"type": "text", "text": content})
    blocks += [_tool_use(c) for c in calls]
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
            "model": model, "content": blocks,
            "stop_reason": stop_reason(splitter.finish_reason(last.finish_reason),
                                       stop_sequence),
            "stop_sequence": stop_sequence, "usage": usage(n_prompt, last), "dflash": stats}


def event(kind: str, data: dict) -> str:
    """One server-sent event of Anthropic's stream (named, with the type repeated in the data)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class MessageStream:
    """The events of one streamed ``/v1/messages`` answer; blocks open as the answer needs them."""

    DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}

    def __init__(self, model: str, splitter: AnswerSplitter, tokenizer, stops: list[str] | None):
        self.model, self.splitter = model, splitter
        self.tokenizer, self.stops = tokenizer, stops
        self.id = f"msg_{uuid.uuid4().hex}"
        self.index = -1
        self.open: str | None = None  # the kind of the block being streamed
        self.tokens: list[int] = []

    def opening(self, n_prompt: int, first) -> str:
        u = usage(n_prompt, first)
        u["output_tokens"] = 0
        return event("message_start", {"message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": u}})

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def _start(self, block: dict) -> list[str]:
        events = self._close()
        self.index += 1
        self.open = block["type"]
        return events + [event("content_block_start", {"index": self.index,
                                                       "content_block": block})]

    def _text(self, kind: str, text: str) -> list[str]:
        events = []
        if self.open != kind:
            empty = {"type": kind, kind: ""}
            if kind == "thinking":
                empty["signature"] = ""
            events += self._start(empty)
        delta_type, key = self.DELTAS[kind]
        events.append(event("content_block_delta", {"index": self.index,
                                                    "delta": {"type": delta_type, key: text}}))
        return events

    def add(self, r) -> list[str]:
        """The events for one step of the generation."""
        self.tokens += r.tokens
        reasoning, content, calls = self.splitter.feed(r.text, r.finish_reason is not None)
        events = []
        if reasoning:
            events += self._text("thinking", reasoning)
        if content:
            events += self._text("text", content)
        for call in calls:
            block = _tool_use(call)
            events += self._start({**block, "input": {}})
            events.append(event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": call["arguments"]}}))
            events += self._close()
        return events

    def closing(self, n_prompt: int, last, stats: dict) -> list[str]:
        events = self._close()
        if self.index < 0:  # an empty answer still has one (empty) text block
            events += self._start({"type": "text", "text": ""}) + self._close()
        stop = matched_stop(self.tokenizer, self.tokens, self.stops)
        u = usage(n_prompt, last)
        return events + [
            event("message_delta", {
                "delta": {"stop_reason": stop_reason(self.splitter.finish_reason(
                    last.finish_reason), stop), "stop_sequence": stop},
                "usage": u, "dflash": stats}),
            event("message_stop", {})]

    def error(self, e: APIError) -> str:
        return event("error", {"error": error_body(e)["error"]})
