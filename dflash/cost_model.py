"""What a verify pass and a draft pass cost on this machine: learnt while decoding, or measured.

Speculation pays when the tokens a cycle commits outweigh what the cycle costs relative to a plain
one-token step, and that ratio is a property of the machine, the model and the context length
(docs/how-it-works.md has this CPU's numbers). The policy asks three prices, in milliseconds:

* ``verify(rows, context)``: one target pass over ``rows`` new tokens after ``context`` cached ones;
* ``step(context)``: one plain one-token step as greedy decoding takes it, each pass queued on the
  previous pass's still-lazy token (mlx-lm's pipelining: where a pass takes a few ms, on GPUs, a
  pipelined step costs clearly less than a lone one-row pass);
* ``draft(rows)``: one drafter block pass of ``rows`` rows.

:func:`cost_model` answers them without measuring anything first, so the first token comes as
soon as plain decoding's. Its :class:`PassCosts` learns from the passes decoding runs anyway
(the engines report each pass's time to :meth:`PassCosts.observe`): per (pass kind, rows,
power-of-two context bucket) it keeps the recent timings and takes a low quantile of them (a busy
moment does not raise a price), interpolates across rows and contexts, and prices what it has not
seen from a conservative prior: before any multi-row pass is timed each extra row costs
``PRIOR_ROW_COST`` of a one-row pass, so speculation has to prove itself on short chains first;
past the longest pass timed a row costs the average extra row of the passes timed; a drafter pass
not yet timed is priced like a target pass of its rows. What it learnt is stored per machine and
pair under ``$DFLASH_HOME/calibration/`` (pass costs are a property of the machine) and is where
the next process starts.

``dflash calibrate`` measures the table up front instead (:func:`calibrate`: each shape's fastest of
three round-robin timings, made monotone in rows) and stores it next to it; a stored calibration
is what the policy uses when present. A file that is corrupt, older than 30 days or measured on
another machine (or MLX version) is ignored (said once); an unwritable folder keeps the costs in
memory (said once). ``dflash calibrate`` prints the table and a plot, ``--compare-learned`` the
learnt costs of a generation against it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from .console import log, say_once
from .errors import CostModelError, missing_extra
from .files import write_atomic

FORMAT = "dflash-cost/2"
LEARNED_FORMAT = "dflash-learned-cost/1"
KINDS = ("verify", "step", "draft")
ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
DRAFT_ROWS = (2, 4, 8, 16)
CONTEXTS = (128, 1024, 4096)  # those the target reads (long contexts: attention grows)
PIPELINED_STEPS = 8  # plain steps per pipelined timing (the first pass is not hidden)
MAX_AGE_DAYS = 30  # drivers, thermals and background load change: re-measure now and then

RECENT = 16  # timings kept per (kind, rows, context bucket): recent enough to follow the machine
QUANTILE = 0.2  # of the recent timings: near the fastest, not one lucky outlier
PRIOR_ROW_COST = 0.5  # an extra verify row, in one-row passes, until a multi-row pass is timed
PRIOR_STEP_MS = 1.0  # before any pass is timed: only ratios matter, so any unit will do
EPOCH_EVERY = 16  # timings between epochs (PassCosts.epoch)
SAVE_EVERY_S = 5.0  # learnt costs are written at most this often (and by flush())

_memory: dict[str, PassCosts] = {}
_lock = threading.Lock()


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear in ``xs``, extended linearly past both ends."""
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y0


