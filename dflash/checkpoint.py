"""Checkpoint folders: reading a drafter's (``config.json``, safetensors in one file or shards, hub
ids) and writing any folder atomically.

One reader serves :func:`dflash.drafter.load_draft` and ``dflash convert``, so both refuse a broken
folder with the same :class:`~dflash.errors.DraftCheckpointError`, naming the file at fault.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from .errors import DraftCheckpointError

INDEX_FILE = "model.safetensors.index.json"


def resolve_path(path_or_repo: str | Path) -> Path:
    """A local folder as is; an ``owner/name`` that is not one is downloaded from the hub."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        return path
    if isinstance(path_or_repo, str) and path_or_repo.count("/") == 1 and not path_or_repo.startswith(("/", ".")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(path_or_repo, allow_patterns=["*.json", "*.safetensors", "*.md"]))
        except Exception as e:
            raise DraftCheckpointError(f"{path_or_repo}: not a local folder and not downloadable ({e})") from None
    raise DraftCheckpointError(f"{path_or_repo}: no such drafter folder")


def read_config(path: Path) -> dict:
    """The folder's ``config.json`` as a dict."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise DraftCheckpointError(f"{cfg_file}: missing (a drafter folder needs config.json)")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise DraftCheckpointError(f"{cfg_file}: malformed JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(raw, dict):
        raise DraftCheckpointError(f"{cfg_file}: expected a JSON object")
    return raw


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a folder: the shards its index lists, else every ``*.safetensors``."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise DraftCheckpointError(f"{index}: malformed (expected a `weight_map`)") from None
        files = sorted(path / f for f in names)
        for f in files:
            if not f.is_file():
                raise DraftCheckpointError(f"{f}: shard listed in {index.name} is missing")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DraftCheckpointError(f"{path}: no *.safetensors weights found")
    return files


def read_weights(path: Path) -> dict[str, mx.array]:
    """All tensors of a checkpoint folder, names as stored."""
    weights = {}
    for f in weight_files(path):
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mlx raises RuntimeError/ValueError for truncated files
            raise DraftCheckpointError(f"{f}: cannot read safetensors ({e})") from None
    return weights


def drafter_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """Some exports nest the drafter under ``model.``; lm_head/embeddings belong to the target."""
    out = {}
    for k, v in weights.items():
        if k.startswith("model."):
            k = k[len("model."):]
        if k.startswith(("embed_tokens.", "lm_head.")):
            continue
        out[k] = v
    return out


def write_atomically(dst: Path, fill: Callable[[Path], None]) -> None:
    """``fill`` a temporary folder next to ``dst``, then rename it into place.

    On any failure the temporary folder is removed and an existing ``dst`` is left as it was;
    an old ``dst`` is replaced only once the new one is complete.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    backup = None
    try:
        tmp.mkdir()
        fill(tmp)
        if dst.exists():
            backup = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(dst, backup)
        try:
            os.replace(tmp, dst)
        except OSError:
            if backup is not None:
                os.replace(backup, dst)
                backup = None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)
