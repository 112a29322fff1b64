"""``dflash export``: the published Hugging Face layout, read by other readers and by our own loader.

Proposals are compared exactly. The export stores bf16, so the reference is the original drafter
with its weights rounded through bf16 (a float32 source) or the original itself (a bf16 or
quantized source, whose dequantized weights are bf16 already): the same weights, so any difference
in proposals would be a layout or config error, not rounding. A drafter with a cut vocabulary is
compared with its cut lifted (what the export is), and on the cut's own ids with the original.
"""

import json
import struct
import sys

import mlx.core as mx
import pytest
from dflash2_fixtures import write_dflash2_drafter
from mlx.utils import tree_map
from tiny_models import write_drafter

from dflash.cli import main
from dflash.convert import convert
from dflash.default_pair import default_draft_path, default_target_path
from dflash.drafter import load_draft
from dflash.errors import DraftCheckpointError, ExportError
from dflash.export import export
from dflash.model_mlx import load
from dflash.sampling import BlockSampler, SamplingConfig
from dflash.target import forward, make_cache, target_parts

BRIEF_FIELDS = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                "rms_norm_eps", "max_position_embeddings", "num_target_layers", "block_size",
                "rope_theta", "layer_types", "tie_word_embeddings")


def brief_table(c: dict) -> dict:
    """The tensor names and shapes the published layout has, from its config.json."""
    h, hd, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    taps = len(c["dflash_config"]["target_layer_ids"])
    t = {"fc.weight": [h, taps * h], "hidden_norm.weight": [h], "norm.weight": [h]}
    for i in range(c["num_hidden_layers"]):
        t.update({f"layers.{i}.input_layernorm.weight": [h],
                  f"layers.{i}.post_attention_layernorm.weight": [h],
                  f"layers.{i}.self_attn.q_proj.weight": [q, h],
                  f"layers.{i}.self_attn.k_proj.weight": [kv, h],
                  f"layers.{i}.self_attn.v_proj.weight": [kv, h],
                  f"layers.{i}.self_attn.o_proj.weight": [h, q],
                  f"layers.{i}.self_attn.q_norm.weight": [hd],
                  f"layers.{i}.self_attn.k_norm.weight": [hd],
                  f"layers.{i}.mlp.gate_proj.weight": [inter, h],
                  f"layers.{i}.mlp.up_proj.weight": [inter, h],
                  f"layers.{i}.mlp.down_proj.weight": [h, inter]})
    return t