@dataclass
class CostModel:
    """Measured pass times (milliseconds) and what they were measured for."""

    key: str
    machine: dict
    rows: list[int]
    contexts: list[int]
    verify_ms: list[list[float]]  # [context index][rows index]
    draft_rows: list[int]
    draft_ms: list[float]
    measured_at: str = ""
    format: str = FORMAT
    step_ms: list[float] = field(default_factory=list)  # [context index]; empty: verify(1)
    # [context index][draft rows index]: the drafter attends to the whole context (unless
    # windowed), so its pass grows with it too; empty: ``draft_ms`` at every context.
    draft_ms_at: list[list[float]] = field(default_factory=list)

    def unlearnt(self) -> CostModel:
        """A measured table learns nothing: itself (see :meth:`PassCosts.unlearnt`)."""
        return self

    def verify(self, rows: int, context: int = 256) -> float:
        """Milliseconds of one target pass over ``rows`` tokens after ``context`` cached ones."""
        per_context = [_interp(rows, self.rows, ms) for ms in self.verify_ms]
        return max(1e-3, _interp(context, self.contexts, per_context))

    def step(self, context: int = 256, pipelined: bool = True) -> float:
        """Milliseconds of one plain one-token step: pipelined (greedy decoding) or a lone pass."""
        lone = self.verify(1, context)
        if not pipelined or len(self.step_ms) != len(self.contexts):
            return lone
        return max(1e-3, min(lone, _interp(context, self.contexts, self.step_ms)))

    def draft(self, rows: int, context: int = 256) -> float:
        """Milliseconds of one drafter block pass of ``rows`` rows after ``context`` tokens of
        target context (0 for no drafting)."""
        if rows <= 1:
            return 0.0
        if len(self.draft_ms_at) != len(self.contexts):
            return max(0.0, _interp(rows, self.draft_rows, self.draft_ms))
        per_context = [_interp(rows, self.draft_rows, ms) for ms in self.draft_ms_at]
        return max(0.0, _interp(context, self.contexts, per_context))

    @property
    def epoch(self) -> int:
        """A measured table never changes (see :attr:`PassCosts.epoch`)."""
        return 0

    def observe(self, kind: str, rows: int, context: int, seconds: float) -> None:
        """A measured table learns nothing (:class:`PassCosts` does)."""

    def table(self) -> list[dict]:
        step = {c: self.verify(1, c) for c in self.contexts}
        return [{"rows": r, **{f"verify_ms@{c}": round(self.verify(r, c), 2) for c in self.contexts},
                 **{f"x_step@{c}": round(self.verify(r, c) / step[c], 2) for c in self.contexts}}
                for r in self.rows]


# ---------------------------------------------------------------------------------------------
# Learnt from decoding


def context_bucket(context: int) -> int:
    """Contexts are grouped by powers of two (0-1, 2-3, 4-7, ...): a pass costs about the same
    within one."""
    return max(0, int(context)).bit_length()


