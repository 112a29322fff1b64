"""dflash train: the recipe element by element, training on tiny targets, resume, export, errors."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny_models import write_target

import dflash
from dflash.acceptance import measure_tau
from dflash.drafter import load_draft
from dflash.errors import DFlashError, TrainConfigError, TrainingDataError, UnsupportedTargetError
from dflash.training.commands import add_train_args, run_train
from dflash.training.data import Sample, read_samples, seen_ids
from dflash.training.evaluation import engine_tau
from dflash.training.features import FeatureStore
from dflash.training.initialise import init_from_target
from dflash.training.loss import block_loss, draft_hidden
from dflash.training.options import TrainOptions, from_args
from dflash.training.recipe import (
    block_visibility,
    build_blocks,
    default_gamma,
    default_taps,
    loss_weights,
    pick_mask_token,
    sample_anchors,
    training_visibility,
)
from dflash.training.trainer import Trainer

CYCLE = 24  # the pattern target walks a fixed cycle of this many token ids


# ---------------------------------------------------------------------------------------------
# Fixtures: a tiny target with a learnable pattern, and data generated from it


def make_pattern_target(path: Path) -> dict[int, int]:
    """A tiny Qwen3 whose greedy continuation walks a fixed cycle: next = f(current token).

    Attention/MLP outputs are zeroed, so the last hidden state is the current token's embedding;
    the untied head maps it to its successor in a random cycle over ids 100..100+CYCLE.
    """
    write_target(path, "qwen3", vocab_size=512, layers=4, seed=0)
    w = dict(mx.load(str(path / "model.safetensors")))
    for k in list(w):
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = mx.zeros_like(w[k])
    rng = np.random.default_rng(0)
    cyc = 100 + rng.permutation(CYCLE)
    succ = {int(cyc[i]): int(cyc[(i + 1) % CYCLE]) for i in range(CYCLE)}
    emb = np.array(w["model.embed_tokens.weight"])
    head = rng.normal(0, 0.01, emb.shape).astype(np.float32)
    for x, y in succ.items():
        head[y] = emb[x] / np.sqrt((emb[x] ** 2).mean()) * 0.5
    w["lm_head.weight"] = mx.array(head)
    mx.save_safetensors(str(path / "model.safetensors"), w)
    return succ


def pattern_records(succ: dict[int, int], n: int, seed: int, length: int = 40) -> list[dict]:
    rng = np.random.default_rng(seed)
    ids = sorted(succ)
    out = []
    for i in range(n):
        prompt = [int(x) for x in rng.choice(ids, size=int(rng.integers(4, 16)))]
        resp, t = [], prompt[-1]
        for _ in range(length):
            t = succ[t]
            resp.append(t)
        out.append({"id": f"s{seed}-{i:03d}", "prompt_ids": prompt, "response_ids": resp,
                    "finish_reason": "length"})
    return out


def write_pattern_data(root: Path, n: int) -> tuple[dict[int, int], Path]:
    """The pattern target in ``root/target`` and ``n`` of its records in ``root/data``."""
    succ = make_pattern_target(root / "target")
    data = root / "data"
    data.mkdir()
    with (data / "gen-00.jsonl").open("w") as f:
        for r in pattern_records(succ, n, seed=1):
            f.write(json.dumps(r) + "\n")
    return succ, data


def assert_same_weights(a, b, atol: float = 1e-6) -> None:
    a, b = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    for k in a:
        assert mx.allclose(a[k], b[k], atol=atol).item(), k


@pytest.fixture(scope="module")
def pattern(tmp_path_factory):
    root = tmp_path_factory.mktemp("pattern")
    succ, data = write_pattern_data(root, 64)
    held_out = [r["prompt_ids"] for r in pattern_records(succ, 4, seed=2)]
    return {"root": root, "target": root / "target", "data": data, "succ": succ,
            "held_out": held_out}


def opts(pattern, out, **kw) -> TrainOptions:
    base = dict(target=str(pattern["target"]), data=str(pattern["data"]), out=str(out),
                layers=1, block_size=8, taps="0,2", steps=40, batch_seqs=4, anchors=16, lr=3e-3,
                checkpoint_every=1000, progress=False, val_percent=0, soft_weight=0.0)
    base.update(kw)
    return TrainOptions(**base)


# ---------------------------------------------------------------------------------------------
# The recipe, element by element


def test_loss_weights_decay():
    w = loss_weights(16, 7.0)
    assert w.shape == (16,)
    assert w[0] == 0.0  # the anchor row carries no loss
    for k in range(1, 16):
        assert w[k] == pytest.approx(math.exp(-(k - 1) / 7.0), rel=1e-6)
    assert default_gamma(16) == 7.0 and default_gamma(8) == 4.0


def test_blocks_and_same_position_labels():
    ids = np.arange(100, 130)  # token at position p is 100 + p
    anchors = np.array([10, 20, 27])
    tokens, labels, positions = build_blocks(ids, anchors, 8, mask_token_id=7)
    for b, a in enumerate(anchors):
        assert tokens[b, 0] == ids[a]  # the anchor token itself
        assert (tokens[b, 1:] == 7).all()  # then masks
        assert labels[b, 0] == -1  # row 0: no label
        for k in range(8):
            assert positions[b, k] == a + k
            if k >= 1:
                # row k predicts the token AT anchor + k (same position, no shift)
                expected = ids[a + k] if a + k < len(ids) else -1
                assert labels[b, k] == expected
    assert (labels[2, 3:] == -1).all() and labels[2, 2] == ids[29]


def test_anchors_inside_the_response():
    rng = np.random.default_rng(0)
    a = sample_anchors(rng, prompt_len=12, seq_len=40, n=10)
    assert len(a) == 10 and len(set(a.tolist())) == 10 and (np.diff(a) > 0).all()
    assert a.min() >= 12 and a.max() <= 38  # the anchor is a response token with a label after it
    assert sample_anchors(rng, 12, 15, 10).tolist() == [12, 13]  # fewer positions than asked
    assert len(sample_anchors(rng, 12, 13, 10)) == 0  # one response token: nothing to predict
    again = sample_anchors(np.random.default_rng(0), 12, 40, 10)
    assert (again == a).all()


def test_visibility_context_strictly_before_anchor_and_bidirectional_block():
    anchors = np.array([5, 9, 12])
    ctx_len, bs = 16, 4
    vis = block_visibility(anchors, ctx_len, bs)
    assert vis.shape == (3, bs, ctx_len + bs)
    for b, a in enumerate(anchors):
        for j in range(bs):
            for c in range(ctx_len):
                # context row c (the token at position c) is visible iff c < anchor
                assert vis[b, j, c] == (c < a), (b, j, c)
            assert vis[b, j, ctx_len:].all()  # bidirectional inside the block
        assert vis[b, :, a - 1].all() and not vis[b, :, a].any()


def test_full_matrix_has_no_cross_block_visibility():
    anchors = np.array([3, 6, 7])
    ctx_len, bs = 8, 3
    full = training_visibility(anchors, ctx_len, bs)
    assert full.shape == (3 * bs, ctx_len + 3 * bs)
    for r in range(3 * bs):
        b = r // bs
        for c in range(ctx_len):
            assert full[r, c] == (c < anchors[b])
        for k in range(3 * bs):
            assert full[r, ctx_len + k] == (k // bs == b), (r, k)  # own block only


def test_sliding_layers_follow_the_engine():
    vis = block_visibility(np.array([10]), 12, 4, window=4, causal=True)
    for j in range(4):
        q = 10 + j
        for c in range(12):
            assert vis[0, j, c] == (c < 10 and q - c < 4)
        assert (vis[0, j, 12:] == (np.arange(4) <= j)).all()


@pytest.mark.slow
def test_default_taps_and_mask_token(pattern):
    assert default_taps(30) == [1, 8, 14, 20, 27]
    assert default_taps(36) == [1, 9, 17, 25, 33]  # as the published Qwen3-8B drafter
    assert default_taps(2, 5) == [0, 1]
    from dflash.model_mlx import load

    _, tok = load(str(pattern["target"]))
    mask = pick_mask_token(tok, 49152)
    template = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                       add_generation_prompt=True)
    assert mask not in template and mask not in tok.eos_token_ids
    assert mask in tok._tokenizer.all_special_ids  # SmolLM2: a spare special token (<empty_output>)


# ---------------------------------------------------------------------------------------------
# The training forward is the engine's forward


@pytest.mark.slow
def test_training_forward_equals_engine_forward(pattern, tmp_path):
    tr = Trainer(opts(pattern, tmp_path / "d", layers=2))
    sample = tr.samples[0]
    batch = tr.make_batch([sample, tr.samples[1]], np.random.default_rng(0), 5)
    h = draft_hidden(tr.draft, batch.context, batch.seq_index, tr.embed(batch.tokens),
                     batch.anchors, batch.masks)
    feats = [mx.array(tr.features.get(s)["feats"].astype(np.float32))[None]
             for s in (sample, tr.samples[1])]
    for i, (a, s) in enumerate(zip(np.array(batch.anchors), np.array(batch.seq_index))):
        cache = tr.draft.make_cache()
        tr.draft.append_context(feats[s][:, :a], cache)  # the engine: context rows 0..a-1
        ref = tr.draft(tr.embed(batch.tokens[i:i + 1]), cache)[0]
        assert mx.abs(ref - h[i]).max().item() < 1e-4
        # and the labels are what the engine compares proposal j (row j+1) with
        ids = (sample if s == 0 else tr.samples[1]).ids
        lab = np.array(batch.labels[i])
        for j in range(7):
            if a + j + 1 < len(ids):
                assert tr.vocab_ids[lab[j]] == ids[a + j + 1]



@pytest.mark.parametrize("window", [None, 5])
def test_shared_context_attention_equals_a_copy_per_block(window):
    """The training forward shares each sequence's context keys/values among its blocks: the
    same outputs and gradients as SDPA over a copy per block — uneven and empty sequences,
    grouped query heads, a sliding window's mask."""
    from dflash.drafter import shared_context_attention

    rows, heads, kv_heads, L, T, d = [3, 0, 1, 4], 6, 2, 4, 11, 8
    n = sum(rows)
    seq = np.repeat(np.arange(len(rows)), rows)
    anchors = np.random.default_rng(0).integers(1, T, n)
    mask = mx.array(block_visibility(anchors, T, L, window, window is not None))[:, None]
    k = mx.random.split(mx.random.key(3), 5)
    q = mx.random.normal((n, heads, L, d), key=k[0])
    kb, vb = (mx.random.normal((n, kv_heads, L, d), key=k[i]) for i in (1, 2))
    kc, vc = (mx.random.normal((len(rows), kv_heads, T, d), key=k[i]) for i in (3, 4))
    idx = mx.array(seq)

    def copied(q, kb, vb, kc, vc):
        return mx.fast.scaled_dot_product_attention(
            q, mx.concatenate([kc[idx], kb], axis=2), mx.concatenate([vc[idx], vb], axis=2),
            scale=0.3, mask=mask)

    def shared(q, kb, vb, kc, vc):
        return shared_context_attention(q, kb, vb, kc, vc, rows, 0.3, mask)

    args = (q, kb, vb, kc, vc)
    assert mx.allclose(shared(*args), copied(*args), atol=1e-5).item()
    weights = mx.random.normal((n, heads, L, d), key=mx.random.key(9))
    grads = [mx.grad(lambda *a, f=f: (f(*a) * weights).sum(), argnums=(0, 1, 2, 3, 4))(*args)
             for f in (shared, copied)]
    for a, b in zip(*grads):
        assert mx.allclose(a, b, atol=1e-4).item()


