"""dflash train --init-from D --grow-layers N: the grown drafter proposes exactly as D before its
first step (its new layers add nothing to the residual stream), its zeroed projections move once
it trains, its depth survives export and resume, and bad input is named."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_dflash2_train import greedy_proposals, v1_drafter  # noqa: F401  (fixture)
from test_train import opts, pattern, pattern_records  # noqa: F401  (the pattern fixture)

from dflash.drafter import load_draft
from dflash.errors import TrainConfigError
from dflash.model_mlx import generate
from dflash.training.trainer import Trainer

ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def test_grown_drafter_proposes_exactly_as_the_one_it_grew_from(pattern, v1_drafter,  # noqa: F811
                                                                 tmp_path):
    tr = Trainer(opts(pattern, tmp_path / "grown", init_from=str(v1_drafter), grow_layers=2,
                      export_vocab=False))
    v1 = load_draft(v1_drafter)
    assert len(tr.draft.layers) == len(v1.layers) + 2
    prompts = [r["prompt_ids"] for r in pattern_records(pattern["succ"], 4, seed=5)]
    prompts.append([7, 300, 41, 9, 2])  # off-pattern
    expected = greedy_proposals(v1, tr.model, tr.tokenizer, prompts)
    assert greedy_proposals(tr.draft, tr.model, tr.tokenizer, prompts) == expected
    grown = load_draft(tr.export(tmp_path / "exported"))
    assert grown.config.num_hidden_layers == len(v1.layers) + 2
    assert greedy_proposals(grown, tr.model, tr.tokenizer, prompts) == expected
    for prompt in prompts[:2]:
        a = generate(tr.model, v1, tr.tokenizer, prompt, max_tokens=40, policy="fixed")
        b = generate(tr.model, grown, tr.tokenizer, prompt, max_tokens=40, policy="fixed")
        assert a.tokens == b.tokens and a.stats.mean_tau == b.stats.mean_tau
    # the zeroed projections are what keeps the proposals: a moved one changes them
    mx.random.seed(1)
    new = tr.draft.layers[-1]
    new.mlp.down_proj.weight = mx.random.normal(new.mlp.down_proj.weight.shape)
    mx.eval(tr.draft.parameters())
    assert greedy_proposals(tr.draft, tr.model, tr.tokenizer, prompts) != expected


def test_grown_layers_train_and_keep_their_depth_on_resume(pattern, v1_drafter,  # noqa: F811
                                                           tmp_path):
    out = tmp_path / "grown"
    tr = Trainer(opts(pattern, out, init_from=str(v1_drafter), grow_layers=1, steps=3,
                      checkpoint_every=3, export_vocab=False))
    kept = len(tr.draft.layers) - 1
    before = dict(tree_flatten(tr.draft.layers[kept - 1].parameters()))
    tr.run()
    moved = dict(tree_flatten(tr.draft.layers[kept].parameters()))
    for name in ZEROED:  # zero at the start, trained since
        assert float(mx.abs(moved[name]).max()) > 0, name
    copied = [n for n in before if n not in ZEROED and n.endswith("weight")]
    assert copied  # the rest started as the last layer's copy (then trained from there)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == kept + 1
    assert len(cfg["layer_types"]) == kept + 1
    again = Trainer(opts(pattern, out, resume=True, steps=5, checkpoint_every=5,
                         export_vocab=False))
    assert len(again.draft.layers) == kept + 1 and again.step == 3
    resumed = dict(tree_flatten(again.draft.layers[kept].parameters()))
    np.testing.assert_array_equal(np.array(resumed["mlp.down_proj.weight"]),
                                  np.array(moved["mlp.down_proj.weight"]))


def test_grow_layers_needs_a_drafter_to_grow(pattern, tmp_path):  # noqa: F811
    with pytest.raises(TrainConfigError, match="--grow-layers 2: .*needs --init-from"):
        Trainer(opts(pattern, tmp_path / "x", grow_layers=2))
    with pytest.raises(TrainConfigError, match="--grow-layers -1"):
        Trainer(opts(pattern, tmp_path / "x", grow_layers=-1))
