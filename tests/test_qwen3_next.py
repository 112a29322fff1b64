"""Qwen3-Next targets (mlx-lm's ``qwen3_next``: GatedDeltaNet layers behind fused ``in_proj_qkvz``
/ ``in_proj_ba`` projections, gated attention, a sparse-MoE MLP) in one process.

The promise is the one for every target: greedy output identical to mlx-lm's own ``generate_step``,
token for token, whatever the drafter proposes. A planted drafter makes the verify passes accept
all, some or none of their rows, so the GatedDeltaNet states are rolled back (replayed from the
pass's start) over and over, under the ``fixed`` and ``auto`` policies and in the batched engine.
Split by layers over two ranks: tests/test_pipeline.py.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache
from tiny_models import OracleDrafter, write_drafter

from dflash.target import VerifyTrace, forward, make_cache, rollback, target_parts

N_TOKENS = 80
# Qwen3-Next's layout at a tiny size: three GatedDeltaNet layers to one attention layer
# (full_attention_interval 4, so layers 0-2 are linear and 3 is attention), sparse-MoE MLPs
# (4 experts, 2 per token, a shared expert) except layer 1's dense one (mlp_only_layers).
QWEN3_NEXT = dict(model_type="qwen3_next", head_dim=16, rope_theta=1e7,
                  partial_rotary_factor=0.25, full_attention_interval=4,
                  linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4,
                  num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[1], moe_intermediate_size=32,
                  shared_expert_intermediate_size=64, tie_word_embeddings=False)


def write_qwen3_next(path: Path) -> Path:
    """A random-weight float32 qwen3_next target (4 layers, hidden 128, SmolLM2's tokenizer)
    saved as an ordinary mlx-lm folder."""
    from test_kv_cache import write_fixture

    return write_fixture(path, "qwen3", **QWEN3_NEXT)


def mixed(cycle: int, j: int) -> bool:
    """Wrong proposals at different rows of different cycles: accept-none, -some, -all."""
    return (cycle % 3 == 0 and j == 0) or (cycle % 3 == 1 and j == 3)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(model, tokenizer, drafter) for the qwen3_next fixture, the drafter tapping layers 0 and
    2 (both GatedDeltaNet layers)."""
    from conftest import calibrated

    from dflash.model_mlx import load, load_draft

    root = tmp_path_factory.mktemp("qwen3_next")
    target = write_qwen3_next(root / "target")
    draft = write_drafter(root / "draft", target, taps=(0, 2))
    calibrated(target, draft)
    model, tokenizer = load(str(target))
    return model, tokenizer, load_draft(str(draft))


@pytest.fixture(scope="module")
def reference(pair):
    model, tokenizer, _ = pair
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about the sea."}], add_generation_prompt=True)
    return prompt, [int(t) for t, _ in generate_step(mx.array(prompt), model,
                                                     max_tokens=N_TOKENS)]


def test_fixture_is_qwen3_next(pair):
    model, _, _ = pair
    assert type(model).__module__ == "mlx_lm.models.qwen3_next"
    layers = target_parts(model).layers
    assert [hasattr(layer, "linear_attn") for layer in layers] == [True, True, True, False]
    assert all(hasattr(layer.linear_attn, "in_proj_qkvz") for layer in layers[:3])
    assert [type(layer.mlp).__name__ for layer in layers] == [
        "Qwen3NextSparseMoeBlock", "Qwen3NextMLP", "Qwen3NextSparseMoeBlock",
        "Qwen3NextSparseMoeBlock"]


def test_walk_is_bit_identical_to_mlx_lm(pair):
    """dflash's layer walk (its own GatedDeltaNet front end included) gives the logits of the
    model's own forward, bit for bit, over a prompt and then a multi-row pass, and leaves the
    same caches."""
    model, _, _ = pair
    parts = target_parts(model)
    ours, theirs = make_cache(parts), model.make_cache()
    for tokens in ([5, 17, 300, 42, 9, 1000, 77], [3, 2, 8, 11, 12], [40]):
        x = mx.array(tokens)[None]
        got, _ = forward(parts, x, ours, [], VerifyTrace())
        want = model(x, cache=theirs)
        assert np.array_equal(np.array(got), np.array(want))
    for a, b in zip(ours, theirs, strict=True):
        if isinstance(a, ArraysCache):
            for x, y in zip(a.cache, b.cache, strict=True):
                assert np.array_equal(np.array(x), np.array(y))
        else:
            assert a.offset == b.offset
            assert np.array_equal(np.array(a.keys[..., :a.offset, :]),
                                  np.array(b.keys[..., :b.offset, :]))


@pytest.mark.parametrize("keep", [pytest.param(1, marks=pytest.mark.slow), 3,
                                  pytest.param(6, marks=pytest.mark.slow)])
def test_rollback_restores_every_cache(keep, pair):
    """After a verify pass and a roll-back to ``keep`` rows, every cache (conv window and
    recurrent state of each GatedDeltaNet layer, the attention layer's keys) equals a cache fed
    only the kept rows, and the next step agrees."""
    model, _, _ = pair
    parts = target_parts(model)
    tokens = [5, 17, 300, 42, 9, 1000, 77, 3, 2, 8, 11, 12]
    prefix, block = tokens[:4], tokens[4:10]
    rolled, trace = make_cache(parts), VerifyTrace()
    forward(parts, mx.array(prefix)[None], rolled, [])
    forward(parts, mx.array(block)[None], rolled, [], trace)
    assert sorted(trace.deltas) == [0, 1, 2]
    rollback(rolled, trace, keep=keep, verified=len(block))
    fresh = make_cache(parts)
    forward(parts, mx.array(prefix)[None], fresh, [])
    forward(parts, mx.array(block[:keep])[None], fresh, [])
    for r, f in zip(rolled, fresh, strict=True):
        if isinstance(r, ArraysCache):
            for a, b in zip(r.cache, f.cache, strict=True):
                assert mx.allclose(a, b, atol=1e-5), "GatedDeltaNet state differs after roll-back"
        else:
            assert r.offset == f.offset
            assert mx.allclose(r.keys[..., :r.offset, :], f.keys[..., :f.offset, :], atol=1e-5)
    nxt = mx.array([tokens[10]])[None]
    la, _ = forward(parts, nxt, rolled, [])
    lb, _ = forward(parts, nxt, fresh, [])
    assert mx.allclose(la, lb, atol=1e-4)


def test_greedy_equals_target_alone(pair, reference):
    from dflash.model_mlx import generate

    model, tokenizer, draft = pair
    prompt, ref = reference
    out = generate(model, draft, tokenizer, prompt, block_size=8, max_tokens=N_TOKENS)
    assert out.tokens == ref and out.finish_reason == "length"


@pytest.mark.parametrize("policy", ["fixed", "auto"])
def test_partial_acceptance_stays_exact(policy, pair, reference):
    """Verify passes that reject some of their rows, so the GatedDeltaNet states are rolled
    back: still mlx-lm's tokens."""
    from dflash.model_mlx import generate

    model, tokenizer, draft = pair
    prompt, ref = reference
    oracle = OracleDrafter(draft, prompt + ref + [0] * 32, mixed)
    out = generate(model, oracle, tokenizer, prompt, block_size=8, max_tokens=N_TOKENS,
                   policy=policy, lookup=False)
    assert out.tokens == ref
    assert 1.0 < out.stats.mean_tau < 7.5  # some rows accepted, some rejected


@pytest.mark.slow
def test_batched_partial_acceptance_stays_exact(pair):
    """The batched engine (per-row GatedDeltaNet replay after each row's own acceptance): every
    request's tokens are mlx-lm's for that request alone."""
    from test_batch import MAX_TOKENS, BatchOracle, alone, mixed_plant, prompts_for, run_engine

    from dflash.batch import BatchGenerator

    model, tokenizer, draft = pair
    prompts = prompts_for(tokenizer)
    refs = {tuple(p): p + alone(model, p, m + 8) for p, m in zip(prompts, MAX_TOKENS)}
    oracle = BatchOracle(draft, refs, mixed_plant)
    engine = BatchGenerator(model, oracle, tokenizer, max_batch=4, prefill_chunk=8,
                            block_size=6, policy="fixed")
    oracle.engine = engine
    tokens, _, stats = run_engine(engine, prompts, MAX_TOKENS)
    for p, m, out in zip(prompts, MAX_TOKENS, tokens):
        assert out == refs[tuple(p)][len(p):len(p) + m]
    taus = [st.mean_tau for st in stats if st.cycles]
    assert taus and min(taus) > 1.0 and any(t < 6.0 for t in taus)