def low_quantile(values, q: float = QUANTILE) -> float:
    """The ``q`` quantile (nearest rank, from below) of ``values``: the price of a pass when the
    machine is not busy with something else, without trusting one lucky timing."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def along_context(points: list[tuple[float, float]], context: float) -> float:
    """``points`` ``(context, value)`` interpolated at ``context``; flat past both ends (a price
    seen at one context is the best guess at another)."""
    points = sorted(points)
    if context <= points[0][0]:
        return points[0][1]
    if context >= points[-1][0]:
        return points[-1][1]
    xs, ys = [x for x, _ in points], [y for _, y in points]
    return _interp(context, xs, ys)


def along_rows(points: dict[int, float], rows: int, prior_slope: float) -> float:
    """A price at ``rows`` from the prices ``points`` timed at some row counts (the smallest
    first): made monotone in rows, interpolated between them; past the largest, each extra row
    costs the average extra row of the timed ones (``prior_slope`` when only one row count was
    timed).

    Timing noise is one-sided (a busy moment only slows a pass down), so a price above a larger
    row count's is lowered to it (never below the smallest row count's), rather than the larger
    ones raised to it as the calibration's fastest-of-three timings are.
    """
    xs = sorted(points)
    ys = [points[x] for x in xs]
    ys = [max(ys[0], min(ys[i:])) if i else ys[0] for i in range(len(ys))]
    if rows <= xs[0]:
        return ys[0]
    if rows <= xs[-1]:
        return _interp(rows, xs, ys)
    slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0]) if len(xs) > 1 else prior_slope
    return ys[-1] + slope * (rows - xs[-1])


class PassCosts:
    """The pass costs the policy prices with: a stored calibration (:class:`CostModel`) when there
    is one, else learnt from :meth:`observe`; :meth:`learned_verify`, :meth:`learned_step` and
    :meth:`learned_draft` always answer from what was learnt. Thread-safe."""

    def __init__(self, key: str, machine: dict, path: Path | None = None,
                 calibrated: CostModel | None = None):
        self.key, self.machine, self.path, self.calibrated = key, machine, path, calibrated
        self.samples: dict[tuple[str, int, int], deque] = {}
        self.observed = 0  # passes observed by this process
        # Bumped when prices may have moved: a shape timed for the first time (a prior replaced)
        # or EPOCH_EVERY timings since; what a caller derived from the prices is stale after it.
        self.epoch = 0
        self._lock = threading.Lock()
        self._version = 0
        self._estimates: tuple[int, dict] | None = None
        self._curve: tuple[dict, int, tuple[float, dict[int, float]]] | None = None
        self._dirty = False
        self._saved_at = time.monotonic()

    # -- learning -----------------------------------------------------------------------------

    def observe(self, kind: str, rows: int, context: int, seconds: float) -> None:
        """One pass of ``kind`` (``verify``: a target pass over ``rows`` tokens; ``step``: one
        pipelined plain step, ``rows`` 1; ``draft``: a drafter block pass) after ``context``
        cached tokens took ``seconds`` (issue to host read of its result)."""
        if kind not in KINDS:
            raise CostModelError(f"kind {kind!r}: expected one of {', '.join(KINDS)}")
        if not (rows >= 1 and math.isfinite(seconds) and seconds > 0):
            return
        bucket = context_bucket(context)
        with self._lock:
            group = self.samples.get((kind, int(rows), bucket))
            if group is None:
                group = self.samples[(kind, int(rows), bucket)] = deque(maxlen=RECENT)
                self.epoch += 1
            group.append((int(context), 1000.0 * seconds))
            self.observed += 1
            if self.observed % EPOCH_EVERY == 0:
                self.epoch += 1
            self._version += 1
            self._dirty = True
            due = self.path is not None and time.monotonic() - self._saved_at >= SAVE_EVERY_S
        if due:
            self.flush()

    def _groups(self) -> dict:
        """``{kind: {rows: [(context, ms), ...]}}``: each group's typical context and price."""
        with self._lock:
            if self._estimates is not None and self._estimates[0] == self._version:
                return self._estimates[1]
            out: dict = {k: {} for k in KINDS}
            for (kind, rows, _), group in self.samples.items():
                contexts = sorted(c for c, _ in group)
                out[kind].setdefault(rows, []).append(
                    (contexts[len(contexts) // 2], low_quantile([ms for _, ms in group])))
            self._estimates = (self._version, out)
            return out

    def _one_row(self, groups: dict, context: int, pipelined: bool) -> float:
        """A one-row target pass at ``context``: a plain step (``pipelined``) or a lone pass,
        each standing in for the other; before either was timed, the shortest multi-row pass
        (else a drafter pass) scaled down by the prior; before anything, the prior's unit."""
        lone, step = groups["verify"].get(1), groups["step"].get(1)
        points = (step or lone) if pipelined else (lone or step)
        if points is None:
            for kind in ("verify", "draft"):
                if groups[kind]:
                    r = min(groups[kind])
                    points = [(c, ms / (1 + PRIOR_ROW_COST * (r - 1))) for c, ms in groups[kind][r]]
                    break
        return PRIOR_STEP_MS if points is None else along_context(points, context)

    def learned_step(self, context: int = 256, pipelined: bool = True) -> float:
        """A plain step as learnt (the prior's unit before any pass was timed)."""
        groups = self._groups()
        ms = self._one_row(groups, context, pipelined)
        if pipelined:  # a pipelined step never costs more than a lone pass
            ms = min(ms, self._one_row(groups, context, False))
        return max(1e-3, ms)

    def learned_verify(self, rows: int, context: int = 256) -> float:
        """A target pass over ``rows`` tokens as learnt, priced in one-row passes at ``context``
        (each timed row count at the context nearest to this one it was timed at)."""
        base, ratios = self._row_curve(context)
        return max(1e-3, base * along_rows(ratios, max(1, rows), PRIOR_ROW_COST))

    def _row_curve(self, context: int) -> tuple[float, dict[int, float]]:
        """A one-row pass at ``context`` and each timed row count's price in one-row passes
        (kept until the next timing: the policy prices many row counts at one context)."""
        groups = self._groups()  # a new dict at each timing
        cached = self._curve
        if cached is not None and cached[0] is groups and cached[1] == context:
            return cached[2]
        ratios = {1: 1.0}
        for r, points in groups["verify"].items():
            if r > 1:
                ratios[r] = along_context(
                    [(c, ms / self._one_row(groups, c, False)) for c, ms in points], context)
        curve = (self._one_row(groups, context, False), ratios)
        self._curve = (groups, context, curve)
        return curve

    def learned_draft(self, rows: int, context: int = 256) -> float:
        """A drafter block pass of ``rows`` rows after ``context`` tokens as learnt (0 for no
        drafting); one not yet timed is priced like a target pass over as many rows."""
        if rows <= 1:
            return 0.0
        points = {r: along_context(pts, context) for r, pts in self._groups()["draft"].items()}
        if not points:
            return self.learned_verify(rows, context)
        if len(points) == 1:  # one block length timed: proportional to rows beyond it
            (r, ms), = points.items()
            return ms if rows <= r else ms * rows / r
        return max(0.0, along_rows(points, rows, 0.0))

    # -- pricing ------------------------------------------------------------------------------

    def verify(self, rows: int, context: int = 256) -> float:
        """Milliseconds of one target pass over ``rows`` tokens after ``context`` cached ones."""
        if self.calibrated is not None:
            return self.calibrated.verify(rows, context)
        return self.learned_verify(rows, context)

    def step(self, context: int = 256, pipelined: bool = True) -> float:
        """Milliseconds of one plain one-token step: pipelined (greedy decoding) or a lone pass."""
        if self.calibrated is not None:
            return self.calibrated.step(context, pipelined)
        return self.learned_step(context, pipelined)

    def draft(self, rows: int, context: int = 256) -> float:
        """Milliseconds of one drafter block pass of ``rows`` rows after ``context`` tokens (0
        for no drafting)."""
        if self.calibrated is not None:
            return self.calibrated.draft(rows, context)
        return self.learned_draft(rows, context)

    @property
    def rows(self) -> list[int]:
        """The verify row counts the prices cover (a tree budget's range)."""
        return list(self.calibrated.rows) if self.calibrated is not None else list(ROWS)

    def source(self) -> str:
        """``calibrated`` or ``learnt``: what the prices come from."""
        return "calibrated" if self.calibrated is not None else "learnt"

    def timed(self, kind: str) -> dict[int, int]:
        """``{rows: timings}`` of the passes of ``kind`` learnt from (all contexts)."""
        with self._lock:
            out: dict[int, int] = {}
            for (k, rows, _), group in self.samples.items():
                if k == kind:
                    out[rows] = out.get(rows, 0) + len(group)
            return dict(sorted(out.items()))

    # -- storing ------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        with self._lock:
            return {"format": LEARNED_FORMAT, "key": self.key, "machine": self.machine,
                    "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "samples": [[kind, rows, bucket, [list(s) for s in group]]
                                for (kind, rows, bucket), group in sorted(self.samples.items())]}

    def load_samples(self, data: dict) -> None:
        """Start from stored timings (a dict written by :meth:`to_dict`)."""
        with self._lock:
            for kind, rows, bucket, group in data["samples"]:
                if kind in KINDS:
                    self.samples[(kind, int(rows), int(bucket))] = deque(
                        ((int(c), float(ms)) for c, ms in group), maxlen=RECENT)
            self._version += 1

    def flush(self) -> None:
        """Store what was learnt since the last time (atomically; an unwritable folder is said
        once and the costs stay in memory)."""
        with self._lock:
            if not self._dirty or self.path is None:
                return
            self._dirty, self._saved_at = False, time.monotonic()
        try:
            write_atomic(self.path, json.dumps(self.to_dict()) + "\n", durable=False)
        except OSError as e:
            say_once("unwritable", f"cannot save the learnt pass costs in {self.path.parent} "
                      f"({e}); keeping them in memory for this process")

    def unlearnt(self) -> PassCosts:
        """This pair's prices without what was learnt: the stored calibration, else the prior, in
        an object of its own that nothing observes. Plans priced with it never depend on a
        timing of this process (seeded sampling reproduces)."""
        return PassCosts(self.key, self.machine, calibrated=self.calibrated)

    @classmethod
    def stored(cls, key: str) -> PassCosts:
        """This pair's costs as stored on this machine: its calibration, if any, and what earlier
        processes learnt (each ignored, said once, when corrupt, stale or foreign)."""
        machine = machine_id()
        path = learned_file(key)
        costs = cls(key, machine, path=path, calibrated=_read(calibration_file(key), key))
        if not path.is_file():
            return costs
        try:
            data = json.loads(path.read_text())
            if data.get("format") != LEARNED_FORMAT or data.get("key") != key:
                raise CostModelError("not the learnt costs of this pair")
            age_days = (time.time() - os.path.getmtime(path)) / 86400
            if age_days > MAX_AGE_DAYS or data.get("machine") != machine:
                say_once(f"{path}:foreign", f"learnt pass costs {path} are from another machine, MLX "
                          "version or month; learning afresh")
                return costs
            costs.load_samples(data)
        except (ValueError, TypeError, KeyError, OSError) as e:
            say_once(f"{path}:unreadable", f"learnt pass costs {path} are unreadable ({e}); learning afresh")
        return costs


def machine_id() -> dict:
    """What makes timings differ between machines (not the hostname: a rebuilt machine of the
    same kind measures the same), with the backend set up as the loaders set it up."""
    from . import backend

    backend.configure()
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), "")
    except OSError:
        cpu = platform.processor()
    return {"device": str(mx.default_device()), "mlx": mx.__version__,
            "machine": platform.machine(), "system": platform.system(), "cpu": cpu,
            "cores": os.cpu_count(), "blas": backend.blas_status}


