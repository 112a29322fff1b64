"""``dflash bench --trace``: trace files (dflash.traces) and their replay against mlx-lm."""

from __future__ import annotations

import json

import pytest
import test_bench

from dflash import bench_trace, cli
from dflash.errors import TraceFileError
from dflash.traces import DEFAULT_MAX_TOKENS, Replay, load_trace, read_trace

pair = test_bench.pair  # the fixture: the tiny llama pair, loaded once per module
CONVERSATIONS = [
    {"id": "edit", "system": "Reply with the whole file.", "max_tokens": 12,
     "turns": [{"user": "def add(a, b):\n    return a + b\n\nRename add to plus."},
               {"user": "Now add a docstring.", "max_tokens": 10},
               {"retry": True}]},
    {"id": "json", "turns": [{"user": '{"tool": "ls", "result": ["a.py"]} Next call?'},
                             {"user": '{"tool": "read", "result": "x = 1"} Next call?'}],
     "max_tokens": 8},
]


def write(tmp_path, *lines: str):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def line(**obj) -> str:
    return json.dumps(obj)


# ---------------------------------------------------------------------------------------------
# Trace files (no model)


def test_shipped_agent_traces():
    source, convs = read_trace("agent")
    assert source.endswith("assets/traces/agent.jsonl")
    assert [c.id for c in convs] == ["edit-file", "fix-test", "tool-json"]
    edit, fix, tools = convs
    assert len(edit.turns) == 4 and not any(t.retry for t in edit.turns)
    assert "```python" in edit.turns[0].user and edit.turns[0].user.count("\n") >= 45
    assert [t.retry for t in fix.turns] == [False, True, False]
    assert 3 <= len(tools.turns) <= 4 and all(t.max_tokens == 160 for t in tools.turns)
    assert all(t.max_tokens == DEFAULT_MAX_TOKENS for c in (edit, fix) for t in c.turns)


def test_shipped_traces_fit_the_builtin_target():
    """Every request, with answers as long as their budgets, fits SmolLM2's 8,192 positions; the
    agent-sized histories run from about 500 to 1,500 tokens."""
    import tiny_models
    from mlx_lm.utils import load_tokenizer

    from dflash.prompts import encode_prompt

    tokenizer = load_tokenizer(tiny_models.tokenizer_source())
    for conv in read_trace("agent")[1]:
        replay, sizes = Replay(conv), []
        for turn in conv.turns:
            sizes.append(len(encode_prompt(tokenizer, {"messages": replay.request(turn)})))
            assert sizes[-1] + turn.max_tokens <= 8192
            replay.answered(turn, " ".join(["word"] * turn.max_tokens))
        assert 450 <= sizes[0] and sizes[-1] <= 1700, (conv.id, sizes)


def test_replay_sends_the_whole_history_and_retries_exactly():
    _, (conv, _) = load_trace(CONVERSATIONS)
    replay = Replay(conv)
    first = replay.request(conv.turns[0])
    assert [m["role"] for m in first] == ["system", "user"]
    replay.answered(conv.turns[0], "ANSWER 1")
    second = replay.request(conv.turns[1])
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert second[2]["content"] == "ANSWER 1" and second[:2] == first
    replay.answered(conv.turns[1], "ANSWER 2")
    assert replay.request(conv.turns[2]) == second  # the previous request, unchanged
    replay.answered(conv.turns[2], "ANSWER 2")
    assert [m["role"] for m in replay.messages][-2:] == ["user", "assistant"]  # once
    assert len(replay.messages) == 5
    assert [t.max_tokens for t in conv.turns] == [12, 10, 10]  # a retry keeps its request's


