"""The pass costs learnt while decoding (dflash.cost_model.PassCosts), on synthetic timings:
the prior, robustness to busy moments, interpolation across rows and contexts, storage."""

from __future__ import annotations

import json

import pytest

from dflash import console
from dflash import cost_model as costs
from dflash.cost_model import (
    PRIOR_ROW_COST,
    PRIOR_STEP_MS,
    PassCosts,
    along_context,
    along_rows,
    context_bucket,
    low_quantile,
)


def learnt(**kw) -> PassCosts:
    return PassCosts("k", {"cpu": "test"}, **kw)


def feed(c: PassCosts, kind: str, rows: int, context: int, ms: float, n: int = 1) -> None:
    for _ in range(n):
        c.observe(kind, rows, context, ms / 1000)


# ---------------------------------------------------------------------------------------------
# Pure pieces


def test_low_quantile_ignores_busy_moments_not_single_lucky_ones():
    assert low_quantile([5.0]) == 5.0
    timings = [10.0] * 8 + [30.0, 45.0]  # two passes slowed by something else
    assert low_quantile(timings) == 10.0
    assert low_quantile([1.0] + [10.0] * 9) == 10.0  # one lucky timing of ten is not the price


def test_context_buckets_are_powers_of_two():
    assert [context_bucket(c) for c in (0, 1, 2, 3, 4, 127, 128, 255, 256)] == \
        [0, 1, 2, 2, 3, 7, 8, 8, 9]


def test_along_context_interpolates_and_is_flat_past_the_ends():
    points = [(200, 10.0), (1000, 20.0)]
    assert along_context(points, 600) == pytest.approx(15.0)
    assert along_context(points, 50) == 10.0 and along_context(points, 5000) == 20.0


def test_along_rows_interpolates_monotone_and_extrapolates_with_the_average_row():
    points = {1: 1.0, 4: 1.2, 8: 1.5}
    assert along_rows(points, 2, 0.5) == pytest.approx(1 + 0.2 / 3)
    assert along_rows(points, 6, 0.5) == pytest.approx(1.35)
    assert along_rows(points, 16, 0.5) == pytest.approx(1.5 + 8 * 0.5 / 7)
    assert along_rows({1: 1.0}, 5, 0.5) == pytest.approx(3.0)  # only the prior's slope


def test_along_rows_lowers_a_slowed_timing_to_a_larger_row_counts():
    """4 rows timed in a busy moment, above 8 rows: 4 rows is priced like 8, not 8 like 4."""
    points = {1: 1.0, 4: 1.9, 8: 1.5}
    assert along_rows(points, 4, 0.5) == pytest.approx(1.5)
    assert along_rows(points, 8, 0.5) == pytest.approx(1.5)
    assert along_rows({1: 1.0, 2: 0.9, 4: 1.3}, 2, 0.5) == 1.0  # never below one row


# ---------------------------------------------------------------------------------------------
# The prior


def test_before_any_timing_speculation_must_prove_itself():
    c = learnt()
    assert c.step() == PRIOR_STEP_MS and c.verify(1) == PRIOR_STEP_MS
    for rows in (2, 4, 16):
        assert c.verify(rows) == pytest.approx(PRIOR_STEP_MS * (1 + PRIOR_ROW_COST * (rows - 1)))
        # even a drafter whose every row is accepted gains less than rows per verify row
        assert rows / (c.draft(rows) + c.verify(rows)) < 1 / c.step()
    assert c.draft(1) == 0.0 and c.draft(4) == c.verify(4)
    assert c.source() == "learnt" and c.rows == list(costs.ROWS)


def test_plain_steps_set_the_unit_of_the_prior():
    c = learnt()
    feed(c, "step", 1, 300, 60.0, n=4)
    assert c.step(300) == pytest.approx(60.0) and c.verify(1, 300) == pytest.approx(60.0)
    assert c.verify(3, 300) == pytest.approx(60.0 * (1 + 2 * PRIOR_ROW_COST))


