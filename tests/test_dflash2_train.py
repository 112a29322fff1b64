"""dflash train --arch dflash2: the upgrade from a v1 drafter proposes exactly as v1, the training
forward keeps the convolution inside each block, the selector's loss element by element, a few
steps lower the loss, the export is the released layout and reloads, and bad input is named."""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from test_train import opts, pattern, pattern_records  # noqa: F401  (the pattern fixture)
from tiny_models import write_drafter

from dflash.drafter import CODEBOOKS, load_draft
from dflash.errors import TrainConfigError
from dflash.model_mlx import generate
from dflash.sampling import BlockSampler, SamplingConfig
from dflash.training.commands import add_train_args
from dflash.training.loss import block_loss, draft_hidden, selector_loss
from dflash.training.options import from_args
from dflash.training.trainer import Trainer

SMALL = dict(arch="dflash2", selector_rank=16, selector_top_k=4)


def d2opts(pattern, out, **kw):  # noqa: F811
    return opts(pattern, out, **{**SMALL, **kw})


@pytest.fixture(scope="module")
def v1_drafter(pattern, tmp_path_factory):  # noqa: F811
    """A v1 drafter of the pattern target, briefly trained (so its proposals are not noise)."""
    out = tmp_path_factory.mktemp("v1") / "draft"
    Trainer(opts(pattern, out, steps=30, export_vocab=False)).run()
    return out


def randomise_new_parts(draft, seed=0):
    """Move DFlash2's convolutions and codebooks off their identity initialisation."""
    mx.random.seed(seed)
    for layer in draft.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = conv.base_kernel + 0.3 * mx.random.normal(conv.base_kernel.shape)
            w = conv.kernel_projection.weight
            conv.kernel_projection.weight = 0.1 * mx.random.normal(w.shape)
    sel = draft.candidate_selector
    sel.successor_codebook.weight = mx.random.normal(sel.successor_codebook.weight.shape)
    mx.eval(draft.parameters())


def greedy_proposals(draft, model, tokenizer, prompts):
    """Each prompt's first block of proposals after its prefill, through the engine's parts."""
    from dflash.target import forward, make_cache, target_parts

    parts = target_parts(model)
    out = []
    for prompt in prompts:
        _, taps = forward(parts, mx.array(prompt)[None], make_cache(parts), draft.target_layer_ids)
        cache = draft.make_cache()
        draft.append_context(taps, cache)
        logits = draft.block_logits(parts, prompt[-1], draft.block_size, cache)
        proposals, _ = draft.propose(logits, prompt[-1], cache, BlockSampler(SamplingConfig()),
                                     prompt)
        out.append(proposals.tolist())
    return out


# ---------------------------------------------------------------------------------------------
# Upgrading a v1 drafter


@pytest.mark.slow
def test_upgrade_from_v1_proposes_exactly_as_v1(pattern, v1_drafter, tmp_path):  # noqa: F811
    tr = Trainer(d2opts(pattern, tmp_path / "up", init_from=str(v1_drafter), export_vocab=False))
    assert type(tr.draft).__name__ == "DFlash2DraftModel"
    v1 = load_draft(v1_drafter)
    prompts = [r["prompt_ids"] for r in pattern_records(pattern["succ"], 4, seed=5)]
    prompts.append([7, 300, 41, 9, 2])  # off-pattern: proposals far from the cycle
    expected = greedy_proposals(v1, tr.model, tr.tokenizer, prompts)
    assert greedy_proposals(tr.draft, tr.model, tr.tokenizer, prompts) == expected
    # the step-0 export (released layout, bf16 of float32 weights that were bf16) too
    upgraded = load_draft(tr.export(tmp_path / "exported"))
    assert greedy_proposals(upgraded, tr.model, tr.tokenizer, prompts) == expected
    # and every cycle of a whole generation: same tokens, same acceptance
    for prompt in prompts[:2]:
        a = generate(tr.model, v1, tr.tokenizer, prompt, max_tokens=40, policy="fixed")
        b = generate(tr.model, upgraded, tr.tokenizer, prompt, max_tokens=40, policy="fixed")
        assert a.tokens == b.tokens and a.stats.mean_tau == b.stats.mean_tau
    # the identity is a real constraint: moved new parts change the proposals
    randomise_new_parts(tr.draft)
    assert greedy_proposals(tr.draft, tr.model, tr.tokenizer, prompts) != expected


