"""load_draft reads every config variant and both weight forms; bad checkpoints fail clearly."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from tiny_models import write_drafter

from dflash.drafter import DFlashConfig, load_draft
from dflash.errors import DraftCheckpointError, GenerationConfigError, IncompatibleDraftError
from dflash.model_mlx import generate
from dflash.target import target_parts


def block_hidden(draft, parts, seed=0):
    """Drafter output for a fixed random context and block: a deterministic fingerprint."""
    mx.random.seed(seed)
    taps = mx.random.normal((1, 5, draft.config.num_taps * draft.config.hidden_size))
    cache = draft.make_cache()
    draft.append_context(taps, cache)
    return draft.block_logits(parts, 7, draft.block_size, cache)


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    return cfg


def test_config_variants_top_level_or_nested():
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100}
    nested = DFlashConfig.from_dict({**base, "rope_parameters": {"rope_theta": 1e7,
                                                                 "rope_type": "default"},
                                     "dflash_config": {"target_layer_ids": [1, 5, 9, 13, 17, 21,
                                                                            25, 29],
                                                       "mask_token_id": 99, "block_size": 16}})
    assert nested.rope_theta == 1e7 and nested.block_size == 16 and nested.num_taps == 8
    assert nested.head_dim == 16 and nested.rope_scaling is None
    top = DFlashConfig.from_dict({**base, "rope_theta": 1e6, "block_size": 8,
                                  "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 4096},
                                  "layer_types": ["sliding_attention", "full_attention"],
                                  "sliding_window": 4096,
                                  "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33],
                                                    "mask_token_id": 7}})
    assert top.rope_theta == 1e6 and top.block_size == 8 and top.num_taps == 5
    assert top.rope_scaling["rope_type"] == "yarn"
    assert top.layer_types == ["sliding_attention", "full_attention"]


def test_hf_bf16_and_sharded_and_quantized_forms_agree(tmp_path, tiny_pair, loaded_pair):
    target, draft_dir = tiny_pair("qwen3")
    model, tokenizer, draft = loaded_pair("qwen3")
    parts = target_parts(model)
    reference = block_hidden(draft, parts)

    # Sharded with an index.
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    weights = mx.load(str(draft_dir / "model.safetensors"))
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, keys in halves.items():
        mx.save_safetensors(str(sharded / file), {k: weights[k] for k in keys})
        weight_map.update(dict.fromkeys(keys, file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(draft_dir / "config.json", sharded / "config.json")
    assert mx.allclose(block_hidden(load_draft(str(sharded)), parts), reference)

    # MLX quantized: uniform 6-bit / group 64 with one per-layer override at 8 bits.
    quant = tmp_path / "q6"
    quant.mkdir()
    qmodel = load_draft(str(draft_dir), dtype=mx.bfloat16)
    overrides = {"layers.0.mlp.down_proj": {"group_size": 64, "bits": 8}}
    nn.quantize(qmodel, group_size=64, bits=6,
                class_predicate=lambda p, m: overrides.get(p, isinstance(m, nn.Linear)))
    mx.save_safetensors(str(quant / "model.safetensors"), dict(tree_flatten(qmodel.parameters())))
    cfg = json.loads((draft_dir / "config.json").read_text())
    cfg["quantization"] = {"group_size": 64, "bits": 6, **overrides}
    (quant / "config.json").write_text(json.dumps(cfg))
    loaded = load_draft(str(quant))
    assert loaded.layers[0].mlp.down_proj.weight.dtype == mx.float32  # dequantized on the CPU
    got = block_hidden(loaded, parts)
    rel = mx.abs(got - reference).max() / mx.abs(reference).max()
    assert rel.item() < 0.05
    out = generate(model, loaded, tokenizer, [1, 2, 3, 4], max_tokens=20)
    assert out.stats.generation_tokens == 20


def test_sliding_window_override_and_layer_types(tmp_path, tiny_pair, loaded_pair):
    target, _ = tiny_pair("qwen3")
    model, tokenizer, _ = loaded_pair("qwen3")
    path = write_drafter(tmp_path / "swa", target, layers=2,
                         extra={"layer_types": ["sliding_attention", "full_attention"],
                                "sliding_window": 4})
    draft = load_draft(str(path))
    assert draft.layers[0].self_attn.sliding_window == 4
    assert draft.layers[1].self_attn.sliding_window is None
    assert load_draft(str(path), sliding_window_size=64).layers[0].self_attn.sliding_window == 64
    out = generate(model, draft, tokenizer, list(range(1, 30)), max_tokens=12)
    assert out.stats.generation_tokens == 12


def copy_draft(tiny_pair, tmp_path, name="bad"):
    _, draft_dir = tiny_pair("qwen3")
    dst = tmp_path / name
    shutil.copytree(draft_dir, dst)
    return dst


def test_bad_checkpoints_raise_clear_errors(tmp_path, tiny_pair):
    missing = copy_draft(tiny_pair, tmp_path, "missing")
    (missing / "config.json").unlink()
    with pytest.raises(DraftCheckpointError, match="config.json"):
        load_draft(str(missing))

    malformed = copy_draft(tiny_pair, tmp_path, "malformed")
    (malformed / "config.json").write_text("{not json")
    with pytest.raises(DraftCheckpointError, match="malformed JSON"):
        load_draft(str(malformed))

    not_dflash = copy_draft(tiny_pair, tmp_path, "notdflash")
    edit_config(not_dflash, dflash_config=None)
    with pytest.raises(DraftCheckpointError, match="target_layer_ids"):
        load_draft(str(not_dflash))

    truncated = copy_draft(tiny_pair, tmp_path, "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(DraftCheckpointError, match="model.safetensors"):
        load_draft(str(truncated))

    weights = mx.load(str(copy_draft(tiny_pair, tmp_path, "w") / "model.safetensors"))
    lacking = copy_draft(tiny_pair, tmp_path, "lacking")
    mx.save_safetensors(str(lacking / "model.safetensors"),
                        {k: v for k, v in weights.items() if k != "fc.weight"})
    with pytest.raises(DraftCheckpointError, match="missing.*fc.weight"):
        load_draft(str(lacking))

    extra = copy_draft(tiny_pair, tmp_path, "extra")
    mx.save_safetensors(str(extra / "model.safetensors"), {**weights, "bogus.weight": mx.ones(3)})
    with pytest.raises(DraftCheckpointError, match="unexpected.*bogus.weight"):
        load_draft(str(extra))

    shape = copy_draft(tiny_pair, tmp_path, "shape")
    edit_config(shape, intermediate_size=96)
    with pytest.raises(DraftCheckpointError, match="shape"):
        load_draft(str(shape))

    with pytest.raises(DraftCheckpointError, match="no such"):
        load_draft(str(tmp_path / "does-not-exist"))


@pytest.mark.parametrize("field,value,match", [
    ("hidden_size", 32, "hidden_size"),
    ("vocab_size", 1000, "vocab_size"),
    ("num_target_layers", 9, "num_target_layers"),
    ("dflash_config", {"target_layer_ids": [0, 4], "mask_token_id": 5}, "target_layer_ids"),
])
def test_incompatible_drafter_is_refused_before_generation(field, value, match, tmp_path,
                                                           tiny_pair, loaded_pair):
    target, _ = tiny_pair("qwen3")
    model, tokenizer, _ = loaded_pair("qwen3")
    extra = {field: value}
    if field == "hidden_size":
        extra["head_dim"] = 8
    path = write_drafter(tmp_path / field, target, extra=extra)
    draft = load_draft(str(path))
    with pytest.raises(IncompatibleDraftError, match=match):
        generate(model, draft, tokenizer, [1, 2, 3], max_tokens=5)


@pytest.mark.parametrize("kwargs,match", [
    ({"block_size": 1}, "block_size"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": -1}, "max_tokens"),
])
def test_bad_generation_settings_raise_before_generating(kwargs, match, loaded_pair):
    model, tokenizer, draft = loaded_pair("qwen3")
    with pytest.raises(GenerationConfigError, match=match):
        generate(model, draft, tokenizer, [1, 2, 3], **kwargs)


def test_no_state_left_after_error_or_interrupted_generator(loaded_pair):
    model, tokenizer, draft = loaded_pair("qwen3_5")
    prompt = [1, 5, 9, 33, 2]
    before = generate(model, draft, tokenizer, prompt, max_tokens=40).tokens
    gen = __import__("dflash.model_mlx", fromlist=["x"]).stream_generate(
        model, draft, tokenizer, prompt, max_tokens=40, block_size=4)
    next(gen)
    next(gen)
    gen.close()
    with pytest.raises(GenerationConfigError):
        generate(model, draft, tokenizer, prompt, temperature=-1)
    assert generate(model, draft, tokenizer, prompt, max_tokens=40).tokens == before


def cut_drafter(tmp_path, target, vocab: list[int]):
    """A tiny drafter for ``target`` that proposes only ``vocab``."""
    path = write_drafter(tmp_path / "cut", target,
                         extra={"dflash_config": {"target_layer_ids": [0, 2],
                                                  "mask_token_id": 100,
                                                  "draft_vocab_ids": vocab}})
    return load_draft(str(path))


def test_restricted_draft_vocabulary_proposes_from_it_and_stays_exact(tmp_path, tiny_pair,
                                                                       loaded_pair):
    target, _ = tiny_pair("qwen3")
    model, tokenizer, full_draft = loaded_pair("qwen3")
    prompt = [1, 2, 3, 4, 5, 6]
    ref = generate(model, full_draft, tokenizer, prompt, max_tokens=40).tokens
    vocab = sorted(set(ref[::2]) | {7, 8, 9})
    draft = cut_drafter(tmp_path, target, vocab)
    parts = target_parts(model)
    cache = draft.make_cache()
    draft.append_context(mx.zeros((1, 3, 2 * draft.config.hidden_size)), cache)
    proposals = mx.argmax(draft.block_logits(parts, 5, 8, cache), axis=-1).tolist()
    assert set(proposals) <= set(vocab)
    for threshold in (0.0, 0.01, 0.3, 1.0):  # the confidence reads the vocabulary's columns
        out = generate(model, draft, tokenizer, prompt, max_tokens=40, min_confidence=threshold)
        assert out.tokens == ref
    assert out.stats.verified_tokens <= out.stats.cycles
    bad = write_drafter(tmp_path / "badcut", target,
                        extra={"dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 100,
                                                 "draft_vocab_ids": [10**7]}})
    with pytest.raises(IncompatibleDraftError, match="draft_vocab_ids"):
        generate(model, load_draft(str(bad)), tokenizer, prompt, max_tokens=4)


def test_cut_vocabulary_scores_and_every_proposal_path_stay_exact(tmp_path, tiny_pair,
                                                                  loaded_pair):
    """``block_scores`` scores only the draft vocabulary (``block_logits`` is the same numbers
    with -inf elsewhere); greedy proposals read from the candidates on the host, and proposals
    through ``propose`` (logit bias), keep every policy exact."""
    target, _ = tiny_pair("qwen3")
    model, tokenizer, full_draft = loaded_pair("qwen3")
    prompt = [1, 2, 3, 4, 5, 6]
    ref = generate(model, full_draft, tokenizer, prompt, max_tokens=40).tokens
    vocab = sorted(set(ref) | {7, 8, 9})
    draft = cut_drafter(tmp_path, target, vocab)
    parts = target_parts(model)
    cache = draft.make_cache()
    draft.append_context(mx.random.normal((1, 3, 2 * draft.config.hidden_size)), cache)
    scores, ids = draft.block_scores(parts, 5, 8, cache)
    logits = draft.block_logits(parts, 5, 8, cache)
    assert scores.shape == (7, len(vocab)) and ids.tolist() == vocab
    assert mx.allclose(logits[:, ids], scores, atol=1e-5)
    outside = mx.array([i for i in range(logits.shape[-1]) if i not in set(vocab)])
    assert bool(mx.all(mx.isinf(logits[:, outside]) & (logits[:, outside] < 0)))
    for policy in ("auto", "fixed", "tree"):
        out = generate(model, draft, tokenizer, prompt, max_tokens=40, policy=policy)
        assert out.tokens == ref, policy
    bias = {vocab[-1]: 2.0, ref[3]: -1.5}  # proposals through `propose`, on full logits
    want = generate(model, full_draft, tokenizer, prompt, max_tokens=40, logit_bias=bias).tokens
    for policy in ("auto", "fixed"):
        got = generate(model, draft, tokenizer, prompt, max_tokens=40, logit_bias=bias,
                       policy=policy)
        assert got.tokens == want, policy


@pytest.mark.parametrize("policy", ["fixed", "auto"])
def test_restricted_draft_vocabulary_in_the_batched_engine(policy, tmp_path, tiny_pair,
                                                           loaded_pair):
    """The batched drafter pass scores the cut vocabulary only, for every row of the batch;
    greedy proposals come from the one host read of the candidates, a row with a logit bias
    proposes through ``propose`` on full logits, in the same passes; all exact."""
    from dflash.batch import BatchGenerator
    from dflash.model_mlx import batch_generate
    from dflash.ragged_cache import RaggedKVCache

    target, _ = tiny_pair("qwen3")
    model, tokenizer, full_draft = loaded_pair("qwen3")
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8, 7], [4, 4, 2, 11, 3]]
    refs = [generate(model, full_draft, tokenizer, p, max_tokens=24).tokens for p in prompts]
    vocab = sorted({t for r in refs for t in r[::2]} | {7, 8, 9})
    draft = cut_drafter(tmp_path, target, vocab)
    results = batch_generate(model, draft, tokenizer, prompts, max_batch=3, max_tokens=24,
                             policy=policy)
    assert [r.tokens for r in results] == refs
    cache = [RaggedKVCache() for _ in draft.layers]
    for n in (3, 5):
        one = draft.make_cache()
        draft.append_context(mx.random.normal((1, n, 2 * draft.config.hidden_size)), one)
        for ragged, c in zip(cache, one):
            ragged.add_cache(c)
    scores, ids = draft.block_scores_batch(target_parts(model), [5, 7], 4, cache)
    assert scores.shape == (2, 3, len(vocab)) and ids.tolist() == vocab
    bias = {vocab[-1]: 2.0, refs[0][3]: -1.5}
    want = generate(model, full_draft, tokenizer, prompts[0], max_tokens=24,
                    logit_bias=bias).tokens
    engine = BatchGenerator(model, draft, tokenizer, max_batch=3, policy=policy)
    uids = [engine.insert(prompts[0], max_tokens=24, logit_bias=bias)]
    uids += [engine.insert(p, max_tokens=24) for p in prompts[1:]]
    tokens = {u: [] for u in uids}
    while engine.active or engine.pending:
        for e in engine.step():
            tokens[e.uid] += e.tokens
    assert [tokens[u] for u in uids] == [want] + refs[1:]
