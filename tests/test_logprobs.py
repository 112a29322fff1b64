"""Log-probabilities (``logprobs=N``, ``prompt_logprobs``): the target's own log-softmax of its raw
logits, for every emitted token and prompt token, equal to mlx-lm's model run on the same ids.

Every path that emits tokens is driven: plain steps (the ``auto`` policy with a random drafter),
chains with accepted drafts (an oracle drafter with planted errors under ``fixed``), draft trees
through runner-up branches (``tree``), sampled decoding, the batched engine (rows accepting
different counts) and its lone-sequence cycle, and the prefill in chunks for the prompt's own.
Greedy output is unchanged with log-probabilities on.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from test_engine import PLANTS, chat_prompt
from tiny_models import OracleDrafter, RankedOracleDrafter

from dflash.errors import GenerationConfigError
from dflash.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, TokenText, text_offsets
from dflash.model_mlx import batch_generate, generate

TOLERANCE = 1e-4  # the bound, float32
N = 48  # tokens per generation: several cycles of every kind, a few seconds on the CPU


def mlx_lm_logprobs(model, ids: list[int]) -> np.ndarray:
    """mlx-lm's model on ``ids`` in one call: row ``i`` holds the log-probabilities of the token
    after ``ids[:i + 1]``, as mlx-lm's ``generate_step`` computes them (float32)."""
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def worst_diff(entries: list[TokenLogprob | None], ids: list[int], start: int,
               reference: np.ndarray, top: int) -> float:
    """The largest gap between ``entries`` (scoring ``ids[start:]``) and ``reference``; each
    entry's token, its alternatives' count, order and ids checked on the way."""
    worst = 0.0
    assert len(entries) == len(ids) - start
    for j, e in enumerate(entries):
        pos = start + j
        assert e is not None and e.token == ids[pos], (pos, e)
        row = reference[pos - 1]
        worst = max(worst, abs(e.logprob - row[e.token]))
        assert len(e.top) == top
        values = [v for _, v in e.top]
        assert values == sorted(values, reverse=True)
        best = np.sort(row)[::-1][:top]
        worst = max([worst, *np.abs(np.array(values) - best),
                     *(abs(v - row[t]) for t, v in e.top)])
    return worst


@pytest.fixture(scope="module")
def llama(loaded_pair):
    model, tokenizer, draft = loaded_pair("llama")
    prompt = chat_prompt(tokenizer)
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=N)]
    return model, tokenizer, draft, prompt, ref


@pytest.mark.parametrize("path", ["plain", "chain", "tree"])
def test_greedy_logprobs_equal_mlx_lm_on_every_path(path, llama):
    model, tokenizer, draft, prompt, ref = llama
    if path == "plain":  # the random drafter loses: auto takes plain steps (and some chains)
        settings = dict(policy="auto")
    elif path == "chain":  # accept-none, accept-some and accept-all cycles
        draft = OracleDrafter(draft, prompt + ref + [0] * 32, PLANTS["mixed"])
        settings = dict(policy="fixed", block_size=8)
    else:  # accepted paths through runner-up branches
        draft = RankedOracleDrafter(draft, prompt + ref + [0] * 32,
                                    lambda c, j: 1 if j == c % 7 else 0)
        settings = dict(policy="tree", tree_budget=16, block_size=8)
    out = generate(model, draft, tokenizer, prompt, max_tokens=N, logprobs=MAX_TOP_LOGPROBS,
                   **settings)
    assert out.tokens == ref  # the same tokens as without log-probabilities
    reference = mlx_lm_logprobs(model, prompt + ref)
    diff = worst_diff(out.logprobs, prompt + ref, len(prompt), reference, MAX_TOP_LOGPROBS)
    assert diff < TOLERANCE, diff
    if path == "plain":
        assert out.stats.plain_steps > 0
    elif path == "chain":
        assert out.stats.mean_tau > 2  # drafts were accepted and scored
    else:
        assert out.stats.tree_cycles > 0 and out.stats.mean_tau > 2
    assert out.prompt_logprobs is None  # not asked


def test_sampled_logprobs_are_the_raw_distribution(llama):
    """Sampling settings change the tokens, not their log-probabilities (OpenAI's definition)."""
    model, tokenizer, draft, prompt, _ = llama
    out = generate(model, draft, tokenizer, prompt, max_tokens=N, temperature=0.7, top_p=0.9,
                   repetition_penalty=1.3, seed=3, logprobs=3, policy="fixed")
    ids = prompt + out.tokens
    assert worst_diff(out.logprobs, ids, len(prompt), mlx_lm_logprobs(model, ids), 3) < TOLERANCE


