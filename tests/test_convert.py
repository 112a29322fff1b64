"""``dflash convert``: HF drafter -> MLX (optionally quantized) -> ``load_draft``.

Error bound used below. Affine quantization with ``b`` bits and group 64 rounds each weight to a grid
of ``2^b - 1`` steps spanning its group's range; for Gaussian-like weights the range of 64 samples is
about 4.8 sigma, so the RMS error of one weight is ``delta_b = 4.8 / (2^b - 1) / sqrt(12)
~= 1.39 / (2^b - 1)`` of its scale (4-bit 9.3 %, 6-bit 2.2 %, 8-bit 0.55 %). We check
1. every stored weight dequantizes to exactly ``dequantize(quantize(source weight))`` (format),
2. per tensor, the relative weight error is below ``1.5 * delta_b + 2^-7``; the second term is
   the bf16 storage of scales and biases (relative rounding 2^-9 on offsets up to ~5 sigma; in
   float32 the measured error is delta_b itself, in bf16 at 8 bits it is 1.5 * delta_b),
3. the drafter's block hidden states deviate from the unquantized drafter's by a relative error
   below ``5 * delta_b + 0.02`` (5: error amplification through 3 random layers, measured ~3.5;
   0.02: rounding of the bf16 scales/biases), and errors shrink as bits grow,
4. block predictions (logits through a random head) keep the reference's top-1 token on every row
   whose top-1 margin exceeds twice the largest logit deviation, and at 8 bits on >= 75 % of all
   rows (a random drafter and head have many near-ties; measured 86 %).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from drafter_fixtures import write_hf_drafter  # noqa: E402

from dflash import convert as convert_mod  # noqa: E402
from dflash.convert import (  # noqa: E402
    add_convert_args,
    convert,
    parse_size,
    run_convert,
)
from dflash.drafter import load_draft  # noqa: E402
from dflash.errors import DFlashError, DraftCheckpointError  # noqa: E402

HIDDEN, LAYERS, VOCAB, TAPS, BLOCK = 64, 3, 512, (0, 2), 8
LINEARS = ["fc"] + [f"layers.{i}.{m}" for i in range(LAYERS) for m in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


BF16_TERM = 2**-7


def delta(bits: int) -> float:
    return 1.39 / (2**bits - 1)


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return write_hf_drafter(tmp_path_factory.mktemp("src") / "Tiny-DFlash-b8", hidden=HIDDEN,
                            layers=LAYERS, vocab=VOCAB, taps=TAPS, block_size=BLOCK)


@pytest.fixture(scope="module")
def probe():
    """Fixed context features, block embeddings and a head: 4 blocks, 28 predicted rows."""
    k1, k2, k3 = mx.random.split(mx.random.key(7), 3)
    taps = mx.random.normal((4, 24, len(TAPS) * HIDDEN), key=k1)
    embeds = mx.random.normal((4, BLOCK, HIDDEN), key=k2) * 0.5
    head = mx.random.normal((VOCAB, HIDDEN), key=k3) * (3 / math.sqrt(HIDDEN))
    return taps, embeds, head


def block_outputs(model, probe):
    taps, embeds, head = probe
    cache = model.make_cache()
    model.append_context(taps, cache)
    hidden = model(embeds, cache)[:, 1:].reshape(-1, HIDDEN)
    return hidden, hidden @ head.T


def files_tensors(folder: Path) -> dict[str, mx.array]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def stored_bits(tensors: dict, path: str, group_size: int = 64) -> int | None:
    """Bits of a linear read back from the files (None: kept in floating point)."""
    w = tensors[f"{path}.weight"]
    if f"{path}.scales" not in tensors:
        assert w.dtype in (mx.bfloat16, mx.float16, mx.float32)
        return None
    assert w.dtype == mx.uint32
    in_dim = tensors[f"{path}.scales"].shape[-1] * group_size
    return w.shape[-1] * 32 // in_dim


def no_leftovers(parent: Path):
    assert not [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


# ---------------------------------------------------------------------------------------------
# Round trips


def test_round_trip_4_6_8_bits_within_quantization_error(hf, probe, tmp_path):
    src_weights = files_tensors(hf)
    reference = load_draft(hf)
    h_ref, logits_ref = block_outputs(reference, probe)
    errors = {}
    for bits in (4, 6, 8):
        dst = tmp_path / f"Tiny-DFlash-MLX-{bits}bit"
        report = convert(hf, dst, quantize=True, q_bits=bits, q_group_size=64)
        cfg = json.loads((dst / "config.json").read_text())
        assert cfg["quantization"] == {"group_size": 64, "bits": bits, "mode": "affine"}
        assert cfg["dflash_config"]["target_layer_ids"] == list(TAPS)  # original fields kept
        assert report["quantized"] == {p: bits for p in LINEARS} and not report["kept"]
        tensors = files_tensors(dst)
        for p in LINEARS:
            assert stored_bits(tensors, p) == bits
            w = src_weights[f"{p}.weight"]
            expect = mx.dequantize(*mx.quantize(w, group_size=64, bits=bits), group_size=64,
                                   bits=bits)
            got = mx.dequantize(tensors[f"{p}.weight"], tensors[f"{p}.scales"],
                                tensors[f"{p}.biases"], group_size=64, bits=bits)
            assert mx.array_equal(got, expect).item(), p
            w32 = w.astype(mx.float32)
            rel_w = (mx.linalg.norm(got.astype(mx.float32) - w32) / mx.linalg.norm(w32)).item()
            assert rel_w < 1.5 * delta(bits) + BF16_TERM, (p, bits, rel_w)
        for name in ("norm.weight", "hidden_norm.weight", "layers.0.self_attn.q_norm.weight"):
            assert tensors[name].dtype == mx.bfloat16
        drafter = load_draft(dst)
        h, logits = block_outputs(drafter, probe)
        rel = (mx.linalg.norm(h - h_ref) / mx.linalg.norm(h_ref)).item()
        errors[bits] = rel
        assert rel < 5 * delta(bits) + 0.02, (bits, rel)
        # Block predictions: the same top-1 token wherever the reference's top-1 margin exceeds
        # twice the largest logit deviation (random heads have near-ties elsewhere).
        dev = mx.abs(logits - logits_ref).max().item()
        top2 = mx.sort(logits_ref, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2 * dev
        same = logits.argmax(-1) == logits_ref.argmax(-1)
        assert mx.all(same | ~clear).item()
        if bits == 8:
            assert same.astype(mx.float32).mean().item() >= 0.75
        assert report["size_after"] < report["size_before"]
        assert report["bits_per_weight"] < bits + 1.0  # + bf16 scale and bias per 64 weights
        card = (dst / "README.md").read_text()
        assert f"Uniform {bits}-bit" in card and "| Group size | 64 |" in card
        assert "from dflash.model_mlx import load, load_draft, stream_generate" in card
    assert errors[8] < errors[6] < errors[4]


def test_unquantized_conversion_and_dtype(hf, probe, tmp_path):
    report = convert(hf, tmp_path / "bf16")
    assert report["quantization"] is None
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization" not in cfg
    a, _ = block_outputs(load_draft(hf), probe)
    b, _ = block_outputs(load_draft(tmp_path / "bf16"), probe)
    assert mx.array_equal(a, b).item()
    # the card names a local source by its folder, never by this machine's path
    card = (tmp_path / "bf16" / "README.md").read_text()
    assert f"DFlash drafter `{Path(hf).name}`" in card and str(Path(hf).parent) not in card

    convert(hf, tmp_path / "q32", quantize=True, q_bits=4, dtype="float32")
    tensors = files_tensors(tmp_path / "q32")
    assert tensors["fc.scales"].dtype == mx.float32 and tensors["norm.weight"].dtype == mx.float32
    assert json.loads((tmp_path / "q32" / "config.json").read_text())["torch_dtype"] == "float32"


@pytest.mark.parametrize("recipe,hi,lo", [("mixed_8_4", 8, 4), ("mixed_6_4", 6, 4)])
def test_mixed_recipes_store_the_bits_they_promise(hf, tmp_path, recipe, hi, lo):
    dst = tmp_path / recipe
    report = convert(hf, dst, quant_recipe=recipe)  # a recipe implies -q
    tensors = files_tensors(dst)
    qcfg = json.loads((dst / "config.json").read_text())["quantization"]
    for p in LINEARS:
        edge = p == "fc" or p.startswith(("layers.0.", f"layers.{LAYERS - 1}."))
        want = hi if edge else lo
        assert stored_bits(tensors, p) == want, p
        assert qcfg.get(p, {"bits": qcfg["bits"]})["bits"] == want, p
        assert report["quantized"][p] == want
    load_draft(dst)
    assert f"Mixed {hi}/{lo}-bit" in (dst / "README.md").read_text()


@pytest.mark.slow
def test_sensitivity_recipe_spends_the_budget_where_it_matters(hf, tmp_path):
    dst = tmp_path / "sens"
    report = convert(hf, dst, quant_recipe="sensitivity", bit_budget=5.0,
                     sensitivity_levels=(4, 5, 6, 8), calib_samples=6)
    tensors = files_tensors(dst)
    bits = {p: stored_bits(tensors, p) for p in LINEARS}
    sizes = {p: int(tensors[f"{p}.scales"].size) * 64 for p in LINEARS}
    average = sum(bits[p] * sizes[p] for p in LINEARS) / sum(sizes.values())
    assert average <= 5.0 + 1e-6
    assert bits == report["quantized"]
    assert abs(average - report["average_bits"]) < 1e-9
    assert len(set(bits.values())) > 1  # it really mixes
    table = report["sensitivity"]["kl_single_tensor"]
    for p in LINEARS:  # more bits never measured as worse
        kls = [table[p][str(b)] for b in (4, 5, 6, 8)]
        assert kls == sorted(kls, reverse=True)
    most = max(LINEARS, key=lambda p: table[p]["4"] / sizes[p])
    least = min(LINEARS, key=lambda p: table[p]["4"] / sizes[p])
    assert bits[most] >= bits[least]
    uniform = report["sensitivity"]["uniform_comparison"]  # uniform 5-bit, same budget
    assert uniform["bits"] == 5 and report["calibration"]["kl"] <= uniform["kl"]
    assert "SYNTHETIC" in report["calibration"]["description"]
    load_draft(dst)
    assert "Sensitivity-aware" in (dst / "README.md").read_text()


def test_indivisible_input_dim_is_kept_in_float_and_listed(tmp_path):
    src = write_hf_drafter(tmp_path / "odd", layers=1, intermediate=96)
    dst = tmp_path / "odd-q4"
    report = convert(src, dst, quantize=True, q_bits=4)
    assert report["kept"] == {
        "layers.0.mlp.down_proj": "input dimension 96 is not a multiple of the group size 64"}
    tensors = files_tensors(dst)
    assert stored_bits(tensors, "layers.0.mlp.down_proj") is None
    assert stored_bits(tensors, "layers.0.mlp.up_proj") == 4
    assert json.loads((dst / "config.json").read_text())["quantization"][
        "layers.0.mlp.down_proj"] is False
    assert "`layers.0.mlp.down_proj`: input dimension 96" in (dst / "README.md").read_text()
    load_draft(dst)


def test_sharded_input_and_sharded_output(hf, probe, tmp_path):
    src = write_hf_drafter(tmp_path / "sharded", hidden=HIDDEN, layers=LAYERS, vocab=VOCAB,
                           taps=TAPS, block_size=BLOCK, shards=3, prefix="model.")
    assert len(list(src.glob("*.safetensors"))) == 3
    one = convert(src, tmp_path / "one", quantize=True, q_bits=6)
    assert one["files"] == ["model.safetensors"] and not (tmp_path / "one" /
                                                          "model.safetensors.index.json").exists()
    many = convert(src, tmp_path / "many", quantize=True, q_bits=6, max_shard_bytes=16_000)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert many["sharded"] and len(files) == len(many["files"]) > 2
    for f in files:
        assert (tmp_path / "many" / f).stat().st_size <= 16_000 + 4096
    assert set(index["weight_map"]) == set(files_tensors(tmp_path / "one"))
    a, _ = block_outputs(load_draft(tmp_path / "one"), probe)
    b, _ = block_outputs(load_draft(tmp_path / "many"), probe)
    c, _ = block_outputs(load_draft(hf), probe)  # same seed: same weights as the single-file src
    assert mx.array_equal(a, b).item()
    assert not mx.array_equal(a, c).item()  # quantized, so not identical to bf16 ...
    assert (mx.linalg.norm(a - c) / mx.linalg.norm(c)).item() < 5 * delta(6) + 0.02  # ... but near


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the problem, nothing left at the destination


def _expect_refusal(src, dst: Path, exc, match, **kwargs):
    with pytest.raises(exc, match=match):
        convert(src, dst, **kwargs)
    assert not dst.exists()
    no_leftovers(dst.parent)


def test_not_a_drafter(tmp_path):
    src = write_hf_drafter(tmp_path / "plain", layers=1)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["dflash_config"]
    (src / "config.json").write_text(json.dumps(cfg))
    _expect_refusal(src, tmp_path / "out", DraftCheckpointError, "target_layer_ids")

    src2 = write_hf_drafter(tmp_path / "llama", layers=1,
                            extra_config={"architectures": ["LlamaForCausalLM"]})
    _expect_refusal(src2, tmp_path / "out", DraftCheckpointError, "not a DFlash drafter")
    _expect_refusal(tmp_path / "nothing-here", tmp_path / "out", DraftCheckpointError,
                    "no such drafter folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    _expect_refusal(empty, tmp_path / "out", DraftCheckpointError, "config.json")


def test_unsupported_options(hf, tmp_path):
    _expect_refusal(hf, tmp_path / "o", DFlashError, r"q_bits=7", quantize=True, q_bits=7)
    _expect_refusal(hf, tmp_path / "o", DFlashError, r"q_group_size=48", quantize=True,
                    q_group_size=48)
    _expect_refusal(hf, tmp_path / "o", DFlashError, "unknown recipe", quant_recipe="mixed_4_8")
    _expect_refusal(hf, tmp_path / "o", DFlashError, "dtype", dtype="float8")
    _expect_refusal(hf, tmp_path / "o", DFlashError, "bit_budget", quant_recipe="sensitivity",
                    bit_budget=1.0)
    with pytest.raises(DFlashError, match="overwrite the source"):
        convert(hf, hf, force=True)
    assert (hf / "model.safetensors").is_file()


def test_convert_and_load_draft_refuse_a_broken_folder_alike(tmp_path):
    """One reader (dflash.checkpoint) serves both: the same error, naming the same file."""
    src = write_hf_drafter(tmp_path / "idx", layers=1, shards=2)
    (src / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
    match = "model.safetensors.index.json: malformed"
    _expect_refusal(src, tmp_path / "out", DraftCheckpointError, match)
    with pytest.raises(DraftCheckpointError, match=match):
        load_draft(src)
    (src / "config.json").write_text("[1, 2]")
    _expect_refusal(src, tmp_path / "out", DraftCheckpointError, "config.json: expected a JSON")
    with pytest.raises(DraftCheckpointError, match="config.json: expected a JSON object"):
        load_draft(src)


def test_missing_shard_and_mismatched_shapes(tmp_path):
    src = write_hf_drafter(tmp_path / "sh", layers=1, shards=2)
    missing = sorted(src.glob("model-*.safetensors"))[1]
    missing.unlink()
    _expect_refusal(src, tmp_path / "out", DraftCheckpointError,
                    f"{missing.name}: shard listed in model.safetensors.index.json is missing")

    src = write_hf_drafter(tmp_path / "shape", layers=1)
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 256
    (src / "config.json").write_text(json.dumps(cfg))
    _expect_refusal(src, tmp_path / "out", DraftCheckpointError,
                    r"tensor layers\.0\.mlp\.\w+_proj\.weight has shape")


def test_destination_exists_refused_unless_force(hf, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(DFlashError, match="already exists"):
        convert(hf, dst, quantize=True)
    assert (dst / "keep.txt").read_text() == "mine"
    convert(hf, dst, quantize=True, force=True)
    assert not (dst / "keep.txt").exists() and (dst / "model.safetensors").is_file()
    no_leftovers(tmp_path)


def test_already_quantized_input_refused_unless_dequantize(hf, probe, tmp_path):
    q = tmp_path / "q8"
    convert(hf, q, quantize=True, q_bits=8)
    _expect_refusal(q, tmp_path / "again", DraftCheckpointError, "already quantized")
    report = convert(q, tmp_path / "deq", dequantize=True)
    assert report["quantization"] is None and report["source_quantization"]["bits"] == 8
    assert "quantization" not in json.loads((tmp_path / "deq" / "config.json").read_text())
    a, _ = block_outputs(load_draft(q), probe)
    b, _ = block_outputs(load_draft(tmp_path / "deq"), probe)
    assert mx.allclose(a, b, atol=1e-5).item()
    report = convert(q, tmp_path / "deq4", dequantize=True, quantize=True, q_bits=4)
    assert set(report["quantized"].values()) == {4}


def test_failure_midway_leaves_nothing_and_keeps_an_old_destination(hf, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(convert_mod, "model_card", boom)  # after the weights were written
    with pytest.raises(RuntimeError, match="disk full"):
        convert(hf, tmp_path / "new", quantize=True)
    assert not (tmp_path / "new").exists()
    no_leftovers(tmp_path)

    old = tmp_path / "old"
    old.mkdir()
    (old / "keep.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="disk full"):
        convert(hf, old, quantize=True, force=True)
    assert (old / "keep.txt").read_text() == "mine" and len(list(old.iterdir())) == 1
    no_leftovers(tmp_path)


# ---------------------------------------------------------------------------------------------
# With a target: real calibration features and the τ comparison


def tiny_target(hidden=HIDDEN, layers=4, vocab=VOCAB):
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=2 * hidden, num_attention_heads=4,
                           num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab,
                           head_dim=hidden // 4, tie_word_embeddings=True)
    model = llama.Model(args)
    mx.eval(model.parameters())
    model.eval()
    return model


def test_target_gives_real_calibration_and_tau(hf, tmp_path):
    target = tiny_target()
    prompts = ("a", "b", "c")
    report = convert(hf, tmp_path / "t", quantize=True, q_bits=4, target=(target, None),
                     calib_prompts=prompts, calib_samples=6, tau_prompts=prompts,
                     tau_max_tokens=12)
    tau = report["tau"]
    assert tau["prompts"] == 3 and tau["outputs_identical"]  # output is the target's either way
    assert 1.0 <= tau["original"] <= BLOCK and 1.0 <= tau["converted"] <= BLOCK
    assert "SYNTHETIC" not in report["calibration"]["description"]
    assert 0 <= report["calibration"]["top1_agreement"] <= 1
    card = (tmp_path / "t" / "README.md").read_text()
    assert "Mean acceptance τ" in card


def test_target_of_the_wrong_shape_is_refused(hf, tmp_path):
    from dflash.errors import IncompatibleDraftError

    _expect_refusal(hf, tmp_path / "o", IncompatibleDraftError, "hidden_size", quantize=True,
                    target=(tiny_target(hidden=128), None))


# ---------------------------------------------------------------------------------------------
# Command line


def test_cli_arguments(hf, tmp_path):
    import argparse

    parser = add_convert_args(argparse.ArgumentParser())
    args = parser.parse_args(["--hf-path", str(hf), "--mlx-path", str(tmp_path / "cli"), "-q",
                              "--q-bits", "6", "--q-group-size", "64", "--max-shard-size", "1MB",
                              "--report-json", str(tmp_path / "r.json")])
    assert run_convert(args) == 0
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["quantization"]["bits"] == 6
    assert json.loads((tmp_path / "r.json").read_text())["quantization"]["group_size"] == 64
    with pytest.raises(SystemExit):
        parser.parse_args(["--hf-path", "x", "--mlx-path", "y", "--q-bits", "7"])
    assert parse_size("5GB") == 5_000_000_000 and parse_size("2GiB") == 2 << 30
    assert parse_size("512") == 512
    with pytest.raises(DFlashError):
        parse_size("lots")


def test_quantized_modules_are_real_quantized_linears(hf, tmp_path):
    """Without the CPU backend's dequantization the loaded drafter holds QuantizedLinear layers."""
    from dflash.checkpoint import read_weights
    from dflash.drafter import DFlashConfig, build_draft

    dst = tmp_path / "raw"
    convert(hf, dst, quant_recipe="mixed_8_4")
    raw = json.loads((dst / "config.json").read_text())
    model = build_draft(DFlashConfig.from_dict(raw), read_weights(dst), str(dst),
                        raw["quantization"])
    mods = dict(model.named_modules())
    assert isinstance(mods["fc"], nn.QuantizedLinear) and mods["fc"].bits == 8
    assert mods["layers.1.mlp.up_proj"].bits == 4
    assert isinstance(mods["norm"], nn.RMSNorm)