@pytest.mark.slow
def test_a_continued_drafter_is_evaluated_before_its_first_step(pattern, v1_drafter,  # noqa: F811
                                                                tmp_path):
    """With --init-from the curve starts at step 0 with the drafter it continues: the τ of that
    record is the v1 drafter's own, measured through the engine on the same prompts."""
    from dflash.training.evaluation import engine_tau

    tr = Trainer(opts(pattern, tmp_path / "cont", init_from=str(v1_drafter), steps=10,
                      eval_every=10, eval_block_sizes="4", eval_max_tokens=12))
    held_out = pattern["held_out"]
    tr.eval_prompts = {"alpha": held_out[:2], "beta": held_out[2:4]}
    tr.run()
    records = [json.loads(line) for line in
               (tmp_path / "cont" / "train" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "tau_b4" in r]
    assert [r["step"] for r in evaluated] == [0, 10]
    v1 = load_draft(v1_drafter)
    own = engine_tau(tr.model, tr.tokenizer, v1, tr.eval_prompts, "4", 12, tr._draft_vocab())
    assert evaluated[0]["tau_b4"] == pytest.approx(own["tau_b4"], abs=1e-6)
    assert evaluated[0]["cpu_s"] >= 0 and evaluated[0]["tau_b4"] > 1.0


@pytest.mark.slow
def test_upgrade_keeps_the_v1_draft_vocabulary(pattern, tmp_path):  # noqa: F811
    v1 = tmp_path / "v1"
    cut = list(range(0, 512, 3))
    write_drafter(v1, pattern["target"], taps=(0, 2), block_size=8,
                  extra={"dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 511,
                                           "draft_vocab_ids": cut}})
    tr = Trainer(d2opts(pattern, tmp_path / "up", init_from=str(v1), steps=1))
    assert set(cut) <= set(tr.vocab_ids.tolist())
    assert tr.cfg.block_size == 8 and tr.cfg.mask_token_id == 511
    cfg = json.loads(tr.export(tmp_path / "exported").joinpath("config.json").read_text())
    assert set(cut) <= set(cfg["dflash_config"]["draft_vocab_ids"])
    assert cfg["dflash_training"]["init_from"] == str(v1)


# ---------------------------------------------------------------------------------------------
# The training forward and the loss


@pytest.mark.slow
def test_training_forward_equals_engine_forward_and_stays_in_its_block(pattern, tmp_path):  # noqa: F811
    """Blocks packed along the batch: each equals the engine's one-block forward (convolution
    included), and changing one block's tokens changes no other block."""
    tr = Trainer(d2opts(pattern, tmp_path / "d", layers=2))
    randomise_new_parts(tr.draft)
    samples = [tr.samples[0], tr.samples[1]]
    batch = tr.make_batch(samples, np.random.default_rng(0), 5)
    h = draft_hidden(tr.draft, batch.context, batch.seq_index, tr.embed(batch.tokens),
                     batch.anchors, batch.masks)
    feats = [mx.array(tr.features.get(s)["feats"].astype(np.float32))[None] for s in samples]
    for i, (a, s) in enumerate(zip(np.array(batch.anchors), np.array(batch.seq_index))):
        cache = tr.draft.make_cache()
        tr.draft.append_context(feats[s][:, :a], cache)
        ref = tr.draft(tr.embed(batch.tokens[i:i + 1]), cache)[0]
        assert mx.abs(ref - h[i]).max().item() < 1e-4
    tokens = np.array(batch.tokens)
    tokens[3, 1:] = 7  # block 3's rows now differ
    h2 = draft_hidden(tr.draft, batch.context, batch.seq_index, tr.embed(mx.array(tokens)),
                      batch.anchors, batch.masks)
    changed = [i for i in range(len(tokens)) if mx.abs(h2[i] - h[i]).max().item() > 0]
    assert changed == [3]


