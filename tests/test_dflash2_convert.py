"""dflash convert on DFlash2 drafters: which tensors quantize (kernel projections, the selector's
projection, the codebooks at their own bits or float), the written names, the read-back through
``load_draft`` and greedy output identical to the target alone."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from dflash2_fixtures import write_dflash2_drafter
from mlx_lm.generate import generate_step
from test_dflash2 import PROMPT

from dflash.convert import convert
from dflash.drafter import CODEBOOKS, load_draft
from dflash.errors import DFlashError
from dflash.model_mlx import generate, load

KERNEL = "layers.0.attention_conv.kernel_projection"
SELECTOR = "candidate_selector.hidden_projection"


@pytest.fixture(scope="module")
def dflash2_source(tiny_pair, tmp_path_factory):
    target, v1 = tiny_pair("qwen3")
    root = tmp_path_factory.mktemp("dflash2-convert")
    return target, write_dflash2_drafter(root / "src", v1, sliding_window=16)


def stored_bits(folder, name):
    """Bits of a tensor as written (None: float), from the config's quantization block."""
    stored = mx.load(str(folder / "model.safetensors"))
    if f"{name}.scales" not in stored:
        assert name in stored or f"{name}.weight" in stored, name
        return None
    q = json.loads((folder / "config.json").read_text())["quantization"]
    return q[name]["bits"] if isinstance(q.get(name), dict) else q["bits"]


@pytest.mark.slow
def test_6bit_round_trip_is_exact_through_the_engine(dflash2_source, tmp_path):
    target, src = dflash2_source
    out = tmp_path / "six"
    report = convert(src, out, quantize=True, q_bits=6, target=str(target),
                     tau_prompts=("Count to ten.", "Name a colour."), tau_max_tokens=24)
    assert stored_bits(out, KERNEL) == 6 and stored_bits(out, SELECTOR) == 6
    for name in CODEBOOKS:
        assert stored_bits(out, name) == 8  # the default codebook bits
    assert report["tau"]["converted"] >= 1.0
    model, tokenizer = load(str(target))
    draft = load_draft(out)
    assert draft.config.is_dflash2
    expected = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=60)]
    assert generate(model, draft, tokenizer, PROMPT, max_tokens=60, policy="fixed").tokens \
        == expected


@pytest.mark.slow
def test_float_parts_and_released_names(dflash2_source, tmp_path):
    _, src = dflash2_source
    plain = tmp_path / "bf16"
    convert(src, plain)
    stored = mx.load(str(plain / "model.safetensors"))
    assert all(name in stored for name in CODEBOOKS)  # bare names, as released
    kept = convert(src, tmp_path / "kept", quantize=True, q_bits=4, codebook_bits=None,
                   float_kernels=True)
    for name in CODEBOOKS + (KERNEL,):
        assert stored_bits(tmp_path / "kept", name) is None
        assert name in kept["kept"]
    assert stored_bits(tmp_path / "kept", SELECTOR) == 4
    load_draft(tmp_path / "kept")  # per-tensor False entries read back
    # mixed: parts outside the layer stack (fc, the selector's projection) at the high bits
    mixed = convert(src, tmp_path / "mixed", quant_recipe="mixed_8_4", codebook_bits=4)
    assert mixed["quantized"][SELECTOR] == 8 and mixed["quantized"]["fc"] == 8
    assert all(mixed["quantized"][name] == 4 for name in CODEBOOKS)
    load_draft(tmp_path / "mixed")


@pytest.mark.slow
def test_sensitivity_recipe_plans_the_dflash2_projections(dflash2_source, tmp_path):
    target, src = dflash2_source
    report = convert(src, tmp_path / "sens", quant_recipe="sensitivity", bit_budget=5,
                     target=str(target), tau_prompts=())
    measured = report["sensitivity"]["kl_single_tensor"]
    assert KERNEL in measured and SELECTOR in measured
    assert all(name not in measured and report["quantized"][name] == 8 for name in CODEBOOKS)
    load_draft(tmp_path / "sens")


def test_bad_codebook_bits_is_named(dflash2_source, tmp_path):
    _, src = dflash2_source
    with pytest.raises(DFlashError, match="codebook_bits=7"):
        convert(src, tmp_path / "x", quantize=True, codebook_bits=7)
