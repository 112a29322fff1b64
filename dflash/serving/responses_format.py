"""OpenAI's Responses API (``POST /v1/responses``): its request body in, its shapes out.

So that agents that speak only the Responses API (the Codex CLI, the ``openai`` SDK's
``client.responses.create``) can use the server. A request is translated into the chat request the
other endpoints build: ``input`` items become chat messages (``message`` items, ``function_call``
items as an assistant's tool calls, ``function_call_output`` items as tool results),
``instructions`` and the leading system/developer messages become one system message, the
function tools go through the same checks and rendering as chat tools. The answer, split by the
same ``AnswerSplitter``, is written as output items: ``reasoning`` (a reasoning split),
``message`` (``output_text``) and ``function_call``. Streaming follows the Responses event
sequence (``response.created``, ``response.in_progress``, per item ``output_item.added`` /
deltas / ``output_item.done``, then ``response.completed``, or ``response.incomplete`` when
``max_output_tokens`` cut the answer), every event named and numbered (``sequence_number``).

Conversation state: ``previous_response_id`` continues an earlier response whose input and output
the server kept (``store`` true, OpenAI's default); the store is in memory and bounded
(``ResponseStore``), so an old id can be forgotten and is then a 400 naming the field. ``store:
false`` (what Codex sends) keeps nothing.

Without ``max_output_tokens`` an answer may run to the end of the context, as on OpenAI's API
(not ``--default-max-tokens``): Codex sends no limit and reports an answer cut short
(``incomplete``) as an error, where a tool call writing a whole file easily outgrows a default.

Fields are checked where they change the answer; fields about accounting, caching or OpenAI's
platform (``include``, ``prompt_cache_key``, ``client_metadata``, ``reasoning``, ...) are accepted
and ignored (but ``include: ["message.output_text.logprobs"]`` and ``top_logprobs``, which put
log-probabilities on the message: :mod:`.logprobs_format`), and fields this server does not know are ignored too, each logged once. Hosted tools
(``web_search``, ``namespace``, ``custom``, ...) are ignored and logged once per type: Codex sends
them with every request, and a model served here cannot run them.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, fields

from ..console import say_once
from ..errors import APIError
from .anthropic_format import EXTENSIONS, event
from .logprobs_format import LogprobFormat, parse_logprobs
from .openai_format import usage as chat_usage
from .requests import (
    CompletionRequest,
    ServedModel,
    answer_grammar,
    chat_request,
    check_model,
    generation_settings,
    ignore_unknown,
    parse_checked_tools,
    parse_grammar,
)
from .tools import AnswerSplitter, ToolSpec, check_function, parse_arguments

# Fields read here (EXTENSIONS: the server's own settings, as on the other endpoints).
FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens",
          "temperature", "top_p", "parallel_tool_calls", "stream", "store",
          "previous_response_id", "text", "truncation", "top_logprobs", "background",
          "conversation", "prompt"}
# Known fields that change nothing here: accepted and ignored without a word.
QUIET = {"reasoning", "reasoning_effort", "include", "metadata", "user", "service_tier",
         "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "client_metadata",
         "stream_options", "max_tool_calls"}
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
INPUT_ITEMS = ("message", "function_call", "function_call_output", "reasoning")
MAX_STORED = 256  # responses kept for previous_response_id
MAX_STORED_CHARS = 32 * 1024 * 1024  # and the text they hold together


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------------
# Conversation state


@dataclass
class _Stored:
    scope: str
    messages: list[dict]  # the conversation (instructions aside) including the response
    chars: int


class ResponseStore:
    """Earlier responses' conversations (input and output as chat messages), for
    ``previous_response_id``: bounded by count and by characters, oldest dropped first. ``scope``
    keeps one client's conversations from another's (an id is found only in its own scope)."""

    def __init__(self, max_responses: int = MAX_STORED, max_chars: int = MAX_STORED_CHARS):
        self.max_responses, self.max_chars = max_responses, max_chars
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, messages: list[dict], scope: str = "") -> None:
        chars = len(json.dumps(messages, ensure_ascii=False))
        if chars > self.max_chars:
            return
        self._items[response_id] = _Stored(scope, messages, chars)
        self._chars += chars
        while len(self._items) > self.max_responses or self._chars > self.max_chars:
            _, old = self._items.popitem(last=False)
            self._chars -= old.chars

    def get(self, response_id: str, scope: str = "") -> list[dict] | None:
        item = self._items.get(response_id)
        if item is None or item.scope != scope:
            return None
        self._items.move_to_end(response_id)
        return item.messages


# ---------------------------------------------------------------------------------------------
# Requests


@dataclass
class ResponsesRequest(CompletionRequest):
    """A parsed ``/v1/responses`` request: the chat request, and what the response echoes."""

    echo: dict = field(default_factory=dict)  # request fields the response object repeats
    history: list[dict] = field(default_factory=list)  # the conversation, instructions aside
    store: ResponseStore | None = None  # where the finished response goes (None: not kept)
    scope: str = ""


def _text_parts(content, where: str) -> str:
    """A message's ``content``: a string, or a list of text parts, as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: a string or a list of input_text parts", where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text", part.get("refusal")) if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(text, str):
            raise _bad(f"{where}[{j}].type: {kind!r} parts are not supported (input_text and "
                       "output_text are)", f"{where}[{j}].type")
        out.append(text)
    return "".join(out)