def safetensors_header(path) -> dict:
    """The safetensors header, as any reader sees it (no MLX)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])


def check_published_layout(out, dflash2=False):
    cfg = json.loads((out / "config.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    for field in BRIEF_FIELDS:
        assert field in cfg, field
    assert cfg["torch_dtype"] == "bfloat16" and cfg["model_type"] == "qwen3"
    assert set(cfg["dflash_config"]) >= {"target_layer_ids", "mask_token_id", "block_size"}
    assert "draft_vocab_ids" not in cfg["dflash_config"] and "quantization" not in cfg
    header = safetensors_header(out / "model.safetensors")
    assert header.pop("__metadata__") == {"format": "pt"}
    shapes = {k: v["shape"] for k, v in header.items()}
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    table = brief_table(cfg)
    if dflash2:
        extra = {k: v for k, v in shapes.items() if k not in table}
        assert {k.rsplit(".", 1)[-1] for k in extra} >= {"predecessor_codebook",
                                                          "successor_codebook", "base_kernel"}
        shapes = {k: v for k, v in shapes.items() if k in table}
    assert shapes == table
    try:  # the reference reader, where installed (numpy has no bf16: header and slices only)
        from safetensors import safe_open
    except ImportError:
        return cfg
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        assert {k: f.get_slice(k).get_shape() for k in f.keys()} == {k: v["shape"]
                                                                     for k, v in header.items()}
    return cfg


def proposals(draft, parts, prompts, anchors=(3, 9, 17)) -> list[list[int]]:
    """Greedy proposals of one block at each anchor of each prompt (context: the rows before)."""
    sampler = BlockSampler(SamplingConfig())
    out = []
    for ids in prompts:
        _, taps = forward(parts, mx.array(ids)[None], make_cache(parts), draft.target_layer_ids)
        for a in anchors:
            cache = draft.make_cache()
            draft.append_context(taps[:, :a], cache)
            logits = draft.block_logits(parts, ids[a], draft.block_size, cache)
            out.append(draft.propose(logits, ids[a], cache, sampler, ids[:a + 1])[0].tolist())
    return out


def through_bf16(draft):
    draft.update(tree_map(lambda p: p.astype(mx.bfloat16).astype(mx.float32), draft.parameters()))
    return draft


PROMPTS = [[1, 5, 9, 2, 44, 7, 3, 3, 12, 8, 60, 2, 9, 31, 4, 4, 18, 22, 5, 1],
           [7, 7, 30, 2, 11, 40, 5, 6, 9, 13, 2, 8, 8, 50, 3, 21, 17, 6, 2, 10]]


def test_float32_drafter_with_a_cut_vocabulary(tmp_path, tiny_pair, loaded_pair):
    target, _ = tiny_pair("qwen3")
    parts = target_parts(loaded_pair("qwen3")[0])
    src = write_drafter(tmp_path / "src", target, layers=2, dtype="float32",
                        extra={"dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 100}})
    full = proposals(through_bf16(load_draft(src)), parts, PROMPTS)
    proposed = sorted({t for block in full for t in block})
    vocab = sorted(set(proposed[::2]) | set(range(0, 40, 3)))  # half of what it proposes
    cfg = json.loads((src / "config.json").read_text())
    cfg["dflash_config"]["draft_vocab_ids"] = vocab
    (src / "config.json").write_text(json.dumps(cfg))

    report = export(src, tmp_path / "out")
    assert report["draft_vocab_ids"] == len(vocab) and "lifted" in report["notes"][0]
    check_published_layout(tmp_path / "out")
    exported = load_draft(tmp_path / "out")
    assert exported.config.draft_vocab_ids is None
    assert proposals(exported, parts, PROMPTS) == full
    cut = proposals(through_bf16(load_draft(src)), parts, PROMPTS)
    assert all(t in vocab for block in cut for t in block)
    # inside the cut, the full-vocabulary argmax is the cut's own proposal
    pairs = [(f, c) for fb, cb in zip(full, cut) for f, c in zip(fb, cb)]
    assert any(f in vocab for f, _ in pairs) and any(f not in vocab for f, _ in pairs)
    assert all(f == c for f, c in pairs if f in vocab)


def test_quantized_and_dflash2_drafters(tmp_path, tiny_pair, loaded_pair):
    target, draft = tiny_pair("qwen3")
    parts = target_parts(loaded_pair("qwen3")[0])
    convert(draft, tmp_path / "q6", quantize=True, q_bits=6, verify=False)
    export(tmp_path / "q6", tmp_path / "q6-hf")
    check_published_layout(tmp_path / "q6-hf")
    assert (proposals(load_draft(tmp_path / "q6-hf"), parts, PROMPTS)
            == proposals(load_draft(tmp_path / "q6"), parts, PROMPTS))

    v2 = write_dflash2_drafter(tmp_path / "v2", draft, rank=16, top_k=4, sliding_window=64)
    export(v2, tmp_path / "v2-hf")
    cfg = check_published_layout(tmp_path / "v2-hf", dflash2=True)
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["use_sliding_window"] is True
    assert proposals(load_draft(tmp_path / "v2-hf"), parts, PROMPTS) == proposals(
        load_draft(v2), parts, PROMPTS)


def test_destination_rules_and_errors(tmp_path, tiny_pair, monkeypatch):
    _, draft = tiny_pair("qwen3")
    out = tmp_path / "out"
    out.mkdir()
    export(draft, out)  # an empty folder is fine
    with pytest.raises(ExportError, match="out=.*not empty.*--force"):
        export(draft, out)
    (out / "stale.txt").write_text("old")
    export(draft, out, force=True)
    assert not (out / "stale.txt").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="not a folder"):
        export(draft, tmp_path / "file")
    with pytest.raises(ExportError, match="overlaps the source"):
        export(draft, draft / "inside")
    with pytest.raises(DraftCheckpointError, match="no such drafter folder"):
        export(tmp_path / "missing", tmp_path / "x")

    import dflash.export as ex

    def broken(folder, cfg, weights):
        raise ExportError(f"{folder}: tensor fc.weight does not read back as written")

    monkeypatch.setattr(ex, "_check_readback", broken)
    with pytest.raises(ExportError, match="fc.weight"):
        export(draft, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".new")]


def test_command_line(tmp_path, tiny_pair, capsys):
    _, draft = tiny_pair("qwen3")
    assert main(["export", str(draft), str(tmp_path / "out"),
                 "--report-json", str(tmp_path / "r.json")]) == 0
    assert "DFlashDraftModel" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["dtype"] == "bfloat16"
    assert main(["export", str(draft), str(tmp_path / "out")]) == 1
    assert "--force" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["export", "--help"])
    assert e.value.code == 0 and "dflash export" in capsys.readouterr().out


def test_transformers_reads_the_config(tmp_path, tiny_pair):
    transformers = pytest.importorskip("transformers")
    target, draft = tiny_pair("qwen3")
    v2 = write_dflash2_drafter(tmp_path / "v2", draft, rank=16, top_k=4, sliding_window=64)
    for src, name in ((draft, "v1-hf"), (v2, "v2-hf")):
        export(src, tmp_path / name)
        cfg = transformers.AutoConfig.from_pretrained(str(tmp_path / name))
        raw = json.loads((tmp_path / name / "config.json").read_text())
        assert cfg.hidden_size == raw["hidden_size"] and cfg.head_dim == raw["head_dim"]
        assert cfg.dflash_config["target_layer_ids"] == raw["dflash_config"]["target_layer_ids"]
        assert cfg.layer_types == raw["layer_types"]
        assert cfg.sliding_window == raw.get("sliding_window")


@pytest.mark.slow
def test_builtin_drafter(tmp_path):
    """The shipped 6-bit drafter with its cut vocabulary: exported, it proposes what the original
    proposes with the cut lifted; inside the cut, what the original proposes."""
    report = export(default_draft_path(), tmp_path / "out")
    assert report["source_quantization"]["bits"] == 6
    cfg = check_published_layout(tmp_path / "out")
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 8, 14, 20, 27]
    model, tokenizer = load(str(default_target_path()))
    parts = target_parts(model)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True)
               for q in ("What is 17 times 23? Think step by step.",
                         "Write a Python function that reverses a string.")]
    original = load_draft(default_draft_path())
    vocab = set(original.config.draft_vocab_ids)
    cut = proposals(original, parts, prompts, anchors=(20, 28))
    original.config.draft_vocab_ids = None
    full = proposals(original, parts, prompts, anchors=(20, 28))
    assert proposals(load_draft(tmp_path / "out"), parts, prompts, anchors=(20, 28)) == full
    pairs = [(f, c) for fb, cb in zip(full, cut) for f, c in zip(fb, cb)]
    assert all(f == c for f, c in pairs if f in vocab)
    same = sum(f == c for f, c in pairs)
    print(f"built-in: {same}/{len(pairs)} proposals unchanged by lifting the cut",
          file=sys.stderr)
