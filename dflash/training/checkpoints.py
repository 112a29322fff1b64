"""Training checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint ``<out>/train/step-NNNNNNN/`` holds the drafter's weights, the optimizer state and
``state.json`` (step, data order and cursor, vocabulary, draft config, history). It is written to a
temporary folder and renamed, so a run killed mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..console import log
from ..errors import TrainConfigError

FORMAT_NOTE = "dflash train"
STATE_FILE = "state.json"


def checkpoint_path(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step-{step:07d}"


def step_of(checkpoint: Path) -> int:
    """The step a checkpoint folder (``step-NNNNNNN``) holds."""
    return int(checkpoint.name.split("-")[1])


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints (those with a state file), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.glob("step-*") if (p / STATE_FILE).is_file()]
    return sorted(found, key=step_of)


def prepare_output(out: Path, ckpt_dir: Path, resume: bool, force: bool,
                   own_ckpt_dir: bool) -> Path | None:
    """Check (or, with ``force``, clear) the output folder; the checkpoint to resume from, if any.

    An existing output folder needs ``--resume`` (continue) or ``--force`` (start over), so that a
    published drafter is never overwritten by accident. ``own_ckpt_dir``: checkpoints live outside
    ``out`` (``--checkpoint-dir``) and ``force`` clears them too.
    """
    existing = list_checkpoints(ckpt_dir)
    if out.exists() and any(out.iterdir()):
        if force:
            shutil.rmtree(out)
            if own_ckpt_dir and ckpt_dir.exists():
                shutil.rmtree(ckpt_dir)
            existing = []
        elif not resume:
            raise TrainConfigError(
                f"output folder {out} exists: pass --resume to continue its training or "
                "--force to overwrite it")
    if resume and not existing:
        if out.exists() and any(out.iterdir()) and not force:
            raise TrainConfigError(
                f"--resume: {out} exists but holds no training checkpoint "
                f"({ckpt_dir}/step-*); pass --force to overwrite it")
        log(f"train: no checkpoint in {ckpt_dir}; starting from scratch")
    return existing[-1] if (resume and existing) else None


def read_state(path: Path) -> dict:
    return json.loads((path / STATE_FILE).read_text())


def write_safetensors(path: Path, arrays: dict, metadata: dict | None = None) -> None:
    """``mx.save_safetensors``, a failed write raised as the ``OSError`` it is (MLX raises a bare
    ``RuntimeError``): ENOSPC when the disk has less room than the tensors, naming the file."""
    try:
        if metadata is None:
            mx.save_safetensors(str(path), arrays)
        else:
            mx.save_safetensors(str(path), arrays, metadata=metadata)
    except RuntimeError as e:
        free = shutil.disk_usage(path.parent).free
        if free < sum(a.nbytes for a in arrays.values()):
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free} bytes free)",
                          str(path)) from e
        raise OSError(errno.EIO, str(e), str(path)) from e


def save_checkpoint(ckpt_dir: Path, step: int, draft, optimizer, state: dict, keep: int) -> Path:
    """Write checkpoint ``step`` atomically and keep only the newest ``keep``."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(ckpt_dir, step)
    for stale in ckpt_dir.glob(".tmp-step-*"):  # left by a write that failed (a full disk)
        shutil.rmtree(stale)
    tmp = ckpt_dir / f".tmp-step-{step:07d}"
    tmp.mkdir()
    write_safetensors(tmp / "draft.safetensors", dict(tree_flatten(draft.parameters())))
    opt_state = {k: v for k, v in tree_flatten(optimizer.state) if isinstance(v, mx.array)}
    write_safetensors(tmp / "optimizer.safetensors", opt_state)
    (tmp / STATE_FILE).write_text(json.dumps({"format": FORMAT_NOTE, **state}))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(ckpt_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_weights(path: Path, draft, optimizer) -> None:
    """Put a checkpoint's drafter weights and optimizer state back."""
    draft.load_weights(list(mx.load(str(path / "draft.safetensors")).items()), strict=True)
    opt = mx.load(str(path / "optimizer.safetensors"))
    optimizer.state = tree_unflatten(list(opt.items()))
    optimizer.init(draft.trainable_parameters())
    mx.eval(draft.parameters(), optimizer.state)
