"""Prompt files: JSONL, one object a line, with `messages` (a chat), `prompt` (text) or `question`."""

from __future__ import annotations

import json
from pathlib import Path

PROMPT_FIELDS = ("messages", "prompt", "question", "instruction")


def read_prompts(path: str | Path) -> list[dict]:
    """Return ``[{"id", "messages" | "prompt"}]``; a bad line raises ``ValueError`` naming it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    items = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            item = {"id": str(obj.get("id", obj.get("task_id", f"{path.stem}-{lineno}")))}
            if isinstance(obj.get("messages"), list):
                item["messages"] = obj["messages"]
            else:
                text = next((obj[k] for k in PROMPT_FIELDS[1:] if isinstance(obj.get(k), str)), None)
                if text is None:
                    raise ValueError(
                        f"{path}:{lineno}: needs one of the fields {', '.join(PROMPT_FIELDS)}")
                item["prompt"] = text
            items.append(item)
    if not items:
        raise ValueError(f"prompt file {path} holds no prompts")
    return items


def encode_prompt(tokenizer, item: dict, chat_template: bool = True, system: str | None = None,
                  **template_kwargs) -> list[int]:
    """Token ids for a prompt item, through the tokenizer's own chat template when it has one."""
    messages = item.get("messages") or [{"role": "user", "content": item["prompt"]}]
    if system and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system}, *messages]
    if chat_template and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, **template_kwargs))
    text = "\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text))
