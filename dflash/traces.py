"""Agent traces for ``dflash bench --trace``: multi-turn conversations replayed as an agent sends them.

Why: an agent re-sends its whole conversation every turn, and the model re-emits files, tool-call
JSON and identifiers it has already seen or written. A prompt set of single questions cannot show
what that is worth; a trace replays the turns in order, each with the whole history, the assistant
turns being the target's own earlier (greedy) answers.

A trace file is JSONL, one conversation per line::

    {"id": "edit-file", "system": "...", "max_tokens": 320,
     "turns": [{"user": "..."}, {"user": "...", "max_tokens": 200}, {"retry": true}]}

``id`` (default: the file's stem and line number), ``system`` (optional) and ``max_tokens`` (the
answer's budget for every turn; default :data:`DEFAULT_MAX_TOKENS`) per conversation; per turn
either ``user`` (the next user message; ``max_tokens`` overrides the conversation's) or
``"retry": true`` alone (the previous turn's exact request sent again, as an agent retrying after a
tool error). Any other field is an error naming the line and the field, raised before a model
loads. ``agent`` names the traces shipped with the package (``assets/traces/agent.jsonl``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import TraceFileError
from .prompts import jsonl_lines, shipped_file, shipped_names

DEFAULT_MAX_TOKENS = 320
TRACE_SETS = Path(__file__).parent / "assets" / "traces"
CONVERSATION_FIELDS = ("id", "system", "max_tokens", "turns")
TURN_FIELDS = ("user", "retry", "max_tokens")


@dataclass(frozen=True)
class Turn:
    """One request of a conversation: a new user message, or the previous request again."""

    user: str | None
    max_tokens: int
    retry: bool = False


@dataclass(frozen=True)
class Conversation:
    id: str
    system: str | None
    turns: tuple[Turn, ...]


def trace_sets() -> list[str]:
    """The names of the traces shipped with the package."""
    return shipped_names(TRACE_SETS)


def trace_file(path: str | Path) -> Path:
    """``path`` itself, or the shipped trace it names when no such file exists."""
    return shipped_file(path, TRACE_SETS)


def _max_tokens(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceFileError(f"{where}: `max_tokens` must be an integer >= 1, got {value!r}")
    return value


def _unknown(obj: dict, known: tuple[str, ...], where: str, hint: str) -> None:
    extra = sorted(set(obj) - set(known))
    if extra:
        raise TraceFileError(f"{where}: unknown field {extra[0]!r} ({hint}: "
                             f"{', '.join(f'`{k}`' for k in known)})")


def _turn(obj, where: str, first: bool, default_max: int) -> Turn:
    if not isinstance(obj, dict):
        raise TraceFileError(f"{where}: a turn is a JSON object, got {type(obj).__name__}")
    _unknown(obj, TURN_FIELDS, where,
             "the assistant turns are the target's own answers; a turn has")
    retry = obj.get("retry", False)
    if not isinstance(retry, bool):
        raise TraceFileError(f"{where}: `retry` must be true or false, got {retry!r}")
    if retry:
        if first:
            raise TraceFileError(f"{where}: `retry` on the first turn: there is no earlier "
                                 "request to send again")
        if len(obj) > 1:
            other = next(k for k in obj if k != "retry")
            raise TraceFileError(f"{where}: a retry re-sends the previous request exactly; "
                                 f"it takes no {other!r}")
        return Turn(None, 0, retry=True)
    user = obj.get("user")
    if not isinstance(user, str) or not user.strip():
        raise TraceFileError(f"{where}: needs `user`, the user message (non-empty text), "
                             "or `\"retry\": true`")
    limit = default_max if "max_tokens" not in obj else _max_tokens(obj["max_tokens"], where)
    return Turn(user, limit)


def parse_conversation(obj, where: str, default_id: str) -> Conversation:
    """One line's conversation; :class:`~dflash.errors.TraceFileError` naming ``where`` and the
    field at fault."""
    if not isinstance(obj, dict):
        raise TraceFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    _unknown(obj, CONVERSATION_FIELDS, where, "a conversation has")
    cid = obj.get("id", default_id)
    if not isinstance(cid, str) or not cid:
        raise TraceFileError(f"{where}: `id` must be a non-empty string, got {cid!r}")
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        raise TraceFileError(f"{where}: `system` must be a string, got {type(system).__name__}")
    limit = _max_tokens(obj["max_tokens"], where) if "max_tokens" in obj else DEFAULT_MAX_TOKENS
    turns = obj.get("turns")
    if not isinstance(turns, list) or not turns:
        raise TraceFileError(f"{where}: needs `turns`, a non-empty list of "
                             "{\"user\": ...} / {\"retry\": true} objects")
    parsed = []
    for k, t in enumerate(turns):
        turn = _turn(t, f"{where}: turns[{k}]", k == 0, limit)
        if turn.retry:  # the same request: the same budget
            turn = Turn(None, parsed[-1].max_tokens, retry=True)
        parsed.append(turn)
    return Conversation(cid, system, tuple(parsed))


def read_trace(path: str | Path) -> tuple[str, list[Conversation]]:
    """``(source, conversations)`` from a trace file (or a shipped trace's name); a bad line raises
    :class:`~dflash.errors.TraceFileError` naming the file, the line and the field."""
    path = trace_file(path)
    if not path.is_file():
        raise TraceFileError(f"trace file {path} does not exist (or name a shipped trace: "
                             f"{', '.join(trace_sets())})")
    conversations: list[Conversation] = []
    seen: dict[str, int] = {}
    for lineno, where, obj in jsonl_lines(path, TraceFileError, "a trace file is JSONL, one "
                                          "conversation (a JSON object) per line"):
        conv = parse_conversation(obj, where, f"{path.stem}-{lineno}")
        if conv.id in seen:
            raise TraceFileError(f"{where}: id {conv.id!r} repeats line {seen[conv.id]}")
        seen[conv.id] = lineno
        conversations.append(conv)
    if not conversations:
        raise TraceFileError(f"trace file {path} holds no conversations")
    return str(path), conversations


def load_trace(trace: str | Path | list, limit: int | None = None
               ) -> tuple[str, list[Conversation]]:
    """A trace file, a shipped trace's name, or a list of conversation dicts (or
    :class:`Conversation`\\ s); ``limit``: the first ``limit`` conversations."""
    if isinstance(trace, (str, Path)):
        source, conversations = read_trace(trace)
    else:
        source = "list"
        conversations = [c if isinstance(c, Conversation)
                         else parse_conversation(c, f"conversation {i}", f"conversation-{i}")
                         for i, c in enumerate(trace)]
        if not conversations:
            raise TraceFileError("trace: no conversations")
    if limit is not None:
        if limit < 1:
            raise TraceFileError(f"limit={limit}: must be >= 1")
        conversations = conversations[:limit]
    return source, conversations


class Replay:
    """The requests of one conversation as an agent sends them: every turn the whole history
    (system, earlier user turns, the answers given), a retry the previous request unchanged.

    ``request(turn)`` gives the messages of a turn; ``answered(turn, text)`` records the answer
    the next turns will carry (a retry's answer replaces nothing: its request is already answered
    in the history)."""

    def __init__(self, conversation: Conversation):
        self.messages: list[dict] = []
        if conversation.system:
            self.messages.append({"role": "system", "content": conversation.system})
        self.last: list[dict] | None = None

    def request(self, turn: Turn) -> list[dict]:
        if not turn.retry:
            self.messages.append({"role": "user", "content": turn.user})
            self.last = [dict(m) for m in self.messages]
        if self.last is None:
            raise TraceFileError("a retry before any request")
        return [dict(m) for m in self.last]

    def answered(self, turn: Turn, text: str) -> None:
        if not turn.retry:
            self.messages.append({"role": "assistant", "content": text})
