"""The first run (``scripts/run_default.sh`` after setup: ``scripts/first_run.py``) on the
built-in pair, slow tier: the answer is the correct one, dflash's output is mlx-lm's, and the
speed-up and the verify pass's cost are printed as measured in that run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_first_run_answers_correctly_and_prints_what_it_measured():
    # The work tree's dflash, installed or not (a script's own folder is on its path, not ROOT).
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "first_run.py")], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    # The documented answer (docs/benchmarks.md, "The first run"): type hints, the body kept.
    assert "def is_even(n: int) -> bool:\n    return n % 2 == 0" in out, out
    assert "output identical" in out, out
    speedup = re.search(r"^speed-up (\d+\.\d+)× on this prompt", out, re.M)
    cost = re.search(r"a 16-row verify pass costs (\d+\.\d+) one-token steps", out)
    assert speedup and float(speedup.group(1)) > 0, out
    assert cost and float(cost.group(1)) > 0 and "docs/benchmarks.md" in out, out
