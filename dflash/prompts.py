"""Prompt files: JSONL, one object a line, with `messages` (a chat), `prompt` (text) or `question`.

GSM8K (``question``), HumanEval (``prompt`` + ``task_id``), Alpaca-style (``instruction``) and chat
(``messages``) files all read as they are. Ids come from ``id`` / ``task_id`` or the line number.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from .errors import PromptFileError

PROMPT_FIELDS = ("messages", "prompt", "question", "instruction")
# Prompt sets shipped with the package (the benchmarks' held-out prompts): ``heldout-mix`` names
# ``assets/prompts/heldout-mix.jsonl`` wherever dflash is installed.
PROMPT_SETS = Path(__file__).parent / "assets" / "prompts"


def shipped_names(folder: Path) -> list[str]:
    """The names of the JSONL files shipped in the package's ``folder``."""
    return sorted(p.stem for p in folder.glob("*.jsonl"))


def shipped_file(path: str | Path, folder: Path) -> Path:
    """``path`` itself, or the JSONL file in ``folder`` it names when no such file exists."""
    path = Path(path)
    if not path.exists() and path.suffix == "" and (folder / f"{path}.jsonl").is_file():
        return folder / f"{path}.jsonl"
    return path


def prompt_sets() -> list[str]:
    """The names of the prompt sets shipped with the package."""
    return shipped_names(PROMPT_SETS)


def prompt_file(path: str | Path) -> Path:
    """``path`` itself, or the shipped prompt set it names when no such file exists."""
    return shipped_file(path, PROMPT_SETS)


def prompt_domain(prompt_id: str) -> str:
    """The domain a prompt id names: its prefix before the first ``-`` or ``/`` (``gsm8k-3``,
    ``chat-0``, ``HumanEval/7``; ids from line numbers name the file's stem)."""
    return re.split(r"[-/]", prompt_id)[0]


def _check_messages(messages, where: str) -> list[dict]:
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                               and isinstance(m.get("role"), str) for m in messages):
        raise PromptFileError(f"{where}: `messages` must be a non-empty list of "
                              "{\"role\": ..., \"content\": ...} objects")
    return messages


def jsonl_lines(path: Path, error: type[PromptFileError],
                what: str) -> Iterator[tuple[int, str, object]]:
    """``(line number, "file:line", value)`` for each non-blank line of a JSONL file; a line that
    is not JSON raises ``error`` naming the file and line (``what``: what the file should hold)."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{where}: not valid JSON ({e.msg}); {what}") from None
            yield lineno, where, obj


def read_prompts(path: str | Path) -> list[dict]:
    """Return ``[{"id", "messages" | "prompt"}]``; a bad line raises :class:`PromptFileError`
    naming the file and line. A shipped prompt set may be named (``heldout-mix``)."""
    path = prompt_file(path)
    if not path.is_file():
        raise PromptFileError(f"prompt file {path} does not exist (or name a shipped set: "
                              f"{', '.join(prompt_sets())})")
    items = []
    seen: dict[str, int] = {}
    for lineno, where, obj in jsonl_lines(path, PromptFileError,
                                          "prompt files are JSONL, one JSON object per line"):
        if not isinstance(obj, dict):
            raise PromptFileError(f"{where}: expected a JSON object, got "
                                  f"{type(obj).__name__}")
        item = {"id": str(obj.get("id", obj.get("task_id", f"{path.stem}-{lineno}")))}
        if item["id"] in seen:
            raise PromptFileError(f"{where}: id {item['id']!r} repeats line {seen[item['id']]}")
        seen[item["id"]] = lineno
        if obj.get("messages") is not None:
            item["messages"] = _check_messages(obj["messages"], where)
        else:
            text = next((obj[k] for k in PROMPT_FIELDS[1:] if isinstance(obj.get(k), str)), None)
            if text is None:
                raise PromptFileError(
                    f"{where}: needs one of the fields {', '.join(PROMPT_FIELDS)} "
                    f"(found {', '.join(sorted(obj)) or 'none'})")
            item["prompt"] = text
        items.append(item)
    if not items:
        raise PromptFileError(f"prompt file {path} holds no prompts")
    return items


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of a raw text prompt: the tokenizer's BOS is added unless the text starts with it."""
    add_special = tokenizer.bos_token is None or not text.startswith(tokenizer.bos_token)
    return list(tokenizer.encode(text, add_special_tokens=add_special))


def thinking_kwargs(enable_thinking: bool | None) -> dict:
    """Chat-template keywords for ``--enable-thinking`` / ``--no-enable-thinking`` (unset: the
    template's own default)."""
    return {} if enable_thinking is None else {"enable_thinking": enable_thinking}


def encode_prompt(tokenizer, item: dict, chat_template: bool = True, system: str | None = None,
                  **template_kwargs) -> list[int]:
    """Token ids for a prompt item, through the tokenizer's own chat template when it has one."""
    messages = item.get("messages") or [{"role": "user", "content": item["prompt"]}]
    if system and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system}, *messages]
    if chat_template and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, **template_kwargs))
    return encode_text(tokenizer, "\n".join(m["content"] for m in messages))
