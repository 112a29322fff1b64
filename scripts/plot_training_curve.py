"""Held-out τ against CPU-hours of a long training run (issue 11): the plot, the table and the
extrapolation, from the run's own ``metrics.jsonl``.

``dflash train --eval-every N --eval-prompts ...`` writes, every N steps, the held-out τ through the
engine (``tau_b16``) beside ``cpu_s`` — the process's CPU time, carried across ``--resume``. The
data's CPU cost (datagen, magpie) is added as a fixed offset (``--data-cpu-hours``) so the x axis is
the whole pipeline's CPU time, which is what the issue's efficiency target compares: the new
pipeline should reach the old built-in drafter's held-out math τ (``--reference-tau``, 1.95) in a
third of the CPU-hours the old one took (``--reference-cpu-hours``).

The extrapolation fits τ = a + b·ln(CPU-hours) to the evaluations after the first
``--fit-from-hours`` hours (τ against log-compute is close to a line in this regime for small
drafters; it is a guide for how many more hours to spend, not a promise) and prints where it
crosses each target.

    python scripts/plot_training_curve.py $DFLASH_HOME/runs/final-v4/train/metrics.jsonl \\
        --data-cpu-hours 3.4 --compare docs/bench/final-v2-evaluations.jsonl \\
        --compare-data-cpu-hours 2.7 --out docs/bench/tau-vs-cpu
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def load_evaluations(path: Path, key: str) -> list[tuple[float, int, float, dict[str, float]]]:
    """(CPU-hours of training, step, τ, τ by domain) of every record that carries the held-out τ
    ``key`` (``dflash train`` writes ``KEY_<domain>`` beside it when the prompts span domains)."""
    points = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{n}: not JSON ({e})") from None
        if key in rec and "cpu_s" in rec:
            domains = {k[len(key) + 1:]: float(v) for k, v in rec.items()
                       if k.startswith(key + "_")}
            points.append((rec["cpu_s"] / 3600.0, rec["step"], float(rec[key]), domains))
    return points


def fit_log(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares τ = a + b·ln(h); None with fewer than 3 points."""
    pts = [(math.log(h), t) for h, t in points if h > 0]
    if len(pts) < 3:
        return None
    n = len(pts)
    mx_ = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx_) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    b = sum((x - mx_) * (y - my) for x, y in pts) / sxx
    return my - b * mx_, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics", type=Path, help="the run's train/metrics.jsonl")
    ap.add_argument("--key", default="tau_b16", help="the held-out τ field (default tau_b16)")
    ap.add_argument("--data-cpu-hours", type=float, default=0.0,
                    help="CPU-hours spent making the run's data, added to every point")
    ap.add_argument("--reference-tau", type=float, default=1.95,
                    help="the old built-in drafter's held-out math τ")
    ap.add_argument("--reference-cpu-hours", type=float, default=8.5,
                    help="the CPU-hours the old pipeline took to reach it (lower bound)")
    ap.add_argument("--targets", default="2.0,2.5,3.0", help="τ values to extrapolate to")
    ap.add_argument("--fit-from-hours", type=float, default=0.5,
                    help="fit only the evaluations after this many training CPU-hours")
    ap.add_argument("--compare", type=Path, default=None,
                    help="another run's metrics.jsonl, drawn beside this one (e.g. an earlier run)")
    ap.add_argument("--compare-data-cpu-hours", type=float, default=0.0,
                    help="the data CPU-hours of the --compare run")
    ap.add_argument("--out", type=Path, required=True, help="output stem: STEM.png and STEM.md")
    a = ap.parse_args()

    evals = load_evaluations(a.metrics, a.key)
    other = load_evaluations(a.compare, a.key) if a.compare else []
    if not evals:
        raise SystemExit(f"{a.metrics}: no record with {a.key!r} and cpu_s (is --eval-every set?)")
    xs = [h + a.data_cpu_hours for h, *_ in evals]
    taus = [t for _, _, t, _ in evals]
    domains = list(dict.fromkeys(d for *_, by in evals for d in by))
    fit = fit_log([(h + a.data_cpu_hours, t) for h, _, t, _ in evals if h >= a.fit_from_hours])

    lines = [f"# Held-out τ against CPU-hours ({a.metrics.parent.parent.name or a.metrics.stem})", "",
             f"`python scripts/plot_training_curve.py {a.metrics} --data-cpu-hours "
             f"{a.data_cpu_hours}"
             + (f" --compare {a.compare} --compare-data-cpu-hours {a.compare_data_cpu_hours}"
                if a.compare else "")
             + f" --out {a.out}`", "",
             f"CPU-hours = the data's {a.data_cpu_hours:.2f} CPU-h (datagen, magpie) + the "
             "training process's CPU time (`cpu_s`, carried across `--resume`). τ: held-out "
             f"`{a.key}` through the engine, greedy, whole blocks verified.", "",
             "| step | training CPU-h | pipeline CPU-h | held-out τ |"
             + "".join(f" {d} |" for d in domains), "|---:|---:|---:|---:|" + "---:|" * len(domains)]
    lines += [f"| {s} | {h:.2f} | {h + a.data_cpu_hours:.2f} | {t:.3f} |"
              + "".join(f" {by[d]:.3f} |" if d in by else " – |" for d in domains)
              for h, s, t, by in evals]
    first = next((x for x, t in zip(xs, taus) if t >= a.reference_tau), None)
    lines += ["", f"Old pipeline: τ {a.reference_tau} after ≥ {a.reference_cpu_hours} CPU-h. "
              + (f"This run first reached it at {first:.2f} CPU-h ("
                 + (f"{a.reference_cpu_hours / first:.1f}× less)." if first <= a.reference_cpu_hours
                    else f"{first / a.reference_cpu_hours:.2f}× the old pipeline's lower bound).")
                 if first else
                 f"This run has not reached it yet (best {max(taus):.3f} at "
                 f"{xs[taus.index(max(taus))]:.2f} CPU-h).")]
    if other:
        shown = [p for p in other if p[1] % 1000 == 0]
        if other[-1] not in shown:
            shown.append(other[-1])
        lines += ["", f"Beside `{a.compare}` (data {a.compare_data_cpu_hours:.2f} CPU-h): "
                  + "; ".join(f"step {s} τ {t:.3f} at {h:.2f} training CPU-h"
                              for h, s, t, _ in shown) + "."]
    if fit:
        ca, cb = fit
        lines += ["", f"Fit over the evaluations after {a.fit_from_hours} training CPU-h: "
                  f"τ ≈ {ca:.3f} + {cb:.3f}·ln(CPU-h)."]
        for target in [float(t) for t in a.targets.split(",") if t]:
            if cb <= 0:
                lines.append(f"- τ {target}: not reached (τ is not rising).")
                continue
            hours = math.exp((target - ca) / cb)
            lines.append(f"- τ {target}: ~{hours:,.1f} CPU-h" + (" (beyond any session budget)"
                                                                  if hours > 200 else ""))
    else:
        lines += ["", "Too few evaluations to fit a trend yet."]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    md = a.out.with_suffix(".md")
    md.with_suffix(".tmp").write_text("\n".join(lines) + "\n")
    md.with_suffix(".tmp").replace(md)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot(xs, taus, "o-", label=f"held-out {a.key}")
    for d in domains:
        pts = [(x, by[d]) for x, (*_, by) in zip(xs, evals) if d in by]
        ax.plot([x for x, _ in pts], [t for _, t in pts], ".--", lw=1, label=d)
    if other:
        ax.plot([h + a.compare_data_cpu_hours for h, *_ in other], [t for _, _, t, _ in other],
                "s-", ms=3, color="grey", alpha=0.7, label=f"{a.compare.stem} {a.key}")
    ax.axhline(a.reference_tau, color="grey", ls="--", lw=1,
               label=f"old drafter τ {a.reference_tau} (≥ {a.reference_cpu_hours} CPU-h)")
    if fit:
        ca, cb = fit
        hi = max(xs) * 4
        grid = [min(xs) * (hi / min(xs)) ** (i / 50) for i in range(51)] if min(xs) > 0 else []
        ax.plot(grid, [ca + cb * math.log(g) for g in grid], ":", color="C1",
                label="fit a + b·ln(CPU-h)")
    ax.set_xscale("log")
    ax.set_xlabel("pipeline CPU-hours (data + training)")
    ax.set_ylabel("τ (tokens per cycle)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png = a.out.with_suffix(".png")
    tmp = png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(png)
    print(md.read_text())


if __name__ == "__main__":
    main()
