"""``dflash bench --context``: prompts padded to each context length with unrelated text, the
bench run at each, with and without continuations (tiny models; the measured numbers are in
docs/long-context.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dflash.contexts import at_context, filler_text, parse_contexts, run_context_bench
from dflash.errors import GenerationConfigError
from dflash.pair import Pair
from dflash.prompts import encode_prompt

KIND = "llama"
PROMPTS = [{"id": "sum", "prompt": "What is 12 + 30?"},
           {"id": "chat", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Write a short poem."}]}]


def test_context_lengths_are_read_as_token_counts():
    assert parse_contexts("512,2k, 4K,8k,2k") == [512, 2048, 4096, 8192]
    assert parse_contexts(300) == [300]
    for bad in ("", "2x", "1.5k", "0", "-4"):
        with pytest.raises(GenerationConfigError, match="--context"):
            parse_contexts(bad)


@pytest.fixture(scope="module")
def pair(tiny_pair, loaded_pair):
    target, draft = tiny_pair(KIND)
    model, tokenizer, d = loaded_pair(KIND)
    return Pair(model, tokenizer, d, str(target), str(draft))


def test_each_prompt_is_padded_to_its_length_before_the_question(pair):
    def encode(item):
        return encode_prompt(pair.tokenizer, item)

    filler = filler_text()
    assert len(filler) > 50_000  # enough real text for 8k tokens
    for length in (200, 700, 1500):
        padded = at_context(PROMPTS, length, 64, encode, pair.tokenizer, filler)
        for item, original in zip(padded, PROMPTS):
            assert abs(len(encode(item)) - (length - 64)) <= 2
            assert item["id"] == f"{original['id']}@{length}"
            question = original.get("prompt") or original["messages"][-1]["content"]
            user = [m for m in item["messages"] if m["role"] == "user"][0]["content"]
            assert user.endswith(question) and len(user) > 4 * len(question)
        assert padded[1]["messages"][0] == PROMPTS[1]["messages"][0]  # the system turn kept
    # A prompt already longer than the length is kept as it is.
    short = at_context(PROMPTS, 10, 4, encode, pair.tokenizer, filler)
    assert [encode(p) for p in short] == [encode(p) for p in PROMPTS]


@pytest.mark.slow
def test_the_context_bench_runs_each_length_with_and_without_continuations(pair):
    saved = []
    result = run_context_bench([256, 512], pair=pair, prompts=PROMPTS, max_tokens=16, limit=1,
                               block_sizes="4", on_row=saved.append)
    assert [r["context"] for r in result["rows"]] == [256, 512]
    # What a run stopped during a later length keeps: every finished length, after each.
    assert [[r["context"] for r in s["rows"]] for s in saved] == [[256], [256, 512]]
    assert saved[-1] == result
    for row in result["rows"]:
        assert all(abs(n - (row["context"] - 16)) <= 2 for n in row["prompt_tokens"])
        for side in ("lookup", "no_lookup"):
            r = row[side]
            assert r["identical"] is True and r["speedup"] > 0 and r["tau"] >= 1.0
            assert r["baseline_prefill_s"] > 0 and r["dflash_prefill_s"] > 0
            assert r["baseline_peak_gb"] > 0 and r["dflash_peak_gb"] > 0
            assert 0 <= r["drafter_share"] <= 1
            assert r["reused_prefill"] is True
            low, high = r["speedup_range"]
            assert 0 < low <= high
        assert row["no_lookup"]["lookup_share"] == 0.0
        # Both arms decode from the same prefills: one prefill time per side.
        for side in ("baseline_prefill_s", "dflash_prefill_s"):
            assert row["lookup"][side] == row["no_lookup"][side]
    # Continuations off only (`--no-lookup`).
    off = run_context_bench([256], pair=pair, prompts=PROMPTS, max_tokens=16, limit=1,
                            block_sizes="4", lookups=(False,))
    assert set(off["rows"][0]) == {"context", "prompt_tokens", "no_lookup"}
    assert off["rows"][0]["no_lookup"]["identical"] is True


def test_repeats_decode_from_one_prefill_per_side_and_match_fresh_runs(pair, monkeypatch,
                                                                       tiny_pair, loaded_pair):
    """``reuse_prefill``: each side prefills a prompt once; every repeat decodes from a copy of
    its caches and gives the tokens a fresh run gives (both sides, greedy)."""
    from dflash import bench

    prefills = []
    real = bench.Prefilled.__init__

    def counted(self, *args, **kwargs):
        prefills.append(args[1])
        real(self, *args, **kwargs)

    monkeypatch.setattr(bench.Prefilled, "__init__", counted)
    kwargs = dict(pair=pair, prompts=PROMPTS, max_tokens=20, block_sizes="4", warmup=False)
    fresh = bench.run_bench(repeats=1, **kwargs)
    reused = bench.run_bench(repeats=3, reuse_prefill=True, **kwargs)
    assert reused["config"]["reuse_prefill"] is True and fresh["config"]["reuse_prefill"] is False
    assert len(prefills) == len(PROMPTS)  # once per prompt, not per repeat
    assert reused["identical"] is True
    for a, b in zip(fresh["runs"][0]["prompts"], reused["runs"][0]["prompts"]):
        assert a["text"] == b["text"] and a["generated_tokens"] == b["generated_tokens"]
        assert len(b["repeat_speedups"]) == 3 and all(x > 0 for x in b["repeat_speedups"])
        assert b["baseline"]["prompt_time"] > 0 and b["dflash"]["prompt_time"] > 0
        assert b["baseline"]["peak_memory_gb"] > 0 and b["dflash"]["peak_memory_gb"] > 0
    # Each side's prefill peak is its own (a prefill-only run reports its peak too).
    kept = bench.Prefilled(pair, encode_prompt(pair.tokenizer, PROMPTS[0]), {"temperature": 0.0,
                           "top_p": 1.0, "top_k": 0, "min_p": 0.0}, 0)
    assert kept.baseline_peak > 0 and kept.dflash_peak > 0
    # A recurrent cache cannot be cut back (nor a quantized one's switch moved): those prefill
    # every run instead.
    target, draft = tiny_pair("qwen3_5")
    model, tokenizer, d = loaded_pair("qwen3_5")
    hybrid = Pair(model, tokenizer, d, str(target), str(draft))
    kwargs.update(pair=hybrid, prompts=PROMPTS[:1])
    assert bench.run_bench(reuse_prefill=True, **kwargs)["config"]["reuse_prefill"] is False
    assert bench.Prefilled.possible(pair, None)
    assert not bench.Prefilled.possible(pair, {"kv_bits": 8, "quantized_kv_start": 0})


def test_arms_with_and_without_continuations_share_prefills_and_mlx_lm_decodes(pair,
                                                                              monkeypatch):
    """``run_bench(lookup=(True, False))``: one prefill per prompt and side, one mlx-lm decode
    per repeat for both arms, each arm its own run (and its own pair memory), both exact."""
    from dflash import bench

    calls = {"prefill": 0, "baseline": 0}
    real_init, real_base = bench.Prefilled.__init__, bench.Prefilled.run_baseline

    def init(self, *args, **kwargs):
        calls["prefill"] += 1
        real_init(self, *args, **kwargs)

    def base(self, *args, **kwargs):
        calls["baseline"] += 1
        return real_base(self, *args, **kwargs)

    monkeypatch.setattr(bench.Prefilled, "__init__", init)
    monkeypatch.setattr(bench.Prefilled, "run_baseline", base)
    result = bench.run_bench(pair=pair, prompts=PROMPTS, max_tokens=12, block_sizes="4",
                             warmup=False, repeats=2, reuse_prefill=True, lookup=(True, False))
    assert calls == {"prefill": len(PROMPTS), "baseline": 2 * len(PROMPTS)}
    assert [(r["block_size"], r["lookup"]) for r in result["runs"]] == [(4, True), (4, False)]
    assert result["config"]["lookup"] == [True, False] and result["identical"] is True
    on, off = result["runs"]
    assert off["overall"]["lookup_share"] == 0.0
    assert [p["text"] for p in on["prompts"]] == [p["text"] for p in off["prompts"]]
    assert "continuations off" in bench.format_summary(result)
    with pytest.raises(ValueError, match="lookup"):
        bench.run_bench(pair=pair, prompts=PROMPTS, max_tokens=4, lookup=(), warmup=False)


def test_a_context_past_the_targets_positions_is_refused_before_loading(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dflash", "bench", "--context", "4k,huge"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--context" in out.stderr and "huge" in out.stderr

