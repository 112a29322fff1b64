"""dflash.bound (``dflash bench --bound``): the chain, oracle and batched bounds from acceptance
by position."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash import bound
from dflash.errors import DataSetError

CURVE = {1: 1.0, 2: 1.2, 3: 1.35, 4: 1.5}  # the measured CPU curve, one sequence


def cost(rows: int) -> float:
    """... 8-16 rows 1.7, 24-32 rows 2.7, 64 rows 4.5 (linear past 32)."""
    if rows in CURVE:
        return CURVE[rows]
    return 1.7 if rows <= 16 else 2.7 if rows <= 32 else 2.7 + (rows - 32) * 1.8 / 32


def test_acceptance_is_cycle_weighted():
    prompts = [{"dflash": {"acceptance_by_position": [1.0, 0.5], "cycles": 10}},
               {"dflash": {"acceptance_by_position": [0.0, 0.0], "cycles": 30}}]
    assert bound.acceptance(prompts) == pytest.approx([0.25, 0.125])


def test_a_drafter_that_never_agrees_is_bounded_by_plain_decoding():
    a = np.zeros(15)
    assert bound.chain_bound(a, cost) == (1, 1.0)
    assert bound.oracle_bound(a, cost) == pytest.approx(1.0)
    assert bound.batch_bound(a, cost, cost, cost, 4) == (1, 1.0)


def test_chain_and_oracle_by_hand():
    a = np.array([0.5, 0.25] + [0.0] * 13)
    # chains: 2 rows 1.5/1.2 = 1.25, 3 rows 1.75/1.35 = 1.296, 4 rows 1.75/1.5
    rows, ratio = bound.chain_bound(a, cost)
    assert rows == 3 and ratio == pytest.approx(1.75 / 1.35)
    # oracle: L = 0, 1, 2 with 0.5, 0.25, 0.25 -> E[L+1] 1.75 over E[cost] 0.5 + 0.3 + 0.3375
    assert bound.oracle_bound(a, cost) == pytest.approx(1.75 / (0.5 + 0.25 * 1.2 + 0.25 * 1.35))
    assert bound.oracle_bound(a, cost) > ratio  # knowing the outcome never loses


def test_batches_pay_for_every_sequence_s_rows():
    a = np.array([0.5, 0.25] + [0.0] * 13)
    free = lambda rows: 0.0  # noqa: E731
    rows, ratio = bound.batch_bound(a, cost, cost, free, 4)
    # 4 x 3 rows = 12 rows (1.7) for 1.75 tokens each against 4 rows (1.5) for 1 each
    assert rows == 3 and ratio == pytest.approx(1.75 * 1.5 / 1.7)
    assert bound.batch_bound(a, cost, cost, free, 16)[0] == 1  # plain batching wins


def bench_json(policy="fixed", min_confidence=0.0) -> dict:
    run = lambda acc, cycles: {"acceptance_by_position": acc, "cycles": cycles}  # noqa: E731
    return {"config": {"policy": policy, "min_confidence": min_confidence},
            "runs": [{"block_size": 3, "prompts": [
                {"id": "gsm8k-0", "dflash": run([0.5, 0.25], 10)},
                {"id": "HumanEval/1", "dflash": run([0.0, 0.0], 10)}]}]}


def test_the_report_has_a_row_per_domain_and_all(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench_json()))
    table = bound.format_bound(bound.read_whole_block_run(path), "bench.json", cost,
                               lambda rows: 0.0, 20.0, clients=(1, 4))
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| domain")}
    assert set(rows) == {"gsm8k", "code", "all"}  # no chat prompt: no chat row
    assert "1.30× (3 rows)" in rows["gsm8k"]  # 1.75 / 1.35, as by hand above
    assert "1.00× (1 rows)" in rows["code"] and "4 clients (r)" in table


@pytest.mark.parametrize("config", [dict(policy="auto"), dict(min_confidence=0.3)])
def test_a_run_that_did_not_verify_whole_blocks_is_refused(tmp_path, config):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench_json(**config)))
    with pytest.raises(DataSetError, match="not a whole-block run"):
        bound.read_whole_block_run(path)


def test_the_command_refuses_a_run_that_was_not_whole_block(tmp_path, capsys):
    from dflash import cli

    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench_json(policy="auto")))
    assert cli.main(["bench", "--bound", str(path)]) == 1
    err = capsys.readouterr().err
    assert "config.policy 'auto'" in err and "Traceback" not in err


@pytest.mark.slow
def test_the_bound_of_a_real_whole_block_run(tiny_pair, tmp_path):
    import subprocess
    import sys

    target, draft = tiny_pair("llama")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in [
        ("gsm8k-0", "The sea is"), ("HumanEval/0", "def add(a, b):")]))
    models = ["--model", str(target), "--draft", str(draft)]

    def run(*args):
        return subprocess.run([sys.executable, "-m", "dflash", "bench", *models, *args],
                              capture_output=True, text=True, timeout=600)

    p = run("--prompts", str(prompts), "--policy", "fixed", "--min-confidence", "0",
            "--block-size", "4", "--max-tokens", "12", "--out", str(tmp_path / "whole"))
    assert p.returncode == 0, p.stderr
    p = run("--bound", str(tmp_path / "whole" / "bench.json"))
    assert p.returncode == 0, p.stderr
    rows = [line.split("|")[1].strip() for line in p.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| domain")]
    assert rows == ["gsm8k", "code", "all"]
