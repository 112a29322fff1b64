"""What a (target, drafter) pair's generations taught the ``auto`` policy, kept for later ones
when the caller asks.

A :class:`PairMemory` is an object its user owns: pass it as ``memory=`` to ``stream_generate``,
``generate`` or ``BatchGenerator``, or attach it to a loaded drafter as ``draft.policy_memory``
(that drafter's generations then share it). ``dflash serve`` owns one per loaded pair; ``dflash
bench`` starts each run from an empty one. Without one, every generation starts from the
drafter's raw confidence. Nothing is read from or written to disk unless asked:
:meth:`PairMemory.open` (``--pair-memory PATH``) reads a file and saves back to it, atomically, at
most every ``SAVE_EVERY_S`` while generations run and when one ends; ``DFLASH_PAIR_MEMORY=1``
gives a loaded drafter that has no memory the pair's own file under ``$DFLASH_HOME/calibration/``
(keyed by a fingerprint of both models' weights, so a drafter re-trained in place starts fresh).

Carried, not imposed: a generation starts from the drafter's calibration decayed toward the
prior (at most ``CARRY`` observations per confidence bin, all block rows together) and the recent
verified depths. How often the context continues itself is a property of the text, not of the
pair, and the losing streak belongs to the last text too, so neither is inherited by default
(``carry_continuations`` / ``inherit_streak`` turn them on): measured on the held-out mix run
math -> chat -> code in one process, inheriting them cost the code answers ~1.3x their priced
time (continuations all but stopped), inheriting neither kept every domain within 5 % of fresh
memory (docs/how-it-works.md, "Pair memory"). The per-millisecond parts (the losing streak, the drafted blocks' rate)
belong to the machine that measured them and are dropped from a file written on another one.

Exactness never depends on any of it: the memory only steers how much is drafted and verified.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..backend import env_flag
from ..console import one_line, say_once
from ..errors import GenerationConfigError, PairMemoryFileError
from ..files import write_atomic
from .calibration import BINS, RIVAL_PRIORS, AcceptanceModel, Calibration, NodeCalibration
from .plan import Continuation, Outcome

FORMAT = "dflash-pair-memory/1"
ENV = "DFLASH_PAIR_MEMORY"
# Most observations per (row, confidence bin) the memory keeps (older ones weigh less).
MEMORY_CAP = 32.0
# Most observations per confidence bin (all rows together) a new generation inherits from the
# memory: the decay toward the prior at the start of each generation (its first few cycles in
# a bin weigh as much as everything carried).
CARRY = 4.0
# Longest losing streak a generation inherits: its first plain stretches stay short, so a
# prompt on which the drafter does well soon finds out.
INHERITED_LOSSES = 3
SAVE_EVERY_S = 2.0  # a killed process loses at most this much of what it learned
SAMPLES_PER_ARRAY = 64  # values of each parameter hashed into the pair's fingerprint


def storing() -> bool:
    """Whether a loaded drafter without a memory gets its pair's stored one
    (``DFLASH_PAIR_MEMORY=1``; default off)."""
    return env_flag(ENV, default=False)


@dataclass
class Carried:
    """What a generation inherits from its pair's earlier ones."""

    calibration: Calibration
    depths: list[int]
    losses: int
    draft_rate: float | None