# ---------------------------------------------------------------------------------------------
# Learning


def machine_ms(rows: int, context: int) -> float:
    """A synthetic machine: a fixed pass cost, a little per row, a little per cached token."""
    return 50.0 + 2.0 * rows + 0.01 * context


def test_timed_shapes_converge_to_the_machine_despite_busy_moments():
    c = learnt()
    for i in range(48):
        busy = 1.6 if i % 5 == 0 else 1.0  # one pass in five slowed by another process
        context = 300 + i
        c.observe("step", 1, context, busy * machine_ms(1, context) / 1000)
        for rows in (3, 5):
            c.observe("verify", rows, context, busy * machine_ms(rows, context) / 1000)
        c.observe("draft", 4, context, busy * 12.0 / 1000)
    for rows in (1, 3, 5):
        assert c.verify(rows, 340) == pytest.approx(machine_ms(rows, 340), rel=0.03)
    assert c.step(340) == pytest.approx(machine_ms(1, 340), rel=0.03)
    assert c.draft(4) == pytest.approx(12.0, rel=0.01)
    assert c.draft(8) == pytest.approx(24.0, rel=0.01)  # one block length: proportional
    assert c.verify(4, 340) == pytest.approx(machine_ms(4, 340), rel=0.03)  # interpolated
    assert c.timed("verify") == {3: 16, 5: 16}  # the recent ones are kept


def test_contexts_are_interpolated_and_row_ratios_carry_across_contexts():
    c = learnt()
    for context in (200, 1000):
        feed(c, "step", 1, context, machine_ms(1, context), n=3)
    feed(c, "verify", 4, 200, machine_ms(4, 200), n=3)  # 4 rows timed at one context only
    assert c.step(600) == pytest.approx((machine_ms(1, 200) + machine_ms(1, 1000)) / 2)
    ratio = machine_ms(4, 200) / machine_ms(1, 200)
    assert c.verify(4, 1000) == pytest.approx(machine_ms(1, 1000) * ratio)


def test_a_pipelined_step_never_costs_more_than_a_lone_pass():
    c = learnt()
    feed(c, "verify", 1, 100, 50.0, n=2)
    feed(c, "step", 1, 100, 58.0, n=2)  # host overhead counted into a stretch's steps
    assert c.step(100) == 50.0 and c.step(100, pipelined=False) == 50.0
    feed(c, "step", 1, 100, 40.0, n=8)
    assert c.step(100) == 40.0 and c.step(100, pipelined=False) == 50.0


def test_nonsense_timings_are_ignored_and_unknown_kinds_refused():
    c = learnt()
    for seconds in (0.0, -1.0, float("nan"), float("inf")):
        c.observe("verify", 2, 10, seconds)
    c.observe("verify", 0, 10, 0.01)
    assert c.observed == 0
    with pytest.raises(ValueError, match="kind 'prefill'"):
        c.observe("prefill", 1, 10, 0.01)


def test_a_calibration_prices_while_learning_goes_on():
    table = costs.CostModel(key="k", machine={}, rows=[1, 2, 4], contexts=[128],
                            verify_ms=[[10.0, 11.0, 13.0]], draft_rows=[4], draft_ms=[3.0],
                            step_ms=[9.0])
    c = learnt(calibrated=table)
    feed(c, "verify", 2, 128, 30.0)
    assert c.verify(2, 128) == 11.0 and c.step(128) == 9.0 and c.draft(4) == 3.0
    assert c.learned_verify(2, 128) == 30.0 and c.source() == "calibrated"
    assert c.rows == [1, 2, 4]
    (row,) = costs.compare_learned(c, table)
    assert row == {"kind": "verify", "rows": 2, "context": 128, "timings": 1, "timed_ms": 30.0,
                   "learnt_ms": 30.0, "calibrated_ms": 11.0, "ratio": pytest.approx(2.727, abs=1e-3)}
    assert "off by more than 15%" in costs.format_comparison([row])


