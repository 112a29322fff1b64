"""Bad input around the verify policy: unknown policy names and tree budgets are refused when
``stream_generate`` is called, before any token; a generation measures nothing before its first
token; a stored calibration that is corrupt, foreign or unwritable is ignored or kept in memory,
said once, generation unaffected."""

from __future__ import annotations

import json
import os

import pytest
from test_engine import chat_prompt, reference

from dflash import console
from dflash import cost_model as costs
from dflash.errors import GenerationConfigError
from dflash.model_mlx import generate, stream_generate
from dflash.target import target_parts

N = 12
MEASURING = "measuring this machine's verify and draft costs"


@pytest.fixture(scope="module")
def qwen3(loaded_pair):
    """Loaded before any test moves DFLASH_HOME (the tiny models take their tokenizer from it)."""
    model, tokenizer, draft = loaded_pair("qwen3")
    prompt = chat_prompt(tokenizer)
    return model, tokenizer, draft, prompt, reference(model, prompt, n=N)


@pytest.fixture
def home(qwen3, tmp_path, monkeypatch):
    """A fresh DFLASH_HOME, nothing in memory, nothing said yet."""
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(costs, "_memory", {})
    monkeypatch.setattr(console, "_said", set())
    return tmp_path / "home"


# ---------------------------------------------------------------------------------------------
# Policy and tree budget


def test_unknown_policy_is_refused_at_call_time(qwen3):
    model, tokenizer, draft, prompt, _ = qwen3
    with pytest.raises(GenerationConfigError, match="policy='greedy-tree'"):
        stream_generate(model, draft, tokenizer, prompt, policy="greedy-tree")  # no next()


@pytest.mark.parametrize("policy", ["tree", "auto"])
@pytest.mark.parametrize("budget", [0, -3, 32, 1000, 2.5, "8"])
def test_bad_tree_budget_is_refused_at_call_time(policy, budget, qwen3):
    model, tokenizer, draft, prompt, _ = qwen3
    most = max(costs.cost_model(target_parts(model), draft).rows) - 1
    assert most == 31
    with pytest.raises(GenerationConfigError, match=r"tree_budget=.*from 1 to 31"):
        stream_generate(model, draft, tokenizer, prompt, policy=policy, tree_budget=budget)


@pytest.mark.parametrize("policy", ["fixed", "confidence"])
def test_tree_budget_without_trees_is_refused_at_call_time(policy, qwen3):
    model, tokenizer, draft, prompt, _ = qwen3
    with pytest.raises(GenerationConfigError, match="tree_budget=4: only with policy 'tree'"):
        stream_generate(model, draft, tokenizer, prompt, policy=policy, tree_budget=4)


def test_tree_budget_at_both_ends_of_the_range(qwen3):
    model, tokenizer, draft, prompt, ref = qwen3
    for budget in (1, 31):
        out = generate(model, draft, tokenizer, prompt, max_tokens=N, policy="tree",
                       tree_budget=budget)
        assert out.tokens == ref


# ---------------------------------------------------------------------------------------------
# The calibration cache


def _generate_fresh(qwen3) -> None:
    """One generation with nothing in memory (the cache folder is read again)."""
    model, tokenizer, draft, prompt, ref = qwen3
    costs._memory.clear()
    assert generate(model, draft, tokenizer, prompt, max_tokens=N).tokens == ref


def _cache_file(qwen3) -> str:
    model, _, draft, _, _ = qwen3
    return costs.calibration_file(costs.cost_key(target_parts(model), draft))


def _calibrate(qwen3) -> costs.CostModel:
    model, _, draft, _, _ = qwen3
    return costs.calibrate(target_parts(model), draft)


def test_a_generation_measures_nothing_before_its_first_token(qwen3, home, capsys):
    _generate_fresh(qwen3)
    assert MEASURING not in capsys.readouterr().err
    assert not _cache_file(qwen3).is_file()


def test_corrupt_calibration_is_ignored_and_said_once(qwen3, home, capsys):
    path = _cache_file(qwen3)
    path.parent.mkdir(parents=True)
    for garbage in ("{not json", json.dumps({"format": "dflash-cost/1", "rows": "many"})):
        path.write_text(garbage)
        _generate_fresh(qwen3)
    err = capsys.readouterr().err
    assert err.count("is unreadable") == 1, err
    assert MEASURING not in err
    _calibrate(qwen3)  # dflash calibrate replaces it by a good measurement
    assert json.loads(path.read_text())["key"] == path.stem


