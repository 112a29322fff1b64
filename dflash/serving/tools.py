"""Function calling: ``tools`` / ``tool_choice`` checked, rendered into the prompt, calls parsed out.

The model decides what to call; this module only prepares the prompt and reads the answer, so the
output stays the target's own (speculative decoding is untouched). Two renderings:

- *native*: the tokenizer's chat template knows tools (mlx-lm found a tool parser for it, e.g. the
  Hermes/Qwen ``<tool_call>{json}</tool_call>`` form, Qwen3-Coder's XML form): ``tools`` go to
  ``apply_chat_template`` and calls are parsed with mlx-lm's parser for that template;
- *system prompt*: templates without tool support get the tools as a Hermes-style system prompt
  (the JSON schemas and the ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` format);
  earlier calls and tool results in the history are written in the same form as text.

``tool_choice`` "none" leaves the tools out of the prompt; "required" starts the answer with the
call's opening tag; a named function renders only that tool and, for the JSON form, starts the
answer with ``{"name": "<it>", "arguments": {`` (a prefix of the prompt, not a constraint on
decoding). Output that looks like a call but does not parse is returned as text, never an error.

Tools declared ``strict: true`` are constrained instead (:func:`call_grammar`): a Lark grammar
(llguidance) lets the answer be any text until the call's opening tag, then only a call of a
declared tool whose arguments match its ``parameters`` schema, then the closing tag. The grammar
forces the call's fixed parts (``{"name": "``, the name once its first letters decide it,
``", "arguments": {``): free proposals for the verify pass, which still decides every token.
Strict calls need the JSON form (Hermes ``<tool_call>`` JSON); another form is a 400 naming the
tool.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import APIError, GrammarError
from ..grammar import WHITESPACE, Grammar
from .reasoning import ThinkSplitter

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
JSON_PARSERS = ("json_tools",)  # mlx-lm parsers of the Hermes JSON form (a named prefix fits)
XML_PARSERS = ("qwen3_coder",)  # mlx-lm parsers of the <function=...><parameter=...> form
ARG_KEY_PARSERS = ("glm47",)  # mlx-lm parsers of GLM's NAME<arg_key>K</arg_key><arg_value>V form
HEADER_PARSERS = ("mistral",)  # mlx-lm parsers of Mistral's [TOOL_CALLS]NAME[ARGS]{...} form
CHOICES = ("auto", "none", "required")

SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


@dataclass
class ToolSpec:
    """A request's validated tools (OpenAI's ``{"type": "function", "function": {...}}``)."""

    tools: list[dict]
    choice: str = "auto"  # "auto", "none", "required" or the name of the function to call
    strict: tuple[str, ...] = ()  # the tools declared strict: their arguments are constrained

    @property
    def constrained(self) -> bool:
        """Whether the answer's calls are constrained (:func:`call_grammar`)."""
        if self.choice == "none" or not self.strict:
            return False
        return self.choice in CHOICES or self.choice in self.strict

    @property
    def rendered(self) -> list[dict]:
        """The tools the prompt shows: none for "none", only the named one for a name."""
        if self.choice == "none":
            return []
        if self.choice in CHOICES:
            return self.tools
        return [t for t in self.tools if t["function"]["name"] == self.choice]


def check_function(fn, param: str) -> dict:
    """One function definition (``name``, ``description``, ``parameters``) checked."""
    if not isinstance(fn, dict):
        raise _bad(f"{param}: must be an object", param)
    name = fn.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or not all(
            c.isalnum() or c in "_-." for c in name):
        raise _bad(f"{param}.name: a non-empty string of letters, digits, '_', '-' or '.' "
                   "(at most 64)", f"{param}.name")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise _bad(f"{param}.description: must be a string", f"{param}.description")
    schema = fn.get("parameters")
    if schema is not None:
        if not isinstance(schema, dict):
            raise _bad(f"{param}.parameters: must be a JSON Schema object", f"{param}.parameters")
        if schema.get("type", "object") != "object":
            raise _bad(f"{param}.parameters.type: must be \"object\"",
                       f"{param}.parameters.type")
        props = schema.get("properties")
        if props is not None and (not isinstance(props, dict) or not all(
                isinstance(v, dict) for v in props.values())):
            raise _bad(f"{param}.parameters.properties: must map names to schema objects",
                       f"{param}.parameters.properties")
        required = schema.get("required")
        if required is not None and (not isinstance(required, list) or not all(
                isinstance(r, str) for r in required)):
            raise _bad(f"{param}.parameters.required: must be a list of strings",
                       f"{param}.parameters.required")
    out = {"name": name}
    if fn.get("description"):
        out["description"] = fn["description"]
    out["parameters"] = schema if schema is not None else {"type": "object", "properties": {}}
    return out


