"""Training data in one target pass per token: records, their features, and the target they came from.

A data folder holds

* ``dataset.json``: the target's fingerprint, the tapped layers and top-k, written once; a later run
  with another target (or other taps) is refused, so that data from two targets never mixes;
* ``gen-<rank>-<worker>.jsonl``: one record per finished response,
  ``{"id", "domain", "prompt_ids", "response_ids", "finish_reason"}`` - a few MB of token ids, the
  precious part (features can be recomputed from them);
* ``features/``: per record, the float16 tap features and the target's top-k distribution, taken
  from the passes that generated it (:mod:`dflash.training.capture`), in the feature-cache layout
  training reads (``--feature-cache DATA/features``).

Order of writes: features first (atomically, temp file + rename), then the record line. A record
line therefore always has its features; a run killed mid-line leaves a partial line that readers
skip and the next run regenerates; a full disk fails a write without leaving a corrupt record.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ..errors import DataSetError
from ..files import write_json_atomic

MANIFEST = "dataset.json"
FORMAT = "dflash-data/2"


def target_fingerprint(parts, config: dict) -> str:
    """A short hash of what makes a target's outputs: its config and samples of its weights."""
    import mlx.core as mx

    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for w in (parts.embed_tokens.weight, parts.norm.weight, parts.head_rows(mx.arange(4))):
        flat = w.reshape(-1)[:4096].astype(mx.float32)
        h.update(np.asarray(flat).tobytes())
        h.update(str(w.shape).encode())
    return h.hexdigest()[:16]


def check_manifest(out: Path, manifest: dict) -> None:
    """Write ``dataset.json`` on first use; refuse a folder made with another target or taps."""
    path = out / MANIFEST
    if not path.is_file():
        write_json_atomic(path, manifest)
        return
    try:
        have = json.loads(path.read_text())
    except ValueError:
        raise DataSetError(f"{path}: not valid JSON; remove it only if the folder holds no "
                           "records") from None
    for key in ("target_fingerprint", "taps", "topk"):
        if have.get(key) != manifest.get(key):
            raise DataSetError(
                f"--out {out}: holds data of {key}={have.get(key)!r}, this run has "
                f"{manifest.get(key)!r}; data of different targets (or taps) must not mix: "
                "use another --out folder")


def read_manifest(data: str | Path) -> dict | None:
    path = Path(data) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise DataSetError(f"{path}: not valid JSON") from None


def save_features(path: Path, rollout) -> None:
    """The rollout's features and top-k as one ``.npz``, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + f".tmp{os.getpid()}.npz")
    try:
        np.savez(tmp, feats=rollout.feats, top_ids=rollout.top_ids, top_logp=rollout.top_logp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