def test_calibration_times_the_pipelined_plain_step(qwen3, home):
    cost = _calibrate(qwen3)
    assert len(cost.step_ms) == len(cost.contexts) and min(cost.step_ms) > 0
    for context in (64, *cost.contexts, 4096):
        assert cost.step(context, pipelined=False) == cost.verify(1, context)
        assert 0 < cost.step(context) <= cost.verify(1, context)
    assert "plain step, pipelined" in costs.format_table(cost)
    model, _, draft, _, _ = qwen3
    priced = costs.cost_model(target_parts(model), draft)  # what the policy prices with now
    assert priced.source() == "calibrated" and priced.verify(4, 300) == cost.verify(4, 300)


def test_calibration_measures_every_context_the_target_reads_drafts_included(qwen3, home):
    """Long contexts cost more per pass (attention): the table covers the contexts the target
    reads, the drafter's pass at each of them, and none past the target's positions."""
    model, _, draft, _, _ = qwen3
    cost = _calibrate(qwen3)
    limit = target_parts(model).max_positions
    expected = [c for c in costs.CONTEXTS if limit is None or c + max(costs.ROWS) + 8 <= limit]
    assert cost.contexts == expected and len(cost.draft_ms_at) == len(expected)
    for c, row in zip(cost.contexts, cost.draft_ms_at):
        assert cost.draft(16, c) == pytest.approx(row[cost.draft_rows.index(16)])
    assert cost.draft(1, 4096) == 0.0
    assert "ms after CONTEXT tokens" in costs.format_table(cost)
    small = costs.measure(target_parts(model), draft, rows=(1, 4), contexts=(16, 10**9),
                          draft_rows=(2, 4), rounds=1, quiet=True)
    assert small.contexts == [16]  # a context past the target's positions is not measured


@pytest.mark.slow
def test_calibration_in_an_older_format_is_ignored_and_measured_again(qwen3, home, capsys):
    path = _cache_file(qwen3)
    _calibrate(qwen3)
    data = json.loads(path.read_text())
    data["format"] = "dflash-cost/1"  # before pipelined plain steps were timed
    del data["step_ms"]
    path.write_text(json.dumps(data))
    _generate_fresh(qwen3)
    _calibrate(qwen3)
    err = capsys.readouterr().err
    assert err.count("is unreadable (format 'dflash-cost/1'") == 1, err
    assert err.count(MEASURING) == 2, err
    assert json.loads(path.read_text())["format"] == costs.FORMAT


@pytest.mark.slow
def test_calibration_from_another_machine_is_ignored_and_said_once(qwen3, home, capsys):
    path = _cache_file(qwen3)
    _calibrate(qwen3)  # measured and saved here
    for cpu in ("another CPU", "yet another CPU"):
        data = json.loads(path.read_text())
        data["machine"]["cpu"] = cpu
        path.write_text(json.dumps(data))
        _generate_fresh(qwen3)
    err = capsys.readouterr().err
    assert err.count("was measured on another machine") == 1, err
    assert err.count(MEASURING) == 1, err
    _calibrate(qwen3)  # measured again, here
    assert json.loads(path.read_text())["machine"] == costs.machine_id()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["file-in-the-way", "read-only"])
def test_unwritable_calibration_folder_keeps_the_model_in_memory(how, qwen3, home, capsys):
    home.mkdir()
    if how == "file-in-the-way":  # works for root too, which ignores permission bits
        (home / "calibration").write_text("not a folder")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        home.chmod(0o500)
    try:
        for _ in range(2):
            costs._memory.clear()
            _calibrate(qwen3)
        model, tokenizer, draft, prompt, ref = qwen3
        # Still in memory: the next generation neither measures nor warns.
        assert generate(model, draft, tokenizer, prompt, max_tokens=N).tokens == ref
    finally:
        home.chmod(0o700)
    err = capsys.readouterr().err
    assert err.count("cannot save the calibration") == 1, err
    assert err.count(MEASURING) == 2, err
    assert not _cache_file(qwen3).is_file()
