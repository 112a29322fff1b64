"""What bad long-context input gets: a typed error naming the field before any work starts, and
from the server a 400 naming it while it keeps serving other requests.

The draft window's own checks (an integer of at least the drafter's block size, in
``load_draft``, ``set_window``, the CLI and ``create_server``) are in tests/test_draft_window.py;
``kv_bits`` / ``kv_group_size`` / ``quantized_kv_start`` outside mlx-lm's range in
tests/test_kv_cache.py. Here: a prompt longer than the target's positions, a block longer than
the draft window, and the server answering both with a 400.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dflash.errors import GenerationConfigError
from dflash.model_mlx import generate, load, load_draft
from dflash.target import max_positions, target_parts

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
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert max_positions(model(max_position_embeddings=40960, rope_scaling=yarn)) == 131072
    assert max_positions(model(max_position_embeddings=40960, rope_parameters=yarn)) == 131072
    assert max_positions(model()) is None
    wrapped = SimpleNamespace(args=SimpleNamespace(text_config={"max_position_embeddings": 512}))
    assert max_positions(wrapped) == 512


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