class PairMemory:
    """What a pair's generations taught the ``auto`` policy: the drafter's and the continuations'
    acceptance calibrations, the off-spine node calibrations (the drafter's trees' and the rival
    continuations'), the verified depths, the drafted
    blocks' expected rate and the losing streak. Each generation starts from a decayed copy
    (:meth:`start`) and reports its cycles as they happen (:meth:`observe`, under a lock:
    generations in other threads see them from their next start, never mid-generation).

    ``rows``: block rows to start with (it grows with longer blocks); ``carry``: observations per
    confidence bin a generation inherits (``CARRY``; ``MEMORY_CAP * rows`` or more: no decay);
    ``path``: where it is saved (``None``: in this process only; see :meth:`open`)."""

    def __init__(self, rows: int = 15, path: str | Path | None = None, carry: float = CARRY,
                 cap: float = MEMORY_CAP, carry_continuations: bool = False,
                 inherit_streak: bool = False):
        if not (isinstance(carry, (int, float)) and carry >= 0):
            raise GenerationConfigError(f"carry={carry!r}: must be a number >= 0")
        self._lock = threading.Lock()
        self.calibration = Calibration.fresh(max(1, rows))
        self.carry, self.cap = float(carry), float(cap)
        self.carry_continuations, self.inherit_streak = carry_continuations, inherit_streak
        self.depths: deque[int] = deque(maxlen=8)
        self.losses = 0
        self.draft_rate: float | None = None
        self.path = None if path is None else Path(path)
        self.source = "fresh"  # or the file it was read from (the bench reports it)
        self._dirty = False
        self._saved_at = time.monotonic()

    @classmethod
    def open(cls, path: str | Path, rows: int = 15, carry: float = CARRY) -> PairMemory:
        """The memory stored at ``path`` (a fresh one if there is none yet), saved back there.
        A corrupt or foreign file is said once and replaced at the next save."""
        memory = cls(rows, path, carry)
        path = memory.path
        if not path.is_file():
            memory.source = f"fresh (to be saved in {path})"
            return memory
        try:
            same_machine = memory.load(json.loads(path.read_text()))
        except (ValueError, OSError) as e:  # bad JSON, or load()'s PairMemoryFileError
            say_once(f"{path}: {e}", f"pair memory {path} is unreadable ({e}); starting fresh")
            return memory
        memory.source = f"stored {path}" + ("" if same_machine else
                                            " (another machine: acceptance only)")
        return memory

    def start(self) -> Carried:
        """What a new generation starts from: the drafter's calibration decayed toward the prior
        (at most ``carry`` observations per confidence bin) and the recent verified depths; with
        ``carry_continuations`` the continuations' calibration too, with ``inherit_streak`` the
        losing streak (at most ``INHERITED_LOSSES`` long) and the drafted blocks' rate. A copy: a
        running generation never sees another's updates."""
        with self._lock:
            calibration = self.calibration.copy()
            depths, losses, rate = list(self.depths), self.losses, self.draft_rate
        calibration.decay(self.carry)
        if not self.carry_continuations:
            calibration.continuation = AcceptanceModel(calibration.continuation.rows)
        if not self.inherit_streak:
            return Carried(calibration, depths, 0, None)
        return Carried(calibration, depths, min(losses, INHERITED_LOSSES), rate)

    def observe(self, outcome: Outcome, streak: tuple[int, float | None] | None = None) -> None:
        """One cycle of some generation; ``streak``: the losing streak it is in now (0:
        speculation pays) and what its drafted blocks were expected to commit per ms, where the
        cycle was judged."""
        with self._lock:
            depth = self.calibration.learn(outcome)
            changed = depth is not None or isinstance(outcome.plan, Continuation)
            if changed:
                self.calibration.cap(self.cap)
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
        try:
            write_atomic(path, json.dumps(self._to_dict()) + "\n", durable=False)
            self._dirty = False
        except OSError as e:
            say_once(f"unwritable {path.parent}",
                     f"cannot save the pair's memory in {path.parent} ({e}); keeping it in this "
                     "process")
            self.path = None  # (write_atomic leaves nothing half-written behind)

    def _to_dict(self) -> dict:
        from ..cost_model import machine_id

        c = self.calibration

        def model(m: AcceptanceModel) -> dict:
            return {"accepted": m.accepted.round(4).tolist(), "tried": m.tried.round(4).tolist()}

        return {"format": FORMAT, "machine": machine_id(), "saved_at": time.time(),
                "acceptance": model(c.drafter), "lookup": model(c.continuation),
                "nodes": {"hits": c.nodes.hits, "mass": c.nodes.mass},
                "rivals": {"hits": c.rivals.hits, "mass": c.rivals.mass},
                "depths": list(self.depths), "losses": self.losses,
                "draft_rate": self.draft_rate}

    def load(self, data: dict) -> bool:
        """Take what a stored file says, every value checked before anything changes (a
        :class:`~dflash.errors.PairMemoryFileError`, a ``ValueError``, names what is wrong).
        Returns whether its per-ms parts were kept (measured on this machine)."""
        from ..cost_model import machine_id

        if not isinstance(data, dict):
            raise PairMemoryFileError(f"a JSON {type(data).__name__}, not an object")
        if data.get("format") != FORMAT:
            raise PairMemoryFileError(
                f"format {data.get('format')!r}, this dflash writes {FORMAT!r}")
        acceptance, lookup = (_stored_model(data, name) for name in ("acceptance", "lookup"))
        nodes = _stored_nodes(data, "nodes", NodeCalibration.PRIORS)
        # Files written before rival continuations were stored start them from the prior.
        rivals = _stored_nodes(data, "rivals", RIVAL_PRIORS) if "rivals" in data else \
            NodeCalibration(RIVAL_PRIORS)
        depths = data.get("depths")
        if not isinstance(depths, list) or not all(
                isinstance(d, int) and 0 <= d <= acceptance.rows + 1 for d in depths):
            raise PairMemoryFileError(
                f"depths: {str(depths)[:60]} is not a list of verified depths")
        same_machine = data.get("machine") == machine_id()
        losses, rate = 0, None
        if same_machine:
            losses = data.get("losses")
            if not isinstance(losses, int) or losses < 0:
                raise PairMemoryFileError(f"losses: {losses!r}")
            if data.get("draft_rate") is not None:
                rate = _number(data, "draft_rate", "draft_rate")
        for stored in (acceptance, lookup, nodes, rivals):  # capped like any memory observed here
            stored.cap(self.cap)
        with self._lock:
            c = self.calibration
            c.drafter = c.drafter.grown(acceptance.rows)
            c.continuation = c.continuation.grown(lookup.rows)
            acceptance.copy_into(c.drafter)
            lookup.copy_into(c.continuation)
            c.nodes, c.rivals = nodes, rivals
            self.depths.extend(depths)
            self.losses, self.draft_rate = losses, rate
        return same_machine


