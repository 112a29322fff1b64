"""What a loaded (target, drafter) pair's generations taught the ``auto`` policy, for the next ones:
in this process, and — stored under ``$DFLASH_HOME/calibration/`` — in the next process.

A generation starts from a copy of the memory (:meth:`PairMemory.start`) and reports each of its
cycles to it (:meth:`PairMemory.observe`). The stored file belongs to the pair's weights (a
fingerprint of every parameter's name, shape, dtype and a strided sample of its values), not to a
path: a re-trained drafter in the same folder starts fresh. Its per-millisecond parts (the losing
streak, the drafted blocks' rate) belong to the machine that measured them and are dropped on
another one; the acceptance calibrations are the pair's own and kept. A corrupt or foreign file is
said once and replaced; an unwritable folder keeps the memory in the process (said once).

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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..backend import env_flag
from ..console import one_line, say_once
from .calibration import BINS, AcceptanceModel, Calibration, NodeCalibration
from .plan import Continuation, Outcome

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



@dataclass
class Carried:
    """What a generation inherits from its pair's earlier ones."""

    calibration: Calibration
    depths: list[int]
    losses: int
    draft_rate: float | None


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
        self.calibration = Calibration.fresh(rows)
        self.carry = MEMORY_CAP
        self.depths: deque[int] = deque(maxlen=8)
        self.losses = 0
        self.draft_rate: float | None = None
        self.path = path
        self.source = "fresh"  # or where it was read from (the bench reports it)
        self._dirty = False
        self._saved_at = time.monotonic()

    def start(self) -> Carried:
        """What a new generation starts from: a copy of the calibration (at most ``carry``
        observations per cell), the recent verified depths, the losing streak (at most
        ``INHERITED_LOSSES`` long) and the drafted blocks' rate. A copy: a running generation
        never sees another's updates."""
        with self._lock:
            calibration = self.calibration.copy()
            calibration.cap(self.carry)
            return Carried(calibration, list(self.depths), min(self.losses, INHERITED_LOSSES),
                           self.draft_rate)

    def observe(self, outcome: Outcome, streak: tuple[int, float | None] | None = None) -> None:
        """One cycle of some generation; ``streak``: the losing streak it is in now (0:
        speculation pays) and what its drafted blocks were expected to commit per ms, where the
        cycle was judged."""
        with self._lock:
            depth = self.calibration.learn(outcome)
            changed = depth is not None or isinstance(outcome.plan, Continuation)
            if changed:
                self.calibration.cap(MEMORY_CAP)
            if depth is not None:
                self.depths.append(depth)
            if streak is not None:
                self.losses, self.draft_rate = streak
            if changed or streak is not None:
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
            say_once(f"unwritable {path.parent}",
                     f"cannot save the pair's memory in {path.parent} ({e}); keeping it in this "
                     "process")
            self.path = None
            with contextlib.suppress(OSError):  # nothing half-written stays behind
                tmp.unlink()

    def _to_dict(self) -> dict:
        from ..cost_model import machine_id

        c = self.calibration

        def model(m: AcceptanceModel) -> dict:
            return {"accepted": m.accepted.round(4).tolist(), "tried": m.tried.round(4).tolist()}

        return {"format": FORMAT, "machine": machine_id(), "saved_at": time.time(),
                "acceptance": model(c.drafter), "lookup": model(c.continuation),
                "nodes": {"hits": c.nodes.hits, "mass": c.nodes.mass},
                "depths": list(self.depths), "losses": self.losses,
                "draft_rate": self.draft_rate}

    def load(self, data: dict) -> bool:
        """Take what a stored file says, every value checked before anything changes (a
        ``ValueError`` names what is wrong). Returns whether its per-ms parts were kept
        (measured on this machine)."""
        from ..cost_model import machine_id

        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, this dflash writes {FORMAT!r}")
        acceptance, lookup = (_stored_model(data, name) for name in ("acceptance", "lookup"))
        raw = data.get("nodes")
        if not isinstance(raw, dict):
            raise ValueError("nodes: not an object")
        hits = {k: _number(raw.get("hits"), k, "nodes.hits") for k in NodeCalibration.PRIORS}
        mass = {k: _number(raw.get("mass"), k, "nodes.mass") for k in NodeCalibration.PRIORS}
        if any(m <= 0 for m in mass.values()):
            raise ValueError("nodes.mass: must be > 0")
        depths = data.get("depths")
        if not isinstance(depths, list) or not all(
                isinstance(d, int) and 0 <= d <= acceptance.rows + 1 for d in depths):
            raise ValueError(f"depths: {str(depths)[:60]} is not a list of verified depths")
        same_machine = data.get("machine") == machine_id()
        losses, rate = 0, None
        if same_machine:
            losses = data.get("losses")
            if not isinstance(losses, int) or losses < 0:
                raise ValueError(f"losses: {losses!r}")
            if data.get("draft_rate") is not None:
                rate = _number(data, "draft_rate", "draft_rate")
        nodes = NodeCalibration()
        nodes.hits, nodes.mass = hits, mass
        for stored in (acceptance, lookup, nodes):  # capped like any memory observed here
            stored.cap(MEMORY_CAP)
        with self._lock:
            c = self.calibration
            c.drafter = c.drafter.grown(acceptance.rows)
            c.continuation = c.continuation.grown(lookup.rows)
            acceptance.copy_into(c.drafter)
            lookup.copy_into(c.continuation)
            c.nodes = nodes
            self.depths.extend(depths)
            self.losses, self.draft_rate = losses, rate
        return same_machine