def cost_key(parts, draft, kv=None) -> str:
    """A hash of the shapes and dtypes that decide the cost of a pass (``kv``: a quantized target
    KV cache, :class:`~dflash.target.KVQuantization`, whose passes cost differently)."""
    cfg = draft.config
    desc = {
        "target": type(parts.model).__module__, "layers": parts.num_layers,
        "hidden": parts.hidden_size, "vocab": parts.vocab_size,
        "dtype": str(parts.norm.weight.dtype),
        "quantized": bool(hasattr(parts.embed_tokens, "scales")),
        "draft_layers": len(draft.layers), "draft_hidden": cfg.hidden_size,
        "draft_vocab": len(cfg.draft_vocab_ids) if cfg.draft_vocab_ids else cfg.vocab_size,
        "draft_dtype": str(draft.norm.weight.dtype),
    }
    if kv is not None:
        desc["kv"] = [kv.bits, kv.group_size]
    from .distributed import shard_count

    ranks = shard_count(parts)  # a sharded target's passes cost per rank count
    if ranks > 1:
        desc["ranks"] = ranks
    if getattr(parts, "stage", None) is not None:  # split by layers: passes cost otherwise
        desc["split"] = "layers"
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]


def _fastest_ms(fns: list, rounds: int) -> list[float]:
    """The fastest of ``rounds`` timings of each function, measured round-robin.

    The minimum is what a pass costs when nothing else competes for the machine; taking the
    shapes in turn spreads any contention over all of them instead of skewing a few.
    """
    for fn in fns:
        fn()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], 1000 * (time.perf_counter() - t))
    return best


