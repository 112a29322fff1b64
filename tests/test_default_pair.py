"""The built-in pair (SmolLM2-135M-Instruct + the drafter trained for it) loads and is exact."""

import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash.default_pair import default_draft_path
from dflash.model_mlx import generate, load_default

QUESTION = ("A baker makes 24 muffins and sells 3 boxes of 4 muffins. "
            "How many muffins are left?")


@pytest.mark.slow
def test_default_pair_is_exact_and_drafts():
    model, tokenizer, draft = load_default()
    assert draft.config.block_size >= 8
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                           add_generation_prompt=True)
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=64)]
    eos = set(tokenizer.eos_token_ids)
    if any(t in eos for t in ref):
        ref = ref[: next(i for i, t in enumerate(ref) if t in eos)]
    out = generate(model, draft, tokenizer, prompt, max_tokens=64)
    assert out.tokens == ref
    assert out.stats.mean_tau >= 1.0


def test_default_drafter_ships_in_the_model_card_format():
    import json

    cfg = json.loads((default_draft_path() / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 6 and cfg["quantization"]["group_size"] == 64
    assert (default_draft_path() / "README.md").is_file()


@pytest.mark.slow
def test_generate_command_runs_on_the_builtin_pair():
    run = subprocess.run([sys.executable, "-m", "dflash", "generate", "--max-tokens", "24",
                          "--prompt", QUESTION], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-1500:]
    assert run.stdout.strip()
    assert "τ" in run.stderr
