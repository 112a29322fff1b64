"""What a loaded (target, drafter) pair's generations taught the ``auto`` policy, for the next ones:
in this process, and — stored under ``$DFLASH_HOME/calibration/`` — in the next process.

Why: a generation that starts from the drafter's raw confidence spends its first cycles learning
what the pair's earlier generations already measured (a never-agreeing drafter verified its first
two cycles and probed six times in each 96-token generation). Kept in the process, a bench or a
server learns once; but the model card's snippet, ``dflash generate`` and every script are one
generation in a fresh process. Measured on the built-in pair's 16 held-out prompts (greedy,
block 16, 96 tokens; ``docs/bench/pair-memory.md``), each prompt's passes priced by the
calibrated cost model: starting every prompt fresh costs 1.16x the stored memory's time on
GSM8K, 1.05x on chat, 1.01x on HumanEval, 1.08x overall. So the memory is saved — at most every
``SAVE_EVERY_S`` while generations run and at exit — and read by the pair's first generation in
the next process.

The stored file belongs to the pair's weights (a fingerprint of every parameter's name, shape,
dtype and a strided sample of its values), not to a path: a re-trained drafter in the same folder
starts fresh. Its per-millisecond parts (the losing streak, the drafted blocks' rate) belong to
the machine that measured them and are dropped on another one; the acceptance calibrations are
the pair's own and kept. A corrupt or foreign file is said once and replaced; an unwritable folder
keeps the memory in the process (said once). ``DFLASH_PAIR_MEMORY=0`` turns the stored memory off
(the in-process one stays); ``dflash calibrate --refresh`` forgets it with the pair's costs.

Exactness never depends on any of it: the memory only steers how much is drafted and verified.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .backend import env_flag
from .console import log
from .tree import DraftTree
from .verify_policy import AcceptanceModel, NodeCalibration

if TYPE_CHECKING:
    from .verify_policy import VerifyPolicy

FORMAT = "dflash-pair-memory/1"
ENV = "DFLASH_PAIR_MEMORY"
# Most observations per (row, confidence bin) a pair remembers: enough to start a generation
# calibrated, few enough that ~a generation's cycles re-steer it.
MEMORY_CAP = 32.0
# Longest losing streak a generation inherits: its first plain stretches stay short (2**3 steps
# after the first probe), so a prompt on which the drafter does well soon finds out.
INHERITED_LOSSES = 3
SAVE_EVERY_S = 2.0  # a save costs ~1 ms; a killed process loses at most this much of what it learned
SAMPLES_PER_ARRAY = 64  # values of each parameter hashed into the pair's fingerprint

_said: set[str] = set()


def _say_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        log(message)


def storing() -> bool:
    """Whether memories are read from and saved to disk (``DFLASH_PAIR_MEMORY``, default on)."""
    return env_flag(ENV, default=True)


class PairMemory:
    """What one loaded (target, drafter) pair's generations taught the ``auto`` policy, for the
    next ones: the drafter's and the continuations' acceptance calibrations, the off-spine node
    calibration, the verified depths, the drafted blocks' expected rate and whether the last
    cycles were losing. Each generation starts from a copy and adds its cycles as they happen
    (under a lock: generations in other threads see them from their next start, never
    mid-generation). ``path``: where it is stored (``None``: in this process only)."""

    def __init__(self, rows: int, path: Path | None = None):
        # Re-entrant: a pair whose model is collected mid-update saves from its finalizer.
        self._lock = threading.RLock()
        self.acceptance = AcceptanceModel(rows)
        self.lookup = AcceptanceModel(rows)
        self.nodes = NodeCalibration()
        self.depths: deque[int] = deque(maxlen=8)
        self.losses = 0
        self.draft_rate: float | None = None
        self.path = path
        self.source = "fresh"  # or where it was read from (the bench reports it)
        self._dirty = False
        self._saved_at = time.monotonic()

    def seed(self, policy: VerifyPolicy) -> None:
        """Start ``policy`` from what earlier generations measured."""
        with self._lock:
            self.acceptance.copy_into(policy.acceptance)
            self.lookup.copy_into(policy.lookup_acceptance)
            policy.nodes.hits, policy.nodes.mass = dict(self.nodes.hits), dict(self.nodes.mass)
            policy.depths.extend(self.depths)
            policy.losses = min(self.losses, INHERITED_LOSSES)
            policy.draft_rate = self.draft_rate

    def observe(self, conf: np.ndarray | None, verified: int, accepted: int,
                tree: DraftTree | None, path: list[int] | None, depth: int) -> None:
        """One verified cycle of some generation."""
        with self._lock:
            if conf is not None and len(conf):
                if len(conf) > self.acceptance.rows:  # a longer block than before
                    grown = AcceptanceModel(len(conf))
                    self.acceptance.copy_into(grown)
                    self.acceptance = grown
                self.acceptance.update(conf, verified, accepted)
                self.acceptance.cap(MEMORY_CAP)
            if tree is not None:
                self.nodes.update(tree, path)
                self.nodes.cap(MEMORY_CAP)
            self.depths.append(depth)
            self._changed()

    def observe_lookup(self, conf: np.ndarray, verified: int, accepted: int) -> None:
        """One verified chain of the context's continuation."""
        with self._lock:
            if len(conf) <= self.lookup.rows:
                self.lookup.update(conf, verified, accepted)
                self.lookup.cap(MEMORY_CAP)
                self._changed()

    def streak(self, losses: int, draft_rate: float | None) -> None:
        """The losing streak a generation is in now (0: speculation pays) and what its drafted
        blocks were expected to commit per ms."""
        with self._lock:
            self.losses, self.draft_rate = losses, draft_rate
            self._changed()

    # -- stored -------------------------------------------------------------------------------

    def _changed(self) -> None:
        """Under the lock: note the change, and save when the last save is old enough."""
        self._dirty = True
        if self.path is not None and time.monotonic() - self._saved_at >= SAVE_EVERY_S:
            self._save()

    def save(self) -> None:
        """Write what changed since the last save (nothing for a memory kept in process)."""
        with self._lock:
            if self._dirty and self.path is not None:
                self._save()

    def _save(self) -> None:
        path, self._saved_at = self.path, time.monotonic()
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self._to_dict()) + "\n")
            os.replace(tmp, path)
            self._dirty = False
        except OSError as e:
            _say_once(f"unwritable {path.parent}", f"cannot save the pair's memory in {path.parent} ({e}); "
                      "keeping it in this process")
            self.path = None
            with contextlib.suppress(OSError):  # nothing half-written stays behind
                tmp.unlink()

    def _to_dict(self) -> dict:
        from .cost_model import machine_id

        def model(m: AcceptanceModel) -> dict:
            return {"accepted": m.accepted.round(4).tolist(), "tried": m.tried.round(4).tolist()}

        return {"format": FORMAT, "machine": machine_id(), "saved_at": time.time(),
                "acceptance": model(self.acceptance), "lookup": model(self.lookup),
                "nodes": {"hits": self.nodes.hits, "mass": self.nodes.mass},
                "depths": list(self.depths), "losses": self.losses,
                "draft_rate": self.draft_rate}

    def load(self, data: dict) -> bool:
        """Take what a stored file says (checked first: nothing changes when it is malformed).
        Returns whether its per-ms parts were kept (measured on this machine)."""
        from .cost_model import machine_id

        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, this dflash writes {FORMAT!r}")
        models = []
        for name in ("acceptance", "lookup"):
            accepted = np.asarray(data[name]["accepted"], dtype=np.float64)
            tried = np.asarray(data[name]["tried"], dtype=np.float64)
            if accepted.ndim != 2 or accepted.shape != tried.shape or \
                    accepted.shape[1] != self.acceptance.accepted.shape[1]:
                raise ValueError(f"{name}: counts of shape {accepted.shape} and {tried.shape}")
            if not (np.isfinite(tried).all() and (0 <= accepted).all() and
                    (accepted <= tried + 1e-6).all()):
                raise ValueError(f"{name}: counts out of range")
            stored = AcceptanceModel(accepted.shape[0])
            stored.accepted, stored.tried = accepted, tried
            models.append(stored)
        hits = {k: float(data["nodes"]["hits"][k]) for k in NodeCalibration.PRIORS}
        mass = {k: float(data["nodes"]["mass"][k]) for k in NodeCalibration.PRIORS}
        depths = [int(d) for d in data["depths"]]
        same_machine = data.get("machine") == machine_id()
        losses, rate = (int(data["losses"]), data["draft_rate"]) if same_machine else (0, None)
        with self._lock:
            if models[0].rows > self.acceptance.rows:
                self.acceptance = AcceptanceModel(models[0].rows)
            models[0].copy_into(self.acceptance)
            models[1].copy_into(self.lookup)
            self.nodes.hits, self.nodes.mass = hits, mass
            self.depths.extend(depths)
            self.losses = losses
            self.draft_rate = None if rate is None else float(rate)
        return same_machine