def _monotone(values: list[float]) -> list[float]:
    """More rows never cost less: the running maximum smooths timing noise."""
    out, top = [], 0.0
    for v in values:
        top = max(top, v)
        out.append(top)
    return out


def _snapshot(cache: list) -> list:
    """What :func:`_restore` needs: recurrent (GatedDeltaNet) states cannot trim, keep their arrays."""
    return [list(c.cache) if isinstance(c, ArraysCache) else None for c in cache]


def _restore(cache: list, saved: list, n: int) -> None:
    """Undo the last ``n`` tokens of a timing pass."""
    for c, state in zip(cache, saved):
        if state is None:
            c.trim(n)
        else:
            c.cache = state


def measure(parts, draft, rows=ROWS, contexts=CONTEXTS, draft_rows=DRAFT_ROWS,
            rounds: int = 3, quiet: bool = False, kv=None) -> CostModel:
    """Time target passes of ``rows`` rows at ``contexts`` and drafter passes of ``draft_rows``
    (``kv``: over a target KV cache quantized from the first token)."""
    from .target import forward, make_cache

    if not quiet:
        log(f"measuring this machine's verify and draft costs ({len(rows) * len(contexts)} "
            "target shapes, once; cached) ...")
    tic = time.perf_counter()
    most = max(rows) + PIPELINED_STEPS
    limit = parts.max_positions  # RoPE scaling counted (dflash.target.max_positions)
    contexts = [c for c in contexts if limit is None or c + most <= limit] or [min(contexts)]
    verify_ms, step_ms, draft_at = [], [], []
    for context in contexts:
        cache = make_cache(parts) if kv is None else make_cache(parts, kv, switch_at=0)
        prompt = (mx.arange(context) % max(2, parts.vocab_size - 1))[None] + 1
        logits, taps = forward(parts, prompt, cache, draft.target_layer_ids)
        mx.eval(logits, [c.state for c in cache])
        passes = []
        for r in rows:
            tokens = (mx.arange(r) % max(2, parts.vocab_size - 1))[None] + 1

            def verify(tokens=tokens, r=r, cache=cache):
                saved = _snapshot(cache)
                out, _ = forward(parts, tokens, cache, draft.target_layer_ids)
                mx.eval(out)
                _restore(cache, saved, r)

            passes.append(verify)

        def plain_steps(cache=cache, n=PIPELINED_STEPS):
            saved = _snapshot(cache)
            token = mx.array([[1]])
            for i in range(n):
                logits, _ = forward(parts, token, cache, draft.target_layer_ids)
                lazy = mx.argmax(logits[:, -1:], axis=-1)
                mx.async_eval(lazy)
                if i:  # read the previous token while this pass runs
                    token.item()
                token = lazy
            token.item()
            _restore(cache, saved, n)

        *timed, plain = _fastest_ms(passes + [plain_steps], rounds)
        verify_ms.append(_monotone(timed))
        step_ms.append(plain / PIPELINED_STEPS)
        dcache = draft.make_cache()
        draft.append_context(taps, dcache)
        mx.eval([c.state for c in dcache])
        # The pass the engines run: scores over the draft vocabulary (block_logits'
        # full-vocabulary rows of -inf are read by neither engine; with the built-in drafter
        # they cost 10-20 % more).
        draft_at.append(_monotone(_fastest_ms(
            [lambda n=n, d=dcache: mx.eval(draft.block_scores(parts, 1, n, d)[0])
             for n in draft_rows], rounds)))
    model = CostModel(key=cost_key(parts, draft, kv), machine=machine_id(), rows=list(rows),
                      contexts=list(contexts), verify_ms=verify_ms, draft_rows=list(draft_rows),
                      draft_ms=draft_at[0], measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
                      step_ms=step_ms, draft_ms_at=draft_at)
    if not quiet:
        log(f"measured in {time.perf_counter() - tic:.1f} s: verify 1 row "
            f"{model.verify(1):.1f} ms (pipelined step {model.step():.1f} ms), 16 rows "
            f"{model.verify(16):.1f} ms; draft 16 rows "
            f"{model.draft(16):.1f} ms")
    return model


