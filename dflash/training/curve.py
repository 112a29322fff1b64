"""Held-out τ against CPU-hours of a training run: the table, the plot and a log-fit
extrapolation, from the run's own ``metrics.jsonl`` (``python -m dflash.training.curve``).

Why: a drafter's held-out τ grows roughly linearly in the log of the compute spent on it, so the
curve tells whether more CPU on the same data is still worth it, or whether the run has converged
and more data is what is left. ``dflash train --eval-every N --eval-prompts ...`` writes the
held-out τ through the engine (``tau_b16``, and ``tau_b16_<domain>`` when the prompts span
domains) beside ``cpu_s``, the process's CPU time carried across ``--resume``. The data's CPU cost
(datagen, magpie) is added as a fixed offset (``--data-cpu-hours``), so the x axis is the whole
pipeline's CPU time. The fit τ = a + b·ln(CPU-hours) is a guide for how many more hours to spend,
not a promise.

    python -m dflash.training.curve $DFLASH_HOME/runs/final-v4/train/metrics.jsonl \\
        --data-cpu-hours 3.4 --out curve      # writes curve.md and curve.png (needs matplotlib)
    python -m dflash.training.curve --arm fresh=RUN_A/train/metrics.jsonl \\
        --arm continue=RUN_B/train/metrics.jsonl@11.2 --out arms   # arms at equal CPU
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..errors import DataSetError
from ..files import write_atomic

Evaluation = tuple[float, int, float, dict[str, float]]


def load_evaluations(path: str | Path, key: str = "tau_b16") -> list[Evaluation]:
    """``(training CPU-hours, step, τ, τ by domain)`` of every record that carries ``key`` and
    ``cpu_s``; a line that is not JSON raises :class:`DataSetError` naming it."""
    import json

    path = Path(path)
    points = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataSetError(f"{path}:{n}: not JSON ({e.msg})") from None
        if key in rec and "cpu_s" in rec:
            domains = {k[len(key) + 1:]: float(v) for k, v in rec.items()
                       if k.startswith(key + "_")}
            points.append((rec["cpu_s"] / 3600.0, rec["step"], float(rec[key]), domains))
    return points


def fit_log(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares ``τ = a + b·ln(h)`` over ``(hours, τ)``; None with fewer than 3 points."""
    pts = [(math.log(h), t) for h, t in points if h > 0]
    if len(pts) < 3:
        return None
    n = len(pts)
    mean_x = sum(x for x, _ in pts) / n
    mean_y = sum(y for _, y in pts) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    b = sum((x - mean_x) * (y - mean_y) for x, y in pts) / sxx
    return mean_y - b * mean_x, b