# ---------------------------------------------------------------------------------------------
# Storage


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(console, "_said", set())
    return tmp_path / "home"


def test_learnt_costs_are_stored_and_where_the_next_process_starts(home):
    c = PassCosts.stored("k")
    assert c.path == costs.learned_file("k") and c.calibrated is None
    feed(c, "verify", 4, 300, 70.0, n=3)
    feed(c, "draft", 4, 300, 9.0)
    c.flush()
    again = PassCosts.stored("k")
    assert again.learned_verify(4, 300) == 70.0 and again.draft(4) == 9.0
    assert json.loads(costs.learned_file("k").read_text())["format"] == costs.LEARNED_FORMAT


def test_learnt_costs_of_another_machine_or_corrupt_are_ignored_said_once(home, capsys):
    path = costs.learned_file("k")
    path.parent.mkdir(parents=True)
    c = PassCosts.stored("k")
    feed(c, "verify", 4, 300, 70.0)
    data = c.to_dict()
    data["machine"] = {**data["machine"], "cpu": "another CPU"}
    path.write_text(json.dumps(data))
    for _ in range(2):
        assert PassCosts.stored("k").observed == 0 and not PassCosts.stored("k").samples
    path.write_text("{not json")
    assert not PassCosts.stored("k").samples
    err = capsys.readouterr().err
    assert err.count("from another machine") == 1 and err.count("are unreadable") == 1, err


def test_an_unwritable_folder_keeps_the_learnt_costs_in_memory(home, capsys):
    home.mkdir()
    (home / "calibration").write_text("not a folder")
    c = PassCosts.stored("k")
    for _ in range(2):
        feed(c, "verify", 2, 10, 5.0)
        c.flush()
    assert c.learned_verify(2, 10) == 5.0
    assert capsys.readouterr().err.count("cannot save the learnt pass costs") == 1


def test_observations_are_stored_now_and_then_without_asking(home, monkeypatch):
    monkeypatch.setattr(costs, "SAVE_EVERY_S", 0.0)
    c = PassCosts.stored("k")
    feed(c, "step", 1, 10, 5.0)
    assert costs.learned_file("k").is_file()


def test_what_a_benchmark_reports_about_the_pass_costs():
    c = learnt()
    assert costs.describe(c) == "pass costs: the prior (no pass timed yet on this machine)"
    feed(c, "verify", 2, 128, 12.0, n=2)
    assert costs.describe(c) == "pass costs: learnt from 2 timings of this machine's passes"
    assert costs.report(c)["compare"] is None and costs.report(c)["learnt"][0]["timings"] == 2
    c.calibrated = costs.CostModel(key="k", machine={}, rows=[1, 2], contexts=[128],
                                   verify_ms=[[10.0, 10.0]], draft_rows=[4], draft_ms=[3.0],
                                   measured_at="2026-12-01T10:00:00")
    assert costs.describe(c) == ("pass costs: dflash calibrate's of 2026-12-01T10:00:00; learnt "
                                 "from 2 timings alongside: 1 shapes at 1.20-1.20x the calibration")
    assert costs.report(c)["compare"][0]["ratio"] == pytest.approx(1.2)


def test_the_epoch_moves_when_a_prior_is_replaced_and_now_and_then():
    c = learnt()
    assert c.epoch == 0
    feed(c, "step", 1, 100, 50.0)
    assert c.epoch == 1  # a new shape: its prior replaced
    feed(c, "step", 1, 100, 50.0, n=14)
    assert c.epoch == 1
    feed(c, "step", 1, 100, 50.0)  # the 16th timing
    assert c.epoch == 2
    assert costs.CostModel(key="k", machine={}, rows=[1], contexts=[1], verify_ms=[[1.0]],
                           draft_rows=[2], draft_ms=[1.0]).epoch == 0