def test_prompt_logprobs_in_chunks_and_no_prompt_cache(llama):
    from dflash.prompt_cache import PromptCache

    model, tokenizer, draft, prompt, ref = llama
    cache = PromptCache()
    generate(model, draft, tokenizer, prompt, max_tokens=4, prompt_cache=cache)  # cached now
    for step in (2048, 7):  # one chunk, then chunks whose last rows score the next chunk's first
        out = generate(model, draft, tokenizer, prompt, max_tokens=5, logprobs=5,
                       prompt_logprobs=True, prefill_step_size=step, prompt_cache=cache)
        assert out.tokens == ref[:5]
        assert out.stats.reused_prompt_tokens == 0  # every prompt row was computed
        reference = mlx_lm_logprobs(model, prompt + ref[:5])
        assert out.prompt_logprobs[0] is None  # nothing predicts the first token
        assert worst_diff(out.prompt_logprobs[1:], prompt, 1, reference, 5) < TOLERANCE
        assert worst_diff(out.logprobs, prompt + ref[:5], len(prompt), reference, 5) < TOLERANCE
    # max_tokens=0: the prompt's alone (scoring a text, as evaluation harnesses do)
    out = generate(model, draft, tokenizer, prompt, max_tokens=0, prompt_logprobs=True)
    assert out.tokens == [] and out.logprobs is None and len(out.prompt_logprobs) == len(prompt)
    assert worst_diff(out.prompt_logprobs[1:], prompt, 1, reference, 0) < TOLERANCE


@pytest.mark.parametrize("kind", ["llama", pytest.param("qwen3_5", marks=pytest.mark.slow)])
def test_batched_engine_logprobs_equal_mlx_lm(kind, loaded_pair):
    """Rows of one batched pass accept different counts; each is scored from its own rows. A
    short prefill chunk makes the prompts' scoring cross chunks inside the batch's prefill."""
    model, tokenizer, draft = loaded_pair(kind)
    words = tokenizer.encode(" the sea, the sky and the long road home under a grey morning")
    prompts = [words[:n] for n in (5, 13, 9)]
    outs = batch_generate(model, draft, tokenizer, prompts, max_batch=3, prefill_chunk=6,
                          max_tokens=N, logprobs=MAX_TOP_LOGPROBS, prompt_logprobs=True,
                          policy="fixed")
    for prompt, out in zip(prompts, outs):
        ids = prompt + out.tokens
        ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=N)]
        assert out.tokens == ref
        reference = mlx_lm_logprobs(model, ids)
        assert worst_diff(out.logprobs, ids, len(prompt), reference,
                          MAX_TOP_LOGPROBS) < TOLERANCE
        assert out.prompt_logprobs[0] is None
        assert worst_diff(out.prompt_logprobs[1:], prompt, 1, reference,
                          MAX_TOP_LOGPROBS) < TOLERANCE
    assert outs[0].stats.cycles > 0


def test_lone_sequence_of_the_batched_engine(llama):
    model, tokenizer, draft, prompt, ref = llama
    out, = batch_generate(model, draft, tokenizer, [prompt], max_batch=4, max_tokens=N,
                          logprobs=2)
    assert out.tokens == ref
    ids = prompt + ref
    assert worst_diff(out.logprobs, ids, len(prompt), mlx_lm_logprobs(model, ids), 2) < TOLERANCE


def test_logprobs_stop_with_the_tokens(llama):
    """A stop string or ``max_tokens`` cuts the tokens: their log-probabilities are cut alike."""
    model, tokenizer, draft, prompt, ref = llama
    out = generate(model, draft, tokenizer, prompt, max_tokens=7, logprobs=0)
    assert [e.token for e in out.logprobs] == out.tokens == ref[:7]
    assert all(e.top == () for e in out.logprobs)


def test_bad_logprobs_name_the_field(llama):
    model, tokenizer, draft, prompt, _ = llama
    for bad in (-1, True, 1.5, "3", 10 ** 9):
        with pytest.raises(GenerationConfigError, match="logprobs="):
            generate(model, draft, tokenizer, prompt, max_tokens=2, logprobs=bad)
    with pytest.raises(GenerationConfigError, match="prompt_logprobs="):
        generate(model, draft, tokenizer, prompt, max_tokens=2, prompt_logprobs="yes")


def test_token_text_and_offsets(llama):
    _, tokenizer, _, _, _ = llama
    text = "Hi — café 🌊!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    texts = TokenText(tokenizer)
    pieces = [texts.bytes(t) for t in ids]
    assert b"".join(pieces).decode() == text  # byte-level BPE: the exact bytes
    offsets = text_offsets(pieces)
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(text)
    assert any("\\x" in texts.text(t) for t in ids)  # a token holding part of the wave's bytes


def test_with_a_grammar_the_values_are_still_the_raw_distribution(llama):
    """A grammar decides which tokens may come; their log-probabilities stay the target's own
    (before the mask, as before every other sampling setting)."""
    pytest.importorskip("llguidance")
    from dflash.grammar import Grammar

    model, tokenizer, draft, prompt, _ = llama
    out = generate(model, draft, tokenizer, prompt, max_tokens=24, logprobs=3,
                   grammar=Grammar.regex(r"(sea|sky)( (sea|sky)){0,9}"))
    ids = prompt + out.tokens
    assert out.tokens and len(out.logprobs) == len(out.tokens)
    assert worst_diff(out.logprobs, ids, len(prompt), mlx_lm_logprobs(model, ids), 3) < TOLERANCE