def test_selector_loss_element_by_element(pattern, tmp_path):  # noqa: F811
    tr = Trainer(d2opts(pattern, tmp_path / "d"))
    randomise_new_parts(tr.draft)
    batch = tr.make_batch(tr.samples[:2], np.random.default_rng(1), 3)
    sel = tr.draft.candidate_selector
    h = draft_hidden(tr.draft, batch.context, batch.seq_index, tr.embed(batch.tokens),
                     batch.anchors, batch.masks)[:, 1:]
    unary = h @ tr.head_w.T
    got = selector_loss(sel, h, unary, batch).item()

    U, H = np.array(unary), np.array(h)
    A = np.array(sel.predecessor_codebook.weight)
    B = np.array(sel.successor_codebook.weight)
    P = np.array(sel.hidden_projection.weight)
    labels, prev = np.array(batch.labels), np.array(batch.prev_ids)
    w, ids = np.array(batch.weights), tr.vocab_ids
    tokens = np.array(batch.tokens)
    num = den = 0.0
    counted = 0
    for b in range(U.shape[0]):
        for t in range(U.shape[1]):
            # teacher forcing: the gold token one position earlier, the anchor for row 1
            gold_prev = tokens[b, 0] if t == 0 else ids[labels[b, t - 1]]
            if t == 0 or labels[b, t - 1] >= 0:
                assert prev[b, t] == gold_prev
            cand = np.argsort(-U[b, t])[:4]
            if labels[b, t] < 0 or labels[b, t] not in cand:
                continue
            s = U[b, t, cand] + (B[ids[cand]] * (P @ H[b, t]) * A[prev[b, t]]).sum(-1)
            ce = np.log(np.exp(s - s.max()).sum()) + s.max() - s[list(cand).index(labels[b, t])]
            num += w[b, t] * ce
            den += w[b, t]
            counted += 1
    assert counted > 0
    assert got == pytest.approx(num / den, rel=1e-4)


@pytest.mark.slow
def test_a_few_steps_lower_both_losses(pattern, tmp_path):  # noqa: F811
    tr = Trainer(d2opts(pattern, tmp_path / "d", selector_weight=1.0))
    batch = tr.make_batch(tr.samples[:4], np.random.default_rng(5))

    def losses():
        h = draft_hidden(tr.draft, batch.context, batch.seq_index, tr.embed(batch.tokens),
                         batch.anchors, batch.masks)[:, 1:]
        return (block_loss(tr.draft, tr.embed, tr.head_w, batch, 0.0, 1.0)[0].item(),
                selector_loss(tr.draft.candidate_selector, h, h @ tr.head_w.T, batch).item())

    total0, sel0 = losses()
    book0 = np.array(tr.draft.candidate_selector.successor_codebook.weight)
    for _ in range(15):
        tr.train_step(tr.make_batch(tr.feed.next_samples(), np.random.default_rng(tr.step)))
        tr.step += 1
    total1, sel1 = losses()
    assert total1 < 0.5 * total0, (total0, total1)
    assert sel1 < sel0, (sel0, sel1)
    assert not (np.array(tr.draft.candidate_selector.successor_codebook.weight) == book0).all()


# ---------------------------------------------------------------------------------------------
# Export, reload, resume