def input_messages(items, known_calls: set[str]) -> list[dict]:
    """``input`` (a string or a list of items) as chat messages; ``known_calls`` (the call ids of
    the earlier conversation) grows with the ``function_call`` items met."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("input: a string or a non-empty list of items", "input")
    out: list[dict] = []
    calls_open = False  # the last message is an assistant's that further calls join
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where}: must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role: \"user\", \"system\", \"developer\" or "
                           "\"assistant\"", f"{where}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_parts(item.get("content"), f"{where}.content")})
            calls_open = role == "assistant"
        elif kind == "function_call":
            for key in ("call_id", "name"):
                if not isinstance(item.get(key), str) or not item[key]:
                    raise _bad(f"{where}.{key}: a non-empty string is required",
                               f"{where}.{key}")
            call = {"id": item["call_id"], "type": "function", "function": {
                "name": item["name"],
                "arguments": parse_arguments(item.get("arguments", ""), f"{where}.arguments")}}
            if not calls_open:
                out.append({"role": "assistant", "content": ""})
                calls_open = True
            out[-1].setdefault("tool_calls", []).append(call)
            known_calls.add(item["call_id"])
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in known_calls:
                raise _bad(f"{where}.call_id: {call_id!r} names no earlier function_call",
                           f"{where}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _text_parts(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            calls_open = False
        elif kind == "reasoning":
            continue  # earlier reasoning: templates drop it from the history too
        else:
            raise _bad(f"{where}.type: {kind!r} items are not supported ("
                       f"{', '.join(INPUT_ITEMS)} are)", f"{where}.type")
    return out


def parse_response_tools(tools, tool_choice) -> tuple[ToolSpec | None, list[dict]]:
    """``tools`` / ``tool_choice`` as a checked ``ToolSpec`` (or ``None``) and their echo."""
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools: must be a list", "tools")
    converted, echo, names, where = [], [], set(), []
    for i, t in enumerate(tools or []):
        kind = t.get("type") if isinstance(t, dict) else None
        if not isinstance(kind, str):
            raise _bad(f"tools[{i}].type: a string is required", f"tools[{i}].type")
        if kind != "function":
            say_once(f"responses tool type {kind}", f"ignoring `{kind}` tools (/v1/responses): "
                     "only function tools run here (said once per type)")
            continue
        fn = check_function(t, f"tools[{i}]")
        if t.get("strict") is not None and not isinstance(t["strict"], bool):
            raise _bad(f"tools[{i}].strict: must be true or false", f"tools[{i}].strict")
        if fn["name"] in names:
            raise _bad(f"tools[{i}].name: {fn['name']!r} is defined twice", f"tools[{i}].name")
        names.add(fn["name"])
        # Constrained only when asked for (OpenAI's default is true; the echo says what ran).
        converted.append({"type": "function", "function": fn,
                          **({"strict": True} if t.get("strict") is True else {})})
        where.append(i)
        echo.append({"type": "function", "name": fn["name"],
                     "description": fn.get("description"), "parameters": fn["parameters"],
                     "strict": t.get("strict") is True})
    choice = tool_choice
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function":
            raise _bad(f"tool_choice.type: {tool_choice.get('type')!r} is not supported "
                       "(\"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                       "\"name\": ...})", "tool_choice.type")
        choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    try:
        spec = parse_checked_tools(converted, choice)
    except APIError as e:  # name the Responses fields, at their index in the request's list
        def at(text: str) -> str:
            text = text.replace("tool_choice.function.name", "tool_choice.name")
            return re.sub(r"tools\[(\d+)\]\.function", lambda m: f"tools[{where[int(m[1])]}]",
                          text)
        raise _bad(at(e.message), at(e.param or "tools")) from None
    return spec, echo


def _leading_system(messages: list[dict], instructions: str | None) -> list[dict]:
    """``instructions`` and the system messages the conversation starts with, as one."""
    k = 0
    while k < len(messages) and messages[k]["role"] == "system":
        k += 1
    parts = ([instructions] if instructions else []) + [m["content"] for m in messages[:k]]
    head = [{"role": "system", "content": "\n\n".join(parts)}] if parts else []
    return head + messages[k:]


def responses_grammar(fmt: dict | None, tokenizer, served: ServedModel, body: dict | None = None):
    """``text.format`` (``json_object``; ``json_schema`` with ``schema`` beside ``name`` and
    ``strict``, as the Responses API puts it), or the server's ``regex`` / ``grammar`` (Lark)
    fields of ``body``, as the grammar the answer must match (one of them: a 400 naming both)."""
    extra = {name: body[name] for name in ("regex", "grammar")
             if body is not None and body.get(name) is not None}
    if fmt is None or fmt.get("type") == "text":
        return parse_grammar(extra, tokenizer, served.vocab_size) if extra else None
    if extra:
        name = next(iter(extra))
        raise APIError(400, f"text.format and {name}: give one of them", param=name,
                       code="invalid_value")
    if fmt.get("type") == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"name": fmt.get("name"),
                                                      "schema": fmt.get("schema")}}
    try:
        return parse_grammar({"response_format": fmt}, tokenizer, served.vocab_size)
    except APIError as e:
        def where(s: str) -> str:
            return s.replace("response_format.json_schema", "text.format").replace(
                "response_format", "text.format")
        raise APIError(e.status, where(e.message), param=where(e.param or ""),
                       code=e.code) from None


def parse_responses_request(body: dict, tokenizer, served: ServedModel,
                            store: ResponseStore | None = None,
                            scope: str = "") -> ResponsesRequest:
    """Check and encode one ``/v1/responses`` body (``store``: the kept conversations)."""
    ignore_unknown(body, FIELDS | QUIET | EXTENSIONS, "/v1/responses")
    check_model(body, served)
    if "input" not in body:
        raise _bad("input: Field required", "input")
    for name in ("background", "conversation", "prompt"):
        if body.get(name):
            raise _bad(f"{name}: not supported by this server", name)
    if body.get("truncation") not in (None, "disabled"):
        raise _bad("truncation: only \"disabled\" is supported", "truncation")
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if text is not None and (not isinstance(text, dict) or (
            fmt is not None and not isinstance(fmt, dict))):
        raise _bad("text.format: an object ({\"type\": \"text\"}, \"json_object\" or "
                   "\"json_schema\")", "text.format")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions: must be a string", "instructions")
    for name in ("stream", "store", "parallel_tool_calls"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise _bad(f"{name}: must be true or false", name)
    previous = body.get("previous_response_id")
    history: list[dict] = []
    if previous is not None:
        found = store.get(previous, scope) if isinstance(previous, str) and store else None
        if found is None:
            raise _bad(f"previous_response_id: no stored response has the id {previous!r} "
                       "(responses are kept in memory, with `store` true, and the oldest are "
                       "forgotten)", "previous_response_id")
        history = list(found)
    known = {c["id"] for m in history for c in m.get("tool_calls", ())}
    history += input_messages(body["input"], known)
    spec, tools_echo = parse_response_tools(body.get("tools"), body.get("tool_choice"))
    try:
        req = chat_request(_leading_system(history, instructions), spec, {}, tokenizer, served,
                           endpoint="responses")
    except APIError as e:
        raise _bad(e.message.replace("messages:", "input:", 1), "input") from None
    limit = body.get("max_output_tokens")
    if limit is None and served.max_context is not None \
            and len(req.prompt_ids) < served.max_context:
        limit = served.max_context - len(req.prompt_ids)  # OpenAI's: to the end of the context
    settings_body = {"max_tokens": limit,
                     **{k: body[k] for k in ("temperature", "top_p", *EXTENSIONS) if k in body}}
    try:
        req.settings = generation_settings(settings_body, served, len(req.prompt_ids), "input")
    except APIError as e:
        if e.param != "max_tokens":
            raise
        raise APIError(e.status, e.message.replace("max_tokens", "max_output_tokens"),
                       param="max_output_tokens", code=e.code) from None
    req.settings = req.settings.replace(logprobs=parse_logprobs("responses", body)[0],
                                        grammar=answer_grammar(
                                            responses_grammar(fmt, tokenizer, served, body), req,
                                            tokenizer, served, "text.format"))
    echo = {"instructions": instructions, "tools": tools_echo,
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": req.settings.temperature,
            "top_p": req.settings.top_p,
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": previous, "store": body.get("store", True) is not False}
    out = ResponsesRequest(**{f.name: getattr(req, f.name) for f in fields(CompletionRequest)},
                           echo=echo, history=history, scope=scope,
                           store=store if echo["store"] else None)
    out.stream = bool(body.get("stream", False))
    return out


# ---------------------------------------------------------------------------------------------
# Responses


def response_usage(n_prompt: int, last, reasoning_tokens: int = 0) -> dict:
    """The Responses API's token counts (the reused prompt prefix as ``cached_tokens``) and the
    acceptance statistics as on the other endpoints (``dflash``)."""
    chat = chat_usage(n_prompt, last)
    return {"input_tokens": n_prompt,
            "input_tokens_details": {"cached_tokens": last.reused_prompt_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": last.generation_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": n_prompt + last.generation_tokens, "dflash": chat["dflash"]}


def message_item(text: str, status: str = "completed", item_id: str | None = None,
                 logprobs: list[dict] | None = None) -> dict:
    return {"id": item_id or _new_id("msg"), "type": "message", "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": logprobs or []}]}


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or _new_id("rs"), "type": "reasoning", "status": status,
            "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call: dict, status: str = "completed") -> dict:
    return {"id": _new_id("fc"), "type": "function_call", "status": status,
            "call_id": call["id"], "name": call["name"], "arguments": call["arguments"]}


def response_object(req: ResponsesRequest, response_id: str, created: float, model: str,
                    status: str, output: list[dict], usage: dict | None = None,
                    stats: dict | None = None, error: dict | None = None) -> dict:
    """A ``response`` object; ``status`` "incomplete" means cut by ``max_output_tokens``."""
    body = {"id": response_id, "object": "response", "created_at": created, "status": status,
            "background": False, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "model": model, "output": output, "usage": usage, "metadata": {},
            "reasoning": {"effort": None, "summary": None},
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "user": None,
            **req.echo}
    if status in ("completed", "incomplete"):
        body["completed_at"] = time.time() if status == "completed" else None
    if stats is not None:
        body["dflash"] = stats
    return body


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _remember(req: ResponsesRequest, response_id: str, content: str, calls: list[dict]) -> None:
    """Keep the conversation with this response's answer for a later ``previous_response_id``."""
    if req.store is None:
        return
    answer = {"role": "assistant", "content": content}
    if calls:
        answer["tool_calls"] = [{"id": c["call_id"], "type": "function", "function": {
            "name": c["name"], "arguments": json.loads(c["arguments"])}} for c in calls]
    req.store.put(response_id, [*req.history, answer], req.scope)