@pytest.mark.parametrize("lines, expected", [
    (["{not json"], r"trace.jsonl:1: not valid JSON"),
    ([line(turns=[{"user": "a"}]), "[1, 2]"], r"trace.jsonl:2: expected a JSON object"),
    ([line(id="a")], r":1: needs `turns`"),
    ([line(turns=[])], r":1: needs `turns`"),
    ([line(turns=[{"user": "a"}, {"max_tokens": 3}])], r":1: turns\[1\]: needs `user`"),
    ([line(turns=[{"user": "  "}])], r":1: turns\[0\]: needs `user`"),
    ([line(turns=["hello"])], r":1: turns\[0\]: a turn is a JSON object"),
    ([line(turns=[{"role": "user", "content": "a"}])], r":1: turns\[0\]: unknown field 'content'"),
    ([line(turns=[{"user": "a"}, {"assistant": "b"}])],
     r":1: turns\[1\]: unknown field 'assistant' \(the assistant turns are the target's own"),
    ([line(turns=[{"user": "a"}], messages=[])], r":1: unknown field 'messages'"),
    ([line(turns=[{"retry": True}])], r":1: turns\[0\]: `retry` on the first turn"),
    ([line(turns=[{"user": "a"}, {"retry": True, "user": "b"}])],
     r":1: turns\[1\]: a retry re-sends the previous request exactly; it takes no 'user'"),
    ([line(turns=[{"user": "a"}, {"retry": "yes"}])], r":1: turns\[1\]: `retry` must be true"),
    ([line(turns=[{"user": "a", "max_tokens": 0}])], r":1: turns\[0\]: `max_tokens` must be"),
    ([line(turns=[{"user": "a"}], max_tokens="5")], r":1: `max_tokens` must be an integer"),
    ([line(turns=[{"user": "a"}], system=3)], r":1: `system` must be a string"),
    ([line(id="x", turns=[{"user": "a"}]), "", line(id="x", turns=[{"user": "b"}])],
     r":3: id 'x' repeats line 1"),
    (["", "  "], r"holds no conversations"),
])
def test_bad_traces_name_the_line_and_field(tmp_path, lines, expected):
    path = write(tmp_path, *lines)
    with pytest.raises(TraceFileError, match=expected):
        read_trace(path)


def test_missing_trace_and_limits(tmp_path):
    with pytest.raises(TraceFileError, match="does not exist .*agent"):
        read_trace(tmp_path / "nope.jsonl")
    assert len(load_trace("agent", limit=2)[1]) == 2
    with pytest.raises(TraceFileError, match="limit"):
        load_trace("agent", limit=0)
    with pytest.raises(TraceFileError, match="conversation 0: needs `turns`"):
        load_trace([{"id": "a"}])


