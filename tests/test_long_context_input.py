"""What bad long-context input gets: a typed error naming the field before any work starts, and
from the server a 400 naming it while it keeps serving other requests.

The draft window's own checks (an integer of at least the drafter's block size, in
``load_draft``, ``set_window``, the CLI and ``create_server``) are in tests/test_draft_window.py;
``kv_bits`` / ``kv_group_size`` / ``quantized_kv_start`` outside mlx-lm's range in
tests/test_kv_cache.py. Here: a prompt longer than the target's positions, a block longer than
the draft window, and the server answering both with a 400.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from dflash.errors import GenerationConfigError
from dflash.model_mlx import generate, load, load_draft
from dflash.target import config_positions, max_positions, target_parts

TINY_POSITIONS = 4096  # tests/tiny_models.py's max_position_embeddings


@pytest.fixture(scope="module")
def pair(tiny_pair):
    target, draft = tiny_pair("llama")
    model, tokenizer = load(str(target))
    return model, tokenizer, load_draft(str(draft)), target, draft


def test_prompt_longer_than_the_targets_positions(pair):
    model, tokenizer, draft, _, _ = pair
    assert target_parts(model).max_positions == TINY_POSITIONS
    calls = []
    with pytest.raises(GenerationConfigError, match=r"^prompt=4097 tokens: .*4096 positions"):
        generate(model, draft, tokenizer, [5] * (TINY_POSITIONS + 1), max_tokens=4,
                 prompt_progress_callback=lambda *a: calls.append(a))
    assert calls == []  # refused before the prefill started
    # The batched engine validates the same way, at insert.
    from dflash.batch import BatchGenerator

    engine = BatchGenerator(model, draft, tokenizer, max_batch=2)
    with pytest.raises(GenerationConfigError, match="^prompt="):
        engine.insert([5] * (TINY_POSITIONS + 1), max_tokens=4)
    assert not engine.active and not engine.pending


def test_max_positions_follows_rope_scaling():
    def model(**args):
        return SimpleNamespace(args=SimpleNamespace(**args))

    assert max_positions(model(max_position_embeddings=8192)) == 8192
    # Qwen3's documented yarn: factor 4 over the 32,768 pre-trained positions.
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert max_positions(model(max_position_embeddings=40960, rope_scaling=yarn)) == 131072
    assert max_positions(model(max_position_embeddings=40960, rope_parameters=yarn)) == 131072
    # Llama 3.1: max_position_embeddings already the stretched context (8 x 8,192 is less).
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    assert max_positions(model(max_position_embeddings=131072, rope_scaling=llama3)) == 131072
    # Without original_max_position_embeddings, max_position_embeddings is the pre-trained length.
    for kind in ("linear", "dynamic", "yarn"):
        scaling = {"type": kind, "factor": 4.0}
        assert max_positions(model(max_position_embeddings=4096, rope_scaling=scaling)) == 16384
    # Longrope (Phi-3): no factor, max_position_embeddings is the long context.
    longrope = {"type": "longrope", "original_max_position_embeddings": 4096,
                "short_factor": [1.0], "long_factor": [2.0]}
    assert max_positions(model(max_position_embeddings=131072, rope_scaling=longrope)) == 131072
    # Scalings that change frequencies only, and factors that shrink, leave the limit alone.
    for scaling in ({"type": "mrope", "mrope_section": [2, 1, 1]},
                    {"rope_type": "default", "rope_theta": 1e6},
                    {"type": "proportional", "factor": 8.0},
                    {"type": "linear", "factor": 0.5}, {"type": "yarn", "factor": True}):
        assert max_positions(model(max_position_embeddings=4096, rope_scaling=scaling)) == 4096
    assert max_positions(model()) is None
    wrapped = SimpleNamespace(args=SimpleNamespace(text_config={"max_position_embeddings": 512}))
    assert max_positions(wrapped) == 512
    text = {"max_position_embeddings": 512, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert config_positions({"model_type": "x", "text_config": text}) == 1024


@pytest.mark.parametrize("arch, key", [("llama", "rope_scaling"), ("qwen3", "rope_parameters")])
def test_prompt_limit_with_rope_scaling(tiny_pair, tmp_path, arch, key):
    """A fixture target configured as Qwen3 documents its yarn (max_position_embeddings 40 and
    a factor 4 over 32 pre-trained positions, as 40,960 and 4 over 32,768) reads 128: the pair
    (the CLI's and the server's limit) and the engine agree, a prompt past
    max_position_embeddings but within 128 is decoded, one past 128 refused."""
    from dflash.pair import load_pair

    source, draft = tiny_pair(arch)
    target = tmp_path / "target"
    shutil.copytree(source, target)
    cfg = json.loads((target / "config.json").read_text())
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    if key == "rope_parameters":  # transformers 5: rope_theta nested with the scaling
        scaling["rope_theta"] = cfg.pop("rope_theta")
    cfg.update({"max_position_embeddings": 40, key: scaling})
    (target / "config.json").write_text(json.dumps(cfg))
    pair = load_pair(str(target), str(draft))
    assert pair.max_context == target_parts(pair.model).max_positions == 128
    assert config_positions(cfg) == 128
    out = generate(pair.model, pair.draft, pair.tokenizer, [5] * 100, max_tokens=2)
    assert out.stats.prompt_tokens == 100 and out.tokens
    with pytest.raises(GenerationConfigError, match=r"^prompt=129 tokens: .*128 positions"):
        generate(pair.model, pair.draft, pair.tokenizer, [5] * 129, max_tokens=2)


def test_block_longer_than_the_draft_window(tiny_pair):
    model, tokenizer = load(str(tiny_pair("llama")[0]))
    draft = load_draft(str(tiny_pair("llama")[1]), sliding_window_size=8)  # block size 8
    with pytest.raises(GenerationConfigError, match=r"^block_size=12: .*draft window \(8"):
        generate(model, draft, tokenizer, [5, 6, 7], max_tokens=4, block_size=12)
    assert generate(model, draft, tokenizer, [5, 6, 7], max_tokens=4, block_size=8).tokens


@pytest.mark.slow
def test_server_answers_bad_long_context_input_with_a_400(pair):
    """The server's own context limit set past the target's positions: the engine's refusal of
    the prompt is a 400 naming it; a block longer than the draft window likewise; then the
    server answers the next request."""
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from dflash.serving import create_server

    _, _, _, target, draft = pair
    server = create_server(str(target), str(draft), max_context=2 * TINY_POSITIONS,
                           draft_window=8, quiet=True)
    try:
        client = TestClient(server.app)
        comp = {"model": client.get("/v1/models").json()["data"][0]["id"], "max_tokens": 4}
        r = client.post("/v1/completions", json=dict(comp, prompt=[5] * (TINY_POSITIONS + 8)))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt" and "positions" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json=dict(comp, prompt=[5, 6, 7], block_size=16))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "block_size"
        r = client.post("/v1/completions", json=dict(comp, prompt=[5, 6, 7]))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
    finally:
        server.worker.stop()
