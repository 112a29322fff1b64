"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions``, parsed into dataclasses
(``chat_request`` and ``generation_settings`` also serve the Anthropic endpoint).

This layer checks what is HTTP's or OpenAI's own: the JSON shape of each field, the model name,
the prompt against the context length, and the API's documented limits (``temperature <= 2``,
penalties in [-2, 2], ``max_tokens >= 1``, at most 16 stop strings). A ``max_tokens`` beyond the
room the prompt leaves in the context is clamped to that room (the answer then ends with
``length``), as llama.cpp and Ollama do: agent clients send their own large default (Claude Code
32,000) whatever the model. Fields this server does not implement are ignored and logged once per
name (clients send their vendor's newest fields: ``context_management``, ``reasoning_effort``),
while a known field with a bad value is a 400 naming it. Tool definitions must be JSON Schema
(checked with ``jsonschema`` where it is installed). The ranges of the sampling
and decoding settings (``block_size``, ``min_confidence``, ``policy``) are checked by the engine's
own rules (``SamplingConfig.validate``, ``check_decode_settings``, ``check_policy``) here, so a bad
request gets its 400 before it queues. Every rejection is an ``APIError`` naming the parameter at fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..console import say_once
from ..errors import APIError, GenerationConfigError, GrammarError
from ..grammar import Grammar
from ..policy import check_policy
from ..prompts import encode_prompt, encode_text
from ..sampling import SamplingConfig, check_decode_settings
from ..settings import GenerationSettings
from .logprobs_format import parse_logprobs
from .reasoning import prompt_opens_reasoning
from .tools import (
    ToolFormat,
    ToolSpec,
    call_grammar,
    history_calls,
    parse_tools,
    render_messages,
    tool_format,
)

ENDPOINTS = ("chat", "completions", "messages")  # messages: Anthropic's Messages API
# What the OpenAI API accepts, where it is narrower than what the engine can do.
API_LIMITS = {"temperature": (None, 2.0), "presence_penalty": (-2.0, 2.0),
              "frequency_penalty": (-2.0, 2.0)}
MAX_STOP_STRINGS = 16
# OpenAI parameters this server does not implement: rejected rather than silently ignored.
UNSUPPORTED = {"best_of": lambda v: v not in (None, 1), "suffix": lambda v: bool(v)}
# The server's own settings, accepted on every endpoint (``extra_body`` in the OpenAI client).
EXTENSIONS = frozenset({"top_k", "min_p", "repetition_penalty", "proposal", "block_size", "policy",
                        "tree_budget", "min_confidence", "lookup", "regex", "grammar"})
# What the OpenAI endpoints read (the settings, then each endpoint's own fields).
SETTINGS_FIELDS = frozenset({
    "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n", "stop",
    "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "logit_bias",
    "response_format", *UNSUPPORTED}) | EXTENSIONS
OPENAI_FIELDS = {
    "chat": SETTINGS_FIELDS | {"messages", "tools", "tool_choice", "chat_template_kwargs",
                               "enable_thinking", "reasoning_effort", "logprobs", "top_logprobs",
                               "echo"},  # echo: read to be refused (chat has none)
    "completions": SETTINGS_FIELDS | {"prompt", "logprobs", "echo"}}
# About accounting, storage or routing on OpenAI's side: nothing to change here, nothing to log.
OPENAI_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key",
                            "safety_identifier", "parallel_tool_calls"})


@dataclass
class ServedModel:
    """The model a server serves and the limits it puts on requests."""

    name: str
    path: str
    vocab_size: int
    max_context: int | None
    default_max_tokens: int = 512
    block_size: int | None = None
    think_tags: tuple[str, str] | None = None
    tool_format: ToolFormat | None = None  # how the model writes tool calls (None: read it)

    def accepts(self, name: str) -> bool:
        return name in (self.name, self.path, "dflash", "default")


@dataclass
class CompletionRequest:
    """A parsed request of either endpoint."""

    endpoint: str  # "chat" or "completions"
    prompt_ids: list[int]
    settings: GenerationSettings
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: usage in a chunk of its own
    opens_reasoning: bool = False  # the prompt ends inside a <think> block
    tools: ToolSpec | None = None  # tools the answer may call (parsed out of it unless "none")
    tool_format: ToolFormat | None = None
    answer_prefix: str = ""  # the start of the answer that the prompt holds (tool_choice)
    echo_prompt: bool = False  # completions' echo: the answer's text starts with the prompt's
    prompt_text: str = ""  # the prompt as the client sent it (what echo repeats)

    @property
    def parses_tools(self) -> bool:
        return self.tools is not None and self.tools.choice != "none"


