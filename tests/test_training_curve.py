"""``python -m dflash.training.curve``: the τ-against-CPU-hours table, plot and extrapolation of a
run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash.training import curve

pytest.importorskip("matplotlib")


def write_metrics(path: Path, points, a=0.7, b=0.5) -> None:
    """Training-log records with a held-out τ every few steps, on τ = a + b·ln(pipeline hours)."""
    with path.open("w") as f:
        for i, hours in enumerate(points):
            f.write(json.dumps({"step": 10 * i + 5, "cpu_s": hours * 3600 - 60, "loss": 1.0}) + "\n")
            tau = a + b * math.log(hours + 1.0)  # + the data's 1 CPU-hour
            f.write(json.dumps({"step": 10 * i + 10, "cpu_s": hours * 3600, "tau_b16": tau}) + "\n")


def run(*args, capsys=None):
    """The command in this process: its exit code and what it printed on stderr."""
    try:
        code = curve.main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err if capsys is not None else ""
    return SimpleNamespace(returncode=code, stderr=err)


def test_table_fit_and_plot(tmp_path):
    metrics = tmp_path / "run" / "train" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    write_metrics(metrics, [0.6, 1.0, 2.0, 4.0, 8.0])
    out = run(metrics, "--data-cpu-hours", 1.0, "--reference-tau", 1.5, "--reference-cpu-hours",
              9, "--out", tmp_path / "docs" / "curve")
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "docs" / "curve.md").read_text()
    rows = [r for r in md.splitlines() if r.startswith("| ") and r[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["10", "20", "30", "40", "50"]
    assert "| 20 | 1.00 | 2.00 | 1.047 |" in md  # 0.7 + 0.5 ln 2
    # The fit recovers the curve, and the targets are where it crosses them.
    assert "τ ≈ 0.700 + 0.500·ln(CPU-h)" in md
    assert f"- τ 3.0: ~{math.exp(2.3 / 0.5):,.1f} CPU-h" in md
    # τ 1.505 at 4 + 1 pipeline hours is the first at or above the reference 1.5: 9 / 5 = 1.8
    assert "first reached it at 5.00 CPU-h (1.8× less)" in md
    assert (tmp_path / "docs" / "curve.png").stat().st_size > 1000
    # reached later than the old pipeline: said as a ratio above 1, not "0.9× less"
    out = run(metrics, "--data-cpu-hours", 1.0, "--reference-tau", 1.5, "--reference-cpu-hours",
              4, "--out", tmp_path / "docs" / "late")
    assert "first reached it at 5.00 CPU-h (1.25× the reference's lower bound)" in \
        (tmp_path / "docs" / "late.md").read_text()


def test_per_domain_columns(tmp_path):
    """Records with ``tau_b16_<domain>`` (held-out prompts of several domains) get a column each;
    a domain a record lacks shows a dash; the fit stays on ``tau_b16``."""
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": 10, "cpu_s": 3600, "tau_b16": 1.5, "tau_b16_gsm8k": 1.8},
               {"step": 20, "cpu_s": 7200, "tau_b16": 1.6, "tau_b16_gsm8k": 1.9,
                "tau_b16_chat": 1.25}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = run(metrics, "--out", tmp_path / "curve")
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "curve.md").read_text()
    assert "| step | training CPU-h | pipeline CPU-h | held-out τ | gsm8k | chat |" in md
    assert "| 10 | 1.00 | 1.00 | 1.500 | 1.800 | – |" in md
    assert "| 20 | 2.00 | 2.00 | 1.600 | 1.900 | 1.250 |" in md


@pytest.mark.parametrize("content, message", [
    ('{"step": 1, "cpu_s": 3}\n', "no record with 'tau_b16'"),
    ('{"step": 1, "cpu_s": 3}\nnot json\n', "metrics.jsonl:2: not JSON"),
])
def test_a_log_without_evaluations_is_refused_by_line(tmp_path, content, message, capsys):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(content)
    out = run(metrics, "--out", tmp_path / "curve", capsys=capsys)
    assert out.returncode != 0 and message in out.stderr
    assert not (tmp_path / "curve.md").exists()


def test_an_earlier_run_drawn_beside(tmp_path):
    """--compare: another run's evaluations (e.g. a run lost with its machine, kept as a small
    JSONL) on the same axes, and its τ every 1,000 steps and at its last evaluation in the table."""
    metrics, earlier = tmp_path / "metrics.jsonl", tmp_path / "final-v2-evaluations.jsonl"
    write_metrics(metrics, [0.6, 1.0, 2.0])
    earlier.write_text("".join(json.dumps({"step": s, "cpu_s": s * 7.2, "tau_b16": 1 + s / 1e4})
                               + "\n" for s in (500, 1000, 1500, 2000, 2250)))
    out = run(metrics, "--compare", earlier, "--compare-data-cpu-hours", 2.7,
              "--out", tmp_path / "curve")
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "curve.md").read_text()
    assert (f"Beside `{earlier}` (data 2.70 CPU-h): step 1000 τ 1.100 at 2.00 training CPU-h; "
            "step 2000 τ 1.200 at 4.00 training CPU-h; step 2250 τ 1.225 at 4.50 training "
            "CPU-h.") in md
    assert "step 500 " not in md
    assert (tmp_path / "curve.png").stat().st_size > 1000


def test_arms_compared_at_equal_cpu(tmp_path, capsys):
    """--arm: each arm's τ gained per CPU-hour over the window and its τ projected at the budget
    from its own log fit; a fresh arm starts at τ 1, a continued one at its step-0 evaluation."""
    def arm(path: Path, hours, tau) -> Path:
        with path.open("w") as f:
            for i, h in enumerate(hours):
                f.write(json.dumps({"step": 50 * i, "cpu_s": h * 3600, "tau_b16": tau(h),
                                    "tau_b16_math": tau(h) + 0.5}) + "\n")
        return path

    fresh = arm(tmp_path / "fresh.jsonl", [0.5, 1.0, 2.0, 3.0], lambda h: 0.9 + 0.2 * math.log(h))
    cont = arm(tmp_path / "cont.jsonl", [0.0, 0.5, 1.0, 2.0, 3.0],
               lambda h: 1.0 + 0.5 * math.log(10 + h))
    out = run("--arm", f"fresh={fresh}", "--arm", f"continue={cont}@10", "--budget-hours", 15,
              "--window-hours", 2, "--out", tmp_path / "arms", capsys=capsys)
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "arms.md").read_text()
    gain_fresh = (0.9 + 0.2 * math.log(2.0) - 1.0) / 2
    assert (f"| fresh | 1.000 | {0.9 + 0.2 * math.log(2):.3f} (at 2.00) | {gain_fresh:+.3f} | "
            f"0.900 + 0.200·ln(0 + h) | {0.9 + 0.2 * math.log(15):.2f} |") in md
    start, at_2 = 1.0 + 0.5 * math.log(10), 1.0 + 0.5 * math.log(12)
    assert (f"| continue | {start:.3f} | {at_2:.3f} (at 2.00) | {(at_2 - start) / 2:+.3f} | "
            f"1.000 + 0.500·ln(10 + h) | {1.0 + 0.5 * math.log(25):.2f} |") in md
    assert f"| fresh | 100 | 2.00 | {0.9 + 0.2 * math.log(2):.3f} | " \
           f"{0.9 + 0.2 * math.log(2) + 0.5:.3f} |" in md  # the per-domain column
    assert (tmp_path / "arms.png").stat().st_size > 1000


@pytest.mark.parametrize("text, message", [
    ("fresh", "expected NAME=METRICS"), ("fresh=x.jsonl@soon", "'soon' is not a number"),
])
def test_a_bad_arm_is_named(tmp_path, capsys, text, message):
    out = run("--arm", text, "--out", tmp_path / "arms", capsys=capsys)
    assert out.returncode == 1 and message in out.stderr
    assert not (tmp_path / "arms.md").exists()