def parse_tools(tools, tool_choice) -> ToolSpec | None:
    """OpenAI's ``tools`` and ``tool_choice`` checked; ``None`` when the request has no tools."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise _bad("tool_choice: needs `tools`", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise _bad("tools: must be a list of {\"type\": \"function\", \"function\": {...}}",
                   "tools")
    checked, names, strict = [], set(), []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad(f"tools[{i}].type: only \"function\" tools are supported",
                       f"tools[{i}].type")
        fn = check_function(tool.get("function"), f"tools[{i}].function")
        if fn["name"] in names:
            raise _bad(f"tools[{i}].function.name: {fn['name']!r} is defined twice",
                       f"tools[{i}].function.name")
        names.add(fn["name"])
        checked.append({"type": "function", "function": fn})
        flag = tool["function"].get("strict", tool.get("strict"))
        if flag is not None and not isinstance(flag, bool):
            raise _bad(f"tools[{i}].function.strict: must be true or false",
                       f"tools[{i}].function.strict")
        if flag:
            strict.append(fn["name"])
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise _bad("tool_choice: \"auto\", \"none\", \"required\" or {\"type\": "
                       "\"function\", \"function\": {\"name\": ...}}", "tool_choice")
        if name not in names:
            raise _bad(f"tool_choice.function.name: no tool is named {name!r}",
                       "tool_choice.function.name")
        choice = name
    elif choice not in CHOICES:
        raise _bad("tool_choice: \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                   "\"function\": {\"name\": ...}}", "tool_choice")
    return ToolSpec(checked, choice, tuple(strict))


def parse_arguments(arguments, param: str) -> dict:
    """A history call's ``arguments`` (OpenAI sends a JSON string) as the dict templates expect."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            return value
    raise _bad(f"{param}: must be a JSON object (or a string holding one)", param)


def history_calls(calls, param: str) -> list[dict]:
    """An assistant message's ``tool_calls``, checked, with their arguments as dicts."""
    if not isinstance(calls, list):
        raise _bad(f"{param}: must be a list", param)
    out = []
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}.function: needs a string `name`", f"{where}.function")
        out.append({"id": call.get("id") or new_call_id(), "type": "function",
                    "function": {"name": fn["name"], "arguments": parse_arguments(
                        fn.get("arguments", {}), f"{where}.function.arguments")}})
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolFormat:
    """How a model writes calls: the tags around one, and the parser of what is between."""

    start: str
    end: str
    parse: Callable  # (text between the tags, tools) -> {"name", "arguments"} or a list of them
    native: bool  # the chat template renders tools itself
    json_form: bool  # the Hermes JSON form (a named call can be started in the prompt)
    xml_form: bool = False  # Qwen3-Coder's and Qwen3.5's <function=...><parameter=...> form
    header_form: bool = False  # Mistral's NAME[ARGS]{...} after the opening tag, no closing one
    arg_key_form: bool = False  # GLM-4.5/4.7's NAME, then <arg_key>K</arg_key><arg_value>V pairs
    # Its tags the tokenizer holds as special tokens: a grammar's quoted text never matches one
    # (llguidance), so strict calls in such a form are refused rather than spelled out in text.
    special: frozenset[str] = frozenset()

    def prefix(self, spec: ToolSpec | None) -> str:
        """Text the answer starts with (put at the end of the prompt) for ``tool_choice``."""
        if spec is None or spec.choice in ("auto", "none"):
            return ""
        if self.header_form or self.arg_key_form:  # the call's name follows the tag directly
            return self.start
        if spec.choice == "required" or not self.json_form or spec.constrained:
            # (Constrained: the grammar forces the call's name and its opening.)
            return self.start + "\n"
        return self.start + "\n" + json.dumps({"name": spec.choice})[:-1] + ', "arguments": {'