@pytest.mark.slow
def test_export_is_the_released_layout_and_reloads(pattern, tmp_path):  # noqa: F811
    out = tmp_path / "d2"
    tr = Trainer(d2opts(pattern, out, steps=6, checkpoint_every=3, stop_after=3))
    tr.run()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    d = cfg["dflash_config"]
    assert (d["block_size"], d["conv_kernel_size"], d["conv_group_size"], d["selector_rank"],
            d["selector_top_k"]) == (8, 2, 16, 16, 4)
    assert "block_size" not in cfg  # moved into dflash_config, as released
    assert cfg["sliding_window"] == 2048 and cfg["layer_types"] == ["sliding_attention"]
    stored = mx.load(str(out / "model.safetensors"))
    for name in CODEBOOKS:
        assert name in stored and stored[name].shape == (512, 16)  # bare, no `.weight`
    assert stored["layers.0.attention_conv.kernel_projection.weight"].shape == (2 * 2 * 4, 64)
    loaded = load_draft(out)
    want = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(tr.draft.parameters())}
    for k, v in tree_flatten(loaded.parameters()):
        assert mx.array_equal(v.astype(mx.bfloat16), want[k]), k
    # resume continues the DFlash2 run
    resumed = Trainer(d2opts(pattern, out, steps=6, checkpoint_every=3, resume=True))
    assert type(resumed.draft).__name__ == "DFlash2DraftModel" and resumed.step == 3
    resumed.run()
    assert load_draft(out).config.raw["dflash_training"]["step"] == 6
    # the trained drafter stays exact through the engine
    prompt = pattern_records(pattern["succ"], 1, seed=9)[0]["prompt_ids"]
    expected = [int(t) for t, _ in generate_step(mx.array(prompt), tr.model, max_tokens=30)]
    out_tokens = generate(tr.model, load_draft(out), tr.tokenizer, prompt, max_tokens=30,
                          policy="fixed").tokens
    assert out_tokens == expected


# ---------------------------------------------------------------------------------------------
# Bad input


def test_arch_flags_reach_the_options():
    parser = add_train_args(argparse.ArgumentParser())
    args = parser.parse_args(["--data", "d", "--arch", "dflash2", "--init-from", "v1",
                              "--selector-weight", "0.5", "--selector-rank", "32",
                              "--selector-top-k", "8", "--sliding-window", "512"])
    o = from_args(args)
    assert (o["arch"], o["init_from"], o["selector_weight"], o["selector_rank"],
            o["selector_top_k"], o["sliding_window"]) == ("dflash2", "v1", 0.5, 32, 8, 512)
    with pytest.raises(SystemExit):
        parser.parse_args(["--data", "d", "--arch", "dflash3"])


@pytest.mark.slow
def test_bad_arch_and_init_from_raise_named_errors(pattern, v1_drafter, tmp_path):  # noqa: F811
    with pytest.raises(TrainConfigError, match="--arch 'dflash3'"):
        Trainer(d2opts(pattern, tmp_path / "x", arch="dflash3"))
    with pytest.raises(TrainConfigError, match="--selector-weight"):
        Trainer(d2opts(pattern, tmp_path / "x", selector_weight=-1.0))
    with pytest.raises(TrainConfigError, match="--init last and --init-from"):
        Trainer(d2opts(pattern, tmp_path / "x", init="last", init_from=str(v1_drafter)))
    with pytest.raises(TrainConfigError, match="--conv-kernel-size"):
        Trainer(d2opts(pattern, tmp_path / "x", conv_kernel_size=9))
    d2 = tmp_path / "d2"
    Trainer(d2opts(pattern, d2, steps=1)).run()
    with pytest.raises(TrainConfigError, match="--init-from .*DFlash2DraftModel.*v1 drafter"):
        Trainer(d2opts(pattern, tmp_path / "x", init_from=str(d2)))
    with pytest.raises(TrainConfigError, match="--init-from .*not a loadable DFlash drafter"):
        Trainer(d2opts(pattern, tmp_path / "x", init_from=str(pattern["target"])))
    with pytest.raises(TrainConfigError, match="--init-from .*no such drafter folder"):
        Trainer(d2opts(pattern, tmp_path / "x", init_from=str(tmp_path / "missing")))
    other = tmp_path / "other-v1"
    write_drafter(other, pattern["target"], taps=(0, 2), block_size=8,
                  extra={"vocab_size": 1024})
    with pytest.raises(TrainConfigError, match="--init-from .*another target"):
        Trainer(d2opts(pattern, tmp_path / "x", init_from=str(other)))