def fingerprint(module) -> str | None:
    """A hash of a loaded model's weights: every parameter's name, shape, dtype and
    ``SAMPLES_PER_ARRAY`` evenly spaced values (fast for any size; two trainings differ in all
    of them). ``None`` for an object without MLX parameters."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if not callable(getattr(module, "parameters", None)):
        return None
    flat = sorted(tree_flatten(module.parameters()), key=lambda kv: kv[0])
    if not flat:
        return None
    samples = []
    for _, a in flat:
        values = a.reshape(-1)
        step = max(1, values.size // SAMPLES_PER_ARRAY)
        samples.append(values[::step][:SAMPLES_PER_ARRAY].astype(mx.float32))
    mx.eval(samples)
    h = hashlib.sha256()
    for (name, a), s in zip(flat, samples):
        h.update(f"{name}:{a.shape}:{a.dtype};".encode())
        h.update(np.asarray(s).tobytes())
    return h.hexdigest()[:16]


def memory_file(target, draft) -> Path | None:
    """Where this pair's memory is stored (``None``: not stored, or not a loaded model)."""
    from .cost_model import calibration_dir

    if not storing():
        return None
    parts = [fingerprint(target), fingerprint(draft)]
    if None in parts:
        return None
    return calibration_dir() / f"memory-{parts[0]}-{parts[1]}.json"