def _hermes_parse(text: str, tools=None):
    return json.loads(text.strip())


def tool_format(tokenizer) -> ToolFormat:
    """The tokenizer's own tool format (mlx-lm's parser), or the Hermes form as a system prompt."""
    if getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_parser is not None:
        kind = (getattr(tokenizer, "init_kwargs", None) or {}).get("tool_parser_type") or \
            getattr(tokenizer.tool_parser, "__module__", "").rsplit(".", 1)[-1]
        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
        tags = {start, end, *FORM_TAGS.get(kind, ())}
        return ToolFormat(start, end, tokenizer.tool_parser, native=True,
                          json_form=kind in JSON_PARSERS, xml_form=kind in XML_PARSERS,
                          header_form=kind in HEADER_PARSERS,
                          arg_key_form=kind in ARG_KEY_PARSERS,
                          special=special_tags(tokenizer, tags))
    return ToolFormat(HERMES_START, HERMES_END, _hermes_parse, native=False, json_form=True)


# The tags inside a call of each form, besides its opening and closing ones.
FORM_TAGS = {"mistral": ("[ARGS]",),
             "glm47": ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")}


def special_tags(tokenizer, tags) -> frozenset[str]:
    """Which of ``tags`` the tokenizer (mlx-lm's wrapper or Hugging Face's) holds as special
    tokens."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    added = getattr(hf, "added_tokens_decoder", None) or {}
    special = {t.content for t in added.values() if getattr(t, "special", False)}
    return frozenset(t for t in tags if t and t in special)


def call_grammar(spec: ToolSpec, fmt: ToolFormat) -> Grammar | None:
    """The grammar a constrained answer matches (``None``: ``spec`` has no strict tool it may
    call): with "auto", any text with calls of the offered tools in it; with "required" or a
    name, the answer (which starts after the call's opening tag the prompt ends with) is a call
    first. A strict tool's arguments match its ``parameters``; another tool's are any object.
    Calls in the Hermes JSON form, in the XML form of Qwen3-Coder and Qwen3.5 and GLM's
    (:func:`_param_body`) and in Mistral's (:func:`_header_grammar`) are constrained; other
    forms are refused, naming the tool."""
    if not spec.constrained:
        return None
    if fmt.special:
        raise _strict_refused(spec, f"this model writes {', '.join(sorted(fmt.special))} of "
                              "its tool calls as special tokens, which strict tool grammars "
                              "do not constrain")
    if fmt.header_form:
        return _lark(_header_grammar(spec, fmt))
    if not (fmt.json_form or fmt.xml_form or fmt.arg_key_form):
        raise _strict_refused(spec, f"strict arguments need the JSON tool-call form "
                              f"({HERMES_START} JSON {HERMES_END}), the "
                              "<function=...><parameter=...> form, GLM's <arg_key> form or "
                              "Mistral's [TOOL_CALLS]NAME[ARGS] form; this model's template "
                              f"writes calls as {fmt.start}...{fmt.end}")
    if fmt.json_form:
        body = _json_body(spec)
    else:
        body = _param_body(spec, XML_TAGS if fmt.xml_form else ARG_KEY_TAGS)
    start, end = json.dumps(fmt.start), json.dumps(fmt.end)
    # the Hermes and XML forms put the call on lines of its own; GLM's name follows the tag,
    # and its last value's line ends before the closing one
    after, before = ("", "") if fmt.arg_key_form else ('"\\n" ', '"\\n" ')
    first = "" if spec.choice == "auto" else f"body {before}{end} "
    text = (f"start: {first}call* tail\n"
            "tail: TEXT\n"
            "TEXT: /(.|\\n)*/\n"
            f"call_head[lazy]: TEXT {start}\n"  # any text until the opening tag
            f"call: call_head {after}body {before}{end}\n" + body)
    return _lark(text)


def _strict_refused(spec: ToolSpec, reason: str) -> APIError:
    """The 400 for a request whose first strict tool cannot be constrained, naming it."""
    name = spec.strict[0]
    i = _tool_index(spec, name)
    return APIError(400, f"tools[{i}].function.strict: tool {name!r}: {reason}; send the tool "
                    "without strict", param=f"tools[{i}].function.strict",
                    code="unsupported_parameter")


def _lark(text: str) -> Grammar:
    try:
        return Grammar.lark(text, field="tools")
    except GrammarError as e:
        raise APIError(400, f"tools: a strict tool's parameters cannot constrain decoding: {e}",
                       param="tools", code="invalid_value") from None


def _header_grammar(spec: ToolSpec, fmt: ToolFormat) -> str:
    """Mistral's form (mlx-lm's ``mistral`` parser): ``[TOOL_CALLS]NAME[ARGS]{...}``, one call
    after another, each opened by the tag; there is no closing tag, so once a call starts the
    answer is calls to its end. A strict tool's arguments are compact JSON on its
    ``parameters``, another tool's any object."""
    bodies = []
    for t in spec.rendered:
        fn = t["function"]
        args = fn["parameters"] if fn["name"] in spec.strict else {"type": "object"}
        args = dict(args, **{"x-guidance": WHITESPACE["compact"]})
        bodies.append(f"{json.dumps(fn['name'] + '[ARGS]')} %json {json.dumps(args)}")
    start = json.dumps(fmt.start)
    calls = f"body ({start} body)*"
    head = calls if spec.choice != "auto" else f"TEXT | call_head {calls}"
    return (f"start: {head}\n"
            "TEXT: /(.|\\n)*/\n"
            f"call_head[lazy]: TEXT {start}\n"  # any text until the opening tag
            f"body: {' | '.join(bodies)}\n")


def _tool_index(spec: ToolSpec, name: str) -> int:
    return next(k for k, t in enumerate(spec.tools) if t["function"]["name"] == name)


def _json_body(spec: ToolSpec) -> str:
    """``body``: one call in the Hermes JSON form, ``{"name": ..., "arguments": {...}}``."""
    calls = [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        "arguments": t["function"]["parameters"] if t["function"]["name"] in spec.strict
        else {"type": "object"}}, "required": ["name", "arguments"], "additionalProperties": False}
        for t in spec.rendered]
    # One line, Python's separators: the grammar forces every separator and key (free proposals).
    body = {"anyOf": calls, "x-guidance": WHITESPACE["compact"]}
    return f"body: %json {json.dumps(body)}\n"