@pytest.mark.slow
def test_target_features_are_the_tapped_layer_outputs(pattern, tmp_path):
    from dflash.target import forward, make_cache

    tr = Trainer(opts(pattern, tmp_path / "d", soft_topk=4))
    s = tr.samples[3]
    f = tr.features.get(s)
    logits, taps = forward(tr.parts, mx.array(s.ids)[None], make_cache(tr.parts), [0, 2])
    assert np.allclose(f["feats"].astype(np.float32), np.array(taps[0]), atol=2e-3)
    # teacher row p is the target's distribution of the token at p+1: its top id = greedy next
    # (response rows: training reads no others, and prompt rows never reach the head)
    p = s.prompt_len
    top = f["top_ids"][np.arange(p, len(s.ids)), np.argmax(f["top_logp"][p:], -1)]
    assert (top == np.array(mx.argmax(logits[0, p:], -1))).all()
    assert (top[:-1] == s.ids[p + 1:]).all()  # the pattern, greedy


def test_a_sample_claimed_by_a_live_process_is_waited_for_and_a_dead_claim_taken_over(
        pattern, tmp_path):
    """Processes filling one feature cache never compute a sample twice: the claimant computes,
    the others wait for its file; a claim whose process died is taken over."""
    tr = Trainer(opts(pattern, tmp_path / "d", soft_topk=4))
    store = FeatureStore(tr.parts, [0, 2], 4, tmp_path / "cache")
    a, b, c = tr.samples[:3]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        claim = store.path(a).with_suffix(".claim")
        claim.parent.mkdir(parents=True, exist_ok=True)
        claim.write_text(str(sleeper.pid))
        assert not store.claim(a)
        store.prepare([a, b])  # a is left to its claimant, b computed here
        assert store.has(b) and not store.has(a) and store.samples_computed == 1
        got: dict = {}
        waiter = threading.Thread(target=lambda: got.update(store.get(a)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # waiting for the claimant's file
        other = FeatureStore(tr.parts, [0, 2], 4, tmp_path / "cache")
        want = other.compute_and_store(a)
        claim.unlink()
        waiter.join(30)
        assert not waiter.is_alive() and store.samples_computed == 1
        assert np.array_equal(got["feats"], want["feats"])
        assert np.array_equal(got["top_ids"], want["top_ids"])
    finally:
        sleeper.kill()
        sleeper.wait()
    dead = store.path(c).with_suffix(".claim")
    dead.parent.mkdir(parents=True, exist_ok=True)
    dead.write_text(str(sleeper.pid))  # its process is gone
    assert store.claim(c)
    store.release(c)
    dead.write_text(str(sleeper.pid))
    store.get(c)
    assert store.has(c) and not dead.exists() and store.samples_computed == 2


@pytest.mark.slow
def test_a_step_waiting_for_a_claimed_sample_computes_the_next_steps_meanwhile(
        pattern, tmp_path):
    """While another process holds one of this step's samples, the training process computes
    the features of the steps ahead instead of idling, then the step takes over the claim of
    a process that died."""
    tr = Trainer(opts(pattern, tmp_path / "d", stream_features=1, soft_topk=4))
    try:
        samples = tr.feed.next_samples()
        held = samples[0]
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        claim = tr.features.path(held).with_suffix(".claim")
        claim.parent.mkdir(parents=True, exist_ok=True)
        claim.write_text(str(sleeper.pid))
        tr.feed.prepare(samples)
        ahead = tr.data.peek(10_000)
        assert not tr.features.has(held)
        assert all(tr.features.has(s) for s in samples[1:] + ahead)
        assert tr.features.samples_computed >= len(samples) - 1
        sleeper.kill()
        sleeper.wait()
        batch = tr.make_batch(samples, np.random.default_rng(0))  # takes the dead claim over
        assert batch.n_rows > 0 and tr.features.has(held) and not claim.exists()
    finally:
        tr.stream.close()


def test_features_in_chunks_are_the_rows_of_one_pass(pattern, tmp_path):
    """A long record's features are computed in chunks through one cache: the rows one pass
    over the whole sequence gives (cut or not)."""
    tr = Trainer(opts(pattern, tmp_path / "d", soft_topk=4))
    s = tr.samples[5]
    one = FeatureStore(tr.parts, [0, 2], 4, None)
    chunked = FeatureStore(tr.parts, [0, 2], 4, None)
    chunked.chunk = 7
    for prefix in (None, s.ids[:12]):
        ids = s.ids if prefix is None else s.ids[12:]
        a, b = one.compute(ids, prefix), chunked.compute(ids, prefix)
        assert a["feats"].shape == b["feats"].shape == (len(ids), 2 * tr.parts.hidden_size)
        assert np.allclose(a["feats"].astype(np.float32), b["feats"].astype(np.float32),
                           atol=2e-3)
        # the same top-k per row (argpartition leaves its order free): compare by id
        ia, ib = np.argsort(a["top_ids"], -1), np.argsort(b["top_ids"], -1)
        ids_a, ids_b = (np.take_along_axis(x["top_ids"], i, -1) for x, i in ((a, ia), (b, ib)))
        same = (ids_a == ids_b).all(-1)
        assert same.mean() > 0.95
        lp_a, lp_b = (np.take_along_axis(x["top_logp"], i, -1).astype(np.float32)
                      for x, i in ((a, ia), (b, ib)))
        assert np.allclose(lp_a[same], lp_b[same], atol=2e-3)


def test_prompt_rows_skip_the_head(pattern, tmp_path):
    """The head runs on response rows only (training reads no other): their top-k is the one a
    full pass gives, prompt rows hold the filler, and every row a batch reads is a response row."""
    from dflash.training.capture import FILLER_LOGP
    from dflash.training.recipe import sample_anchors

    tr = Trainer(opts(pattern, tmp_path / "d", soft_topk=4))
    s = tr.samples[5]
    store = FeatureStore(tr.parts, [0, 2], 4, None)
    store.chunk = 7  # the head starts inside a chunk
    full, part = store.compute(s.ids), store.compute(s.ids, head_from=s.prompt_len)
    p = s.prompt_len
    assert 0 < p < len(s.ids)
    assert np.array_equal(part["feats"], full["feats"])
    assert (part["top_ids"][:p] == 0).all() and (part["top_logp"][:p] == FILLER_LOGP).all()
    assert np.isfinite(part["top_logp"][p:].astype(np.float32)).all()
    same = (np.sort(full["top_ids"][p:], -1) == np.sort(part["top_ids"][p:], -1)).all(-1)
    assert same.mean() > 0.95  # argpartition leaves the order free; ties may swap the k-th
    assert np.allclose(np.sort(full["top_logp"][p:].astype(np.float32), -1),
                       np.sort(part["top_logp"][p:].astype(np.float32), -1), atol=1e-2)
    rng = np.random.default_rng(0)
    for sample in tr.samples:
        a = sample_anchors(rng, sample.prompt_len, len(sample.ids), 48)
        assert len(a) == 0 or a.min() >= sample.prompt_len  # soft rows a..a+14 are response rows


@pytest.mark.slow
def test_streamed_features_train_the_same_run_and_their_cpu_counts(pattern, tmp_path):
    """--stream-features: a worker computes the next steps' features beside training; the run
    is the one that computes every feature itself, each sample is computed once, and the
    worker's CPU is in the run's cpu_s."""
    kw = dict(steps=12, soft_topk=4, soft_weight=0.5, checkpoint_every=6)
    plain = Trainer(opts(pattern, tmp_path / "plain", feature_cache="none", **kw))
    plain.run()
    streamed = Trainer(opts(pattern, tmp_path / "streamed", stream_features=1, **kw))
    deadline = time.time() + 120
    while streamed.stream.cpu_seconds() == 0 and time.time() < deadline:
        time.sleep(0.1)  # the worker has loaded the target
    before = streamed.cpu_seconds
    assert before >= streamed.stream.cpu_seconds() > 0
    streamed.run()
    assert_same_weights(plain.draft, streamed.draft)
    cache = tmp_path / "streamed" / "train" / "features"
    files = list(cache.rglob("*.npz"))
    worker_n = streamed.stream.samples_computed()
    assert worker_n > 0 and streamed.features.samples_computed > 0
    assert worker_n + streamed.features.samples_computed == len(files) >= 12 * 4
    assert not list(cache.rglob("*.claim")) and not list(cache.rglob("*.tmp*"))
    assert not any(p.is_alive() for p in streamed.stream.procs)  # closed with the run
    records = [json.loads(line) for line in
               (tmp_path / "streamed" / "train" / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    # the worker may still finish a sample of the steps ahead after the last record
    assert 12 * 4 <= last["feat_n"] <= len(files) and last["stream_cpu_s"] > 0
    assert last["cpu_s"] >= last["stream_cpu_s"] + last["feat_s"] - 0.5
    with pytest.raises(TrainConfigError, match="--stream-features"):
        TrainOptions(target="t", data="d", out="o", stream_features=1, only_cached=True).check()
    with pytest.raises(TrainConfigError, match="--stream-features"):
        TrainOptions(target="t", data="d", out="o", stream_features=1, feature_cache="none").check()


@pytest.mark.slow
def test_init_from_target_copies_layers(pattern, tmp_path):
    tr = Trainer(opts(pattern, tmp_path / "d", init="last"))
    src = dict(tree_flatten(tr.parts.layers[3].parameters()))
    dst = dict(tree_flatten(tr.draft.layers[0].parameters()))
    for name in ("self_attn.q_proj.weight", "mlp.up_proj.weight", "input_layernorm.weight"):
        assert mx.array_equal(src[name], dst[name])
    assert (np.array(dst["self_attn.q_norm.weight"]) == 1).all()
    assert (np.array(tr.draft.norm.weight) == 1).all()
    with pytest.raises(TrainConfigError, match="--init"):
        init_from_target(tr.draft, tr.parts, [0, 1])  # the drafter has one layer
    # aligned: the layer after the deepest tap (2 -> 3), fc selects that tap's slice
    al = Trainer(opts(pattern, tmp_path / "al", init="aligned"))
    assert mx.array_equal(al.draft.layers[0].mlp.up_proj.weight, tr.parts.layers[3].mlp.up_proj.weight)
    fc = np.array(al.draft.fc.weight)
    assert (fc[:, 64:] == np.eye(64)).all() and (fc[:, :64] == 0).all()


# ---------------------------------------------------------------------------------------------
# Training


@pytest.mark.slow
def test_a_few_steps_lower_the_loss(pattern, tmp_path):
    tr = Trainer(opts(pattern, tmp_path / "d", soft_weight=0.5, soft_topk=8))
    batch = tr.make_batch(tr.samples[:4], np.random.default_rng(5))
    before = block_loss(tr.draft, tr.embed, tr.head_w, batch, 0.5)[0].item()
    for _ in range(15):
        tr.train_step(tr.make_batch(tr.feed.next_samples(), np.random.default_rng(tr.step)))
        tr.step += 1
    after = block_loss(tr.draft, tr.embed, tr.head_w, batch, 0.5)[0].item()
    assert after < 0.5 * before, (before, after)


@pytest.mark.slow
def test_trained_drafter_accepts_through_the_engine(pattern, tmp_path):
    out = tmp_path / "draft"
    tr = Trainer(opts(pattern, out, steps=150, soft_weight=0.3, soft_topk=8))
    tr.run()
    draft = load_draft(out)  # the exported bf16 Hugging Face folder
    res = measure_tau(tr.model, tr.tokenizer, draft, pattern["held_out"], block_size=8,
                      max_tokens=32)
    assert res["tau"] > 2.0, res
    random_draft = Trainer(opts(pattern, tmp_path / "rand", steps=1)).draft
    base = measure_tau(tr.model, tr.tokenizer, random_draft, pattern["held_out"], 8, 32)
    assert base["tau"] < 1.3, base



@pytest.mark.slow
def test_held_out_tau_during_training_is_measured_per_domain(pattern, tmp_path):
    """--eval-prompts with several domains (the id's prefix): τ of each, and ``tau_b4`` over
    every cycle of all of them — what one measurement over all the prompts gives."""
    prompts = tmp_path / "held-out.jsonl"
    items = [("alpha-0", "a b c"), ("beta-0", "x y"), ("alpha-1", "c b a"), ("beta-1", "y x z"),
             ("alpha-2", "never read: --eval-n 2 takes the first two of each domain")]
    prompts.write_text("".join(json.dumps({"id": i, "prompt": t}) + "\n" for i, t in items))
    tr = Trainer(opts(pattern, tmp_path / "d", steps=20, eval_every=10, soft_topk=8,
                      eval_prompts=str(prompts), eval_n=2, eval_block_sizes="4",
                      eval_max_tokens=12))
    assert {d: len(ids) for d, ids in tr.eval_prompts.items()} == {"alpha": 2, "beta": 2}
    # the pattern target's tokenizer knows more ids than its head: measure on its own prompts
    held_out = pattern["held_out"]
    tr.eval_prompts = {"alpha": held_out[:2], "beta": held_out[2:]}
    tr.run()
    records = [json.loads(line) for line in
               (tmp_path / "d" / "train" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "tau_b4" in r]
    assert [r["step"] for r in evaluated] == [10, 20]
    last = evaluated[-1]
    assert min(last["tau_b4_alpha"], last["tau_b4_beta"]) <= last["tau_b4"] <= \
        max(last["tau_b4_alpha"], last["tau_b4_beta"])
    together = engine_tau(tr.model, tr.tokenizer, tr.draft,
                          {"all": held_out}, "4", 12,
                          tr._draft_vocab())
    assert together["tau_b4"] == last["tau_b4"]
    assert together["acc_pos_b4"] == pytest.approx(last["acc_pos_b4"], abs=2e-3)
    assert "tau_b4_all" not in together  # one domain: no per-domain keys


def test_evaluations_cpu_is_kept_apart_from_the_runs(pattern, tmp_path):
    """--cpu-budget and the curves count training: an evaluation's CPU (validation and τ through
    the engine) goes to ``eval_cpu_s``, carried across --resume, not to ``cpu_s``."""
    kw = dict(steps=4, eval_every=2, eval_block_sizes="4", eval_max_tokens=24, val_percent=20,
              checkpoint_every=2)
    tr = Trainer(opts(pattern, tmp_path / "e", stop_after=2, **kw))
    tr.eval_prompts = {"all": pattern["held_out"]}
    before, clock = tr.cpu_seconds, time.process_time()
    res = tr._evaluate(tr.data.validation())
    spent = time.process_time() - clock
    assert spent > 0.05 and tr.cpu_seconds - before < 0.1 * spent
    assert res["eval_cpu_s"] == pytest.approx(spent, abs=0.05)
    tr.run()
    records = [json.loads(line) for line in
               (tmp_path / "e" / "train" / "metrics.jsonl").read_text().splitlines()]
    at_2 = next(r for r in records if r["step"] == 2 and "eval_cpu_s" in r)
    assert at_2["eval_cpu_s"] > res["eval_cpu_s"]  # the run's own evaluation at step 2 added
    resumed = Trainer(opts(pattern, tmp_path / "e", resume=True, **kw))
    assert resumed.eval_cpu_seconds == pytest.approx(at_2["eval_cpu_s"], abs=0.05)
    resumed.eval_prompts = {"all": pattern["held_out"]}
    resumed.run()
    last = [json.loads(line) for line in
            (tmp_path / "e" / "train" / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 4 and last["eval_cpu_s"] > at_2["eval_cpu_s"]


@pytest.mark.slow
def test_save_resume_continues_at_the_same_step_and_data(pattern, tmp_path):
    straight = Trainer(opts(pattern, tmp_path / "a", steps=8, checkpoint_every=4))
    straight.run()
    first = Trainer(opts(pattern, tmp_path / "b", steps=8, checkpoint_every=4, stop_after=4))
    first.run()
    assert first.step == 4
    # the output folder exists now: a plain rerun refuses, --resume continues
    with pytest.raises(TrainConfigError, match="exists"):
        Trainer(opts(pattern, tmp_path / "b", steps=8))
    resumed = Trainer(opts(pattern, tmp_path / "b", steps=8, checkpoint_every=4, resume=True))
    assert resumed.step == 4 and resumed.cursor == first.cursor and resumed.order == first.order
    resumed.run()
    assert resumed.step == 8
    assert (resumed.epoch, resumed.cursor) == (straight.epoch, straight.cursor)
    assert_same_weights(straight.draft, resumed.draft)
    assert straight.history[-1]["step_loss"] == pytest.approx(resumed.history[-1]["step_loss"],
                                                              rel=1e-4)
    assert straight.history[-1]["loss"] == pytest.approx(resumed.history[-1]["loss"], rel=1e-3)
    # the export loads in the engine with the recorded config
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2]
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 4
    weights = mx.load(str(tmp_path / "b" / "model.safetensors"))
    assert all(v.dtype == mx.bfloat16 for v in weights.values())
    draft = load_draft(tmp_path / "b")
    assert draft.mask_token_id == cfg["dflash_config"]["mask_token_id"]
    # proposals are limited to the training vocabulary (the ids of the data)
    assert cfg["dflash_config"]["draft_vocab_ids"] == sorted(resumed.vocab_ids.tolist())
    assert set(cfg["dflash_config"]["draft_vocab_ids"]) >= set(pattern["succ"])


@pytest.mark.slow
def test_a_packed_checkpoint_resumes_on_another_machine(pattern, tmp_path):
    """recipes/smollm2/carry_checkpoint.py: the newest checkpoint, packed small enough to carry
    (float16 weights, bfloat16 moments, $DFLASH_HOME-relative paths), resumes under another home."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes" / "smollm2"))
    import carry_checkpoint as carry_run

    home_a, home_b, store = tmp_path / "home-a", tmp_path / "home-b", tmp_path / "store"
    kw = dict(steps=8, checkpoint_every=4)
    straight = Trainer(opts(pattern, home_a / "straight", **kw))
    straight.run()
    first = Trainer(opts(pattern, home_a / "run", stop_after=6, cpu_budget=1e6,
                         feature_cache=str(home_a / "features"), **kw))
    first.run()  # checkpoints at 4 and 6 (the stop), metrics at 6
    carry_run.main([str(home_a / "run"), "--store", str(store), "--home", str(home_a)])
    state_text = (store / "state.json").read_text()
    assert str(home_a) not in state_text and "$DFLASH_HOME/features" in state_text
    assert mx.load(str(store / "draft.safetensors"))["fc.weight"].dtype == mx.float16
    assert all(v.dtype == mx.bfloat16 for v in mx.load(str(store / "optimizer.safetensors")).values()
               if mx.issubdtype(v.dtype, mx.floating))

    # the new machine: its own home, no checkpoints; the pack becomes step-0000006 again
    run_b = home_b / "run"
    carry_run.main([str(run_b), "--store", str(store), "--home", str(home_b), "--restore"])
    restored = json.loads((run_b / "train" / "step-0000006" / "state.json").read_text())
    assert restored["options"]["feature_cache"] == str((home_b / "features").resolve())
    weights = mx.load(str(run_b / "train" / "step-0000006" / "draft.safetensors"))
    assert all(v.dtype == mx.float32 for v in weights.values())
    metrics = (run_b / "train" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [6]
    resumed = Trainer(opts(pattern, run_b, resume=True, **kw))
    spent = json.loads((home_a / "run/train/step-0000006/state.json").read_text())["cpu_seconds"]
    assert resumed.step == 6 and resumed.cpu_before == spent > 0  # the CPU budget carries over
    assert (resumed.epoch, resumed.cursor, resumed.order) == (first.epoch, first.cursor,
                                                               first.order)
    resumed.run()
    assert (resumed.step, resumed.epoch, resumed.cursor) == (8, straight.epoch, straight.cursor)
    assert_same_weights(straight.draft, resumed.draft, atol=2e-3)  # float16 / bfloat16 rounding
    assert straight.history[-1]["loss"] == pytest.approx(resumed.history[-1]["loss"], rel=2e-2)

    # the machine that is ahead keeps its run; a folder that is no pack is named
    with pytest.raises(TrainConfigError, match="already holds step 8"):
        carry_run.main([str(run_b), "--store", str(store), "--home", str(home_b), "--restore"])
    with pytest.raises(TrainConfigError, match="not a packed checkpoint"):
        carry_run.main([str(tmp_path / "c"), "--store", str(home_a / "run"), "--restore"])
    with pytest.raises(TrainConfigError, match="no training checkpoint"):
        carry_run.main([str(tmp_path / "empty"), "--store", str(tmp_path / "s2")])


@pytest.mark.slow
def test_cli_entry_trains_and_writes_a_drafter(pattern, tmp_path):
    parser = add_train_args(argparse.ArgumentParser())
    args = parser.parse_args(["--target", str(pattern["target"]), "--data", str(pattern["data"]),
                              "--out", str(tmp_path / "cli"), "--layers", "1",
                              "--block-size", "4", "--taps", "1,3", "--steps", "3",
                              "--anchors", "4", "--no-progress"])
    out = run_train(args)
    assert load_draft(out).block_size == 4


@pytest.mark.slow
def test_dflash_train_command_exits_zero(pattern, tmp_path):
    common = ["--target", str(pattern["target"]), "--data", str(pattern["data"]),
              "--taps", "1,3", "--no-progress", "--feature-cache", str(tmp_path / "features")]
    for extra in (["--features-only"],
                  ["--out", str(tmp_path / "cmd"), "--layers", "1", "--block-size", "4",
                   "--steps", "2", "--anchors", "4", "--only-cached"]):
        p = subprocess.run([sys.executable, "-m", "dflash", "train", *common, *extra],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert load_draft(tmp_path / "cmd").block_size == 4


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.slow
def test_bad_settings_raise_named_errors(pattern, tmp_path):
    with pytest.raises(TrainConfigError, match="block-size"):
        Trainer(opts(pattern, tmp_path / "x", block_size=1))
    with pytest.raises(TrainConfigError, match=r"--taps \[4\].*4 layers"):
        Trainer(opts(pattern, tmp_path / "x", taps="0,4"))
    with pytest.raises(TrainConfigError, match="--taps"):
        Trainer(opts(pattern, tmp_path / "x", taps="a,b"))
    with pytest.raises(TrainConfigError, match="mask-token-id"):
        Trainer(opts(pattern, tmp_path / "x", mask_token_id=10**6))
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "config.json").write_text("{}")
    with pytest.raises(TrainConfigError, match="exists.*--resume.*--force"):
        Trainer(opts(pattern, tmp_path / "exists"))
    with pytest.raises(TrainConfigError, match="holds no training checkpoint"):
        Trainer(opts(pattern, tmp_path / "exists", resume=True))  # e.g. a published drafter
    Trainer(opts(pattern, tmp_path / "exists", force=True))  # --force overwrites


@pytest.mark.slow
def test_bad_data_raise_named_errors(pattern, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TrainingDataError, match="no usable samples"):
        Trainer(opts(pattern, tmp_path / "x", data=str(empty)))
    with pytest.raises(TrainingDataError, match="no such"):
        Trainer(opts(pattern, tmp_path / "x", data=str(tmp_path / "missing")))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "gen-00.jsonl").write_text(
        json.dumps({"id": "a", "prompt_ids": [1, 2], "response_ids": [3, 4, 5]}) + "\n"
        + json.dumps({"id": "b", "prompt": "hello"}) + "\n")
    with pytest.raises(TrainingDataError, match=r"gen-00.jsonl:2: needs `prompt_ids`"):
        Trainer(opts(pattern, tmp_path / "x", data=str(bad)))
    (bad / "gen-00.jsonl").write_text(
        json.dumps({"id": "a", "prompt_ids": [1, 2], "response_ids": [3, 4, 999999]}) + "\n")
    with pytest.raises(TrainingDataError, match="gen-00.jsonl:1: token id outside"):
        Trainer(opts(pattern, tmp_path / "x", data=str(bad)))
    assert issubclass(TrainingDataError, DFlashError)


def test_several_data_sets_merge_and_ids_may_not_repeat(tmp_path):
    def write(folder, ids):
        folder.mkdir()
        (folder / "gen-00.jsonl").write_text("".join(
            json.dumps({"id": i, "prompt_ids": [1, 2], "response_ids": [3, 4, 5]}) + "\n"
            for i in ids))
        return str(folder)

    math, code = write(tmp_path / "math", ["m1", "m2"]), write(tmp_path / "code", ["c1"])
    merged = read_samples(f"{math},{code}")
    assert [s.id for s in merged] == ["c1", "m1", "m2"]
    assert [s.id for s in read_samples([math, code])] == ["c1", "m1", "m2"]
    other = write(tmp_path / "other", ["m2"])
    with pytest.raises(TrainingDataError, match="'m2' is in both"):
        read_samples(f"{math},{other}")


# ---------------------------------------------------------------------------------------------
# Records longer than --max-len: the front of the prompt goes first, the target still reads it


def long_record(succ: dict[int, int], prompt_len: int, response_len: int, rid: str) -> dict:
    """A document-like record: a long prompt of pattern ids, then the pattern's continuation."""
    rng = np.random.default_rng(prompt_len)
    prompt = [int(x) for x in rng.choice(sorted(succ), size=prompt_len)]
    resp, t = [], prompt[-1]
    for _ in range(response_len):
        t = succ[t]
        resp.append(t)
    return {"id": rid, "prompt_ids": prompt, "response_ids": resp, "finish_reason": "stop"}


def test_a_long_record_drops_the_front_of_its_prompt_and_keeps_its_response(tmp_path):
    prompt, resp = list(range(1000, 1200)), list(range(5, 25))
    long_rec = {"id": "long", "prompt_ids": prompt, "response_ids": resp}
    short = {"id": "short", "prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6, 7]}
    huge = {"id": "huge", "prompt_ids": [9] * 10, "response_ids": list(range(300, 400))}
    (tmp_path / "gen-00.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in (long_rec, short, huge)))
    by_id = {s.id: s for s in read_samples(tmp_path, max_len=64)}
    cut = by_id["long"]
    assert cut.ids.tolist() == prompt[-44:] + resp and cut.prompt_len == 44
    assert cut.prefix.tolist() == prompt[:156] and cut.prefix.dtype == np.int32
    assert cut.ids[cut.prompt_len:].tolist() == resp  # anchors lie in the response, as before
    assert cut.n_anchors == len(resp) - 1
    # a response longer than max_len: one prompt token left, then the end is cut as before
    h = by_id["huge"]
    assert h.prompt_len == 1 and h.ids.tolist() == [9] + list(range(300, 363))
    assert h.prefix.tolist() == [9] * 9
    # a record that fits is unchanged, and so is its feature file (caches stay valid)
    sh = by_id["short"]
    assert sh.ids.tolist() == [1, 2, 3, 4, 5, 6, 7] and sh.prompt_len == 3 and not len(sh.prefix)
    store = FeatureStore(None, [0], 0, tmp_path / "features")
    key = hashlib.sha1(b"short|" + np.asarray(sh.ids, np.int32).tobytes()).hexdigest()[:24]
    assert store.path(sh) == tmp_path / "features" / key[:2] / f"{key}.npz"
    assert store.path(sh) == store.path(Sample("short", sh.ids, 3))
    assert store.path(cut) != store.path(Sample("long", cut.ids, cut.prompt_len))
    # the vocabulary is what training sees: not the dropped prefix
    assert not set(prompt[:156]) & seen_ids([cut])


@pytest.mark.slow
def test_cut_sample_features_are_the_whole_sequence_rows(pattern, tmp_path):
    from dflash.target import load_target, target_parts

    rec = long_record(pattern["succ"], 90, 30, "doc-0")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "gen-00.jsonl").write_text(json.dumps(rec) + "\n")
    [s] = read_samples(tmp_path / "data", max_len=48)
    assert len(s.prefix) == 72 and s.prompt_len == 18
    model, _ = load_target(str(pattern["target"]))
    parts = target_parts(model)
    store = FeatureStore(parts, [0, 2], 4, tmp_path / "features")
    whole = np.asarray(rec["prompt_ids"] + rec["response_ids"], np.int32)
    ref = store.compute(whole, head_from=len(rec["prompt_ids"]))  # the uncut record, one pass
    got = store.get(s)
    assert store.has(s) and store.path(s).is_file()
    for k in ("feats", "top_ids", "top_logp"):
        assert got[k].shape[0] == len(s.ids)
        assert np.array_equal(got[k], ref[k][len(s.prefix):]), k  # bit for bit
        assert np.array_equal(store.get(s)[k], got[k]), k  # and from the cache
    # features stored for the whole record (e.g. captured by datagen) serve the cut sample
    other = FeatureStore(parts, [0, 2], 4, tmp_path / "other")
    other.get(Sample(s.id, whole, len(rec["prompt_ids"])))
    assert other.has(s) and not other.path(s).is_file()
    computed = other.tokens_computed
    for k, v in other.get(s).items():
        assert np.array_equal(v, ref[k][len(s.prefix):]), k
    assert other.tokens_computed == computed  # read, not computed again


@pytest.mark.slow
def test_features_only_then_only_cached_trains_on_a_long_record(pattern, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "gen-00.jsonl").write_text(
        json.dumps(long_record(pattern["succ"], 120, 24, "doc-0")) + "\n")
    common = ["--target", str(pattern["target"]), "--data", str(data), "--taps", "1,3",
              "--no-progress", "--feature-cache", str(tmp_path / "features"), "--max-len", "64"]
    for extra in (["--features-only"],
                  ["--out", str(tmp_path / "cmd"), "--layers", "1", "--block-size", "4",
                   "--steps", "2", "--anchors", "4", "--only-cached", "--val-percent", "0"]):
        p = subprocess.run([sys.executable, "-m", "dflash", "train", *common, *extra],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    [s] = read_samples(data, max_len=64)
    assert s.prompt_len == 40 and len(s.prefix) == 80
    files = list((tmp_path / "features").rglob("*.npz"))
    assert [f.name for f in files] == [FeatureStore(None, [1, 3], 16, tmp_path).path(s).name]
    with np.load(files[0]) as z:
        assert z["feats"].shape[0] == 64
    assert load_draft(tmp_path / "cmd").block_size == 4


@pytest.mark.slow
def test_target_that_cannot_be_tapped(pattern, tmp_path):
    """A GPT-2 (no embed_tokens/layers/norm) is refused with the engine's named error."""
    from mlx_lm.utils import _get_classes

    path = tmp_path / "gpt2"
    path.mkdir()
    cfg = {"model_type": "gpt2", "n_ctx": 64, "n_embd": 32, "n_head": 2, "n_layer": 2,
           "n_positions": 64, "layer_norm_epsilon": 1e-5, "vocab_size": 512}
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(pattern["target"] / name, path / name)
    with pytest.raises(UnsupportedTargetError, match="cannot find embed_tokens"):
        Trainer(opts(pattern, tmp_path / "x", target=str(path)))


@pytest.mark.slow
def test_interrupted_run_checkpoints_and_resumes_exactly(pattern, tmp_path):
    """Ctrl-C in the middle of a step: that step is undone, saved, and redone on --resume."""
    straight = Trainer(opts(pattern, tmp_path / "a", steps=6, checkpoint_every=100))
    straight.run()
    tr = Trainer(opts(pattern, tmp_path / "b", steps=6, checkpoint_every=100))
    real_step = tr.train_step

    def flaky(batch):
        if tr.step == 4:
            real_step(batch)  # the update happens ... and then the user presses Ctrl-C
            raise KeyboardInterrupt
        return real_step(batch)

    tr.train_step = flaky
    with pytest.raises(KeyboardInterrupt):
        tr.run()
    resumed = Trainer(opts(pattern, tmp_path / "b", steps=6, checkpoint_every=100, resume=True))
    assert resumed.step == 4
    resumed.run()
    assert_same_weights(straight.draft, resumed.draft)
    assert (resumed.epoch, resumed.cursor) == (straight.epoch, straight.cursor)


@pytest.mark.slow
def test_kill_checkpoints_the_step_in_flight_and_resume_continues(pattern, tmp_path):
    """SIGTERM (a background run ignores Ctrl-C) stops `dflash train` as Ctrl-C does: a
    checkpoint at the last finished step, exit 130, --resume goes on from there."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "dflash", "train", "--target", str(pattern["target"]),
            "--data", str(pattern["data"]), "--out", str(out), "--layers", "1", "--block-size",
            "8", "--taps", "0,2", "--steps", "100000", "--anchors", "8", "--val-percent", "0",
            "--checkpoint-every", "100000", "--no-progress"]
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = out / "train" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.is_file() and metrics.read_text().strip()) and time.time() < deadline:
        time.sleep(0.2)  # the first record is written at step 10
    proc.terminate()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    [ckpt] = sorted((out / "train").glob("step-*"))
    step = json.loads((ckpt / "state.json").read_text())["step"]
    assert step >= 10
    resumed = Trainer(opts(pattern, out, taps="0,2", anchors=8, steps=step + 2, resume=True,
                           checkpoint_every=100000))
    assert resumed.step == step
    resumed.run()
    assert resumed.step == step + 2


# ---------------------------------------------------------------------------------------------
# Recipe levers: --optimizer, --loss, --time-budget


def test_muon_updates_the_layer_matrices_and_adamw_the_rest(pattern, tmp_path):
    """One step from the same weights on the same batch: Muon moves the drafter layers' 2-D
    weights differently; everything else (norms, the context projection) gets the same AdamW step."""
    trained = {}
    for name in ("adamw", "muon"):
        tr = Trainer(opts(pattern, tmp_path / name, optimizer=name))
        tr.train_step(tr.make_batch(tr.samples[:4], np.random.default_rng(5)))
        trained[name] = dict(tree_flatten(tr.draft.parameters()))
    a, m = trained["adamw"], trained["muon"]
    muon_keys = [k for k in a if k.startswith("layers.") and a[k].ndim == 2]
    assert muon_keys
    for k in a:
        same = mx.allclose(a[k], m[k], atol=1e-7).item()
        assert same != (k in muon_keys), k


def _scrambled_labels(batch, rng):
    labels = np.array(batch.labels)
    valid = labels >= 0
    labels[valid] = rng.permutation(labels[valid])
    return mx.array(labels)


def test_loss_kl_ignores_hard_labels_and_ce_ignores_the_top_k(pattern, tmp_path):
    from dataclasses import replace

    rng = np.random.default_rng(0)
    losses = {}
    for kind in ("kl", "ce", "mix"):
        tr = Trainer(opts(pattern, tmp_path / kind, loss=kind, soft_topk=8, soft_weight=0.5))
        batch = tr.make_batch(tr.samples[:4], np.random.default_rng(5))
        w = tr.opts.loss_soft_weight
        assert w == {"kl": 1.0, "ce": 0.0, "mix": 0.5}[kind]
        assert (batch.soft_ids is None) == (kind == "ce")  # ce does not even read the top-k

        def loss(b, tr=tr, w=w):
            return block_loss(tr.draft, tr.embed, tr.head_w, b, w)[0].item()

        base = loss(batch)
        scrambled = loss(replace(batch, labels=_scrambled_labels(batch, rng)))
        losses[kind] = (base, scrambled)
        if kind == "kl":
            assert scrambled == pytest.approx(base, rel=1e-6)
        else:
            assert abs(scrambled - base) > 1e-3 * base
        if kind == "ce":
            full = tr.make_batch(tr.samples[:4], np.random.default_rng(5))
            other = Trainer(opts(pattern, tmp_path / "ce-topk", loss="mix", soft_topk=8))
            topk = other.make_batch(other.samples[:4], np.random.default_rng(5))
            with_topk = replace(full, soft_ids=topk.soft_ids, soft_p=topk.soft_p)
            assert loss(with_topk) == pytest.approx(base, rel=1e-6)
    # mix is the weighted sum of the two terms
    assert losses["mix"][0] == pytest.approx(0.5 * losses["ce"][0] + 0.5 * losses["kl"][0],
                                             rel=1e-5)
    with pytest.raises(TrainConfigError, match="--loss kl"):
        Trainer(opts(pattern, tmp_path / "x", loss="kl", soft_topk=0))



def test_block_loss_equals_the_log_softmax_formula_with_its_gradients(pattern, tmp_path):
    """block_loss reads the label's and the top-k's logits as h · head row (no scatter over the
    vocabulary in the backward pass): the same loss and gradients as −log_softmax at them."""
    from mlx.utils import tree_flatten

    tr = Trainer(opts(pattern, tmp_path / "d", soft_topk=8, soft_weight=0.5, negatives=16))
    batch = tr.make_batch(tr.samples[:4], np.random.default_rng(5))
    assert batch.soft_ids is not None and batch.neg_w is not None

    def reference(draft, w):
        h = draft_hidden(draft, batch.context, batch.seq_index, tr.embed(batch.tokens),
                         batch.anchors, batch.masks)[:, 1:]
        head = mx.concatenate([tr.head_w, batch.neg_w], axis=0)
        logits = h @ head.T
        logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        hard = -mx.take_along_axis(logq, mx.maximum(batch.labels, 0)[..., None], -1)[..., 0]
        soft = -(batch.soft_p * mx.take_along_axis(logq, batch.soft_ids, -1)).sum(-1)
        per_row = (1 - w) * hard + w * soft
        return (per_row * batch.weights).sum() / batch.weights.sum()

    for w in (0.0, 0.5, 1.0):
        ours = nn.value_and_grad(tr.draft, lambda d, w=w: block_loss(d, tr.embed, tr.head_w,
                                                                     batch, w)[0])(tr.draft)
        ref = nn.value_and_grad(tr.draft, lambda d, w=w: reference(d, w))(tr.draft)
        assert ours[0].item() == pytest.approx(ref[0].item(), rel=1e-5)
        for (name, a), (_, b) in zip(tree_flatten(ours[1]), tree_flatten(ref[1])):
            assert mx.allclose(a, b, rtol=1e-3, atol=1e-6).item(), name


@pytest.mark.slow
def test_time_budget_stops_checkpoints_and_resumes_without_repeating_steps(pattern, tmp_path):
    kw = dict(steps=6, checkpoint_every=100, optimizer="muon", soft_topk=8, soft_weight=0.5)
    straight = Trainer(opts(pattern, tmp_path / "a", **kw))
    straight.run()
    first = Trainer(opts(pattern, tmp_path / "b", time_budget=1e-6, **kw))
    first.run()  # out of time after the first step: checkpoint + export, no exception
    assert first.step == 1
    assert (tmp_path / "b" / "train" / "step-0000001" / "state.json").is_file()
    assert load_draft(tmp_path / "b").block_size == 8
    again = Trainer(opts(pattern, tmp_path / "b", time_budget=1e-6, resume=True, **kw))
    assert again.step == 1
    again.run()
    assert again.step == 2
    resumed = Trainer(opts(pattern, tmp_path / "b", resume=True, **kw))
    resumed.run()
    assert resumed.step == 6
    assert (resumed.epoch, resumed.cursor) == (straight.epoch, straight.cursor)
    assert_same_weights(straight.draft, resumed.draft)
    steps = [json.loads(line)["step"]
             for line in (tmp_path / "b" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 6]  # every 10th step and each invocation's last: none twice


@pytest.mark.slow
def test_cpu_budget_counts_cpu_time_and_carries_it_across_resume(pattern, tmp_path):
    """--cpu-budget stops on the run's CPU time (a shared machine's wall time depends on the other
    jobs): waiting costs nothing, the CPU of earlier invocations is kept in the checkpoint."""
    kw = dict(steps=6, checkpoint_every=100)
    ckpts = tmp_path / "c" / "train"
    first = Trainer(opts(pattern, tmp_path / "c", cpu_budget=1e6, stop_after=3, **kw))
    idle = first.cpu_seconds
    time.sleep(0.5)  # wall time passes, CPU time (nearly) does not
    assert first.cpu_seconds - idle < 0.25
    first.run()
    spent = json.loads((ckpts / "step-0000003" / "state.json").read_text())["cpu_seconds"]
    assert spent >= idle > 0
    # resumed with a budget the earlier invocation already used up: one step, then a checkpoint
    again = Trainer(opts(pattern, tmp_path / "c", cpu_budget=spent, resume=True, **kw))
    assert again.cpu_before == spent and again.cpu_seconds > spent
    again.run()
    assert again.step == 4
    total = json.loads((ckpts / "step-0000004" / "state.json").read_text())["cpu_seconds"]
    assert total > spent
    last = Trainer(opts(pattern, tmp_path / "c", cpu_budget=1e6, resume=True, **kw))
    last.run()
    assert last.step == 6
    records = [json.loads(line) for line in (ckpts / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 4, 6]
    cpu = [r["cpu_s"] for r in records]
    assert cpu == sorted(cpu) and cpu[0] > 0
    with pytest.raises(TrainConfigError, match="--cpu-budget"):
        TrainOptions(target="t", data="d", out="o", cpu_budget=0).check()


@pytest.mark.slow
def test_cpu_schedule_anneals_when_the_cpu_budget_ends(pattern, tmp_path):
    """--lr-schedule cpu: warm-up and cosine run over the fraction of --cpu-budget spent, so a
    budgeted run ends annealed whatever a step costs (machines differ ~3x per step); --steps is a
    cap. Each logged rate is the formula at (about) the CPU time beside it."""
    from dflash.training.trainer import cpu_schedule

    assert cpu_schedule(1.0, 0.0, 0.1, 0.0) == pytest.approx(1e-3)
    assert cpu_schedule(1.0, 0.1, 0.1, 0.0) == pytest.approx(1.0)
    assert cpu_schedule(1.0, 0.55, 0.1, 0.0) == pytest.approx(0.5)
    assert cpu_schedule(1.0, 1.0, 0.1, 0.2) == pytest.approx(0.2)
    assert cpu_schedule(1.0, 7.0, 0.1, 0.0) == pytest.approx(0.0)  # past the budget: the floor
    probe = Trainer(opts(pattern, tmp_path / "probe", steps=3))
    before = probe.cpu_seconds
    probe.run()
    per_step = (probe.cpu_seconds - before) / 3
    t = Trainer(opts(pattern, tmp_path / "cpu", steps=10_000, cpu_budget=1e9, warmup=0.05,
                     lr_schedule="cpu", checkpoint_every=1000))
    # a budget of ~60 steps beyond this run's own start-up, far below the step cap
    budget = t.opts.cpu_budget = t.cpu_seconds + 60 * per_step
    t.run()
    assert 10 <= t.step < 10_000
    records = [json.loads(line) for line in
               (tmp_path / "cpu" / "train" / "metrics.jsonl").read_text().splitlines()]
    for r in records:  # the rate of each update is the formula at the CPU time of that update
        assert r["lr"] == pytest.approx(cpu_schedule(3e-3, r["cpu_s"] / budget, 0.05, 0.0),
                                        abs=0.15 * 3e-3)
    assert records[0]["lr"] > 0.3 * 3e-3  # past the warm-up at step 10 (by steps: 0.3 % of it)
    assert records[-1]["cpu_s"] >= budget - 0.1 and records[-1]["lr"] < 0.15 * 3e-3  # (cpu_s: 0.1 s)
    with pytest.raises(TrainConfigError, match="--lr-schedule cpu: needs --cpu-budget"):
        TrainOptions(target="t", data="d", out="o", lr_schedule="cpu").check()


@pytest.mark.slow
def test_a_disk_that_fills_while_training_loses_no_checkpoint_and_resume_continues(
        pattern, tmp_path, small_disk):
    """The disk fills under a running `dflash train`: it stops with the OS error; what it wrote
    before (checkpoints, export, metrics) stays whole, and once there is space again --resume
    ends with the weights of a run that never stopped."""
    kw = dict(steps=150, checkpoint_every=2, feature_cache="none")
    straight = Trainer(opts(pattern, tmp_path / "a", **kw))
    straight.run()
    out = small_disk.path / "run"
    o = opts(pattern, out, **kw)
    cmd = [sys.executable, "-m", "dflash", "train", "--target", o.target, "--data", o.data,
           "--out", str(out), "--layers", "1", "--block-size", "8", "--taps", "0,2", "--steps",
           "150", "--batch-seqs", "4", "--anchors", "16", "--lr", "0.003", "--checkpoint-every",
           "2", "--val-percent", "0", "--soft-weight", "0", "--feature-cache", "none",
           "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(Path(dflash.__file__).parent.parent))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    ckpts = out / "train"
    deadline = time.time() + 300
    while (time.time() < deadline and proc.poll() is None
           and not (ckpts / "step-0000004" / "state.json").is_file()):
        time.sleep(0.01)
    small_disk.fill()
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 1, "training finished before the disk filled"
    assert "No space left on device" in err or "bytes free" in err, err[-2000:]
    assert "Traceback" not in err  # one line that says what happened
    saved = [int(p.name.split("-")[1]) for p in ckpts.glob("step-*")]
    assert saved and max(saved) < 150
    for p in ckpts.glob("step-*"):  # every checkpoint the failed run left is whole
        json.loads((p / "state.json").read_text())
        mx.load(str(p / "draft.safetensors"))
        mx.load(str(p / "optimizer.safetensors"))
    assert load_draft(out).block_size == 8  # so is the exported drafter
    small_disk.free()
    resumed = Trainer(opts(pattern, out, resume=True, **kw))
    assert resumed.step == max(saved)
    resumed.run()
    assert resumed.step == 150
    assert_same_weights(straight.draft, resumed.draft)
    for line in (ckpts / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # a record the full disk cut short was ended before the next one


def test_recipe_flags_reach_the_options():
    parser = add_train_args(argparse.ArgumentParser())
    args = parser.parse_args(["--data", "d", "--optimizer", "muon", "--muon-lr", "0.01",
                              "--loss", "kl", "--time-budget", "90", "--cpu-budget", "300"])
    o = TrainOptions(**{**from_args(args), "target": "t", "out": "o"})
    assert (o.optimizer, o.muon_lr, o.loss, o.time_budget, o.cpu_budget) == (
        "muon", 0.01, "kl", 90.0, 300.0)
    paths = dict(target="t", data="d", out="o")
    assert o.budget_seconds == 90.0 and TrainOptions(**paths, max_minutes=1).budget_seconds == 60
    with pytest.raises(SystemExit):
        parser.parse_args(["--data", "d", "--loss", "hard"])
    with pytest.raises(TrainConfigError, match="--time-budget"):
        TrainOptions(**paths, time_budget=0).check()
