"""One target pass per token: what datagen stores equals a teacher-forced forward of the sequence."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import write_target

from dflash.errors import DataSetError
from dflash.model_mlx import load
from dflash.target import forward, make_cache, target_parts
from dflash.training.capture import RolloutEngine
from dflash.training.data import load_samples
from dflash.training.datagen import datagen

pytestmark = pytest.mark.slow  # every test here runs the models for many seconds

TAPS = [0, 2]


def teacher(parts, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Taps and log-probabilities of one sequence fed at once, without any batch."""
    logits, feats = forward(parts, mx.array(ids)[None], make_cache(parts), TAPS)
    logits = logits[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(feats[0].astype(mx.float32)), np.array(logp)


def prompts_of_many_lengths(vocab: int, n: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    rng = np.random.default_rng(seed)
    return [(f"p{i}", rng.integers(1, vocab - 1, size=int(rng.integers(2, 20))).tolist())
            for i in range(n)]


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_captured_features_and_topk_equal_a_teacher_forced_pass(tmp_path, kind):
    """Rows joined and left a continuous batch of 3 with prompts of 2..19 tokens, so most rows
    were left-padded next to longer ones: every stored row still equals the lone forward pass."""
    path = write_target(tmp_path / kind, kind)
    model, tok = load(str(path))
    parts = target_parts(model)
    items = prompts_of_many_lengths(parts.vocab_size, 7)
    # A stop id that greedy decoding of these random weights hits now and then: sequences end
    # at different steps, so the batch shrinks and refills.
    engine = RolloutEngine(parts, taps=TAPS, topk=5, max_tokens=12, batch_size=3,
                           stop_ids=[7, 11])
    rollouts = list(engine.run(items))
    assert sorted(r.id for r in rollouts) == sorted(i for i, _ in items)
    assert engine.stats.rows / engine.stats.steps > 1.5  # really batched
    for r in rollouts:
        ids = r.prompt_ids + r.response_ids
        n, p = len(ids), len(r.prompt_ids)
        feats, logp = teacher(parts, ids)
        assert r.feats.shape == (n, feats.shape[-1]) and r.top_ids.shape == (n, 5)
        scale = np.abs(feats[: n - 1]).max()
        np.testing.assert_allclose(r.feats[: n - 1].astype(np.float32), feats[: n - 1],
                                   atol=2e-3 * scale, rtol=2e-3)
        # Greedy: each response token is the teacher's argmax at the row before it.
        assert r.response_ids == logp[p - 1: n - 1].argmax(-1).tolist()
        for row in range(p, n - 1):  # the top-k of every response row, fp16 tolerance
            top = np.sort(logp[row])[::-1][:5]
            np.testing.assert_allclose(np.sort(r.top_logp[row].astype(np.float32))[::-1], top,
                                       atol=2e-2)
            np.testing.assert_allclose(logp[row][r.top_ids[row]],
                                       r.top_logp[row].astype(np.float32), atol=2e-2)
        assert r.finish_reason == ("stop" if r.response_ids[-1] in (7, 11) else "length")
        assert r.finish_reason == "stop" or len(r.response_ids) == 12


def test_datagen_stores_features_training_reads_and_refuses_another_target(tmp_path):
    target = write_target(tmp_path / "t", "llama", layers=3, hidden=32)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i} " * (i + 1)})
                               + "\n" for i in range(5)))
    out = datagen(str(target), prompts, tmp_path / "data", max_tokens=6, batch_size=2,
                  taps="0,2", topk=4, domain="math", progress=False)
    samples = load_samples(out)
    assert [s["domain"] for s in samples] == ["math"] * 5
    manifest = json.loads((out / "dataset.json").read_text())
    assert manifest["taps"] == [0, 2] and manifest["topk"] == 4

    from dflash.training.data import Sample
    from dflash.training.features import FeatureStore

    model, _ = load(str(target))
    parts = target_parts(model)
    cache = out / "features" / FeatureStore.signature([0, 2], 4)
    store = FeatureStore(parts, [0, 2], 4, cache)
    for rec in samples:
        ids = np.asarray(rec["prompt_ids"] + rec["response_ids"], np.int32)
        sample = Sample(rec["id"], ids, len(rec["prompt_ids"]))
        assert store.has(sample)
        stored, fresh = store.get(sample), store.compute(ids)
        n = len(ids)
        np.testing.assert_allclose(stored["feats"][: n - 1].astype(np.float32),
                                   fresh["feats"][: n - 1].astype(np.float32), atol=2e-2)

    other = write_target(tmp_path / "other", "llama", layers=3, hidden=32, seed=1)
    with pytest.raises(DataSetError, match="target_fingerprint.*must not mix"):
        datagen(str(other), prompts, out, max_tokens=6, progress=False, taps="0,2", topk=4)
    with pytest.raises(DataSetError, match="taps"):
        datagen(str(target), prompts, out, max_tokens=6, progress=False, taps="0,1", topk=4)