def _read(memory: PairMemory, path: Path) -> None:
    if not path.is_file():
        return
    try:
        same_machine = memory.load(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError, OSError) as e:
        _say_once(f"{path}: {e}", f"pair memory {path} is unreadable ({e}); starting fresh")
        return
    memory.source = f"stored {path.name}" + ("" if same_machine else
                                             " (another machine: acceptance only)")


_memories: dict[tuple[int, int], PairMemory] = {}
_memories_lock = threading.Lock()


def pair_memory(target, draft, rows: int) -> PairMemory:
    """The memory of this loaded target model and drafter (forgotten with either): the one in
    this process, else the stored one, else a fresh one."""
    key = (id(target), id(draft))
    with _memories_lock:
        memory = _memories.get(key)
        if memory is None:
            path = memory_file(target, draft)
            memory = _memories[key] = PairMemory(rows, path)
            if path is not None:
                _read(memory, path)
            for owner in (target, draft):  # an id is reused only after its object is gone
                weakref.finalize(owner, _forget, key)
        return memory


def _forget(key: tuple[int, int]) -> None:
    memory = _memories.pop(key, None)
    if memory is not None:
        memory.save()


def forget_pairs() -> None:
    """Every pair's memory in this process goes, saved first where it is stored: the next
    generations start from the stored memory, or from the drafter's raw confidence."""
    save_all()
    with _memories_lock:
        _memories.clear()


def forget_stored(target, draft) -> Path | None:
    """This pair's memory goes, in the process and on disk; the file it was in, if any."""
    key = (id(target), id(draft))
    with _memories_lock:
        memory = _memories.pop(key, None)
        if memory is not None:
            memory.path = None
    path = memory_file(target, draft)
    if path is not None and path.is_file():
        path.unlink()
        return path
    return None


@atexit.register
def save_all() -> None:
    """What the process's generations taught since the last save (at exit; also callable)."""
    with _memories_lock:
        memories = list(_memories.values())
    for memory in memories:
        memory.save()
