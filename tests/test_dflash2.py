"""DFlash2 drafters: loading both forms, exact output through the real loop, the convolution's
identity and block locality, the selector's walk, and the errors bad checkpoints get."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from dflash2_fixtures import write_dflash2_drafter
from mlx_lm.generate import generate_step
from test_model_card import run_model_card, write_mlx_6bit

from dflash.dflash2 import CandidateSelector, GroupedDynamicConv, block_conv, walk
from dflash.drafter import load_draft
from dflash.errors import DraftCheckpointError
from dflash.model_mlx import generate, load
from dflash.sampling import BlockSampler, SamplingConfig
from dflash.target import target_parts

PROMPT = [1, 17, 42, 5, 99, 3, 8, 250, 31, 77, 12, 9, 64, 2, 18, 40, 11, 6, 33, 21]


@pytest.fixture(scope="module")
def dflash2_pair(tiny_pair, tmp_path_factory):
    """``dflash2_pair(kind)`` -> (target_path, dflash2_path, v1_path). The window (16) is shorter
    than the prompts, so the bounded cache drops rows during the tests."""
    made = {}

    def make(kind):
        if kind not in made:
            target, v1 = tiny_pair(kind)
            root = tmp_path_factory.mktemp(f"dflash2-{kind}")
            made[kind] = (target, write_dflash2_drafter(root / "draft", v1, sliding_window=16), v1)
        return made[kind]

    return make


def fingerprint(draft, parts, anchor=7, seed=0):
    """Unary logits for a fixed random context: a deterministic fingerprint of a drafter."""
    mx.random.seed(seed)
    taps = mx.random.normal((1, 20, draft.config.num_taps * draft.config.hidden_size))
    cache = draft.make_cache()
    draft.append_context(taps, cache)
    return draft.block_logits(parts, anchor, draft.block_size, cache), cache


# ---------------------------------------------------------------------------------------------
# Loading


def test_config_fields_and_defaults(dflash2_pair):
    _, path, _ = dflash2_pair("qwen3")
    cfg = load_draft(str(path)).config
    assert cfg.is_dflash2 and cfg.block_size == 8
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) \
        == (2, 16, 64, 8)
    assert (cfg.output_multiplier, cfg.final_logit_softcapping, cfg.input_embedding_scale) \
        == (1.0, None, 1.0)
    assert cfg.sliding_window == 16 and not cfg.sliding_block_causal


def test_hf_single_sharded_and_6bit_forms_load(tmp_path, dflash2_pair, loaded_pair):
    target, path, _ = dflash2_pair("qwen3")
    parts = target_parts(loaded_pair("qwen3")[0])
    reference, _ = fingerprint(load_draft(str(path)), parts)

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    weights = mx.load(str(path / "model.safetensors"))
    names = sorted(weights)
    weight_map = {}
    for i, chunk in enumerate((names[::2], names[1::2])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        mx.save_safetensors(str(sharded / file), {k: weights[k] for k in chunk})
        weight_map.update(dict.fromkeys(chunk, file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(path / "config.json", sharded / "config.json")
    assert mx.array_equal(fingerprint(load_draft(str(sharded)), parts)[0], reference)

    six = write_mlx_6bit(path, tmp_path / "six")
    stored = mx.load(str(six / "model.safetensors"))
    assert "candidate_selector.successor_codebook.scales" in stored
    assert "layers.0.attention_conv.kernel_projection.scales" in stored
    quantized, _ = fingerprint(load_draft(str(six)), parts)
    assert mx.abs(quantized - reference).max().item() < 0.1 * mx.abs(reference).max().item()


# ---------------------------------------------------------------------------------------------
# Running: exactness through the real loop


@pytest.mark.parametrize("kind", [pytest.param("qwen3", marks=pytest.mark.slow), "qwen3_5",
                                  pytest.param("llama", marks=pytest.mark.slow)])
def test_greedy_output_equals_mlx_lm(kind, dflash2_pair):
    target, path, _ = dflash2_pair(kind)
    model, tokenizer = load(str(target))
    draft = load_draft(str(path))
    expected = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=80)]
    for policy in ("fixed", "auto"):
        out = generate(model, draft, tokenizer, PROMPT, max_tokens=80, policy=policy)
        assert out.tokens == expected, (kind, policy)


def test_planted_partial_acceptance(dflash2_pair):
    """Proposals from the reference with planted errors (a DFlash2 drafter whose successor
    codebook is zero walks the unary argmax): accept-none/some/all cycles stay exact."""
    from tiny_models import OracleDrafter

    target, _, v1 = dflash2_pair("qwen3")
    model, tokenizer = load(str(target))
    draft = load_draft(str(write_dflash2_drafter(target.parent / "zero-successor", v1,
                                                 zero_successor=True, sliding_window=16)))
    expected = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=60)]
    oracle = OracleDrafter(draft, PROMPT + expected + [0] * 16, lambda c, j: j == c % 5)
    out = generate(model, oracle, tokenizer, PROMPT, max_tokens=60, policy="fixed")
    assert out.tokens == expected
    assert 1 < out.stats.mean_tau < 8


def test_identity_conv_and_zero_successor_propose_as_v1(tmp_path, dflash2_pair, loaded_pair):
    """An upgraded v1 drafter (identity convolution, zero successor codebook, no window) gives
    v1's hidden states bit for bit and proposes v1's argmax."""
    target, _, v1_path = dflash2_pair("qwen3")
    parts = target_parts(loaded_pair("qwen3")[0])
    upgraded = load_draft(str(write_dflash2_drafter(
        tmp_path / "up", v1_path, identity=True, zero_successor=True, sliding_window=None)))
    v1 = load_draft(str(v1_path))
    v1_logits, _ = fingerprint(v1, parts)
    v2_logits, cache = fingerprint(upgraded, parts)
    assert mx.array_equal(v1_logits, v2_logits)
    sampler = BlockSampler(SamplingConfig())
    proposals, q = upgraded.propose(v2_logits, 7, cache, sampler, [])
    assert q is None
    assert proposals.tolist() == mx.argmax(v1_logits, axis=-1).tolist()


# ---------------------------------------------------------------------------------------------
# The convolution


def test_identity_conv_is_a_no_op():
    conv = GroupedDynamicConv(32, taps=2, group=8)
    conv.identity()
    u = mx.random.normal((1, 6, 32))
    assert mx.array_equal(conv(u, lambda a: 2 * a), 2 * u)


def test_conv_formula_element_by_element():
    """Conv(y; b, d)[t, c] = sum_j (b[j, c] + d[t, j, c // group]) y[t - j, c], zero before t=0."""
    mx.random.seed(4)
    conv = GroupedDynamicConv(8, taps=2, group=4)
    conv.base_kernel = mx.random.normal((2, 2, 8))
    conv.kernel_projection.weight = mx.random.normal((2 * 2 * 2, 8))
    u = mx.random.normal((1, 3, 8))
    got = np.array(conv(u, lambda a: a))
    b, un = np.array(conv.base_kernel, np.float64), np.array(u[0], np.float64)
    d = (un @ np.array(conv.kernel_projection.weight, np.float64).T).reshape(3, 2, 2, 2)

    def conv_np(y, side):
        out = np.zeros_like(y)
        for t in range(3):
            for c in range(8):
                for j in range(2):
                    if t - j >= 0:
                        out[t, c] += (b[side, j, c] + d[t, side, j, c // 4]) * y[t - j, c]
        return out

    np.testing.assert_allclose(got[0], conv_np(conv_np(un, 0), 1), rtol=1e-4, atol=1e-5)


def test_no_information_crosses_a_block_boundary(dflash2_pair, loaded_pair):
    # The convolution: a block's outputs never see anything before its first token.
    mx.random.seed(5)
    coefficients = mx.random.normal((1, 4, 2, 8))
    prev, block = mx.random.normal((1, 4, 8)), mx.random.normal((1, 4, 8))
    together = block_conv(mx.concatenate([prev, block], axis=1),
                          mx.concatenate([coefficients, coefficients], axis=1))
    alone = block_conv(block, coefficients)
    assert not mx.array_equal(together[:, 4:], alone)  # one stream over both blocks would leak
    assert mx.array_equal(alone[:, 0], coefficients[:, 0, 0] * block[:, 0])
    assert mx.array_equal(together[:, 1:4], block_conv(prev, coefficients)[:, 1:4])
    # The drafter: a block drafted after another one equals a block drafted fresh.
    _, path, _ = dflash2_pair("qwen3")
    parts = target_parts(loaded_pair("qwen3")[0])
    draft = load_draft(str(path))
    fresh, _ = fingerprint(draft, parts, anchor=11)
    _, cache = fingerprint(draft, parts, anchor=3)
    after = draft.block_logits(parts, 11, draft.block_size, cache)
    assert mx.array_equal(after, fresh)


def test_window_cache_keeps_window_minus_one_rows(dflash2_pair, loaded_pair):
    """Context beyond the window never reaches the block: the cache holds 15 rows, and a long
    context gives the same logits as only its last 15 rows at the same positions."""
    _, path, _ = dflash2_pair("qwen3")
    parts = target_parts(loaded_pair("qwen3")[0])
    draft = load_draft(str(path))
    mx.random.seed(6)
    taps = mx.random.normal((1, 40, draft.config.num_taps * draft.config.hidden_size))
    full = draft.make_cache()
    for i in range(0, 40, 7):
        draft.append_context(taps[:, i:i + 7], full)
    assert full[0].offset == 40 and full[0].keys.shape[2] == 15
    tail = draft.make_cache()
    draft.append_context(taps, tail)
    assert tail[0].keys.shape[2] == 15
    assert mx.allclose(draft.block_logits(parts, 5, 8, full),
                       draft.block_logits(parts, 5, 8, tail), atol=1e-5)
    changed = mx.concatenate([taps[:, :25] * 3, taps[:, 25:]], axis=1)
    other = draft.make_cache()
    draft.append_context(changed, other)
    assert mx.allclose(draft.block_logits(parts, 5, 8, other),
                       draft.block_logits(parts, 5, 8, tail), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The selector


def small_selector():
    """V = 5, r = 2, K = 3, H = 2; P = identity, so g_t = h_t."""
    sel = CandidateSelector(hidden=2, rank=2, vocab=5, top_k=3)
    sel.hidden_projection.weight = mx.eye(2)
    sel.predecessor_codebook.weight = mx.array([[1, 0], [0, 1], [1, 1], [2, 0], [0, -1.0]])
    sel.successor_codebook.weight = mx.array([[0, 0], [3, 0], [0, 3], [1, 1], [-2, 0.0]])
    return sel


def test_selector_walk_by_hand():
    sel = small_selector()
    unary = mx.array([[0.0, 1.0, 1.2, 0.9, -5.0],
                      [2.0, 0.0, 1.5, 1.9, -1.0]])
    hidden = mx.array([[1.0, 0.0], [0.0, 1.0]])
    ids, values, first, rest = sel.lattice(hidden, unary, anchor=4)
    # Row 0: candidates by unary: 2 (1.2), 1 (1.0), 3 (0.9). Anchor 4: A[4] = (0, -1); g_0 = (1, 0)
    # -> transition sum_r A[4,r] g_0[r] B[b,r] = 0 for every b: scores 1.2, 1.0, 0.9 -> token 2.
    assert ids[0].tolist() == [2, 1, 3] and np.allclose(first, 0)
    # Row 1: candidates 0 (2.0), 3 (1.9), 2 (1.5). Predecessor 2: A[2] = (1, 1); g_1 = (0, 1)
    # -> B[b, 1]: b=0: 0, b=3: 1, b=2: 3. Scores 2.0, 2.9, 4.5 -> token 2.
    assert ids[1].tolist() == [0, 3, 2]
    np.testing.assert_allclose(rest[0][0], [0.0, 1.0, 3.0])  # from candidate 2 of row 0
    np.testing.assert_allclose(rest[0][1], [0.0, 1.0, 3.0])  # from 1: A[1] = (0, 1)
    np.testing.assert_allclose(rest[0][2], [0.0, 0.0, 0.0])  # from 3: A[3] = (2, 0)
    assert walk(ids, values, first, rest, lambda _, s: int(np.argmax(s))) == [2, 2]
    # Unary argmax alone would propose [2, 0]; the walk from predecessor 3 would too:
    np.testing.assert_allclose(values[1] + rest[0][2], [2.0, 1.9, 1.5])


def test_selector_sampled_q_is_softmax_of_scores_over_candidates():
    sel = small_selector()
    unary = mx.array([[0.0, 1.0, 1.2, 0.9, -5.0], [2.0, 0.0, 1.5, 1.9, -1.0]])
    ids, values, first, rest = sel.lattice(mx.array([[1.0, 0.0], [0.0, 1.0]]), unary, anchor=4)
    sampler = BlockSampler(SamplingConfig(temperature=0.5, top_p=0.5, seed=0, proposal="sample"))
    qs = []

    def draw(candidates, scores):
        index, q = sampler.draw_scores(candidates, scores)
        qs.append(q)
        return index

    path = walk(ids, values, first, rest, draw)
    expected0 = np.exp(np.array([1.2, 1.0, 0.9]) / 0.5)
    np.testing.assert_allclose(qs[0].probs, expected0 / expected0.sum())  # no top_p on q
    assert qs[0].ids.tolist() == [2, 1, 3]
    prev = [2, 1, 3].index(path[0])
    expected1 = np.exp((values[1] + rest[0][prev]) / 0.5)
    np.testing.assert_allclose(qs[1].probs, expected1 / expected1.sum())


def test_softcap_and_multiplier_shape_the_unary_logits():
    sel = CandidateSelector(hidden=2, rank=2, vocab=3, top_k=2, output_multiplier=0.5,
                            softcap=2.0)
    got = sel.unary(mx.array([[4.0, -8.0, 0.0]]))
    np.testing.assert_allclose(np.array(got), [[2 * np.tanh(1.0), 2 * np.tanh(-2.0), 0.0]],
                               rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Bad input


def edited_copy(src, dst, config_edit=None, weights_edit=None):
    shutil.copytree(src, dst)
    if config_edit:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if weights_edit:
        weights = dict(mx.load(str(dst / "model.safetensors")))
        weights_edit(weights)
        mx.save_safetensors(str(dst / "model.safetensors"), weights)
    return dst


def _set(section, **values):
    def edit(cfg):
        (cfg if section is None else cfg[section]).update(values)
    return edit


@pytest.mark.parametrize("name, edit, message", [
    ("arch", _set(None, architectures=["DFlash3DraftModel"]), "`architectures`"),
    ("taps", _set("dflash_config", conv_kernel_size=9), "conv_kernel_size"),
    ("taps0", _set("dflash_config", conv_kernel_size=0), "conv_kernel_size"),
    ("group", _set("dflash_config", conv_group_size=24), "conv_group_size"),
    ("rank", _set("dflash_config", selector_rank=0), "selector_rank"),
    ("topk0", _set("dflash_config", selector_top_k=0), "selector_top_k"),
    ("topkV", _set("dflash_config", selector_top_k=10**7), "selector_top_k"),
    ("missing", lambda cfg: cfg["dflash_config"].pop("selector_rank"), "selector_rank"),
])
def test_bad_config_names_the_field(tmp_path, dflash2_pair, name, edit, message):
    _, path, _ = dflash2_pair("qwen3")
    bad = edited_copy(path, tmp_path / name, config_edit=edit)
    with pytest.raises(DraftCheckpointError, match=message):
        load_draft(str(bad))


@pytest.mark.parametrize("tensor", ["candidate_selector.successor_codebook",
                                    "candidate_selector.predecessor_codebook",
                                    "layers.0.mlp_conv.base_kernel",
                                    "layers.0.attention_conv.kernel_projection.weight"])
@pytest.mark.parametrize("fault", ["missing", "misshapen"])
def test_bad_tensor_names_the_tensor(tmp_path, dflash2_pair, tensor, fault):
    _, path, _ = dflash2_pair("qwen3")

    def edit(weights):
        if fault == "missing":
            del weights[tensor]
        else:
            weights[tensor] = weights[tensor][..., :-1]

    bad = edited_copy(path, tmp_path / "bad", weights_edit=edit)
    with pytest.raises(DraftCheckpointError, match=tensor.replace(".", r"\.")):
        load_draft(str(bad))


# ---------------------------------------------------------------------------------------------
# The model card


@pytest.mark.slow
def test_model_card_snippet_runs_with_a_dflash2_drafter(tmp_path, tiny_pair):
    target, v1 = tiny_pair("qwen3_5_wrapped")
    hf = write_dflash2_drafter(tmp_path / "hf", v1)
    six = write_mlx_6bit(hf, tmp_path / "Qwen3.5-4B-DFlash2-MLX-6bit")
    for draft in (hf, six):
        run_model_card(target, draft)