def read_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 ``invalid_json``."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def config_error(e: Exception) -> APIError:
    """Map a ``GenerationConfigError`` ("name=value: rule") to a 400 naming the parameter."""
    message = str(e)
    param = message.split("=", 1)[0] if "=" in message.split(":", 1)[0] else None
    if param and not param.replace("_", "").replace("[", "").replace("]", "").isalnum():
        param = None
    return APIError(400, message, param=param, code="invalid_value")


def ignore_unknown(body: dict, known, api: str) -> None:
    """Log (once per field name) the fields of ``body`` outside ``known``: they are ignored."""
    for name in sorted(set(body) - set(known)):
        say_once(f"request field {name}", f"ignoring the request field `{name}` ({api}): not "
                 "implemented by this server (said once per field)")


def parse_checked_tools(tools, tool_choice) -> ToolSpec | None:
    """``parse_tools``, and each tool's ``parameters`` checked as JSON Schema (draft 2020-12,
    with ``jsonschema`` where it is installed): a 400 naming the tool."""
    spec = parse_tools(tools, tool_choice)
    if spec is None:
        return None
    try:
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError
    except ImportError:  # the serve extra installs it; without it the shape checks stand alone
        return spec
    for i, tool in enumerate(spec.tools):
        fn = tool["function"]
        try:
            Draft202012Validator.check_schema(fn["parameters"])
        except SchemaError as e:
            at = "".join(f".{p}" for p in e.path)
            param = f"tools[{i}].function.parameters"
            raise APIError(400, f"{param}{at}: tool {fn['name']!r}: not a valid JSON Schema "
                           f"({e.message})", param=param, code="invalid_value") from None
    return spec


