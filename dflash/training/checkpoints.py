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


# -- carrying a run to another machine ---------------------------------------------------------
# A machine's $DFLASH_HOME does not follow a project to a new machine; the repository does. A
# packed checkpoint is the newest checkpoint made small enough to commit: weights in float16,
# optimizer moments in bfloat16 (their range: second moments go far below float16's), paths under
# $DFLASH_HOME written as "$DFLASH_HOME". Unpacked on the new machine, `--resume` continues it
# (the features are recomputed there from the token records; they are GBs, the pack ~50 MB).

PACK_NOTE = "dflash packed checkpoint"
HOME_TOKEN = "$DFLASH_HOME"


def _cast(arrays: dict, float_dtype) -> tuple[dict, dict]:
    """Floating arrays cast to ``float_dtype``; the original dtypes by key (to cast back)."""
    dtypes = {k: str(v.dtype) for k, v in arrays.items()}
    out = {k: v.astype(float_dtype) if mx.issubdtype(v.dtype, mx.floating) else v
           for k, v in arrays.items()}
    return out, dtypes


def _uncast(arrays: dict, dtypes: dict) -> dict:
    by_name = {str(getattr(mx, n)): getattr(mx, n) for n in ("float32", "float16", "bfloat16")}
    return {k: v.astype(by_name[dtypes[k]]) if dtypes.get(k) in by_name else v
            for k, v in arrays.items()}


def _replace_dir(tmp: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def pack_checkpoint(ckpt_dir: Path, dest: Path, home: Path) -> Path:
    """Pack the newest checkpoint of ``ckpt_dir`` (and its ``metrics.jsonl``) into ``dest``."""
    found = list_checkpoints(ckpt_dir)
    if not found:
        raise TrainConfigError(f"{ckpt_dir}: no training checkpoint (step-*/state.json) to pack")
    src = found[-1]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".tmp-{dest.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for name, dtype in (("draft.safetensors", mx.float16), ("optimizer.safetensors", mx.bfloat16)):
        arrays, dtypes = _cast(mx.load(str(src / name)), dtype)
        write_safetensors(tmp / name, arrays, {"dtypes": json.dumps(dtypes)})
    state = (src / STATE_FILE).read_text().replace(str(Path(home).resolve()), HOME_TOKEN)
    (tmp / STATE_FILE).write_text(state)
    metrics = ckpt_dir / "metrics.jsonl"
    if metrics.is_file():
        shutil.copyfile(metrics, tmp / "metrics.jsonl")
    (tmp / "PACKED").write_text(json.dumps({"format": PACK_NOTE, "step": step_of(src)}) + "\n")
    _replace_dir(tmp, dest)
    return dest


def unpack_checkpoint(packed: Path, ckpt_dir: Path, home: Path) -> Path:
    """Put a packed checkpoint back as ``ckpt_dir/step-N`` (float32 again) for ``--resume``.

    Refuses when ``ckpt_dir`` already holds a checkpoint at or past that step: the run here is
    ahead, and its checkpoints and metrics stay.
    """
    marker = packed / "PACKED"
    if not marker.is_file():
        raise TrainConfigError(f"{packed}: not a packed checkpoint (no PACKED file)")
    step = int(json.loads(marker.read_text())["step"])
    have = list_checkpoints(ckpt_dir)
    if have and step_of(have[-1]) >= step:
        raise TrainConfigError(f"{ckpt_dir} already holds step {step_of(have[-1])} "
                               f">= the packed step {step}: nothing to unpack")
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / f".tmp-step-{step:07d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for name in ("draft.safetensors", "optimizer.safetensors"):
        arrays, meta = mx.load(str(packed / name), return_metadata=True)
        write_safetensors(tmp / name, _uncast(arrays, json.loads(meta.get("dtypes", "{}"))))
    state = (packed / STATE_FILE).read_text().replace(HOME_TOKEN, str(Path(home).resolve()))
    (tmp / STATE_FILE).write_text(state)
    final = checkpoint_path(ckpt_dir, step)
    _replace_dir(tmp, final)
    if (packed / "metrics.jsonl").is_file():
        # records past the packed step were written after its checkpoint: the resumed run
        # writes them again
        lines = [line for line in (packed / "metrics.jsonl").read_text().splitlines()
                 if line.strip() and json.loads(line).get("step", 0) <= step]
        part = ckpt_dir / "metrics.jsonl.tmp"
        part.write_text("".join(line + "\n" for line in lines))
        os.replace(part, ckpt_dir / "metrics.jsonl")
    return final