def curve_report(evals: list[Evaluation], *, title: str, data_cpu_hours: float = 0.0,
                 key: str = "tau_b16", reference_tau: float | None = None,
                 reference_cpu_hours: float | None = None, targets: tuple[float, ...] = (),
                 fit_from_hours: float = 0.5, compare: list[Evaluation] | None = None,
                 compare_name: str = "", compare_data_cpu_hours: float = 0.0) -> str:
    """The markdown report: one row per evaluation, the reference crossing, the fit."""
    xs = [h + data_cpu_hours for h, *_ in evals]
    taus = [t for _, _, t, _ in evals]
    domains = list(dict.fromkeys(d for *_, by in evals for d in by))
    lines = [f"# Held-out τ against CPU-hours ({title})", "",
             f"CPU-hours = the data's {data_cpu_hours:.2f} CPU-h (datagen, magpie) + the "
             "training process's CPU time (`cpu_s`, carried across `--resume`). τ: held-out "
             f"`{key}` through the engine, greedy, whole blocks verified.", "",
             "| step | training CPU-h | pipeline CPU-h | held-out τ |"
             + "".join(f" {d} |" for d in domains), "|---:|---:|---:|---:|" + "---:|" * len(domains)]
    lines += [f"| {s} | {h:.2f} | {h + data_cpu_hours:.2f} | {t:.3f} |"
              + "".join(f" {by[d]:.3f} |" if d in by else " – |" for d in domains)
              for h, s, t, by in evals]
    if reference_tau is not None and reference_cpu_hours is not None:
        first = next((x for x, t in zip(xs, taus) if t >= reference_tau), None)
        if first is None:
            reached = (f"This run has not reached it yet (best {max(taus):.3f} at "
                       f"{xs[taus.index(max(taus))]:.2f} CPU-h).")
        elif first <= reference_cpu_hours:
            reached = (f"This run first reached it at {first:.2f} CPU-h "
                       f"({reference_cpu_hours / first:.1f}× less).")
        else:
            reached = (f"This run first reached it at {first:.2f} CPU-h "
                       f"({first / reference_cpu_hours:.2f}× the reference's lower bound).")
        lines += ["", f"Reference: τ {reference_tau} after ≥ {reference_cpu_hours} CPU-h. "
                  + reached]
    if compare:
        shown = [p for p in compare if p[1] % 1000 == 0]
        if compare[-1] not in shown:
            shown.append(compare[-1])
        lines += ["", f"Beside `{compare_name}` (data {compare_data_cpu_hours:.2f} CPU-h): "
                  + "; ".join(f"step {s} τ {t:.3f} at {h:.2f} training CPU-h"
                              for h, s, t, _ in shown) + "."]
    fit = fit_log([(h + data_cpu_hours, t) for h, _, t, _ in evals if h >= fit_from_hours])
    if fit is None:
        return "\n".join(lines + ["", "Too few evaluations to fit a trend yet."]) + "\n"
    a, b = fit
    lines += ["", f"Fit over the evaluations after {fit_from_hours} training CPU-h: "
              f"τ ≈ {a:.3f} + {b:.3f}·ln(CPU-h)."]
    for target in targets:
        lines.append(f"- τ {target}: not reached (τ is not rising)." if b <= 0 else
                     f"- τ {target}: ~{math.exp((target - a) / b):,.1f} CPU-h")
    return "\n".join(lines) + "\n"


