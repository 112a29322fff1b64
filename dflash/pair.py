"""A target model, its tokenizer and a drafter that fits it: what every tool loads first.

``load_pair`` fills in the built-in pair for what is not given, checks that each path is a model
folder (or a Hugging Face repo id), loads both and checks that the drafter fits the target, raising
``ModelLoadError`` naming the option (``--model`` / ``--draft``) at fault.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .console import one_line
from .errors import DFlashError, ModelLoadError


@dataclass
class Pair:
    """A loaded target, its tokenizer and a drafter that fits it."""

    model: Any
    tokenizer: Any
    draft: Any
    model_path: str
    draft_path: str
    config: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return Path(self.model_path.rstrip("/")).name or self.model_path

    @property
    def max_context(self) -> int | None:
        """Positions the target reads (``None``: not stated), as the engine counts them
        (:func:`dflash.target.max_positions`: ``max_position_embeddings``, or the context its
        RoPE scaling stretches to); from the arguments mlx-lm built the target from, else from
        its ``config.json``."""
        from .target import config_positions, max_positions

        return max_positions(self.model) or config_positions(self.config)


def _looks_like_repo_id(text: str) -> bool:
    return (text.count("/") == 1 and not text.startswith(("/", ".", "~"))
            and all(part for part in text.split("/")))


def check_model_path(path: str, option: str) -> str:
    """A local folder with a ``config.json``, or a Hugging Face repo id; else ``ModelLoadError``."""
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ModelLoadError(f"{option} {path}: not a folder")
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{option} {path}: no config.json in this folder, not a model folder")
        return str(p)
    if _looks_like_repo_id(path):
        return path
    raise ModelLoadError(f"{option} {path}: no such folder")


def default_paths(model: str | None, draft: str | None) -> tuple[str, str]:
    """Fill in the built-in pair where ``--model``/``--draft`` were not given."""
    from .default_pair import default_draft_path, default_target_path

    if draft is None:
        try:
            draft = str(default_draft_path())
        except FileNotFoundError as e:
            raise ModelLoadError(f"no --draft given and the built-in drafter is not available "
                                 f"({one_line(e)}); pass --model PATH --draft PATH") from None
    if model is None:
        try:
            with contextlib.redirect_stdout(sys.stderr):  # keep stdout clean for --json
                model = str(default_target_path())
        except Exception as e:  # any failure to build the built-in target is reported as one line
            raise ModelLoadError(f"no --model given and the built-in target is not available "
                                 f"({one_line(e)}); pass --model PATH") from None
    return model, draft


def load_pair(model: str | None = None, draft: str | None = None,
              log: Callable[[str], None] | None = None, pipeline: bool | None = None) -> Pair:
    """Load target + drafter (the built-in pair for what is ``None``) and check they fit.

    ``log`` receives progress lines (``None``: silent). Under ``mlx.launch`` the target is
    sharded over the ranks, tensor-parallel or, with ``pipeline`` (``None``: as the command line
    chose, :func:`dflash.distributed.pipeline_chosen`), by layers.
    """
    from . import distributed
    from .drafter import load_draft
    from .target import check_compatible, target_parts
    from .target import load_target as load

    model, draft = default_paths(model, draft)
    model = check_model_path(str(model), "--model")
    draft = check_model_path(str(draft), "--draft")
    say = log or (lambda message: None)
    tic = time.perf_counter()
    ranks = distributed.join()  # under mlx.launch: the target sharded over the ranks
    if pipeline is None:
        pipeline = distributed.pipeline_chosen()
    if ranks.distributed:
        distributed.check_same_files(ranks, model, draft)
        distributed.check_shardable(model, ranks.size, pipeline)
        say(distributed.describe(ranks, pipeline))
    say(f"loading target {model} ...")
    try:
        target, tokenizer = (distributed.load_target(model, ranks, pipeline) if ranks.distributed
                             else load(model))
    except Exception as e:  # mlx-lm raises many kinds; the user needs the option and the reason
        raise ModelLoadError(f"--model {model}: cannot load it as an mlx-lm model "
                             f"({one_line(e)})") from None
    say(f"loading drafter {draft} ...")
    try:
        drafter = load_draft(draft)
    except Exception as e:  # as above, for the drafter
        raise ModelLoadError(f"--draft {draft}: cannot load it as a DFlash drafter "
                             f"({one_line(e)})") from None
    try:
        check_compatible(target_parts(target), drafter)
    except DFlashError as e:
        raise ModelLoadError(f"--draft {draft} does not fit --model {model}: "
                             f"{one_line(e)}") from None
    config = {}
    cfg_file = Path(model) / "config.json"
    if cfg_file.is_file():
        with contextlib.suppress(ValueError, OSError):
            config = json.loads(cfg_file.read_text())
    say(f"ready in {time.perf_counter() - tic:.1f} s (block size {drafter.block_size}, "
        f"target layers {drafter.target_layer_ids})")
    return Pair(target, tokenizer, drafter, model, draft, config)
