"""The draft window: every drafter (v1 and DFlash2) attends to at most the last N positions of its
context, keeps at most ``N - 1`` context rows per layer however long the context grows, trains
with the window it runs with, and never changes the output (the drafter only proposes)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from dflash2_fixtures import write_dflash2_drafter
from mlx_lm.generate import generate_step

from dflash.batch import batch_generate
from dflash.cli import main
from dflash.dflash2 import WindowCache
from dflash.drafter import block_mask, load_draft
from dflash.errors import DraftCheckpointError, GenerationConfigError
from dflash.model_mlx import PromptCache, generate
from dflash.ragged_cache import RaggedKVCache
from dflash.target import target_parts
from dflash.training.recipe import block_visibility

WINDOW = 8  # the tiny drafters' block size: the smallest window allowed


def alone(model, prompt, n) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def long_prompt(n: int = 70) -> list[int]:
    return [int(x) for x in np.random.default_rng(3).integers(2, 400, size=n)]


@pytest.fixture(scope="module")
def drafters(tiny_pair, tmp_path_factory):
    """``drafters(kind)`` -> {"v1": path, "v2": path}: the tiny v1 drafter and a DFlash2 one
    (full attention, no window of its own)."""
    made = {}

    def make(kind):
        if kind not in made:
            _, v1 = tiny_pair(kind)
            root = tmp_path_factory.mktemp(f"window-{kind}")
            made[kind] = {"v1": v1,
                          "v2": write_dflash2_drafter(root / "v2", v1, sliding_window=None)}
        return made[kind]

    return make


def taps_for(draft, n: int, seed: int = 0) -> mx.array:
    mx.random.seed(seed)
    return mx.random.normal((1, n, draft.config.num_taps * draft.config.hidden_size))


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("bad", [0, -3, 4, 2.5, "8", True])
def test_bad_windows_name_the_field(drafters, bad):
    path = drafters("qwen3")["v1"]
    with pytest.raises(GenerationConfigError, match="sliding_window_size"):
        load_draft(str(path), sliding_window_size=bad)
    draft = load_draft(str(path))
    with pytest.raises(GenerationConfigError, match="--draft-window"):
        draft.set_window(bad, "--draft-window")
    assert draft.window is None and draft.layers[0].self_attn.sliding_window is None


def test_bad_window_in_a_checkpoint(drafters, tmp_path):
    import shutil

    path = tmp_path / "bad"
    shutil.copytree(drafters("qwen3")["v1"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["dflash_config"]["draft_window"] = 3
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftCheckpointError, match="dflash_config.draft_window"):
        load_draft(str(path))


def test_cli_and_server_refuse_bad_windows(tiny_pair, capsys):
    target, draft = tiny_pair("qwen3")
    assert main(["generate", "--model", str(target), "--draft", str(draft), "-p", "hi",
                 "--draft-window", "0"]) == 2
    assert "--draft-window 0" in capsys.readouterr().err
    assert main(["generate", "--model", str(target), "--draft", str(draft), "-p", "hi",
                 "--draft-window", "4", "--no-speedup-estimate"]) == 1
    err = capsys.readouterr().err
    assert "--draft-window=4" in err and "block size (8)" in err
    with pytest.raises(SystemExit):
        main(["generate", "-p", "hi", "--draft-window", "lots"])
    from dflash.serving import create_server

    with pytest.raises(GenerationConfigError, match="draft_window"):
        create_server(str(target), str(draft), draft_window=0)


# ---------------------------------------------------------------------------------------------
# The cache is bounded; a window not reached changes nothing


@pytest.mark.parametrize("arch", ["v1", "v2"])
def test_cache_stays_within_the_window(drafters, arch):
    draft = load_draft(str(drafters("qwen3")[arch]), sliding_window_size=WINDOW)
    taps = taps_for(draft, 200)
    cache = draft.make_cache()
    sizes = {}
    for start in range(0, 200, 5):
        draft.append_context(taps[:, start:start + 5], cache)
        for c in cache:
            assert isinstance(c, WindowCache) and c.offset == start + 5
            assert c.keys.shape[2] == min(start + 5, WINDOW - 1)
        sizes[start + 5] = sum(c.nbytes for c in cache)
    assert sizes[50] == sizes[100] == sizes[200]  # flat once past the window
    # one long prompt at once keeps its last rows only
    once = draft.make_cache()
    draft.append_context(taps, once)
    assert all(c.keys.shape[2] == WINDOW - 1 and c.offset == 200 for c in once)


@pytest.mark.parametrize("arch", ["v1", "v2"])
def test_window_not_reached_changes_nothing(drafters, loaded_pair, arch):
    parts = target_parts(loaded_pair("qwen3")[0])
    path = str(drafters("qwen3")[arch])
    plain, wide = load_draft(path), load_draft(path, sliding_window_size=64)
    taps = taps_for(plain, 30)
    a, b = plain.make_cache(), wide.make_cache()
    plain.append_context(taps, a)
    wide.append_context(taps, b)
    # 30 context rows + a block of 8 all within 64 positions of every query
    ref = plain.block_logits(parts, 7, plain.block_size, a)
    got = wide.block_logits(parts, 7, wide.block_size, b)
    assert mx.array_equal(ref, got).item()
    assert mx.array_equal(plain.propose(ref, 7, a, _Greedy(), [7])[0],
                          wide.propose(got, 7, b, _Greedy(), [7])[0]).item()


class _Greedy:
    """The greedy sampler's proposal side, enough for ``propose``."""

    samples_proposals = False

    def propose(self, logits, history):
        return mx.argmax(logits, axis=-1), None