def test_cli_reports_a_bad_trace_before_loading_a_model(tmp_path, capsys):
    path = write(tmp_path, line(turns=[{"user": "a"}]), line(turns=[{"usr": "b"}]))
    # A model folder that does not exist: the trace's error comes first.
    assert cli.main(["bench", "--trace", str(path), "--model", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert "trace.jsonl:2: turns[0]: unknown field 'usr'" in err and "none" not in err


@pytest.mark.parametrize("extra, expected", [
    (["--temperature", "0.7"], "greedy"),
    (["--concurrency", "2"], "--concurrency"),
    (["--block-size", "4,8"], "one --block-size"),
    (["--prompts", "heldout-mix"], "replaces --prompts"),
    (["--system", "hi"], "system message"),
])
def test_cli_trace_usage_errors(capsys, extra, expected):
    assert cli.main(["bench", "--trace", "agent", *extra]) == 2
    assert expected in capsys.readouterr().err


def test_cli_no_index_needs_a_trace(capsys):
    assert cli.main(["bench", "--no-index"]) == 2
    assert "--no-index: only with --trace" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Replays on the tiny models


@pytest.mark.slow
def test_trace_replay_reports_every_turn(pair, tmp_path):
    logs = []
    result = bench_trace.run_trace_bench(CONVERSATIONS, pair=pair, repeats=2, out=tmp_path,
                                   log=logs.append)
    assert result["identical"] is True and result["differing"] == []
    rows = result["turns"]
    assert [(r["conversation"], r["turn"], r["retry"]) for r in rows] == [
        ("edit", 1, False), ("edit", 2, False), ("edit", 3, True), ("json", 1, False),
        ("json", 2, False)]
    # Warm-up, then 2 repeats x 5 turns x 3 sides, each side once per turn.
    progress = [m for m in logs if m.startswith("[")]
    assert len(progress) == 30 and logs[0].startswith("warming up")
    assert sum("mlx-lm:" in m for m in progress) == 10
    sources = set(bench_trace.SOURCES)
    for r in rows:
        assert r["identical"] is True
        assert r["first_difference"] == {"dflash": None, "dflash_prompt_cache": None}
        assert 0 < r["generated_tokens"] <= r["max_tokens"]
        for side in ("mlx_lm", "dflash", "dflash_prompt_cache"):
            s = r[side]
            assert s["ttft_s"] > 0 and s["decode_s"] >= 0
            assert s["total_s"] == pytest.approx(s["ttft_s"] + s["decode_s"])
        assert r["speedup"] == pytest.approx(r["mlx_lm"]["total_s"] / r["dflash"]["total_s"])
        assert r["decode_speedup"] is None or r["decode_speedup"] > 0
        assert set(r["dflash"]["passes"]) == set(r["dflash"]["shares"]) == sources
        assert r["dflash"]["passes"]["index"] is not None  # the engine counts it apart
        shares = [v for v in r["dflash"]["shares"].values() if v is not None]
        assert sum(shares) == pytest.approx(1.0)
        assert isinstance(r["text"], str)
    # The prefix cache: the whole history but the new user turn is reused; a retry all of it.
    edit1, edit2, retry = rows[:3]
    assert edit1["dflash_prompt_cache"]["reused_prompt_tokens"] == 0
    assert 0 < edit2["dflash_prompt_cache"]["reused_prompt_tokens"] < edit2["prompt_tokens"]
    assert retry["dflash_prompt_cache"]["reused_prompt_tokens"] == retry["prompt_tokens"] - 1
    assert retry["prompt_tokens"] == edit2["prompt_tokens"]
    assert rows[3]["prompt_tokens"] < edit2["prompt_tokens"]  # a new conversation
    # Totals: per conversation, first sends and retries apart, all.
    o = result["overall"]
    assert o["turns"] == 5 and o["identical"] is True
    assert o["speedup"] == pytest.approx(o["mlx_lm"]["total_s"] / o["dflash"]["total_s"])
    assert o["mlx_lm"]["ttft_s"] == pytest.approx(sum(r["mlx_lm"]["ttft_s"] for r in rows))
    assert [c["id"] for c in result["conversations"]] == ["edit", "json"]
    assert result["retries"]["turns"] == 1 and result["first_sends"]["turns"] == 4
    assert result["config"]["index"] is True and result["config"]["repeats"] == 2
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["turns"][2]["retry"] is True and saved["identical"] is True
    md = (tmp_path / "bench.md").read_text()
    assert "| edit 3 (retry) |" in md and "| **all** |" in md
    summary = bench_trace.format_trace_summary(result)
    assert "identical greedy outputs: yes" in summary and "cross-request index" in summary


@pytest.mark.slow
def test_the_index_is_the_runs_own(pair):
    """Without the index no pass comes from it; with it, the retry (its answer written before in
    the same run) is where it can."""
    off = bench_trace.run_trace_bench(CONVERSATIONS[:1], pair=pair, index=False, warmup=False)
    assert off["identical"] is True and off["config"]["index"] is False
    assert all(r["dflash"]["passes"]["index"] == 0 for r in off["turns"])
    on = bench_trace.run_trace_bench(CONVERSATIONS[:1], pair=pair, warmup=False)
    assert [r["text"] for r in on["turns"]] == [r["text"] for r in off["turns"]]
    assert on["turns"][0]["dflash"]["passes"]["index"] == 0  # nothing earlier in the run


@pytest.mark.slow
def test_a_difference_from_mlx_lm_is_loud(pair, monkeypatch):
    real = bench_trace._run_baseline

    def wrong(*args, **kwargs):
        out = real(*args, **kwargs)
        out["tokens"] = out["tokens"][:2] + [out["tokens"][2] + 1] + out["tokens"][3:]
        return out

    monkeypatch.setattr(bench_trace, "_run_baseline", wrong)
    logs = []
    result = bench_trace.run_trace_bench(CONVERSATIONS[1:], pair=pair, warmup=False, log=logs.append)
    assert result["identical"] is False
    assert result["turns"][0]["first_difference"] == {"dflash": 2, "dflash_prompt_cache": 2}
    assert "json turn 1 (dflash, token 2)" in result["differing"]
    assert any(m.startswith("WARNING: greedy outputs differ") for m in logs)
    assert "NO:" in bench_trace.format_trace_summary(result)