# How mlx-lm's qwen3_coder and glm47 parsers read a parameter's text: as it is for these types,
# as JSON (or a Python literal) for the others.
XML_TEXT_TYPES = ("string",)
XML_JSON_TYPES = ("integer", "number", "boolean", "object", "array")


@dataclass(frozen=True)
class ParamTags:
    """How a call form writes a call as a name and one block per parameter."""

    head: str  # the call's opening, with {name}
    tail: str  # after its last parameter
    open: str  # a parameter's block up to its value, with {name}
    close: str  # after the value
    any_param: str  # a regex for any parameter's block (a tool without strict)


# Qwen3-Coder's and Qwen3.5's (mlx-lm's qwen3_coder parser): each value on lines of its own
XML_TAGS = ParamTags("<function={name}>\n", "</function>", "<parameter={name}>\n",
                     "\n</parameter>\n", "<parameter=[^\\s<>]+>\\n(.|\\n)*\\n<\\/parameter>\\n")
# GLM-4.5's and GLM-4.7's (mlx-lm's glm47 parser, which strips each value)
ARG_KEY_TAGS = ParamTags("{name}\n", "", "<arg_key>{name}</arg_key>\n<arg_value>",
                         "</arg_value>\n",
                         "<arg_key>[^<>]+<\\/arg_key>\\n<arg_value>(.|\\n)*<\\/arg_value>\\n")