@pytest.mark.parametrize("arch", ["v1", "v2"])
def test_context_beyond_the_window_never_reaches_the_block(drafters, loaded_pair, arch):
    """A long context gives the same logits as its last ``window - 1`` rows at the same
    positions, and as a context whose older rows are different."""
    parts = target_parts(loaded_pair("qwen3")[0])
    draft = load_draft(str(drafters("qwen3")[arch]), sliding_window_size=WINDOW)
    taps = taps_for(draft, 40)
    full = draft.make_cache()
    for i in range(0, 40, 7):
        draft.append_context(taps[:, i:i + 7], full)
    other = draft.make_cache()
    draft.append_context(mx.concatenate([taps[:, :30] * 3, taps[:, 30:]], axis=1), other)
    ref = draft.block_logits(parts, 5, draft.block_size, full)
    assert mx.allclose(ref, draft.block_logits(parts, 5, draft.block_size, other),
                       atol=1e-5).item()


def test_mask_sees_the_last_positions_only():
    """The engine's mask, brute force: query ``q`` sees context position ``c`` iff
    ``q - c < window``; the block is whole (not causal) on a full-attention layer."""
    n_context, block, window, start = 7, 8, 8, 40
    mask = np.array(block_mask(n_context, block, window, False, start, start - n_context))
    for j in range(block):
        for i in range(n_context):
            assert mask[j, i] == ((start + j) - (start - n_context + i) < window)
        assert mask[j, n_context:].all()


# ---------------------------------------------------------------------------------------------
# Exact output through the real loop; bounded caches there too


@pytest.mark.parametrize("arch", ["v1", "v2"])
def test_greedy_output_is_the_targets_with_a_small_window(drafters, loaded_pair, arch):
    model, tokenizer, _ = loaded_pair("qwen3")
    draft = load_draft(str(drafters("qwen3")[arch]), sliding_window_size=WINDOW)
    prompt = long_prompt()
    cache = PromptCache()
    out = generate(model, draft, tokenizer, prompt, max_tokens=40, prompt_cache=cache)
    assert out.tokens == alone(model, prompt, 40)
    assert all(c.keys.shape[2] <= WINDOW - 1 for c in cache.entries()[-1].draft)
    assert cache.entries()[-1].draft[0].offset > 2 * WINDOW
    # the next turn starts from the kept caches (trimmed back): still exact
    follow = prompt + out.tokens + [5, 6, 7]
    again = generate(model, draft, tokenizer, follow, max_tokens=24, prompt_cache=cache)
    assert again.tokens == alone(model, follow, 24)


def test_batched_engine_honours_the_window(drafters, loaded_pair, capsys):
    model, tokenizer, _ = loaded_pair("qwen3")
    draft = load_draft(str(drafters("qwen3")["v1"]), sliding_window_size=WINDOW)
    prompts = [long_prompt(n) for n in (30, 45, 61)]
    out = batch_generate(model, draft, tokenizer, prompts, max_batch=3, max_tokens=24)
    assert "one sequence at a time" not in capsys.readouterr().err
    for p, r in zip(prompts, out):
        assert r.tokens == alone(model, p, 24)


def test_ragged_mask_brute_force():
    cache = RaggedKVCache()
    for length in (5, 12, 9):
        cache.add(mx.zeros((1, 1, length, 2)), mx.zeros((1, 1, length, 2)))
    n, window = 8, 8
    mask = np.array(cache.context_mask(n, window))
    assert mask.shape == (3, 1, n, 12)
    for b, length in enumerate((5, 12, 9)):
        for j in range(n):
            for s in range(12):
                assert mask[b, 0, j, s] == (s < length and (length + j) - s < window)
    plain = np.array(cache.context_mask(n))
    assert all((plain[b, 0, :, :length].all() and not plain[b, 0, :, length:].any())
               for b, length in enumerate((5, 12, 9)))


