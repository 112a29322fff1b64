"""``dflash.bench.run_bench``: the function API behind ``dflash bench``, on tiny models."""

from __future__ import annotations

import json

import pytest

from dflash import bench, bench_report, bench_runs
from dflash.pair import Pair

KIND = "llama"
PROMPTS = [{"id": "sum", "prompt": "What is 12 + 30?"},
           {"id": "chat", "messages": [{"role": "user", "content": "Write a short poem."}]}]


@pytest.fixture(scope="module")
def pair(tiny_pair, loaded_pair):
    target, draft = tiny_pair(KIND)
    model, tokenizer, d = loaded_pair(KIND)
    return Pair(model, tokenizer, d, str(target), str(draft))


@pytest.mark.slow
def test_sweep_reports_everything(pair, tmp_path):
    logs = []
    result = bench.run_bench(pair=pair, prompts=PROMPTS, block_sizes="4,8", max_tokens=10,
                             repeats=2, out=tmp_path, log=logs.append)
    assert result["identical"] is True
    assert result["config"]["block_sizes"] == [4, 8]
    assert result["config"]["repeats"] == 2
    assert [r["block_size"] for r in result["runs"]] == [4, 8]
    for run, width in zip(result["runs"], (3, 7)):
        o = run["overall"]
        assert o["tau"] >= 1.0 and o["speedup"] > 0
        assert o["baseline_tokens_per_s"] > 0 and o["dflash_tokens_per_s"] > 0
        assert len(o["acceptance_by_position"]) == width
        assert o["identical"] is True
        assert [p["id"] for p in run["prompts"]] == ["sum", "chat"]
        for p in run["prompts"]:
            assert p["identical"] is True and p["first_difference"] is None
            assert p["generated_tokens"] == p["baseline"]["generated_tokens"]
            assert p["baseline"]["prompt_time"] > 0 and p["dflash"]["decode_time"] > 0
            assert p["dflash"]["draft_time"] > 0 and p["dflash"]["verify_time"] > 0
            assert len(p["dflash"]["acceptance_by_position"]) == width
    # What the policy starts from, the warm-up, then 2 repeats x 2 prompts x (baseline + 2 block
    # sizes), alternating order.
    progress = [line for line in logs if line.startswith("[")]
    assert logs[0] == "pair memory: fresh" == "pair memory: " + result["config"]["pair_memory"]
    for run in result["runs"]:  # auto: the passes priced at the calibrated costs, both sides
        assert run["overall"]["priced_speedup"] > 0
        for p in run["prompts"]:
            assert p["priced_speedup"] == pytest.approx(p["baseline"]["priced_ms"]
                                                        / p["dflash"]["priced_ms"])
    assert len(progress) == 12 and logs[1].startswith("warming up")
    assert "mlx-lm" in progress[0] and "mlx-lm" not in progress[3]
    assert json.loads((tmp_path / "bench.json").read_text())["identical"] is True
    md = (tmp_path / "bench.md").read_text()
    assert "| block size | τ |" in md and "| **all** |" in md and "Acceptance by block" in md
    for png in ("speedup.png", "acceptance.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "block 4:" in bench_report.format_summary(result)


def test_acceptance_is_measured(pair, loaded_pair):
    """A drafter that knows the answer: τ and per-position acceptance show it."""
    import tiny_models

    from dflash.model_mlx import generate
    from dflash.prompts import encode_prompt

    model, tokenizer, draft = loaded_pair(KIND)
    ids = encode_prompt(tokenizer, PROMPTS[0])
    reference = ids + generate(model, draft, tokenizer, ids, max_tokens=40).tokens
    oracle = tiny_models.OracleDrafter(draft, reference, plant=lambda cycle, j: j >= 2)
    result = bench.run_bench(pair=Pair(model, tokenizer, oracle, pair.model_path, "oracle"),
                             prompts=PROMPTS[:1], block_sizes=[8], max_tokens=25, warmup=False,
                             policy="fixed")
    o = result["runs"][0]["overall"]
    assert result["identical"] is True
    assert o["acceptance_by_position"][:2] == [1.0, 1.0]
    assert all(a == 0.0 for a in o["acceptance_by_position"][2:])
    assert o["tau"] == pytest.approx(3.0)


def test_difference_from_mlx_lm_is_reported(pair, monkeypatch):
    real = bench._run_baseline

    def wrong(*args, **kwargs):
        out = real(*args, **kwargs)
        out["tokens"] = out["tokens"][:3] + [out["tokens"][3] + 1] + out["tokens"][4:]
        return out

    monkeypatch.setattr(bench, "_run_baseline", wrong)
    logs = []
    result = bench.run_bench(pair=pair, prompts=PROMPTS[:1], max_tokens=8, warmup=False,
                             log=logs.append)
    assert result["identical"] is False
    assert result["runs"][0]["prompts"][0]["first_difference"] == 3
    assert any("WARNING" in line for line in logs)
    assert "**no**" in bench_report.markdown(result)


def test_sampling_makes_identity_not_applicable(pair):
    result = bench.run_bench(pair=pair, prompts=PROMPTS[:1], max_tokens=6, warmup=False,
                             temperature=0.8, top_p=0.9, seed=1)
    assert result["identical"] is None
    assert result["runs"][0]["prompts"][0]["identical"] is None
    assert result["runs"][0]["block_size"] == pair.draft.block_size


def test_builtin_prompts_and_inputs(tmp_path):
    source, items = bench_runs.load_prompts("builtin")
    assert source == "builtin" and len(items) >= 6
    assert any(i["id"].startswith("math") for i in items)
    assert any(i["id"].startswith("code") for i in items)
    assert len(bench_runs.load_prompts("builtin", limit=2)[1]) == 2
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": "b"}]}) + "\n")
    assert [("prompt" in i, "messages" in i) for i in bench_runs.load_prompts(path)[1]] == [
        (True, False), (False, True)]
    assert bench_runs.parse_block_sizes(None) == [None]
    assert bench_runs.parse_block_sizes("4, 8,16") == [4, 8, 16]
    assert bench_runs.parse_block_sizes(8) == [8]
    for bad in ("", "4,x", "1", [0]):
        with pytest.raises(ValueError):
            bench_runs.parse_block_sizes(bad)
    with pytest.raises(ValueError):
        bench.run_bench(prompts=tmp_path / "missing.jsonl")
    with pytest.raises(ValueError):
        bench.run_bench(prompts=path, max_tokens=0)


def test_reports_show_portable_paths(tmp_path, monkeypatch):
    """bench.md is committed and read elsewhere: the built-in drafter and anything in the cache
    are shown relative to the package and ``$DFLASH_HOME``, not by this machine's paths."""
    from dflash.default_pair import default_draft_path

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    assert bench_report.shown_path(str(default_draft_path())) == \
        "dflash/assets/" + default_draft_path().name
    cached = tmp_path / "home" / "smollm2-135m-instruct-f32"
    assert bench_report.shown_path(str(cached)) == "$DFLASH_HOME/smollm2-135m-instruct-f32"
    elsewhere = tmp_path / "elsewhere" / "drafter"
    assert bench_report.shown_path(str(elsewhere)) == str(elsewhere)