def parse_grammar(body: dict, tokenizer, vocab_size: int):
    """The grammar a request's answer must match (a ``BoundGrammar``; ``None``: unconstrained):
    ``response_format`` (``json_object``, ``json_schema``; ``text`` is none), or the server's
    ``regex`` / ``grammar`` (Lark) fields. A bad one: a 400 naming the field."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "text" and len(fmt) == 1:
        fmt = None
    asked = [name for name, value in (("response_format", fmt), ("regex", body.get("regex")),
                                      ("grammar", body.get("grammar"))) if value is not None]
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(400, f"{' and '.join(asked)}: give one of them", param=asked[1],
                       code="invalid_value")
    param = asked[0]
    try:
        if param == "regex":
            grammar = Grammar.regex(body["regex"], field="regex")
        elif param == "grammar":
            grammar = Grammar.lark(body["grammar"], field="grammar")
        elif not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
            kind = fmt.get("type") if isinstance(fmt, dict) else fmt
            raise APIError(400, f"response_format.type={kind!r}: one of 'text', 'json_object', "
                           "'json_schema'", param="response_format", code="invalid_value")
        elif fmt["type"] == "json_object":
            grammar = Grammar.json_object(field="response_format")
        else:
            spec = fmt.get("json_schema")
            param = "response_format.json_schema"
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise APIError(400, f"{param}: an object with the JSON schema in 'schema'",
                               param=param, code="invalid_value")
            param = "response_format.json_schema.schema"
            grammar = Grammar.json_schema(spec["schema"], field=param)
        return grammar.bind(tokenizer, vocab_size)
    except GrammarError as e:
        raise APIError(400, str(e), param=param, code="invalid_value") from None


def answer_grammar(asked, req: CompletionRequest, tokenizer, served: ServedModel, field: str):
    """The grammar a chat answer matches: ``asked`` (the request's ``field``, e.g.
    ``response_format``: a bound grammar or ``None``), or the strict tools' call grammar
    (:func:`~dflash.serving.tools.call_grammar`); both at once is a 400 naming ``field``."""
    calls = call_grammar(req.tools, req.tool_format) if req.tools is not None else None
    if calls is None:
        return asked
    if asked is not None:
        raise APIError(400, f"{field} with strict tools: give one of them (the answer is either a "
                       "document of the format or text with calls)", param=field,
                       code="invalid_value")
    try:
        return calls.bind(tokenizer, served.vocab_size)
    except GrammarError as e:
        for i, tool in enumerate(req.tools.tools):  # name the tool whose schema cannot
            fn = tool["function"]
            if fn["name"] in req.tools.strict:
                param = f"tools[{i}].function.parameters"
                try:
                    Grammar.json_schema(fn["parameters"], field=param).bind(tokenizer,
                                                                            served.vocab_size)
                except GrammarError as bad:
                    raise APIError(400, f"{bad} (tool {fn['name']!r}, strict)", param=param,
                                   code="invalid_value") from None
        raise APIError(400, str(e), param="tools", code="invalid_value") from None


def parse_request(endpoint: str, body: dict, tokenizer, served: ServedModel) -> CompletionRequest:
    """Check and encode one request body of ``endpoint`` ("chat" or "completions")."""
    ignore_unknown(body, OPENAI_FIELDS[endpoint] | OPENAI_IGNORED,
                   "/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    check_model(body, served)
    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    include_usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
    top, echo = parse_logprobs(endpoint, body)
    if endpoint == "chat":
        spec = parse_checked_tools(body.get("tools"), body.get("tool_choice"))
        req = chat_request(chat_messages(body), spec, template_kwargs(body), tokenizer, served)
        req.settings = generation_settings(body, served, len(req.prompt_ids), "messages").replace(
            logprobs=top, grammar=answer_grammar(parse_grammar(body, tokenizer, served.vocab_size),
                                                 req, tokenizer, served, "response_format"))
        req.stream, req.include_usage = stream, include_usage
        return req
    ids = completion_prompt_ids(body, tokenizer, served.vocab_size)
    # echo with max_tokens 0 scores the prompt alone (how harnesses score a text's likelihood).
    score_only = echo and body.get("max_tokens") == 0 and body.get("max_completion_tokens") is None
    settings = generation_settings({**body, "max_tokens": 1} if score_only else body, served,
                                   len(ids), "prompt")
    settings = settings.replace(max_tokens=0 if score_only else settings.max_tokens, logprobs=top,
                                prompt_logprobs=echo and top is not None,
                                grammar=parse_grammar(body, tokenizer, served.vocab_size))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    text = prompt if isinstance(prompt, str) else tokenizer.decode(ids) if echo else ""
    return CompletionRequest(endpoint, ids, settings, stream=stream, include_usage=include_usage,
                             echo_prompt=echo, prompt_text=text)


def chat_request(messages: list[dict], spec: ToolSpec | None, kwargs: dict, tokenizer,
                 served: ServedModel, endpoint: str = "chat") -> CompletionRequest:
    """A chat's prompt (messages, tools, template arguments) encoded; settings left to the caller.

    With a forced ``tool_choice`` the answer's start goes at the end of the prompt (after closing
    a reasoning block the template opened), and the request remembers it as ``answer_prefix``.
    """
    fmt = None
    if spec is not None:
        fmt = served.tool_format or tool_format(tokenizer)
        messages, tool_kwargs = render_messages(messages, spec, fmt)
        kwargs = {**kwargs, **tool_kwargs}
    ids = chat_prompt_ids(messages, kwargs, tokenizer)
    opens = prompt_opens_reasoning(tokenizer, ids, served.think_tags)
    prefix = fmt.prefix(spec) if fmt is not None else ""
    if prefix:
        closing = served.think_tags[1] + "\n\n" if opens else ""
        ids = ids + list(tokenizer.encode(closing + prefix, add_special_tokens=False))
        opens = False
    return CompletionRequest(endpoint, ids, None, opens_reasoning=opens, tools=spec,
                             tool_format=fmt, answer_prefix=prefix)


def check_model(body: dict, served: ServedModel) -> None:
    name = body.get("model")
    if name is not None and not served.accepts(name):
        raise APIError(404, f"The model `{name}` does not exist; this server serves "
                       f"`{served.name}`", param="model", code="model_not_found")


def _number(body: dict, name: str, default, integer: bool = False):
    """A numeric field's JSON type (ranges are checked elsewhere); ``default`` when absent."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if integer:
        ok = ok and float(value).is_integer()
    if not ok:
        raise APIError(400, f"{name}={value!r}: must be {'an integer' if integer else 'a number'}",
                       param=name, code="invalid_type")
    return int(value) if integer else float(value)