def _param_body(spec: ToolSpec, tags: ParamTags) -> str:
    """``body``: one call in a name-and-parameters form (``tags``; in the XML form
    ``<function=NAME>``, one ``<parameter=P>`` block per argument, ``</function>``). A strict
    tool's parameters come in its schema's order, the required ones always, each value as the
    parser reads it back into the schema's type (text for strings; compact JSON on its schema
    for the rest); another tool's are any parameters with any text."""
    rules, bodies = [], []
    tail = f" {json.dumps(tags.tail)}" if tags.tail else ""
    for k, t in enumerate(spec.rendered):
        fn = t["function"]
        head = json.dumps(tags.head.format(name=fn["name"]))
        if fn["name"] not in spec.strict:
            bodies.append(f"fn{k}")
            rules.append(f"fn{k}: {head} any_param*{tail}")
            continue
        params, defs = fn["parameters"], fn["parameters"].get("$defs")
        required = set(params.get("required", []))
        parts = []
        for j, (name, schema) in enumerate(params.get("properties", {}).items()):
            rule = f"p{k}_{j}"
            value = _param_value(schema, defs, spec, fn["name"], name)
            # Free text cannot be a lexeme of its own (it never ends): the whole block is one,
            # lazy, ending at the first closing tag.
            lazy = "[lazy]" if value == "TEXT" else ""
            rules.append(f"{rule}{lazy}: {json.dumps(tags.open.format(name=name))} {value} "
                         f"{json.dumps(tags.close)}")
            parts.append(rule if name in required else f"{rule}?")
        bodies.append(f"fn{k}")
        rules.append(f'fn{k}: {head} {" ".join(parts)}{tail}')
    rules.append(f"any_param[lazy]: /{tags.any_param}/")
    return f"body: {' | '.join(bodies)}\n" + "\n".join(rules) + "\n"


def _param_value(schema: dict, defs: dict | None, spec: ToolSpec, tool: str, name: str) -> str:
    """The grammar of one parameter's text (see :func:`_param_body`); a 400 naming the parameter
    where the parser could not read a constrained text back as the schema says."""
    kind = schema.get("type")
    if kind in XML_TEXT_TYPES and set(schema) <= {"type", "description", "title"}:
        return "TEXT"  # any text (the parser strips the newline after and before it)
    if kind in XML_TEXT_TYPES and "enum" in schema and \
            set(schema) <= {"type", "description", "title", "enum"}:
        return "(" + " | ".join(json.dumps(str(v)) for v in schema["enum"]) + ")"
    if kind in XML_JSON_TYPES:
        sub = dict(schema, **({"$defs": defs} if defs else {}))
        return f"%json {json.dumps(dict(sub, **{'x-guidance': WHITESPACE['compact']}))}"
    i = _tool_index(spec, tool)
    param = f"tools[{i}].function.parameters.properties.{name}"
    raise APIError(400, f"{param}: a strict tool's parameter in this model's call form must "
                   f"have one type of {', '.join(XML_TEXT_TYPES + XML_JSON_TYPES)} (a string "
                   "with at most an enum): the parser reads other text back differently",
                   param=param, code="invalid_value")


def system_prompt(tools: list[dict]) -> str:
    """The Hermes-style tool prompt for templates that do not render tools."""
    return SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def render_messages(messages: list[dict], spec: ToolSpec | None, fmt: ToolFormat
                    ) -> tuple[list[dict], dict]:
    """Messages and chat-template keyword arguments for a prompt with ``spec``'s tools.

    Native templates get ``tools=`` and the history as it is; for the others the tools become (the
    start of) the system message and calls and tool results become text in the Hermes form.
    """
    tools = spec.rendered if spec is not None else []
    if fmt.native:
        return messages, ({"tools": tools} if tools else {})
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                f"{fmt.start}\n" + json.dumps({"name": c["function"]["name"],
                                               "arguments": c["function"]["arguments"]},
                                              ensure_ascii=False) + f"\n{fmt.end}"
                for c in m["tool_calls"])
            text = (m["content"] + "\n" if m["content"] else "") + calls
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        intro = system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + intro}
        else:
            out.insert(0, {"role": "system", "content": intro})
    return out, {}