@pytest.mark.parametrize("endpoint,body,expected", [
    ("chat", {}, (None, False)),
    ("chat", {"logprobs": True}, (0, False)),
    ("chat", {"logprobs": True, "top_logprobs": 20}, (20, False)),
    ("chat", {"logprobs": False, "top_logprobs": 0}, (None, False)),
    ("completions", {"logprobs": 5, "echo": True}, (5, True)),
    ("completions", {"echo": True}, (None, True)),
    ("completions", {"logprobs": 0}, (0, False)),
    ("responses", {"include": ["message.output_text.logprobs"]}, (0, False)),
    ("responses", {"top_logprobs": 4}, (4, False)),
    ("responses", {"include": ["reasoning.encrypted_content"], "top_logprobs": 0}, (None, False)),
])
def test_request_fields(endpoint, body, expected):
    from dflash.serving.logprobs_format import parse_logprobs

    assert parse_logprobs(endpoint, body) == expected


@pytest.mark.parametrize("endpoint,body,param", [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ("chat", {"logprobs": 2}, "logprobs"),
    ("chat", {"echo": True}, "echo"),
    ("responses", {"echo": True}, "echo"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"echo": 1}, "echo"),
    ("responses", {"top_logprobs": 2.5}, "top_logprobs"),
    ("responses", {"include": "message.output_text.logprobs"}, "include"),
])
def test_bad_request_fields_name_the_field(endpoint, body, param):
    from dflash.errors import APIError
    from dflash.serving.logprobs_format import parse_logprobs

    with pytest.raises(APIError) as e:
        parse_logprobs(endpoint, body)
    assert (e.value.status, e.value.param) == (400, param), e.value.message


def test_legacy_shape_with_echo(llama):
    """The legacy object: the prompt first (its first token null), the chosen token among the
    alternatives, offsets into the echoed text."""
    from dflash.serving.logprobs_format import LogprobFormat, join_legacy

    model, tokenizer, draft, prompt, _ = llama
    words = tokenizer.encode(" the sea and the sky")
    out = generate(model, draft, tokenizer, words, max_tokens=3, logprobs=2, prompt_logprobs=True)
    fmt = LogprobFormat(tokenizer, 2)
    text = tokenizer.decode(words)
    body = join_legacy(fmt.legacy_prompt(words, out.prompt_logprobs, text),
                       fmt.legacy(out.logprobs, out.text))
    assert body["tokens"][:len(words)] == [fmt.texts.text(t) for t in words]
    assert body["token_logprobs"][0] is None and body["top_logprobs"][0] is None
    assert all(len(d) in (2, 3) for d in body["top_logprobs"][1:])
    offsets = body["text_offset"]
    assert offsets[0] == 0 and offsets[len(words)] == len(text) and offsets == sorted(offsets)
    full = text + out.text
    for j, (token, at) in enumerate(zip(body["tokens"], offsets)):
        if j == len(words):  # the answer's first token: mlx-lm's detokenizer drops its space
            token = token.lstrip(" ")
        assert full[at:at + len(token)] == token, (j, token, at)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_sharded_target_on_two_ranks(kind, tmp_path):
    """A target split over two ranks (``mlx.launch``, ring backend on localhost; qwen3 by
    tensor parallelism, qwen3_5 by its own sharding): every rank's log-probabilities, prompt's
    included, equal the split model's own forward in the same launch."""
    import json

    import tiny_models
    from test_sharded import launch

    target = tiny_models.write_target(tmp_path / "target", kind)
    draft = tiny_models.write_drafter(tmp_path / "draft", target, taps=(0, 2))
    out = tmp_path / "ranks"
    run = launch(__file__, "sharded-worker", str(target), str(draft), str(out))
    files = [out.with_suffix(f".{r}.json") for r in range(2)]
    assert run.returncode == 0 and all(f.is_file() for f in files), run.stderr[-3000:]
    ranks = [json.loads(f.read_text()) for f in files]
    for got in ranks:
        assert got["size"] == 2 and got["tokens"] == ranks[0]["tokens"]
        assert got["worst"] < TOLERANCE, got


def _sharded_worker(target: str, draft: str, out: str) -> None:
    import json

    from dflash import distributed
    from dflash.pair import load_pair

    ranks = distributed.join()
    pair = load_pair(target, draft)
    ids = pair.tokenizer.encode("The quick brown fox jumps over the lazy dog. Once upon a time")
    worst, tokens = 0.0, []
    for policy in ("fixed", "auto"):
        r = generate(pair.model, pair.draft, pair.tokenizer, ids, max_tokens=16, logprobs=4,
                     prompt_logprobs=True, policy=policy, repetition_penalty=1.5)
        every = ids + r.tokens
        reference = mlx_lm_logprobs(pair.model, every)  # the split model, every rank alike
        worst = max(worst, worst_diff(r.logprobs, every, len(ids), reference, 4),
                    worst_diff(r.prompt_logprobs[1:], ids, 1, reference, 4))
        tokens.append(r.tokens)
    with open(f"{out}.{ranks.rank}.json", "w") as f:
        json.dump({"size": ranks.size, "worst": worst, "tokens": tokens}, f)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["sharded-worker"]:
        sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
        _sharded_worker(*sys.argv[2:5])
