"""Greedy exactness of the speculative loop against mlx-lm's own greedy decoding."""

import mlx.core as mx
import pytest
from conftest import KINDS
from mlx_lm.generate import generate_step
from tiny_models import OracleDrafter

from dflash.model_mlx import generate, stream_generate
from dflash.policy import confident_rows, draft_candidates
from dflash.target import VerifyTrace, forward, make_cache, rollback, target_parts

N_TOKENS = 200


def chat_prompt(tokenizer, text="Tell me about the sea."):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True)


def reference(model, prompt, n=N_TOKENS, **kwargs):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, **kwargs)]


@pytest.fixture(scope="module")
def references(loaded_pair):
    cache = {}

    def get(kind):
        if kind not in cache:
            model, tokenizer, _ = loaded_pair(kind)
            prompt = chat_prompt(tokenizer)
            cache[kind] = (prompt, reference(model, prompt))
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k == "qwen3" else k
                                  for k in KINDS])  # qwen3: llama covers attention-only
@pytest.mark.parametrize("block_size", [pytest.param(2, marks=pytest.mark.slow), 4,
                                        pytest.param(8, marks=pytest.mark.slow),
                                        pytest.param(16, marks=pytest.mark.slow)])
def test_greedy_equals_target_alone(kind, block_size, loaded_pair, references):
    model, tokenizer, draft = loaded_pair(kind)
    prompt, ref = references(kind)
    out = generate(model, draft, tokenizer, prompt, block_size=block_size, max_tokens=N_TOKENS,
                   min_confidence=0.0)
    assert out.tokens == ref
    assert out.finish_reason == "length"
    assert out.stats.generation_tokens == N_TOKENS


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_5", "llama"])
def test_shorter_verify_keeps_output_and_follows_confidence(kind, loaded_pair, references):
    model, tokenizer, draft = loaded_pair(kind)
    prompt, ref = references(kind)
    verified = []
    for threshold in (0.0, None, 1e-3, 0.3, 1.0):
        out = generate(model, draft, tokenizer, prompt, block_size=8, max_tokens=N_TOKENS,
                       min_confidence=threshold)
        assert out.tokens == ref, threshold
        verified.append(out.stats.verified_tokens / out.stats.cycles)
    assert verified[0] == pytest.approx(7.0, abs=0.2)  # every proposal verified
    assert verified[-1] == pytest.approx(1.0, abs=0.01)  # only the first (the last cycle: none)
    assert verified[0] >= verified[2] >= verified[3] >= verified[4]
    # A confident drafter keeps the whole block under any threshold below its confidence.
    oracle = OracleDrafter(draft, prompt + ref + [0] * 32, PLANTS["accept-all"])
    out = generate(model, oracle, tokenizer, prompt, block_size=8, max_tokens=N_TOKENS,
                   min_confidence=0.5)
    assert out.tokens == ref and out.stats.mean_tau > 7.5


def _confident_rows(logits, columns, threshold):
    return confident_rows(draft_candidates(logits, columns, 1)[0][:, 0], threshold)


def test_confident_rows_rule():
    # Top probabilities of the rows: 0.9, 0.5, 0.9, 0.9 -> running products .9 .45 .405 .3645
    probs = mx.array([[0.9, 0.1], [0.5, 0.5], [0.1, 0.9], [0.9, 0.1]])
    logits = mx.log(probs) + 3.0  # any shift: softmax is what counts
    for threshold, rows in ((0.95, 1), (0.5, 1), (0.42, 2), (0.4, 3), (0.01, 4)):
        assert _confident_rows(logits, None, threshold) == rows  # at least one
        # A cut vocabulary: the same scores over token ids 3 and 4, the same answer.
        assert _confident_rows(logits, mx.array([3, 4]), threshold) == rows
    assert draft_candidates(logits, mx.array([3, 4]), 1)[1][:, 0].tolist() == [3, 3, 4, 3]