def plot_curve(evals: list[Evaluation], png: Path, *, data_cpu_hours: float = 0.0,
               key: str = "tau_b16", reference_tau: float | None = None,
               compare: list[Evaluation] | None = None, compare_name: str = "",
               compare_data_cpu_hours: float = 0.0, fit_from_hours: float = 0.5) -> Path:
    """τ against pipeline CPU-hours on a log axis, per domain, with the fit; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [h + data_cpu_hours for h, *_ in evals]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot(xs, [t for _, _, t, _ in evals], "o-", label=f"held-out {key}")
    for d in dict.fromkeys(d for *_, by in evals for d in by):
        pts = [(x, by[d]) for x, (*_, by) in zip(xs, evals) if d in by]
        ax.plot([x for x, _ in pts], [t for _, t in pts], ".--", lw=1, label=d)
    if compare:
        ax.plot([h + compare_data_cpu_hours for h, *_ in compare],
                [t for _, _, t, _ in compare], "s-", ms=3, color="grey", alpha=0.7,
                label=f"{compare_name} {key}")
    if reference_tau is not None:
        ax.axhline(reference_tau, color="grey", ls="--", lw=1, label=f"reference τ {reference_tau}")
    fit = fit_log([(h + data_cpu_hours, t) for h, _, t, _ in evals if h >= fit_from_hours])
    if fit is not None and min(xs) > 0:
        a, b = fit
        lo, hi = min(xs), max(xs) * 4
        grid = [lo * (hi / lo) ** (i / 50) for i in range(51)]
        ax.plot(grid, [a + b * math.log(g) for g in grid], ":", color="C1",
                label="fit a + b·ln(CPU-h)")
    ax.set_xscale("log")
    ax.set_xlabel("pipeline CPU-hours (data + training)")
    ax.set_ylabel("τ (tokens per cycle)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save_figure(fig, png)


def _save_figure(fig, png: Path) -> Path:
    """The figure as a PNG, written whole (:func:`~dflash.files.write_atomic`), then closed."""
    import io

    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomic(png, buf.getvalue())
    return png


Arm = tuple[str, list[Evaluation], float]  # name, evaluations, training CPU-h before its first step


def parse_arm(text: str) -> tuple[str, Path, float]:
    """``NAME=METRICS[@HOURS]``: an arm of a comparison, and the training CPU-hours its drafter
    had before this run (a continued drafter's own training; 0 for a fresh one)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise DataSetError(f"--arm {text!r}: expected NAME=METRICS[@HOURS]")
    path, hours = rest.rsplit("@", 1) if "@" in rest else (rest, "")
    try:
        return name, Path(path), float(hours or 0.0)
    except ValueError:
        raise DataSetError(f"--arm {text!r}: {hours!r} is not a number of hours") from None


def arms_report(arms: list[Arm], *, budget_hours: float, window_hours: float,
                key: str = "tau_b16", fresh_tau: float = 1.0) -> str:
    """Arms compared at equal training CPU: τ (and by domain) at each arm's evaluations, τ gained
    per CPU-hour over the first ``window_hours``, and τ projected at ``budget_hours`` of this
    training from each arm's fit τ = a + b·ln(prior + h). An arm with no step-0 evaluation and no
    prior training starts at ``fresh_tau`` (an untrained drafter's proposals are never accepted:
    each cycle yields the target's own token)."""
    domains = list(dict.fromkeys(d for _, evals, _ in arms for *_, by in evals for d in by))
    lines = [f"# Training arms at equal CPU ({key})", "",
             "Training CPU-h: the run's own (evaluations excluded); prior: what the drafter it "
             "starts from was trained with. τ: held-out, through the engine, greedy, whole "
             "blocks verified.", "",
             "| arm | step | training CPU-h | τ |" + "".join(f" {d} |" for d in domains),
             "|---|---:|---:|---:|" + "---:|" * len(domains)]
    summary = ["", f"| arm | τ at start | τ at {window_hours:g} CPU-h | gained per CPU-h | "
               f"fit τ = a + b·ln(prior + h) | projected τ at {budget_hours:g} CPU-h |",
               "|---|---:|---:|---:|---|---:|"]
    for name, evals, prior in arms:
        lines += [f"| {name} | {s} | {h:.2f} | {t:.3f} |"
                  + "".join(f" {by[d]:.3f} |" if d in by else " – |" for d in domains)
                  for h, s, t, by in evals]
        points = [(h, t) for h, _, t, _ in evals]
        if not any(h == 0 for h, _ in points) and prior == 0:
            points.insert(0, (0.0, fresh_tau))
        start = points[0][1]
        inside = [(h, t) for h, t in points if h <= window_hours]
        end_h, end_t = inside[-1] if inside else points[0]
        gain = (end_t - start) / end_h if end_h > 0 else float("nan")
        fit = fit_log([(prior + h, t) for h, t in points if prior + h > 0])
        if fit is None:
            fitted, projected = "too few evaluations", "–"
        else:
            a, b = fit
            fitted = f"{a:.3f} + {b:.3f}·ln({prior:g} + h)"
            projected = f"{a + b * math.log(prior + budget_hours):.2f}"
        summary.append(f"| {name} | {start:.3f} | {end_t:.3f} (at {end_h:.2f}) | "
                       f"{gain:+.3f} | {fitted} | {projected} |")
    return "\n".join(lines + summary) + "\n"


def plot_arms(arms: list[Arm], png: Path, *, key: str = "tau_b16",
              fresh_tau: float = 1.0) -> Path:
    """τ against the arms' own training CPU-hours, overall and per domain; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = list(dict.fromkeys(d for _, evals, _ in arms for *_, by in evals for d in by))
    fig, axes = plt.subplots(1, 1 + bool(domains), figsize=(11 if domains else 6, 4))
    axes = list(axes) if domains else [axes]
    for i, (name, evals, prior) in enumerate(arms):
        xs = [h for h, *_ in evals]
        ts = [t for _, _, t, _ in evals]
        if not any(h == 0 for h in xs) and prior == 0:
            xs, ts = [0.0] + xs, [fresh_tau] + ts
        axes[0].plot(xs, ts, "o-", color=f"C{i}", label=f"{name} (prior {prior:g} CPU-h)")
        for j, d in enumerate(domains if len(axes) > 1 else []):
            pts = [(h, by[d]) for h, _, _, by in evals if d in by]
            axes[1].plot([h for h, _ in pts], [t for _, t in pts], ".-" if i == 0 else "x--",
                         color=f"C{j}", lw=1, label=f"{name} {d}")
    axes[0].set_title(f"held-out {key}")
    for ax in axes:
        ax.set_xlabel("training CPU-hours of the arm")
        ax.set_ylabel("τ (tokens per cycle)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if len(axes) > 1:
        axes[1].set_title("by domain")
    return _save_figure(fig, png)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash.training.curve",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics", type=Path, nargs="?", help="the run's train/metrics.jsonl")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=METRICS[@HOURS]",
                    help="compare training arms instead (twice or more): each run's "
                         "metrics.jsonl, and the training CPU-hours of the drafter it continues")
    ap.add_argument("--budget-hours", type=float, default=15.0,
                    help="with --arm: training CPU-hours to project each arm's τ at")
    ap.add_argument("--window-hours", type=float, default=2.0,
                    help="with --arm: the first CPU-hours over which τ gained per hour is read")
    ap.add_argument("--key", default="tau_b16", help="the held-out τ field (default tau_b16)")
    ap.add_argument("--data-cpu-hours", type=float, default=0.0,
                    help="CPU-hours spent making the run's data, added to every point")
    ap.add_argument("--reference-tau", type=float, default=None,
                    help="a τ to compare against (e.g. an earlier drafter's)")
    ap.add_argument("--reference-cpu-hours", type=float, default=None,
                    help="the CPU-hours the reference took to reach it")
    ap.add_argument("--targets", default="2.0,2.5,3.0", help="τ values to extrapolate to")
    ap.add_argument("--fit-from-hours", type=float, default=0.5,
                    help="fit only the evaluations after this many training CPU-hours")
    ap.add_argument("--compare", type=Path, default=None,
                    help="another run's metrics.jsonl, drawn beside this one")
    ap.add_argument("--compare-data-cpu-hours", type=float, default=0.0,
                    help="the data CPU-hours of the --compare run")
    ap.add_argument("--out", type=Path, required=True, help="output stem: STEM.md and STEM.png")
    a = ap.parse_args(argv)
    if a.arm:
        return _arms_main(ap, a)
    if a.metrics is None:
        ap.error("a run's metrics.jsonl, or --arm NAME=METRICS twice or more")
    try:
        evals = load_evaluations(a.metrics, a.key)
        other = load_evaluations(a.compare, a.key) if a.compare else []
        if not evals:
            raise DataSetError(f"{a.metrics}: no record with {a.key!r} and cpu_s "
                               "(was --eval-every set?)")
    except DataSetError as e:
        ap.exit(1, f"{ap.prog}: {e}\n")
    common = dict(data_cpu_hours=a.data_cpu_hours, key=a.key, reference_tau=a.reference_tau,
                  compare=other, compare_name=str(a.compare or ""),
                  compare_data_cpu_hours=a.compare_data_cpu_hours,
                  fit_from_hours=a.fit_from_hours)
    text = curve_report(evals, title=a.metrics.parent.parent.name or a.metrics.stem,
                        reference_cpu_hours=a.reference_cpu_hours,
                        targets=tuple(float(t) for t in a.targets.split(",") if t), **common)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    md = a.out.with_suffix(".md")
    write_atomic(md, text)
    plot_curve(evals, a.out.with_suffix(".png"), **common)
    print(text, end="")
    return 0


def _arms_main(ap: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    try:
        arms = []
        for text in a.arm:
            name, path, prior = parse_arm(text)
            evals = load_evaluations(path, a.key)
            if not evals:
                raise DataSetError(f"--arm {name}: {path}: no record with {a.key!r} and cpu_s")
            arms.append((name, evals, prior))
    except DataSetError as e:
        ap.exit(1, f"{ap.prog}: {e}\n")
    text = arms_report(arms, budget_hours=a.budget_hours, window_hours=a.window_hours, key=a.key)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(a.out.with_suffix(".md"), text)
    plot_arms(arms, a.out.with_suffix(".png"), key=a.key)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