def _number(where: dict, key: str, name: str) -> float:
    """A finite, non-negative number ``where[key]``, or a ``ValueError`` naming ``name``."""
    value = where.get(key) if isinstance(where, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not np.isfinite(value) or value < 0:
        raise ValueError(f"{name}: {value!r} is not a finite number >= 0")
    return float(value)


def _stored_model(data: dict, name: str) -> AcceptanceModel:
    """The acceptance counts stored under ``name``, checked."""
    try:
        accepted = np.asarray(data[name]["accepted"], dtype=np.float64)
        tried = np.asarray(data[name]["tried"], dtype=np.float64)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{name}: no counts ({one_line(e)})") from None
    if accepted.ndim != 2 or accepted.shape != tried.shape or accepted.shape[1] != BINS \
            or not 1 <= accepted.shape[0] <= 1024:
        raise ValueError(f"{name}: counts of shape {accepted.shape} and {tried.shape}")
    if not (np.isfinite(tried).all() and np.isfinite(accepted).all() and (accepted >= 0).all()
            and (accepted <= tried + 1e-6).all()):
        raise ValueError(f"{name}: counts out of range")
    stored = AcceptanceModel(accepted.shape[0])
    stored.accepted, stored.tried = accepted, tried
    return stored


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
    return _stored_path(target, draft) if storing() else None


def _stored_path(target, draft) -> Path | None:
    from ..cost_model import calibration_dir

    parts = [fingerprint(target), fingerprint(draft)]
    if None in parts:
        return None
    return calibration_dir() / f"memory-{parts[0]}-{parts[1]}.json"


def _read(memory: PairMemory, path: Path) -> None:
    if not path.is_file():
        return
    try:
        same_machine = memory.load(json.loads(path.read_text()))
    except (ValueError, OSError) as e:  # load() checks every value: its errors are ValueErrors
        say_once(f"{path}: {e}", f"pair memory {path} is unreadable ({e}); starting fresh")
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
            for owner in (target, draft):  # an id is reused only after its object is gone
                weakref.finalize(owner, _forget, key)
            if path is not None:
                _read(memory, path)
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
        with memory._lock:  # a save under way finishes first, then none follows
            memory.path = None
    path = _stored_path(target, draft)  # also when storing is off now: it may be on later
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
