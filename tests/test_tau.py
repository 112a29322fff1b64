"""``dflash bench --tau`` (dflash.tau): held-out τ of drafters side by side, per domain, and 6-bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.tau import format_tau

ROOT = Path(__file__).resolve().parent.parent


def test_the_table_shows_each_domain_and_the_six_bit_cost():
    result = {"prompts": "p.jsonl", "block_size": 16, "max_tokens": 8, "identical": True,
              "domains": {"sea": 2, "code": 1},
              "drafters": {"a": {"sea": 2.0, "code": 1.5, "all": 1.8},
                           "a 6-bit": {"sea": 1.9, "code": 1.5, "all": 1.71}}}
    text = format_tau(result)
    assert "| drafter | sea (2) | code (1) | all |" in text
    assert "| a 6-bit | 1.900 | 1.500 | 1.710 |" in text
    assert "a 6-bit: -5.0 % τ against its unquantized original" in text
    assert text.endswith("outputs identical across drafters: True")


@pytest.mark.slow
def test_two_drafters_and_a_conversion_per_domain(tiny_pair, tmp_path):
    import tiny_models

    target, draft = tiny_pair("llama")
    other = tiny_models.write_drafter(tmp_path / "other", target, taps=(0, 2), seed=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in [
        ("sea-0", "The sea is"), ("sea-1", "Waves come and"), ("code/0", "def add(a, b):")]))
    out = tmp_path / "compare"
    p = subprocess.run([sys.executable, "-m", "dflash", "bench", "--tau", "--draft",
                        f"{draft},{other}", "--model", str(target), "--prompts", str(prompts),
                        "--block-size", "4", "--max-tokens", "12", "--quantize", "--out",
                        str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "| drafter | sea (2) | code (1) | all |" in p.stdout
    assert "outputs identical across drafters: True" in p.stdout
    result = json.loads((out / "tau.json").read_text())["drafters"]
    assert set(result) == {str(draft), str(other), f"{draft} 6-bit", f"{other} 6-bit"}
    for r in result.values():
        assert 1.0 <= r["sea"] <= 4.0 and 1.0 <= r["code"] <= 4.0
        # "all" weighs each domain by its cycles: between the domains' τ
        assert min(r["sea"], r["code"]) - 1e-9 <= r["all"] <= max(r["sea"], r["code"]) + 1e-9
    assert Path(result[f"{draft} 6-bit"]["path"]).parent == out / "drafters"
    assert "τ against its unquantized original" in p.stdout


@pytest.mark.slow
def test_no_chat_template_measures_prompts_that_are_already_templated(tiny_pair, tmp_path):
    """`--tau --no-chat-template` on templated text decodes what the plain prompt decodes (the
    prompts a drafter trained on are kept templated); without the flag the text is templated a
    second time and the target sees another prompt."""
    from dflash.model_mlx import load
    from dflash.tau import compare_drafters

    target, draft = tiny_pair("llama")
    _, tokenizer = load(str(target))
    items = [("sea-0", "The sea is"), ("code/0", "def add(a, b):")]
    plain, templated = tmp_path / "plain.jsonl", tmp_path / "templated.jsonl"
    plain.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in items))
    templated.write_text("".join(json.dumps({"id": i, "prompt": tokenizer.apply_chat_template(
        [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)}) + "\n"
        for i, p in items))

    def outputs(prompts, **kwargs):
        result = compare_drafters([str(draft)], target=str(target), prompts=prompts,
                                  block_size=4, max_tokens=12, work=tmp_path / "w", **kwargs)
        return result["drafters"][str(draft)]["outputs"]

    assert outputs(templated, chat_template=False) == outputs(plain)
    assert outputs(templated) != outputs(plain)