def _number(where: dict, key: str, name: str) -> float:
    """A finite, non-negative number ``where[key]``, or a ``PairMemoryFileError`` naming
    ``name``."""
    value = where.get(key) if isinstance(where, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not np.isfinite(value) or value < 0:
        raise PairMemoryFileError(f"{name}: {value!r} is not a finite number >= 0")
    return float(value)


def _stored_nodes(data: dict, name: str, priors: dict) -> NodeCalibration:
    """The node calibration stored under ``name`` (one of each kind of ``priors``), checked."""
    raw = data.get(name)
    if not isinstance(raw, dict):
        raise PairMemoryFileError(f"{name}: not an object")
    nodes = NodeCalibration(priors)
    nodes.hits = {k: _number(raw.get("hits"), k, f"{name}.hits") for k in priors}
    nodes.mass = {k: _number(raw.get("mass"), k, f"{name}.mass") for k in priors}
    if any(m <= 0 for m in nodes.mass.values()):
        raise PairMemoryFileError(f"{name}.mass: must be > 0")
    return nodes


def _stored_model(data: dict, name: str) -> AcceptanceModel:
    """The acceptance counts stored under ``name``, checked."""
    try:
        accepted = np.asarray(data[name]["accepted"], dtype=np.float64)
        tried = np.asarray(data[name]["tried"], dtype=np.float64)
    except (KeyError, TypeError, ValueError) as e:
        raise PairMemoryFileError(f"{name}: no counts ({one_line(e)})") from None
    if accepted.ndim != 2 or accepted.shape != tried.shape or accepted.shape[1] != BINS \
            or not 1 <= accepted.shape[0] <= 1024:
        raise PairMemoryFileError(
            f"{name}: counts of shape {accepted.shape} and {tried.shape}")
    if not (np.isfinite(tried).all() and np.isfinite(accepted).all() and (accepted >= 0).all()
            and (accepted <= tried + 1e-6).all()):
        raise PairMemoryFileError(f"{name}: counts out of range")
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


def default_file(target, draft) -> Path | None:
    """The pair's own file under ``$DFLASH_HOME/calibration/`` (``None``: not loaded models)."""
    from ..cost_model import calibration_dir

    parts = [fingerprint(target), fingerprint(draft)]
    if None in parts:
        return None
    return calibration_dir() / f"memory-{parts[0]}-{parts[1]}.json"


def memory_of(target, draft) -> PairMemory | None:
    """The memory a generation of ``draft`` uses when none is given: the one the drafter holds
    (``draft.policy_memory``), else, with ``DFLASH_PAIR_MEMORY=1``, the pair's stored one (then
    held by the drafter), else none."""
    memory = getattr(draft, "policy_memory", None)
    if memory is not None or not storing():
        return memory
    path = default_file(target, draft)
    if path is None:
        return None
    memory = PairMemory.open(path, rows=max(1, draft.block_size - 1))
    draft.policy_memory = memory
    return memory


def forget_stored(target, draft) -> Path | None:
    """This pair's stored file goes (and the memory the drafter holds); the file, if any."""
    memory = getattr(draft, "policy_memory", None)
    if memory is not None:
        with memory._lock:  # a save under way finishes first, then none follows
            memory.path = None
        draft.policy_memory = None
    path = default_file(target, draft)
    if path is not None and path.is_file():
        path.unlink()
        return path
    return None