@dataclass
class ToolCallSplitter:
    """Splits streamed text into plain content and parsed calls (``{"id", "name", "arguments"}``).

    A call is held back from its opening tag to its closing tag, then parsed; one that does not
    parse goes out as content, tags and all. At the end, an unclosed call whose body parses
    counts (models that stop right after the JSON); otherwise it is content too.
    """

    fmt: ToolFormat
    tools: list[dict] = field(default_factory=list)
    buf: str = ""
    in_call: bool = False
    calls_made: int = 0
    after_call: bool = False  # the whitespace after a call is the template's, not content
    space: str = ""  # the whitespace before the call being read

    def _partial(self, tag: str) -> int:
        for k in range(min(len(tag) - 1, len(self.buf)), 0, -1):
            if self.buf.endswith(tag[:k]):
                return k
        return 0

    def _parse(self, body: str) -> list[dict] | None:
        try:
            parsed = self.fmt.parse(body, self.tools)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError):
            return None  # a broken call (json.JSONDecodeError is a ValueError)
        calls = parsed if isinstance(parsed, list) else [parsed]
        out = []
        for c in calls:
            if not isinstance(c, dict) or not isinstance(c.get("name"), str):
                return None
            args = c.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            if not isinstance(args, dict):
                return None
            out.append({"id": c.get("id") or new_call_id(), "name": c["name"],
                        "arguments": json.dumps(args, ensure_ascii=False)})
        return out

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """``(content, calls)`` newly decided by ``text``; ``final`` flushes what is held."""
        self.buf += text
        content, calls = "", []
        while self.buf:
            if not self.in_call:
                i = self.buf.find(self.fmt.start)
                if i < 0:
                    # Hold a partial opening tag, and the whitespace before it (it goes if a
                    # call follows), until the next text decides.
                    cut = len(self.buf)
                    if not final:
                        cut -= self._partial(self.fmt.start)
                        cut = len(self.buf[:cut].rstrip())
                    content += self.buf[:cut]
                    self.buf = self.buf[cut:]
                    break
                before = self.buf[:i]
                content += before.rstrip()
                self.space = before[len(before.rstrip()):]  # dropped if the call parses
                self.buf = self.buf[i:]
                self.in_call = True
            if self.fmt.end:
                j, close = self.buf.find(self.fmt.end, len(self.fmt.start)), len(self.fmt.end)
            else:  # no closing tag (Mistral's form): a call runs to the next one, or the end
                j, close = self.buf.find(self.fmt.start, len(self.fmt.start)), 0
            if j < 0 and not final:
                break
            body = self.buf[len(self.fmt.start):j if j >= 0 else len(self.buf)]
            raw = self.buf[:j + close] if j >= 0 else self.buf
            self.buf = self.buf[len(raw):]
            self.in_call = False
            parsed = self._parse(body)
            if parsed is None:
                content += self.space + raw
            else:
                calls += parsed
                self.calls_made += len(parsed)
                self.after_call = True
        if self.after_call and content:
            content = content.lstrip()
            self.after_call = not content
        return content, calls


class AnswerSplitter:
    """A chat answer's stream split three ways: reasoning, content and tool calls.

    ``<think>`` first (the reasoning split), then calls out of the content; ``prefix`` is the start
    of the answer that the prompt already holds (``ToolFormat.prefix``), read as if generated.
    """

    def __init__(self, think: ThinkSplitter | None = None,
                 tools: ToolCallSplitter | None = None, prefix: str = ""):
        self.think, self.tools, self.prefix = think, tools, prefix

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict]]:
        """``(reasoning, content, calls)`` newly decided by ``text``."""
        reasoning, content = self.think.feed(text, final) if self.think else ("", text)
        if self.prefix:
            content, self.prefix = self.prefix + content, ""
        if self.tools is None:
            return reasoning, content, []
        content, calls = self.tools.feed(content, final)
        return reasoning, content, calls

    def finish_reason(self, reason: str | None) -> str | None:
        """``"tool_calls"`` for an answer that ended on its own after making calls."""
        if reason == "stop" and self.tools is not None and self.tools.calls_made:
            return "tool_calls"
        return reason