def test_window_cache_joins_a_batch_padded_to_its_positions():
    c = WindowCache(4)
    c.update_and_fetch(mx.arange(10.0).reshape(1, 1, 10, 1), mx.arange(10.0).reshape(1, 1, 10, 1))
    ragged = RaggedKVCache()
    ragged.add_cache(c)
    keys, _ = ragged.keys_and_values()
    assert ragged.lengths == [10]
    assert np.array(keys)[0, 0, :, 0].tolist() == [0] * 6 + [6, 7, 8, 9]


def test_window_cache_trim_brings_older_rows_back():
    c = WindowCache(4)
    for i in range(6):
        c.update_and_fetch(mx.full((1, 1, 1, 1), float(i)), mx.full((1, 1, 1, 1), float(i)))
    assert np.array(c.keys)[0, 0, :, 0].tolist() == [2, 3, 4, 5]
    c.trim(2)
    assert c.offset == 4 and np.array(c.keys)[0, 0, :, 0].tolist() == [0, 1, 2, 3]
    c.trim(10)
    assert c.offset == 0 and c.keys.shape[2] == 0


# ---------------------------------------------------------------------------------------------
# Training with the window


def test_training_mask_is_the_brute_force_one():
    rng = np.random.default_rng(0)
    anchors, ctx_len, block, window = rng.integers(1, 60, size=12), 64, 8, 10
    vis = block_visibility(anchors, ctx_len, block, window, False)
    for b, a in enumerate(anchors):
        for j in range(block):
            for c in range(ctx_len):
                # strictly before the anchor, and within the window of the query at a + j
                assert vis[b, j, c] == (c < a and (a + j) - c < window)
            assert vis[b, j, ctx_len:].all()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_training_with_a_window(tmp_path, arch):
    """``--draft-window``: every layer's training mask is the window's, the training forward is
    the engine's forward with that window, and the exported drafter runs with it."""
    from test_train import opts, write_pattern_data

    from dflash.training.loss import draft_hidden
    from dflash.training.trainer import Trainer

    succ, data = write_pattern_data(tmp_path / "p", 16)
    pattern = {"target": tmp_path / "p" / "target", "data": data}
    tr = Trainer(opts(pattern, tmp_path / "d", layers=2, steps=3, draft_window=WINDOW, arch=arch,
                      selector_rank=8, selector_top_k=4))
    assert all(layer.self_attn.sliding_window == WINDOW for layer in tr.draft.layers)
    samples = [tr.samples[0], tr.samples[1]]
    batch = tr.make_batch(samples, np.random.default_rng(0), 6)
    anchors = np.array(batch.anchors)
    ctx_len = batch.context.shape[1]
    for mask in batch.masks:
        assert (np.array(mask)[:, 0] == block_visibility(anchors, ctx_len, 8, WINDOW)).all()
    h = draft_hidden(tr.draft, batch.context, batch.seq_index, tr.embed(batch.tokens),
                     batch.anchors, batch.masks)
    feats = [mx.array(tr.features.get(s)["feats"].astype(np.float32))[None] for s in samples]
    for i, (a, s) in enumerate(zip(anchors, np.array(batch.seq_index))):
        cache = tr.draft.make_cache()
        tr.draft.append_context(feats[s][:, :a], cache)
        ref = tr.draft(tr.embed(batch.tokens[i:i + 1]), cache)[0]
        assert mx.abs(ref - h[i]).max().item() < 1e-4
    tr.run()
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["dflash_config"]["draft_window"] == WINDOW
    loaded = load_draft(str(tmp_path / "d"))
    assert loaded.window == WINDOW and isinstance(loaded.make_cache()[0], WindowCache)


def test_train_option_is_checked():
    from dflash.errors import TrainConfigError
    from dflash.training.options import TrainOptions

    with pytest.raises(TrainConfigError, match="--draft-window"):
        TrainOptions(target="t", data="x", out="o", block_size=8, draft_window=4).check()


def test_window_cache_copies_once_per_slack_rows():
    """Once the window is full, appends write in place: the buffer is re-laid (the window copied)
    only when its slack is used up."""
    c = WindowCache(300)
    relaid = 0
    for i in range(1000):
        before = c.used
        c.update_and_fetch(mx.full((1, 1, 1, 1), float(i)), mx.full((1, 1, 1, 1), float(i)))
        relaid += c.used != before + 1
        assert c.keys.shape[2] == min(i + 1, 300)
        assert c._keys.shape[2] <= 300 + 256
    assert relaid <= 1000 // 256 + 1
    assert np.array(c.keys)[0, 0, [0, -1], 0].tolist() == [700, 999]
