"""Reading the data sets ``dflash datagen`` writes, and the order in which training visits them.

A data set is a folder of ``gen-*.jsonl`` files (or one JSONL file) with one record a line::

    {"id": ..., "prompt_ids": [...], "response_ids": [...], "finish_reason": "stop"|"length"}

A line cut short by an interrupted datagen is skipped everywhere: datagen regenerates its prompt.
A record longer than ``max_len`` loses the front of its prompt first (the target still reads
it: :class:`Sample` keeps it as ``prefix``, and the features are computed over the whole context),
so a long document's response is what trains, drafted from features that saw the whole document.
The validation split hashes the sample id, so a sample stays on its side however the data grows;
each epoch's shuffle is seeded by ``(seed, epoch)``, so a resumed run sees exactly the data it had
not seen yet.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import DataSetError, TrainingDataError
from .recipe import anchor_range
from .shards import iter_records

RECORD_FIELDS = ("id", "prompt_ids", "response_ids")


def read_records(path: Path) -> Iterator[tuple[int, object]]:
    """``(lineno, record | None)`` for each non-blank line; ``None`` for a line cut short."""
    with Path(path).open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError:
                yield lineno, None


def _records_of(path: Path) -> Iterator[tuple[int, object]]:
    """``read_records`` of a JSONL file, or the records of a shard folder (``dflash records``:
    sealed shards checked against their manifest, then the open ones), numbered in order."""
    if Path(path).is_dir():
        yield from enumerate(iter_records(path), 1)
    else:
        yield from read_records(path)


def load_samples(data: str | Path) -> list[dict]:
    """All generated records in a data folder (``gen-*.jsonl``) or one JSONL file, sorted by id.

    Lines cut short by an interrupted run are skipped; a record without ``prompt_ids`` /
    ``response_ids`` raises :class:`DataSetError` naming its file and line.
    """
    data = Path(data)
    if not data.exists():
        raise DataSetError(f"data set {data}: no such file or folder")
    files = sorted(data.glob("gen-*.jsonl")) if data.is_dir() else [data]
    samples = {}
    for path in files:
        for lineno, rec in read_records(path):
            if rec is None:
                continue
            if not isinstance(rec, dict) or any(k not in rec for k in RECORD_FIELDS):
                raise DataSetError(f"{path}:{lineno}: expected a record with fields "
                                   f"{', '.join(RECORD_FIELDS)} (written by `dflash datagen`)")
            samples[str(rec["id"])] = rec
    if not samples:
        raise DataSetError(f"data set {data} holds no samples (run `dflash datagen` first)")
    return [samples[k] for k in sorted(samples)]


def _no_prefix() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


@dataclass
class Sample:
    """One training sequence: ``ids`` (prompt + response, int32) start ``prompt_len`` prompt tokens
    before the response. ``prefix``: prompt tokens dropped from the front to fit ``max_len``; only
    the target reads them (features are computed over ``prefix + ids``), and the drafter numbers
    positions from the first of ``ids``: its attention is relative (RoPE), so a block at ``anchor``
    sees its context rows at the same distances as it would at ``len(prefix) + anchor``.
    """

    id: str
    ids: np.ndarray  # prompt + response, int32
    prompt_len: int
    finish_reason: str | None = None
    prefix: np.ndarray = field(default_factory=_no_prefix)  # int32, empty for a record that fits

    @property
    def n_anchors(self) -> int:
        lo, hi = anchor_range(self.prompt_len, len(self.ids))
        return max(0, hi - lo + 1)


def read_samples(data: str | Path | list, max_len: int = 1024, skip_truncated: bool = False,
                 vocab_size: int | None = None) -> list[Sample]:
    """Samples of a ``dflash datagen`` folder (``gen-*.jsonl``) or one JSONL file, sorted by id;
    ``"A,B"`` (or a list) merges several (ids must not repeat across them).

    Lines cut short by an interrupted generation are skipped; records without ``prompt_ids`` /
    ``response_ids`` raise :class:`TrainingDataError` naming the file and line.
    """
    if isinstance(data, str) and "," in data:
        data = data.split(",")
    if isinstance(data, (list, tuple)):
        merged: dict[str, tuple[Sample, str]] = {}
        for source in data:
            for sample in read_samples(source, max_len, skip_truncated, vocab_size):
                if sample.id in merged:
                    raise TrainingDataError(f"sample id {sample.id!r} is in both "
                                            f"{merged[sample.id][1]} and {source}")
                merged[sample.id] = (sample, str(source))
        return sorted((s for s, _ in merged.values()), key=lambda s: s.id)
    data = Path(data)
    if not data.exists():
        raise TrainingDataError(f"data set {data}: no such file or folder")
    files = sorted(data.glob("gen-*.jsonl")) if data.is_dir() else [data]
    if data.is_dir() and not files:
        files = sorted(data.glob("*.jsonl"))
    if data.is_dir() and (data / "manifest.json").is_file():  # sealed shards (``dflash records``)
        files = [data]
    samples: dict[str, Sample] = {}
    for path in files:
        for lineno, rec in _records_of(path):
            if rec is None:
                continue  # cut short by an interrupted datagen: it is regenerated there
            if not isinstance(rec, dict):
                raise TrainingDataError(f"{path}:{lineno}: expected a JSON object")
            pid, rid = rec.get("prompt_ids"), rec.get("response_ids")
            if not isinstance(pid, list) or not isinstance(rid, list):
                raise TrainingDataError(
                    f"{path}:{lineno}: needs `prompt_ids` and `response_ids` lists "
                    "(records written by `dflash datagen`)")
            if skip_truncated and rec.get("finish_reason") == "length":
                continue
            # too long: drop the front of the prompt first (keeping one prompt token, so that the
            # response's first token can be an anchor), then, if still too long, the end
            drop = min(max(0, len(pid) + len(rid) - max_len), max(0, len(pid) - 1))
            read = np.asarray(pid + rid, dtype=np.int64)[:drop + max_len]  # what the target reads
            if vocab_size is not None and len(read) and (read.min() < 0
                                                         or read.max() >= vocab_size):
                raise TrainingDataError(
                    f"{path}:{lineno}: token id outside the target vocabulary ({vocab_size})")
            ids = read[drop:].astype(np.int32)
            sid = str(rec.get("id", f"{path.name}:{lineno}"))
            samples[sid] = Sample(sid, ids, len(pid) - drop, rec.get("finish_reason"),
                                  read[:drop].astype(np.int32))
    usable = [s for s in samples.values() if s.n_anchors > 0]
    if not usable:
        raise TrainingDataError(
            f"data set {data} holds no usable samples (need responses of 2+ tokens; run "
            "`dflash datagen` first)")
    return sorted(usable, key=lambda s: s.id)


def seen_ids(samples: list[Sample]) -> set[int]:
    """Every token id that occurs in ``samples``' ids.

    A cut sample's ``prefix`` is left out: it is target context only, never a label nor a
    drafter input, so its ids would join ``--vocab data`` as rows training never teaches to win;
    the vocabulary stays the ids training sees (for a record that fits, all of them, as before).
    """
    return set(np.unique(np.concatenate([s.ids for s in samples])).tolist())


def is_validation(sample_id: str, percent: float) -> bool:
    """A stable hash split: the same id is always on the same side, however the data grows."""
    if percent <= 0:
        return False
    h = int(hashlib.md5(sample_id.encode()).hexdigest()[:8], 16)
    return (h % 10000) < percent * 100


class DataOrder:
    """Which samples train and in which order: the validation split, one shuffle per epoch, a cursor.

    ``reload`` (with ``--refresh-data``) returns the data set anew; it is called at each epoch
    boundary, so that samples datagen wrote since the start join the next epoch.
    """

    def __init__(self, samples: list[Sample], source: str, seed: int, val_percent: float,
                 val_n: int, reload: Callable[[], list[Sample]] | None = None):
        self.source, self.seed, self.reload = source, seed, reload
        self.val_percent, self.val_n = val_percent, val_n
        self.set_samples(samples)
        self.epoch = 0
        self.cursor = 0
        self.order: list[str] = []
        self.val_ids: list[str] = []

    def set_samples(self, samples: list[Sample]) -> None:
        self.samples = samples
        self.by_id = {s.id: s for s in samples}

    def start(self) -> None:
        """A fresh run: pick the validation samples and shuffle epoch 0."""
        val = [s.id for s in self.samples if is_validation(s.id, self.val_percent)]
        val.sort(key=lambda i: hashlib.md5(i.encode()).hexdigest())
        self.val_ids = val[: self.val_n]
        self.new_epoch(0)

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "order": self.order,
                "val_ids": self.val_ids}

    def restore(self, state: dict) -> None:
        """Go back to a :meth:`state`: its split, its epoch's order and its cursor."""
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self.order, self.val_ids = state["order"], state["val_ids"]

    def check_resumable(self) -> None:
        """Every sample of the current epoch's order is still in the data set."""
        missing = [i for i in self.order if i not in self.by_id]
        if missing:
            raise TrainingDataError(
                f"data set {self.source}: {len(missing)} samples of the checkpointed epoch are gone "
                f"(e.g. {missing[0]}); resume needs the same data")

    def train_ids(self) -> list[str]:
        val = set(self.val_ids)
        return [s.id for s in self.samples
                if s.id not in val and not is_validation(s.id, self.val_percent)]

    def new_epoch(self, epoch: int) -> None:
        if epoch > 0 and self.reload is not None:
            self.set_samples(self.reload())
        ids = self.train_ids()
        if not ids:
            raise TrainingDataError(f"data set {self.source}: no training samples left after "
                                    "the validation split")
        rng = np.random.default_rng([self.seed, epoch, 7])
        self.order = [ids[i] for i in rng.permutation(len(ids))]
        self.epoch, self.cursor = epoch, 0

    def next_samples(self, n: int) -> list[Sample]:
        """The next ``n`` training samples, starting a new epoch when this one is used up."""
        out = []
        while len(out) < n:
            if self.cursor >= len(self.order):
                self.new_epoch(self.epoch + 1)
            out.append(self.by_id[self.order[self.cursor]])
            self.cursor += 1
        return out

    def peek(self, n: int) -> list[Sample]:
        """The next ``n`` training samples of this epoch, without taking them."""
        return [self.by_id[i] for i in self.order[self.cursor:self.cursor + n] if i in self.by_id]

    def validation(self) -> list[Sample]:
        return [self.by_id[i] for i in self.val_ids if i in self.by_id]