PLANTS = {
    "accept-all": lambda cycle, j: False,
    "accept-none": lambda cycle, j: j == 0,
    "accept-some": lambda cycle, j: j == (cycle % 7),
    "mixed": lambda cycle, j: (cycle % 3 == 0 and j == 0) or (cycle % 3 == 1 and j == 3),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("plant", [p if p == "mixed" else pytest.param(p, marks=pytest.mark.slow)
                                   for p in PLANTS])
def test_partial_acceptance_stays_exact(kind, plant, loaded_pair, references):
    model, tokenizer, draft = loaded_pair(kind)
    prompt, ref = references(kind)
    oracle = OracleDrafter(draft, prompt + ref + [0] * 32, PLANTS[plant])
    # (The drafter's planted proposals only: the context's own continuation would take cycles.)
    out = generate(model, oracle, tokenizer, prompt, block_size=8, max_tokens=N_TOKENS,
                   lookup=False)
    assert out.tokens == ref
    taus = out.stats.mean_tau
    if plant == "accept-all":
        assert taus > 7.5
    elif plant == "accept-none":
        assert taus == 1.0
    else:
        assert 1.0 < taus < 7.5


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3"])
@pytest.mark.parametrize("keep", [1, 3, 6])
def test_rollback_restores_every_cache(kind, keep, loaded_pair):
    """After verify + roll-back, every cache equals a cache fed only the kept tokens."""
    model, _, _ = loaded_pair(kind)
    parts = target_parts(model)
    tokens = [5, 17, 300, 42, 9, 1000, 77, 3, 2, 8, 11, 12]
    prefix, block = tokens[:4], tokens[4:10]
    rolled = make_cache(parts)
    forward(parts, mx.array(prefix)[None], rolled, [])
    trace = VerifyTrace()
    forward(parts, mx.array(block)[None], rolled, [], trace)
    rollback(rolled, trace, keep=keep, verified=len(block))
    fresh = make_cache(parts)
    forward(parts, mx.array(prefix)[None], fresh, [])
    forward(parts, mx.array(block[:keep])[None], fresh, [])
    for r, f in zip(rolled, fresh, strict=True):
        if hasattr(r, "offset"):
            assert r.offset == f.offset
            rk, _ = r.state[:2] if isinstance(r.state, tuple) else r.state
            fk, _ = f.state[:2] if isinstance(f.state, tuple) else f.state
            assert mx.allclose(rk[..., : r.offset, :], fk[..., : f.offset, :], atol=1e-5)
        else:
            for a, b in zip(r.cache, f.cache, strict=True):
                assert mx.allclose(a, b, atol=1e-5), "GatedDeltaNet state differs after roll-back"
    # And the next step from both caches agrees.
    nxt = mx.array([tokens[10]])[None]
    la, _ = forward(parts, nxt, rolled, [])
    lb, _ = forward(parts, nxt, fresh, [])
    assert mx.allclose(la, lb, atol=1e-4)


def test_stream_yields_text_and_statistics(loaded_pair):
    model, tokenizer, draft = loaded_pair("qwen3")
    prompt = chat_prompt(tokenizer)
    responses = list(stream_generate(model, draft, tokenizer, prompt, max_tokens=40,
                                     block_size=4))
    text = "".join(r.text for r in responses)
    tokens = [t for r in responses for t in r.tokens]
    assert len(tokens) == 40
    from mlx_lm import stream_generate as mlx_lm_stream

    mlx_lm_text = "".join(r.text for r in mlx_lm_stream(model, tokenizer, prompt, max_tokens=40))
    assert text == mlx_lm_text
    last = responses[-1]
    assert last.finish_reason == "length"
    assert last.prompt_tokens == len(prompt)
    assert last.generation_tokens == 40
    assert last.cycles >= 1 and last.mean_tau >= 1.0
    assert last.generation_tps > 0 and last.prompt_tps > 0
    assert last.draft_time > 0 and last.verify_time > 0
    assert len(last.acceptance_by_position) == 3
    assert last.peak_memory > 0


def test_prompt_as_string_or_ids(loaded_pair):
    model, tokenizer, draft = loaded_pair("llama")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    a = generate(model, draft, tokenizer, text, max_tokens=20)
    b = generate(model, draft, tokenizer, ids, max_tokens=20)
    c = generate(model, draft, tokenizer, mx.array(ids), max_tokens=20)
    assert a.tokens == b.tokens == c.tokens
    assert a.stats.prompt_tokens == len(ids)


def test_chunked_prefill_feeds_every_prompt_row(loaded_pair, references):
    model, tokenizer, draft = loaded_pair("qwen3_5")
    prompt, ref = references("qwen3_5")
    seen = []
    out = generate(model, draft, tokenizer, prompt, max_tokens=30, prefill_step_size=7,
                   prompt_progress_callback=lambda done, total: seen.append((done, total)))
    assert out.tokens == ref[:30]
    assert seen[-1] == (len(prompt), len(prompt))
    assert len(seen) == -(-len(prompt) // 7)
    # The drafter cache saw all prompt rows plus the committed tokens except the newest.
    oracle = OracleDrafter(draft, prompt + ref + [0] * 32, lambda c, j: False)
    out = generate(model, oracle, tokenizer, prompt, max_tokens=30, prefill_step_size=5)
    assert out.tokens == ref[:30] and out.stats.mean_tau > 1


def test_stops_eos_stop_ids_and_strings(loaded_pair, references):
    model, tokenizer, draft = loaded_pair("qwen3")
    prompt, ref = references("qwen3")
    # An extra stop id: generation ends before it and never emits it.
    stop_tok = ref[25]
    first = ref.index(stop_tok)
    out = generate(model, draft, tokenizer, prompt, max_tokens=100, stop_token_ids=[stop_tok])
    assert out.tokens == ref[:first] and out.finish_reason == "stop"
    # A stop string: the text is cut right before it.
    full = generate(model, draft, tokenizer, prompt, max_tokens=60).text
    needle = full[40:46]
    out = generate(model, draft, tokenizer, prompt, max_tokens=60, stop=[needle])
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(needle)]
    # max_tokens exactly, for every block size.
    for n in (1, 2, 7, 16, 17):
        out = generate(model, draft, tokenizer, prompt, max_tokens=n, block_size=16)
        assert out.tokens == ref[:n]


def test_mask_and_anchor_never_leak(loaded_pair, references):
    model, tokenizer, draft = loaded_pair("qwen3")
    prompt, ref = references("qwen3")
    out = generate(model, draft, tokenizer, prompt, max_tokens=60, block_size=16)
    assert draft.mask_token_id not in out.tokens
    assert out.tokens == ref[:60]


def test_enable_thinking_passes_through_chat_template(loaded_pair):
    model, tokenizer, draft = loaded_pair("qwen3")
    messages = [{"role": "user", "content": "Explain speculative decoding."}]
    with_flag = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                              enable_thinking=True)
    out = generate(model, draft, tokenizer, with_flag, max_tokens=10, temperature=0.6, seed=3)
    assert out.stats.generation_tokens == 10
