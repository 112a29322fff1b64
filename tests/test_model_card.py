"""The model card's code runs verbatim, with local paths in place of hub ids."""

import json
import platform
import subprocess
import sys
import textwrap
import threading

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

import dflash.backend as backend
from dflash.drafter import load_draft
from dflash.model_mlx import generate, load

MODEL_CARD = textwrap.dedent('''
    from dflash.model_mlx import load, load_draft, stream_generate

    model, tokenizer = load("Qwen/Qwen3.5-4B")
    draft = load_draft("Qwen3.5-4B-DFlash-MLX-6bit")

    messages = [
        {
            "role": "user",
            "content": "Explain speculative decoding."
        }
    ]

    prompt = tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=True,
    )

    for r in stream_generate(
        model,
        draft,
        tokenizer,
        prompt,
        block_size=16,
        max_tokens=2048,
        temperature=0.6,
    ):
        print(r.text, end="", flush=True)
''')


def write_mlx_6bit(src, dst):
    """The model card's format: uniform 6-bit, group 64, mlx-lm `quantization` block."""
    dst.mkdir()
    model = load_draft(str(src), dtype=mx.bfloat16)
    nn.quantize(model, group_size=64, bits=6)
    mx.save_safetensors(str(dst / "model.safetensors"), dict(tree_flatten(model.parameters())))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization"] = {"group_size": 64, "bits": 6}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def run_model_card(target, draft) -> None:
    """The snippet, verbatim but for the two paths, in a fresh interpreter."""
    code = (MODEL_CARD.replace('"Qwen/Qwen3.5-4B"', repr(str(target)))
            .replace('"Qwen3.5-4B-DFlash-MLX-6bit"', repr(str(draft))))
    # After the snippet, which BLAS it ran on (the loaders set the backend up; Linux: OpenBLAS).
    code += BLAS_PROBE
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert len(run.stdout) > 100
    blas = run.stderr.strip().splitlines()[-1]
    if platform.system() == "Linux" and backend._find_openblas() is not None:
        assert blas.startswith("blas openblas ") and "libopenblas" in blas, blas


BLAS_PROBE = """
import sys, dflash.backend
print("blas", dflash.backend.blas_status, dflash.backend.mlx_blas(), file=sys.stderr)
"""


@pytest.mark.slow
def test_model_card_snippet_runs_verbatim(tmp_path, tiny_pair):
    target, hf_draft = tiny_pair("qwen3_5_wrapped")
    mlx_draft = write_mlx_6bit(hf_draft, tmp_path / "Qwen3.5-4B-DFlash-MLX-6bit")
    for draft in (hf_draft, mlx_draft):
        run_model_card(target, draft)


@pytest.mark.slow
def test_two_pairs_in_two_threads_stay_exact(loaded_pair):
    pairs = {kind: loaded_pair(kind) for kind in ("qwen3_5", "llama")}
    prompt = [1, 17, 42, 5, 99, 3]
    expected = {kind: [int(t) for t, _ in generate_step(mx.array(prompt), m, max_tokens=120)]
                for kind, (m, _, _) in pairs.items()}
    results, errors = {}, []

    def run(kind):
        try:
            m, tok, d = pairs[kind]
            results[kind] = [generate(m, d, tok, prompt, max_tokens=120, block_size=bs).tokens
                             for bs in (4, 8)]
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for kind in pairs:
        assert results[kind] == [expected[kind]] * 2


def test_load_returns_float32_on_cpu(tiny_pair):
    target, _ = tiny_pair("llama")
    model, _ = load(str(target))
    assert all(p.dtype == mx.float32 for _, p in tree_flatten(model.parameters()))