def calibration_dir() -> Path:
    from .default_pair import cache_dir

    return cache_dir() / "calibration"


def calibration_file(key: str) -> Path:
    """Where the cost model of the pair with this :func:`cost_key` is cached."""
    return calibration_dir() / f"{key}.json"


def learned_file(key: str) -> Path:
    """Where the costs learnt while decoding with the pair of this :func:`cost_key` are stored."""
    return calibration_dir() / f"{key}.learned.json"


def to_json(model: CostModel) -> str:
    return json.dumps(asdict(model), indent=1) + "\n"


def _read(path: Path, key: str) -> CostModel | None:
    """The cached model, or ``None`` (and why, once) when it is missing, corrupt or foreign."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        model = CostModel(**data)
        if model.format != FORMAT:
            raise CostModelError(f"format {model.format!r}, this dflash writes {FORMAT!r}")
        if model.key != key or len(model.verify_ms) != len(model.contexts):
            raise CostModelError("not a cost model for this pair")
    except (ValueError, TypeError, OSError) as e:
        say_once(str(path), f"calibration {path} is unreadable ({e}); ignoring it")
        return None
    age_days = (time.time() - os.path.getmtime(path)) / 86400
    if age_days > MAX_AGE_DAYS:
        say_once(str(path), f"calibration {path} is {age_days:.0f} days old; ignoring it")
        return None
    if model.machine != machine_id():
        say_once(str(path), f"calibration {path} was measured on another machine or MLX "
                  "version; ignoring it")
        return None
    return model


def calibrate(parts, draft, refresh: bool = False, quiet: bool = False, kv=None) -> CostModel:
    """The measured cost table of this (target, drafter) on this machine (``dflash calibrate``):
    the stored one, or measured now and stored; from now on it is what the policy prices with
    (``kv``: for generations with that quantized target KV cache, which have their own)."""
    key = cost_key(parts, draft, kv)
    path = calibration_file(key)
    model = None if refresh else _read(path, key)
    if model is None:
        model = measure(parts, draft, quiet=quiet, kv=kv)
        try:
            write_atomic(path, to_json(model))
        except OSError as e:
            say_once("unwritable", f"cannot save the calibration in {path.parent} ({e}); "
                      "keeping it in memory for this process")
    costs = cost_model(parts, draft, kv)
    costs.calibrated = model
    return model


def cost_model(parts, draft, kv=None) -> PassCosts:
    """The pass costs of this (target, drafter) on this machine, at once: the stored calibration
    when there is one, else what decoding has learnt (from the stored learnt costs, or from the
    prior). One object per pair, KV cache kind (``kv``) and process; it never measures anything
    itself."""
    key = cost_key(parts, draft, kv)
    with _lock:
        costs = _memory.get(key)
        if costs is None:
            costs = PassCosts.stored(key)
            _memory[key] = costs
        return costs


def fresh_cost_model(parts, draft, calibrated: bool = False,
                     path: Path | None = None) -> PassCosts:
    """Replace this pair's pass costs by ones that start from the prior (``calibrated``: with the
    stored calibration, if any) and return them; ``path``: where they are stored (None: nowhere).
    What ``dflash calibrate --compare-learned`` starts from."""
    key = cost_key(parts, draft)
    costs = PassCosts(key, machine_id(), path=path)
    if calibrated:
        costs.calibrated = _read(calibration_file(key), key)
    with _lock:
        _memory[key] = costs
    return costs


def flush_all() -> None:
    """Store what every pair's costs learnt since they were last stored."""
    with _lock:
        costs = list(_memory.values())
    for c in costs:
        c.flush()