def _flag(body: dict, name: str, default: bool) -> bool:
    """A boolean field (JSON true/false only); ``default`` when absent."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name}={value!r}: must be true or false", param=name,
                       code="invalid_type")
    return value


def generation_settings(body: dict, served: ServedModel, n_prompt: int,
                        param: str) -> GenerationSettings:
    """The settings of a request whose prompt has ``n_prompt`` tokens (``param`` holds it)."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", served.default_max_tokens,
                         integer=True)
    if max_tokens < 1:
        raise APIError(400, f"max_tokens={max_tokens!r}: must be >= 1", param="max_tokens",
                       code="invalid_value")
    if body.get("n", 1) not in (1, None):
        raise APIError(400, "n: only n=1 is supported", param="n", code="invalid_value")
    for name, rejected in UNSUPPORTED.items():
        if rejected(body.get(name)):
            raise APIError(400, f"{name}: not supported by this server", param=name,
                           code="unsupported_parameter")
    if served.max_context is not None:
        if n_prompt >= served.max_context:
            raise APIError(400, f"This model's maximum context length is "
                           f"{served.max_context} tokens, but the prompt has {n_prompt} tokens",
                           param=param, code="context_length_exceeded")
        # Beyond the room left: the answer ends with "length" where the context is full.
        max_tokens = min(max_tokens, served.max_context - n_prompt)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
                             or any(not isinstance(s, str) or not s for s in stop)):
        raise APIError(400, "stop: a string or a list of non-empty strings",
                       param="stop", code="invalid_value")
    block_size = _number(body, "block_size", served.block_size, integer=True)
    sampling = SamplingConfig(
        temperature=_number(body, "temperature", 0.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=_number(body, "top_k", 0, integer=True),
        min_p=_number(body, "min_p", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", None),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        seed=body.get("seed"), logit_bias=body.get("logit_bias"),
        proposal=body.get("proposal", "sample"))
    try:
        sampling.validate(served.vocab_size)
    except GenerationConfigError as e:
        raise config_error(e) from None
    for name, (lo, hi) in API_LIMITS.items():
        value = getattr(sampling, name)
        if lo is not None and value < lo:
            raise APIError(400, f"{name}={value!r}: must be >= {lo:g}", param=name,
                           code="invalid_value")
        if value > hi:
            raise APIError(400, f"{name}={value!r}: must be <= {hi:g}", param=name,
                           code="invalid_value")
    policy = body.get("policy")
    tree_budget = _number(body, "tree_budget", None, integer=True)
    try:
        if policy is not None:
            check_policy(policy)
        check_decode_settings(block_size if block_size is not None else 2, max_tokens, 1,
                              _number(body, "min_confidence", 0.0))
    except GenerationConfigError as e:
        raise config_error(e) from None
    s = sampling
    return GenerationSettings(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        # 1.0 changes nothing; None skips the penalty pass altogether.
        repetition_penalty=None if s.repetition_penalty == 1.0 else s.repetition_penalty,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty, seed=s.seed,
        logit_bias=s.logit_bias, proposal=s.proposal, max_tokens=max_tokens, stop=stop,
        block_size=block_size, min_confidence=_number(body, "min_confidence", None),
        policy=policy, tree_budget=tree_budget, lookup=_flag(body, "lookup", True))


def _content_text(content, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(
                    part.get("text"), str):
                parts.append(part["text"])
            else:
                raise APIError(400, f"messages[{index}].content: only text parts are supported",
                               param="messages", code="invalid_value")
        return "".join(parts)
    raise APIError(400, f"messages[{index}].content: must be a string or a list of text parts",
                   param="messages", code="invalid_type")


def chat_messages(body: dict) -> list[dict]:
    """The ``messages`` of a chat request, as the chat template takes them (text and calls)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages: a non-empty list of {role, content} objects is required",
                       param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}]: needs a string `role`", param="messages",
                           code="invalid_value")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": _content_text(m.get("content"), i)}
        for key in ("name", "tool_call_id"):
            if key in m:
                msg[key] = m[key]
        if m.get("tool_calls"):
            msg["tool_calls"] = history_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        out.append(msg)
    return out


def template_kwargs(body: dict) -> dict:
    """The chat template's extra arguments: ``chat_template_kwargs`` and the thinking switches."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise APIError(400, "chat_template_kwargs: must be an object",
                       param="chat_template_kwargs", code="invalid_type")
    kwargs = dict(kwargs)
    for key in ("enable_thinking", "reasoning_effort"):
        if key in body and key not in kwargs:
            kwargs[key] = body[key]
    if "reasoning_effort" in kwargs and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = kwargs["reasoning_effort"] not in (None, "none")
    kwargs.pop("reasoning_effort", None)
    return kwargs


def chat_prompt_ids(messages: list[dict], kwargs: dict, tokenizer) -> list[int]:
    """Prompt ids of a chat: its messages through the tokenizer's chat template."""
    try:
        return encode_prompt(tokenizer, {"messages": messages}, **kwargs)
    except Exception as e:  # templates raise anything (jinja, KeyError, ...): the client's fault
        raise APIError(400, f"messages: the chat template rejected them ({e})",
                       param="messages", code="invalid_value") from None


def completion_prompt_ids(body: dict, tokenizer, vocab_size: int) -> list[int]:
    """Prompt ids of a completion request: one string, or one list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return encode_text(tokenizer, prompt)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < vocab_size for t in prompt):
            raise APIError(400, "prompt: token id outside the vocabulary", param="prompt",
                           code="invalid_value")
        return list(prompt)
    raise APIError(400, "prompt: a non-empty string or list of token ids (one prompt)",
                   param="prompt", code="invalid_value")