def _reasoning_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0


def response_body(req: ResponsesRequest, model: str, text: str, last, stats: dict,
                  splitter: AnswerSplitter, tokenizer,
                  logprobs: LogprobFormat | None = None) -> dict:
    """The body of a non-streamed ``/v1/responses`` answer (kept if ``store``); ``logprobs``:
    every token's log-probability (``last.logprobs``) on the message's ``output_text``."""
    reasoning, content, calls = splitter.feed(text, final=True)
    status = _status(last.finish_reason)
    output = [reasoning_item(reasoning, status)] if reasoning else []
    if content or not calls:
        output.append(message_item(content, status, logprobs=None if logprobs is None
                                   else logprobs.content(last.logprobs or [])))
    items = [call_item(c) for c in calls]
    output += items
    response_id = _new_id("resp")
    _remember(req, response_id, content, items)
    return response_object(req, response_id, time.time(), model, status, output,
                           response_usage(len(req.prompt_ids), last,
                                          _reasoning_tokens(tokenizer, reasoning)), stats)


class ResponseStream:
    """The events of one streamed ``/v1/responses`` answer; output items open as it needs them."""

    PARTS = {"message": ("output_text", "response.output_text"),
             "reasoning": ("reasoning_text", "response.reasoning_text")}

    def __init__(self, req: ResponsesRequest, model: str, splitter: AnswerSplitter, tokenizer,
                 logprobs: LogprobFormat | None = None):
        self.req, self.model, self.splitter, self.tokenizer = req, model, splitter, tokenizer
        # Log-probabilities asked: entries wait for the message's next delta (the tokens of a
        # reasoning block included); ``scored``: the open message's so far.
        self.logprobs = logprobs
        self.pending: list = []
        self.scored: list[dict] = []
        self.id = _new_id("resp")
        self.created = time.time()
        self.seq = 0
        self.output: list[dict] = []  # finished items
        self.open: dict | None = None  # the text item being streamed
        self.texts = {"message": "", "reasoning": ""}
        self.opened = False

    def _event(self, kind: str, data: dict) -> str:
        line = event(kind, {**data, "sequence_number": self.seq})
        self.seq += 1
        return line

    def _response(self, status: str, usage: dict | None = None, stats: dict | None = None,
                  error: dict | None = None) -> dict:
        return response_object(self.req, self.id, self.created, self.model, status,
                               list(self.output), usage, stats, error)

    def opening(self, n_prompt: int = 0, first=None) -> str:
        if self.opened:  # sent early, as the first keepalive
            return ""
        self.opened = True
        r = self._response("in_progress")
        return (self._event("response.created", {"response": r})
                + self._event("response.in_progress", {"response": r}))

    def keepalive(self) -> str:
        """What the stream sends while the prompt is processed, before any output: the opening
        events first, then ``keepalive`` events (``{"type": "keepalive", "sequence_number": n}``,
        as OpenAI's API sends on long streams). Not SSE comments: the Codex CLI's idle timeout
        counts events, and its SSE parser skips comments; the ``openai`` SDK's stream helper
        needs ``response.created`` before any other event."""
        return self.opening() if not self.opened else self._event("keepalive", {})

    def _item_ids(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def _close(self, status: str = "completed") -> list[str]:
        if self.open is None:
            return []
        kind, item = self.open["type"], self.open
        part_type, prefix = self.PARTS[kind]
        text = "".join(item.pop("_text"))
        ids = self._item_ids()
        done = {**ids, "content_index": 0, "text": text}
        if kind == "message":
            self.scored += self._scores()  # what never came out as text (a stop string's)
            done["logprobs"], self.scored = self.scored, []
            finished = message_item(text, status, item["id"], done["logprobs"])
        else:
            finished = reasoning_item(text, status, item["id"])
        self.output.append(finished)
        self.open = None
        self.texts[kind] += text
        return [self._event(f"{prefix}.done", done),
                self._event("response.content_part.done", {**ids, "content_index": 0,
                                                           "part": finished["content"][0]}),
                self._event("response.output_item.done", {"output_index": ids["output_index"],
                                                          "item": finished})]

    def _start(self, kind: str) -> list[str]:
        events = self._close()
        empty = (message_item if kind == "message" else reasoning_item)("", "in_progress")
        self.open = {**empty, "_text": []}
        ids = self._item_ids()
        return events + [
            self._event("response.output_item.added", {"output_index": ids["output_index"],
                                                       "item": empty}),
            self._event("response.content_part.added", {**ids, "content_index": 0,
                                                        "part": empty["content"][0]})]

    def _text(self, kind: str, text: str) -> list[str]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._start(kind)
        self.open["_text"].append(text)
        delta = {**self._item_ids(), "content_index": 0, "delta": text}
        if kind == "message":
            delta["logprobs"] = self._scores()
            self.scored += delta["logprobs"]
        return events + [self._event(f"{self.PARTS[kind][1]}.delta", delta)]

    def _scores(self) -> list[dict]:
        pending, self.pending = self.pending, []
        return self.logprobs.content(pending) if self.logprobs is not None else []

    def _call(self, call: dict) -> list[str]:
        events = self._close()
        item = call_item(call)
        index = len(self.output)
        ids = {"item_id": item["id"], "output_index": index}
        events.append(self._event("response.output_item.added", {
            "output_index": index, "item": {**item, "arguments": "", "status": "in_progress"}}))
        events.append(self._event("response.function_call_arguments.delta",
                                  {**ids, "delta": call["arguments"]}))
        events.append(self._event("response.function_call_arguments.done",
                                  {**ids, "arguments": call["arguments"], "name": call["name"]}))
        events.append(self._event("response.output_item.done",
                                  {"output_index": index, "item": item}))
        self.output.append(item)
        return events

    def add(self, r) -> list[str]:
        """The events for one step of the generation."""
        if self.logprobs is not None:
            self.pending += r.logprobs or []
        reasoning, content, calls = self.splitter.feed(r.text, r.finish_reason is not None)
        events = []
        if reasoning:
            events += self._text("reasoning", reasoning)
        if content:
            events += self._text("message", content)
        for call in calls:
            events += self._call(call)
        return events

    def closing(self, n_prompt: int, last, stats: dict) -> list[str]:
        status = _status(last.finish_reason)
        events = self._close(status)
        if not self.output:  # an empty answer is still one (empty) message
            events += self._start("message") + self._close(status)
        calls = [item for item in self.output if item["type"] == "function_call"]
        _remember(self.req, self.id, self.texts["message"], calls)
        usage = response_usage(n_prompt, last,
                               _reasoning_tokens(self.tokenizer, self.texts["reasoning"]))
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(kind, {"response": self._response(status, usage, stats)})]

    def error(self, e: APIError) -> str:
        """An error after the headers went out: an ``error`` event, then ``response.failed``."""
        failed = self._response("failed", error={"code": "server_error", "message": e.message})
        return (self._event("error", {"code": e.code, "message": e.message, "param": e.param})
                + self._event("response.failed", {"response": failed}))
