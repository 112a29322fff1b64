"""What a verify pass and a draft pass cost on this machine, measured, cached, never hard-coded.

Speculation pays when the tokens a cycle commits outweigh what the cycle costs relative to a plain
one-token step, and that ratio is a property of the machine, the model and the context length.
Measured on the project's 2-core CPU (built-in target, float32 + OpenBLAS, 256-token context), a
target pass costs, in one-token steps: 1 row 1.0, 2 rows 1.2, 4 rows 1.5, 8-16 rows ~1.7, 24-32
rows ~2.7, 64 rows ~4.5; on Apple GPUs other runtimes verify only 3-5 rows. So the first
generation with a (target, drafter, dtype, device, MLX version) measures:

* ``verify_ms[context][rows]``: one target pass over ``rows`` new tokens after ``context`` cached
  ones, for a few row counts and two context lengths (linear interpolation between them);
* ``step_ms[context]``: one plain one-token step as greedy decoding takes it, each pass queued on
  the previous pass's still-lazy token (mlx-lm's own pipelining). The host builds the next pass's
  graph (~3 ms here) while the device runs this one, so where a pass takes a few ms (GPUs) a
  pipelined step costs clearly less than a lone one-row pass; on this CPU (~60 ms a pass) the two
  measure equal. The policy weighs speculation against the plain steps it would really take;
* ``draft_ms[rows]``: one drafter block pass of ``rows`` rows.

It takes a few seconds (with a progress line): each shape's fastest of three round-robin timings,
made monotone in rows, so that a busy machine does not skew single shapes. It is cached as JSON
under ``$DFLASH_HOME/calibration/``; a file that is corrupt, older than 30 days or measured on
another machine (or MLX version) is measured again (said once); an unwritable folder keeps the model in memory (said once).
``dflash calibrate`` prints the table and a plot.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from .console import log, say_once
from .errors import MissingDependencyError

FORMAT = "dflash-cost/2"
ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
DRAFT_ROWS = (2, 4, 8, 16)
CONTEXTS = (128, 1024)
PIPELINED_STEPS = 8  # plain steps per pipelined timing (the first pass is not hidden)
MAX_AGE_DAYS = 30  # drivers, thermals and background load change: re-measure now and then

_memory: dict[str, CostModel] = {}
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

    def draft(self, rows: int) -> float:
        """Milliseconds of one drafter block pass of ``rows`` rows (0 for no drafting)."""
        return 0.0 if rows <= 1 else max(0.0, _interp(rows, self.draft_rows, self.draft_ms))

    def table(self) -> list[dict]:
        step = {c: self.verify(1, c) for c in self.contexts}
        return [{"rows": r, **{f"verify_ms@{c}": round(self.verify(r, c), 2) for c in self.contexts},
                 **{f"x_step@{c}": round(self.verify(r, c) / step[c], 2) for c in self.contexts}}
                for r in self.rows]


def machine_id() -> dict:
    """What makes timings differ between machines (not the hostname: a rebuilt machine of the
    same kind measures the same)."""
    from . import backend

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), "")
    except OSError:
        cpu = platform.processor()
    return {"device": str(mx.default_device()), "mlx": mx.__version__,
            "machine": platform.machine(), "system": platform.system(), "cpu": cpu,
            "cores": os.cpu_count(), "blas": str(getattr(backend, "blas_status", ""))}


def cost_key(parts, draft) -> str:
    """A hash of the shapes and dtypes that decide the cost of a pass."""
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
            rounds: int = 3, quiet: bool = False) -> CostModel:
    """Time target passes of ``rows`` rows at ``contexts`` and drafter passes of ``draft_rows``."""
    from .target import forward, make_cache

    if not quiet:
        log(f"measuring this machine's verify and draft costs ({len(rows) * len(contexts)} "
            "target shapes, once; cached) ...")
    tic = time.perf_counter()
    verify_ms, step_ms = [], []
    for context in contexts:
        cache = make_cache(parts)
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
    # The pass the engines run: scores over the draft vocabulary (block_logits' full-vocabulary
    # rows of -inf are read by neither engine; with the built-in drafter they cost 10-20 % more).
    draft_ms = _monotone(_fastest_ms(
        [lambda n=n: mx.eval(draft.block_scores(parts, 1, n, dcache)[0]) for n in draft_rows],
        rounds))
    model = CostModel(key=cost_key(parts, draft), machine=machine_id(), rows=list(rows),
                      contexts=list(contexts), verify_ms=verify_ms, draft_rows=list(draft_rows),
                      draft_ms=draft_ms, measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
                      step_ms=step_ms)
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
            raise ValueError(f"format {model.format!r}, this dflash writes {FORMAT!r}")
        if model.key != key or len(model.verify_ms) != len(model.contexts):
            raise ValueError("not a cost model for this pair")
    except (ValueError, TypeError, OSError) as e:
        say_once(str(path), f"calibration {path} is unreadable ({e}); measuring again")
        return None
    age_days = (time.time() - os.path.getmtime(path)) / 86400
    if age_days > MAX_AGE_DAYS:
        say_once(str(path), f"calibration {path} is {age_days:.0f} days old; measuring again")
        return None
    if model.machine != machine_id():
        say_once(str(path), f"calibration {path} was measured on another machine or MLX "
                  "version; measuring again")
        return None
    return model


def cost_model(parts, draft, refresh: bool = False, quiet: bool = False) -> CostModel:
    """The cost model of this (target, drafter) on this machine: from memory, from the cache
    folder, or measured now (and saved)."""
    key = cost_key(parts, draft)
    with _lock:
        if not refresh and key in _memory:
            return _memory[key]
        path = calibration_file(key)
        model = None if refresh else _read(path, key)
        if model is None:
            model = measure(parts, draft, quiet=quiet)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(to_json(model))
                os.replace(tmp, path)
            except OSError as e:
                say_once("unwritable", f"cannot save the calibration in {path.parent} ({e}); "
                          "keeping it in memory for this process")
        _memory[key] = model
        return model


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
    lines += ["", "draft: one drafter block pass", "block_rows          ms"]
    lines += [f"{n:>10} {ms:>11.2f}" for n, ms in zip(model.draft_rows, model.draft_ms)]
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
        raise MissingDependencyError(
            f"the plot needs matplotlib (pip install 'dflash[bench]'); wrote {files['json']} "
            "only") from None
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