# ---------------------------------------------------------------------------------------------
# The table and the plot of ``dflash calibrate``


def format_table(model: CostModel) -> str:
    """The measured costs as text: each verify row count's milliseconds and its cost in one-token
    steps at each measured context, then the drafter's milliseconds per block length."""
    cols = [f"{name}@{c}" for c in model.contexts for name in ("ms", "x_step")]
    lines = ["verify: one target pass over ROWS new tokens after CONTEXT cached ones "
             "(x_step: in one-token steps at that context)",
             "rows " + "".join(f"{c:>13}" for c in cols)]
    for row in model.table():
        values = [row[f"{name}@{c}"] for c in model.contexts
                  for name in ("verify_ms", "x_step")]
        lines.append(f"{row['rows']:>4} " + "".join(f"{v:>13.2f}" for v in values))
    if model.step_ms:
        lines += ["", "plain step, pipelined as greedy decoding takes it: " + ", ".join(
            f"{ms:.2f} ms @{c} ({ms / model.verify(1, c):.2f} of a lone 1-row pass)"
            for c, ms in zip(model.contexts, model.step_ms))]
    lines += ["", "draft: one drafter block pass (ms after CONTEXT tokens)",
              "block_rows" + "".join(f"{'@' + str(c):>12}" for c in model.contexts)]
    lines += [f"{n:>10}" + "".join(f"{model.draft(n, c):>12.2f}" for c in model.contexts)
              for n in model.draft_rows]
    return "\n".join(lines)


def learnt_table(learned: PassCosts) -> list[dict]:
    """Each pass shape decoding timed, at the context it was mostly timed at: the price the
    policy takes from what was learnt (``learnt_ms``), the low quantile of its own timings
    (``timed_ms``) and how many timings that rests on."""
    out = []
    groups = learned._groups()
    for kind in KINDS:
        for rows, points in sorted(groups[kind].items()):
            for context, ms in sorted(points):
                n = sum(len(g) for (k, r, b), g in list(learned.samples.items())
                        if k == kind and r == rows and (kind == "draft" or
                                                        b == context_bucket(context)))
                price = learned.learned_verify(rows, context) if kind == "verify" else \
                    learned.learned_step(context) if kind == "step" else \
                    learned.learned_draft(rows)
                out.append({"kind": kind, "rows": rows, "context": context, "timings": n,
                            "learnt_ms": round(price, 3), "timed_ms": round(ms, 3)})
    return out


def compare_learned(learned: PassCosts, calibrated: CostModel) -> list[dict]:
    """:func:`learnt_table` with the calibration's price of each shape and the ratio."""
    out = []
    for row in learnt_table(learned):
        kind, rows, context = row["kind"], row["rows"], row["context"]
        ref = calibrated.verify(rows, context) if kind == "verify" else \
            calibrated.step(context) if kind == "step" else calibrated.draft(rows)
        out.append(row | {"calibrated_ms": round(ref, 3),
                          "ratio": round(row["learnt_ms"] / ref, 3) if ref > 0 else None})
    return out


def describe(costs: PassCosts) -> str:
    """One line: what the policy prices with, and (with a calibration) how the learnt prices
    compare with it."""
    timings = sum(len(g) for g in list(costs.samples.values()))
    if costs.calibrated is None:
        return (f"pass costs: learnt from {timings} timings of this machine's passes" if timings
                else "pass costs: the prior (no pass timed yet on this machine)")
    line = f"pass costs: dflash calibrate's of {costs.calibrated.measured_at}"
    ratios = [r["ratio"] for r in compare_learned(costs, costs.calibrated) if r["ratio"]]
    if ratios:
        line += (f"; learnt from {timings} timings alongside: {len(ratios)} shapes at "
                 f"{min(ratios):.2f}-{max(ratios):.2f}x the calibration")
    return line


def report(costs: PassCosts) -> dict:
    """What a benchmark records about the pass costs it ran with."""
    return {"source": costs.source(), "describe": describe(costs),
            "learnt": learnt_table(costs),
            "compare": None if costs.calibrated is None else
            compare_learned(costs, costs.calibrated)}


def format_comparison(rows: list[dict], tolerance: float = 0.15) -> str:
    """:func:`compare_learned` as a table; ``ok`` marks prices within ``tolerance``."""
    lines = [f"{'pass':>7} {'rows':>5} {'context':>8} {'timings':>8} {'timed ms':>9} "
             f"{'learnt ms':>10} {'calibrated ms':>14} {'ratio':>6}"]
    for r in rows:
        ok = r["ratio"] is not None and abs(r["ratio"] - 1) <= tolerance
        lines.append(f"{r['kind']:>7} {r['rows']:>5} {r['context']:>8} {r['timings']:>8} "
                     f"{r.get('timed_ms', r['learnt_ms']):>9.2f} "
                     f"{r['learnt_ms']:>10.2f} {r['calibrated_ms']:>14.2f} "
                     f"{r['ratio'] if r['ratio'] is not None else float('nan'):>6.2f}"
                     f"{'' if ok else '  (off by more than ' + f'{tolerance:.0%})'}")
    return "\n".join(lines)


def write_calibration(model: CostModel, out: str | Path) -> dict[str, Path]:
    """``calibration.json`` and ``calibration.png`` (verify cost against rows) in ``out``.

    Raises :class:`~dflash.errors.MissingDependencyError` (after writing the JSON) when matplotlib
    is missing.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "calibration.json"}
    files["json"].write_text(to_json(model))
    try:
        import matplotlib
    except ImportError:
        raise missing_extra("bench", f"wrote {files['json']} only; the plot needs "
                            "matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ms_ax, step_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for c, row_ms in zip(model.contexts, model.verify_ms):
        ms_ax.plot(model.rows, row_ms, marker="o", label=f"after {c} tokens")
        step_ax.plot(model.rows, [ms / row_ms[0] for ms in row_ms], marker="o",
                     label=f"after {c} tokens")
    ms_ax.set_ylabel("verify pass (ms)")
    step_ax.set_ylabel("verify pass (one-token steps)")
    for ax in (ms_ax, step_ax):
        ax.set_xlabel("rows verified in one target pass")
        ax.legend()
    fig.suptitle("verify cost against rows on this machine")
    fig.tight_layout()
    files["png"] = out / "calibration.png"
    fig.savefig(files["png"], dpi=120)
    plt.close(fig)
    return files
