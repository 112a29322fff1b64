"""The target's KV memory: mlx-lm's quantized KV cache and rotating (sliding-window) caches.

The promise with ``kv_bits``: greedy output identical to mlx-lm's own decoding with the same KV
settings (``kv_bits``, ``kv_group_size``, ``quantized_kv_start``, ``prefill_step_size``), not to
the float cache (up to how the calls were grouped into rows, which a quantized cache can turn
into another token: the built-in pair's test). Rotating caches: identical to mlx-lm's greedy
decoding well past the window, the verify passes rolled back after the cache has wrapped.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import calibrated
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache
from tiny_models import OracleDrafter, target_config, tokenizer_source, write_drafter

from dflash.errors import GenerationConfigError
from dflash.model_mlx import generate, load, load_draft
from dflash.target import (
    KVQuantization,
    VerifyTrace,
    forward,
    make_cache,
    prefill_calls,
    rollback,
    target_parts,
)

N_TOKENS = 80


def mixed(cycle: int, j: int) -> bool:
    """Wrong proposals at different rows of different cycles: accept-none, -some, -all."""
    return (cycle % 3 == 0 and j == 0) or (cycle % 3 == 1 and j == 3)


def write_fixture(path: Path, kind: str, **overrides) -> Path:
    """A random-weight mlx-lm target like tests/tiny_models.py's, with config ``overrides``
    (a head dimension a KV group divides; a sliding window)."""
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import _get_classes

    path.mkdir(parents=True, exist_ok=True)
    tok_dir = tokenizer_source()
    src = json.loads((tok_dir / "config.json").read_text())
    config = target_config(kind, src["vocab_size"], hidden=128, layers=4)
    config.update(overrides, bos_token_id=src["bos_token_id"], eos_token_id=src["eos_token_id"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, path / name)
    mx.random.seed(0)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


FIXTURES = {
    # head_dim 32: kv_group_size 32 divides it
    "llama": ("llama", {}),
    "qwen3_5": ("qwen3_5", {"head_dim": 32}),
    # Sliding-window layers (mlx-lm's RotatingKVCache) with a window of 16 between full ones
    "llama_swa": ("llama", {"sliding_window": 16,
                            "layer_types": ["sliding_attention", "full_attention"] * 2}),
}


@pytest.fixture(scope="module")
def kv_pair(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            kind, overrides = FIXTURES[name]
            target = write_fixture(root / "target", kind, **overrides)
            draft = write_drafter(root / "draft", target, taps=(0, 2))
            calibrated(target, draft)
            model, tokenizer = load(str(target))
            made[name] = (model, tokenizer, load_draft(str(draft)))
        return made[name]

    return get


def prompt_of(tokenizer, n: int) -> list[int]:
    words = tokenizer.encode(" the sea, the sky and the long road home under a grey morning light"
                             " while gulls circle over the harbour and boats come back" * 4)
    return words[:n]


def mlx_lm_greedy(model, prompt, n=N_TOKENS, **kv) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, **kv)]


KV_CASES = [  # (kv_bits, quantized_kv_start, prompt tokens, prefill_step_size)
    (8, 0, 40, 2048),  # the switch after the prompt's first call (all but its last token)
    pytest.param(4, 0, 40, 16, marks=pytest.mark.slow),  # ... after its first chunk
    (4, 50, 40, 2048),  # the switch mid-decode: verify passes cross it
    pytest.param(8, 23, 40, 16, marks=pytest.mark.slow),  # the first chunk end past the start
    pytest.param(4, 0, 1, 2048, marks=pytest.mark.slow),  # a one-token prompt: one float call
]


@pytest.mark.parametrize("bits,start,n_prompt,step", KV_CASES)
def test_quantized_kv_greedy_equals_mlx_lm(bits, start, n_prompt, step, kv_pair):
    model, tokenizer, draft = kv_pair("llama")
    prompt = prompt_of(tokenizer, n_prompt)
    kv = dict(kv_bits=bits, kv_group_size=32, quantized_kv_start=start)
    ref = mlx_lm_greedy(model, prompt, prefill_step_size=step, **kv)
    oracle = OracleDrafter(draft, prompt + ref + [0] * 32, mixed)
    out = generate(model, oracle, tokenizer, prompt, block_size=8, max_tokens=N_TOKENS,
                   policy="fixed", lookup=False, prefill_step_size=step, **kv)
    assert out.tokens == ref
    assert 1.0 < out.stats.mean_tau < 7.5  # rows were rejected and rolled back
    # The drafter's own proposals under the auto policy: the same tokens.
    out = generate(model, draft, tokenizer, prompt, max_tokens=N_TOKENS, prefill_step_size=step,
                   **kv)
    assert out.tokens == ref


def test_quantized_reference_is_not_the_float_one(kv_pair):
    """The contract is mlx-lm's quantized decoding: on this fixture it differs from the float
    cache's, so the tests above compare with the right reference."""
    model, tokenizer, _ = kv_pair("llama")
    prompt = prompt_of(tokenizer, 40)
    assert mlx_lm_greedy(model, prompt, kv_bits=4, kv_group_size=32, quantized_kv_start=0) != \
        mlx_lm_greedy(model, prompt)


@pytest.mark.parametrize("bits", [8, pytest.param(4, marks=pytest.mark.slow)])
def test_quantized_kv_hybrid_target(bits, kv_pair):
    """Qwen3.5: attention layers quantized, GatedDeltaNet state replayed across a split pass."""
    model, tokenizer, draft = kv_pair("qwen3_5")
    prompt = prompt_of(tokenizer, 30)
    kv = dict(kv_bits=bits, kv_group_size=32, quantized_kv_start=45)
    ref = mlx_lm_greedy(model, prompt, **kv)
    oracle = OracleDrafter(draft, prompt + ref + [0] * 32, mixed)
    out = generate(model, oracle, tokenizer, prompt, block_size=8, max_tokens=N_TOKENS,
                   policy="fixed", lookup=False, **kv)
    assert out.tokens == ref


def test_quantized_kv_start_defaults_to_mlx_lm():
    """``kv_bits`` alone means what it means to mlx-lm: the same ``quantized_kv_start``
    default everywhere it can be given."""
    import inspect

    from dflash.cli import build_parser
    from dflash.serving import create_server
    from dflash.settings import GenerationSettings
    from dflash.target import QUANTIZED_KV_START

    mlx_lm_default = inspect.signature(generate_step).parameters["quantized_kv_start"].default
    assert QUANTIZED_KV_START == mlx_lm_default
    assert KVQuantization.from_settings(8).start == mlx_lm_default
    assert KVQuantization(8).start == mlx_lm_default
    assert GenerationSettings().quantized_kv_start == mlx_lm_default
    assert inspect.signature(create_server).parameters["quantized_kv_start"].default == \
        mlx_lm_default
    sub = build_parser(["generate"])._subparsers._group_actions[0].choices["generate"]
    option = next(a for a in sub._actions if a.dest == "quantized_kv_start")
    assert option.default is None and f"{mlx_lm_default} in mlx-lm" in option.help


def test_kv_bits_alone_equals_mlx_lm_kv_bits_alone(kv_pair):
    """Neither side given ``quantized_kv_start``: the request switches where mlx-lm's default
    switches (the switch itself at any offset: the cases above), and the output is mlx-lm's."""
    from dflash.request import build_request
    from dflash.settings import GenerationSettings
    from dflash.target import QUANTIZED_KV_START

    model, tokenizer, draft = kv_pair("llama")
    prompt = prompt_of(tokenizer, 40)
    request = build_request(target_parts(model), draft, tokenizer, prompt,
                            GenerationSettings(kv_bits=8, kv_group_size=32))
    assert request.kv.start == QUANTIZED_KV_START
    assert request.kv.switch_offset(len(prompt), 2048) == \
        KVQuantization(8, 32, QUANTIZED_KV_START).switch_offset(len(prompt), 2048)
    ref = mlx_lm_greedy(model, prompt, kv_bits=8, kv_group_size=32)
    out = generate(model, draft, tokenizer, prompt, max_tokens=N_TOKENS, kv_bits=8,
                   kv_group_size=32)
    assert out.tokens == ref


def test_switch_offset_follows_mlx_lm_calls():
    assert prefill_calls(40, 2048) == [39, 40]
    assert prefill_calls(40, 16) == [16, 32, 39, 40]
    assert prefill_calls(1, 16) == [1]
    kv = KVQuantization(8, 64, 0)
    assert kv.switch_offset(40, 2048) == 39
    assert kv.switch_offset(1, 2048) == 1
    assert KVQuantization(8, 64, 23).switch_offset(40, 16) == 32
    assert KVQuantization(8, 64, 40).switch_offset(40, 16) == 40
    assert KVQuantization(8, 64, 57).switch_offset(40, 16) == 57


@pytest.mark.parametrize("name", ["llama", pytest.param("qwen3_5", marks=pytest.mark.slow)])
@pytest.mark.parametrize("keep", [2, 4, 6])
def test_rollback_across_the_switch(keep, name, kv_pair):
    """A verify pass that crosses the switch is split there; a roll-back to before it returns
    to the float cache, one to after it keeps the quantized cache (Qwen3.5: the GatedDeltaNet
    state replayed over both halves); the next pass agrees with a cache fed only the kept
    tokens (to float rounding: passes of other row counts)."""
    model, _, _ = kv_pair(name)
    parts = target_parts(model)
    kv = KVQuantization(4, 32, 10)
    tokens = [5, 17, 300, 42, 9, 1000, 77, 3, 2, 8, 11, 12, 13, 14, 15]
    rolled = make_cache(parts, kv, switch_at=10)
    forward(parts, mx.array(tokens[:6])[None], rolled, [])
    trace = VerifyTrace()
    forward(parts, mx.array(tokens[6:14])[None], rolled, [], trace)  # rows 6..13: switch at 10
    assert rolled.quantized and trace.switch_row == 4
    rollback(rolled, trace, keep=keep, verified=8)
    assert rolled.offset == 6 + keep
    assert rolled.quantized == (6 + keep >= 10)
    assert all(isinstance(c, QuantizedKVCache) == rolled.quantized
               for c in rolled if hasattr(c, "offset"))
    fresh = make_cache(parts, kv, switch_at=10)
    forward(parts, mx.array(tokens[:6])[None], fresh, [])
    forward(parts, mx.array(tokens[6:6 + keep])[None], fresh, [])
    nxt = mx.array(tokens[6 + keep:6 + keep + 4])[None]
    la, _ = forward(parts, nxt, rolled, [])
    lb, _ = forward(parts, nxt, fresh, [])
    assert mx.allclose(la, lb, atol=1e-4)


def test_bad_kv_settings_name_the_field(kv_pair):
    model, tokenizer, draft = kv_pair("llama")
    for settings, field in (({"kv_bits": 7}, "kv_bits"), ({"kv_bits": "8"}, "kv_bits"),
                            ({"kv_bits": 8, "kv_group_size": 48}, "kv_group_size"),
                            ({"kv_bits": 8, "quantized_kv_start": -1}, "quantized_kv_start"),
                            ({"kv_bits": 8, "kv_group_size": 64}, "kv_group_size"),  # head_dim 32
                            ({"kv_bits": 8, "kv_group_size": 32, "policy": "tree"}, "kv_bits")):
        with pytest.raises(GenerationConfigError, match=field):
            generate(model, draft, tokenizer, [1, 2, 3], max_tokens=4, **settings)


def test_kv_bits_refused_on_rotating_target(kv_pair):
    model, tokenizer, draft = kv_pair("llama_swa")
    with pytest.raises(GenerationConfigError, match="kv_bits=8.*rotating"):
        generate(model, draft, tokenizer, [1, 2, 3], max_tokens=4, kv_bits=8, kv_group_size=32)


def test_mlx_lm_batches_no_quantized_kv_cache():
    """Why the batched engine refuses ``kv_bits``: mlx-lm has no batched decoding with a
    quantized KV cache to be identical to. When it gains one, this fails: wire it then."""
    import inspect

    from mlx_lm.generate import BatchGenerator as MLXBatchGenerator
    from mlx_lm.models.cache import BatchKVCache

    assert not hasattr(BatchKVCache, "to_quantized")
    assert "kv_bits" not in inspect.signature(MLXBatchGenerator.__init__).parameters


def test_kv_bits_refused_by_the_batched_engine(kv_pair):
    from dflash.batch import BatchGenerator

    model, tokenizer, draft = kv_pair("llama")
    engine = BatchGenerator(model, draft, tokenizer, max_batch=2)
    with pytest.raises(GenerationConfigError, match="kv_bits=8: .*no batched quantized KV cache"):
        engine.insert([1, 2, 3], max_tokens=4, kv_bits=8, kv_group_size=32)
    assert not engine.active and not engine.pending
    # One sequence at a time (max_batch=1) is the single-sequence engine: exact.
    lone = BatchGenerator(model, draft, tokenizer, max_batch=1)
    prompt = prompt_of(tokenizer, 20)
    kv = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0)
    uid = lone.insert(prompt, max_tokens=24, **kv)
    tokens = []
    while lone.active or lone.pending:
        tokens += [t for e in lone.step() if e.uid == uid for t in e.tokens]
    assert tokens == mlx_lm_greedy(model, prompt, n=24, prefill_step_size=256, **kv)


# ---------------------------------------------------------------------------------------------
# Rotating (sliding-window) caches


@pytest.mark.parametrize("n_prompt", [pytest.param(5, marks=pytest.mark.slow), 40])
def test_sliding_window_target_exact_past_the_window(n_prompt, kv_pair):
    model, tokenizer, draft = kv_pair("llama_swa")
    assert any(isinstance(c, RotatingKVCache) for c in make_cache(target_parts(model)))
    prompt = prompt_of(tokenizer, n_prompt)
    ref = mlx_lm_greedy(model, prompt)
    oracle = OracleDrafter(draft, prompt + ref + [0] * 32, mixed)
    out = generate(model, oracle, tokenizer, prompt, block_size=8, max_tokens=N_TOKENS,
                   policy="fixed", lookup=False)
    assert out.tokens == ref
    assert 1.0 < out.stats.mean_tau < 7.5
    out = generate(model, draft, tokenizer, prompt, max_tokens=N_TOKENS)
    assert out.tokens == ref


def test_wrapped_rotating_cache_rolls_back(kv_pair):
    """Past the window, a verify pass then a roll-back leaves the cache as if fed only the kept
    tokens: the next pass's logits agree (to float rounding: passes of other row counts)."""
    model, _, _ = kv_pair("llama_swa")
    parts = target_parts(model)
    tokens = list(range(200, 260))
    rolled, fresh = make_cache(parts), make_cache(parts)
    for c in (rolled, fresh):
        forward(parts, mx.array(tokens[:30])[None], c, [])
    trace = VerifyTrace()
    forward(parts, mx.array(tokens[30:38])[None], rolled, [], trace)
    rollback(rolled, trace, keep=3, verified=8)
    forward(parts, mx.array(tokens[30:33])[None], fresh, [])
    for c in rolled:
        if isinstance(c, RotatingKVCache):
            assert c.offset == 33 and c.keys.shape[2] <= c.max_size + 8
    nxt = mx.array(tokens[33:40])[None]
    la, _ = forward(parts, nxt, rolled, [])
    lb, _ = forward(parts, nxt, fresh, [])
    assert mx.allclose(la, lb, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# The built-in pair, the server, the command line, the KV cost report


def mlx_lm_logprobs(model, prompt: list[int], tokens: list[int], kv: KVQuantization,
                    rows: int) -> mx.array:
    """mlx-lm's log-probabilities at every position of ``tokens`` (and the one after them) given
    the tokens before it: its model and ``QuantizedKVCache``, prefilled as ``generate_step``
    prefills, then fed ``tokens`` in calls of ``rows`` rows (1: ``generate_step``'s own
    decoding), the cache converted where ``generate_step`` converts it."""
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    switch = kv.switch_offset(len(prompt), 2048)
    model(mx.array(prompt[:-1])[None], cache=cache)
    maybe_quantize_kv_cache(cache, kv.start, kv.group_size, kv.bits)
    feed, done, passes = [prompt[-1], *tokens], len(prompt) - 1, []
    while feed:
        n = 1 if done == len(prompt) - 1 else rows  # the last prompt token alone, as mlx-lm
        if done < switch:
            n = min(n, switch - done)
        passes.append(model(mx.array(feed[:n])[None], cache=cache)[0])
        maybe_quantize_kv_cache(cache, kv.start, kv.group_size, kv.bits)
        feed, done = feed[n:], done + n
    logits = mx.concatenate(passes, axis=0)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


GROUPINGS = (1, 2, 4, 8, 16)  # rows per call: 1 is mlx-lm's decoding


def grouped_logprobs(model, prompt: list[int], tokens: list[int],
                     kv: KVQuantization) -> list[mx.array]:
    """:func:`mlx_lm_logprobs` under each of :data:`GROUPINGS`, the one-row calls first."""
    return [mlx_lm_logprobs(model, prompt, tokens, kv, rows) for rows in GROUPINGS]


def unexplained_tokens(grouped: list[mx.array], tokens: list[int],
                       stop: set[int] | None) -> list[tuple[int, float, float]]:
    """Positions whose token mlx-lm would not choose on its prefix, up to how the prefix's rows
    were grouped into calls, as ``(position, deficit, spread)``; ``grouped``:
    :func:`grouped_logprobs` of ``tokens``.

    ``deficit``: how far the token's log-probability is below the best one's, in the grouping
    where it is closest (0: some grouping chooses it). ``spread``: how far the groupings'
    log-probabilities of the candidates (the token, each grouping's choice) lie from the one-row
    calls'. A verify pass groups its rows its own way, which moves its log-probabilities by about
    that much from each grouping's, so a token it chooses is within twice the spread of the best;
    a wrong token is further. ``stop``: the end-of-sequence tokens, one of which must come next
    (an early stop), or None (the output reached its length)."""
    out = []
    for i in range(len(tokens) + (stop is not None)):
        rows = [g[i] for g in grouped]
        options = [tokens[i]] if i < len(tokens) else sorted(stop)
        token = max(options, key=lambda t: float(rows[0][t]))
        deficit = min(float(r.max() - r[token]) for r in rows)
        candidates = mx.array(sorted({token, *(int(r.argmax()) for r in rows)}))
        spread = max(float(mx.abs(r[candidates] - rows[0][candidates]).max()) for r in rows)
        if deficit > 2 * spread:
            out.append((i, deficit, spread))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("bits,after_prompt", [(8, None), (4, None), (8, 20)])
def test_builtin_pair_quantized_kv_equals_mlx_lm(bits, after_prompt):
    """kv_bits 8 and 4 from the start, and a switch 20 tokens into the answer.

    Every token is mlx-lm's own greedy choice on the same prefix, up to how the prefix's rows were
    grouped into calls: with a quantized cache the built-in target's choice can depend on that
    alone (a key rounded one way or the other lands on another quantization level;
    docs/long-context.md measures it), and a verify pass groups its rows its own way. Until the
    output first differs from mlx-lm's decoding it is identical, by definition."""
    from dflash.model_mlx import load_default

    model, tokenizer, draft = load_default()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "A baker makes 24 muffins and sells 3 boxes of 4 muffins. "
                                     "How many muffins are left?"}], add_generation_prompt=True)
    start = 0 if after_prompt is None else len(prompt) + after_prompt
    kv = dict(kv_bits=bits, kv_group_size=64, quantized_kv_start=start)
    ref = mlx_lm_greedy(model, prompt, n=64, **kv)
    eos = set(tokenizer.eos_token_ids)
    if any(t in eos for t in ref):
        ref = ref[: next(i for i, t in enumerate(ref) if t in eos)]
    out = generate(model, draft, tokenizer, prompt, max_tokens=64, **kv).tokens
    quant = KVQuantization(bits, 64, start)
    grouped = grouped_logprobs(model, prompt, out, quant)
    assert unexplained_tokens(grouped, out, None if len(out) == 64 else eos) == []
    # The check has power: the token mlx-lm finds least likely, planted at position 20, is caught.
    planted = out[:20] + [int(grouped[0][20].argmin())]
    assert [u[0] for u in unexplained_tokens(grouped_logprobs(model, prompt, planted, quant),
                                             planted, None)] == [20]
    first = None if out == ref else next(
        i for i, (a, b) in enumerate(zip(out + [-1], ref + [-2])) if a != b)
    print(f"kv_bits={bits}: " + ("identical to mlx-lm's decoding" if first is None else
          f"differs from mlx-lm's decoding from token {first} on, each token mlx-lm's own "
          "choice on its prefix up to the grouping of its rows"))
    if first is not None:  # the one-row log-probabilities are mlx-lm's decoding up to there
        steps = grouped[0].argmax(axis=-1).tolist()
        assert steps[:first] == ref[:first]
        assert steps[first] == ref[first] if first < len(ref) else steps[first] in eos


def test_server_refuses_kv_bits_with_concurrency_before_loading():
    pytest.importorskip("fastapi")
    from dflash.errors import ServerConfigError
    from dflash.serving import create_server

    with pytest.raises(ServerConfigError, match="kv_bits=8.*max_concurrency=2"):
        create_server("no/such/model", kv_bits=8, max_concurrency=2, quiet=True)
    with pytest.raises(GenerationConfigError, match="kv_bits=9"):
        create_server("no/such/model", kv_bits=9, quiet=True)


def test_cli_kv_options():
    from dflash.cli import build_parser
    from dflash.cli_args import kv_kwargs

    for command in ("generate", "chat", "serve", "bench"):
        args = build_parser([command]).parse_args(
            [command, "--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "100"])
        assert kv_kwargs(args) == {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 100}
        assert kv_kwargs(build_parser([command]).parse_args([command])) == {}
        # --kv-bits alone: quantized_kv_start left to the default (mlx-lm's, on both sides)
        args = build_parser([command]).parse_args([command, "--kv-bits", "8"])
        assert kv_kwargs(args) == {"kv_bits": 8, "kv_group_size": 64}


def test_cli_bench_kv_bits_only_with_the_prompt_bench(capsys):
    from dflash.cli import main

    assert main(["bench", "--kv-bits", "8", "--concurrency", "2"]) == 2
    assert "--kv-bits" in capsys.readouterr().err


def test_kv_bytes_per_token_float_and_quantized(kv_pair):
    from dflash.cli_bench import kv_cost_line
    from dflash.serving.worker import kv_bytes_per_token

    model, _, _ = kv_pair("llama")
    # 4 layers, 2 KV heads of 32, keys and values, float32 on the CPU
    assert kv_bytes_per_token(model) == 4 * 2 * 2 * 32 * 4
    # 8 bits a value, a float32 scale and bias per 64 values
    assert kv_bytes_per_token(model, 8) == 4 * 2 * 2 * 32 * (1 + 8 / 64)
    assert kv_bytes_per_token(model, 4, 32) == 4 * 2 * 2 * 32 * (0.5 + 8 / 32)
    assert "kv_bits=8" in kv_cost_line(model)


def test_cli_refuses_bad_kv_values_before_loading(capsys):
    from dflash.cli import build_parser
    from dflash.target import KV_BITS, KV_GROUP_SIZES

    parser = build_parser(["generate"])
    for option, good, bad in (("--kv-bits", KV_BITS, 7), ("--kv-group-size", KV_GROUP_SIZES, 48)):
        for value in good:
            parser.parse_args(["generate", option, str(value)])
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["generate", option, str(bad)])
        assert e.value.code == 2 and option in capsys.readouterr().err


def test_prompt_cache_on_a_wrapped_rotating_cache(kv_pair):
    """A later prompt that shares only part of what a wrapped rotating cache held cannot trim
    back to the shared prefix (the rows before the window are gone): it prefills afresh, and the
    output stays mlx-lm's; one that extends everything cached reuses it."""
    from dflash.prompt_cache import PromptCache

    model, tokenizer, draft = kv_pair("llama_swa")
    first = prompt_of(tokenizer, 40)
    cache = PromptCache()
    out = generate(model, draft, tokenizer, first, max_tokens=12, prompt_cache=cache)
    assert out.tokens == mlx_lm_greedy(model, first, n=12)
    for second in (first[:30] + prompt_of(tokenizer, 20)[5:15],  # diverges inside the cache
                   first + out.tokens + first[:9]):  # extends it
        ref = mlx_lm_greedy(model, second, n=24)
        assert generate(model, draft, tokenizer, second, max_tokens=24,
                        prompt_cache=cache).tokens == ref


def test_quantized_kv_has_its_own_pass_costs(kv_pair):
    """Passes over a quantized cache cost differently (quantized attention): the policy prices
    them with their own costs, measured over a quantized cache by ``calibrate --kv-bits``."""
    from dflash import cost_model as costs

    model, _, draft = kv_pair("llama")
    parts = target_parts(model)
    kv = KVQuantization(8, 32, 0)
    assert costs.cost_key(parts, draft, kv) != costs.cost_key(parts, draft)
    assert costs.cost_key(parts, draft, kv) != costs.cost_key(parts, draft, KVQuantization(4, 32))
    assert costs.cost_model(parts, draft, kv) is not costs.cost_model(parts, draft)
    table = costs.measure(parts, draft, rows=[1, 2], contexts=[24], draft_rows=[2], rounds=1,
                          quiet=True, kv=kv)
    assert table.key == costs.cost_key(parts, draft, kv) and table.verify(2, 24) > 0


def test_a_cache_that_never_converts_is_priced_as_float(kv_pair):
    """``quantized_kv_start`` past the prompt and ``max_tokens``: the cache stays float keys all
    along, and its passes are priced (and teach) the float costs, not the quantized ones."""
    from dflash import cost_model as costs

    model, tokenizer, draft = kv_pair("llama")
    parts, prompt = target_parts(model), prompt_of(tokenizer, 20)
    float_costs = costs.cost_model(parts, draft)
    for start, taught in ((10_000, float_costs),
                          (0, costs.cost_model(parts, draft, KVQuantization(8, 32, 0)))):
        before = taught.observed
        generate(model, draft, tokenizer, prompt, max_tokens=8, kv_bits=8, kv_group_size=32,
                 quantized_kv_start=start)
        assert taught.observed > before, start


@pytest.mark.slow
def test_the_context_bench_takes_mlx_lms_quantized_kv_cache_on_both_sides(kv_pair, tmp_path):
    from dflash.contexts import run_context_bench
    from dflash.pair import Pair

    model, tokenizer, draft = kv_pair("llama")
    pair = Pair(model, tokenizer, draft, str(tmp_path / "target"), str(tmp_path / "draft"))
    kv = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}
    prompts = [{"id": "sea", "prompt": "Where do the boats come back to?"}]
    result = run_context_bench([200], pair=pair, prompts=prompts, max_tokens=24,
                               block_sizes="4", kv=kv)
    assert result["config"]["kv"] == kv
    row = result["rows"][0]
    # Identical to mlx-lm's own decoding with the same cache settings, with and without
    # continuations.
    assert row["lookup"]["identical"] is True and row["no_lookup"]["identical"] is True


@pytest.mark.slow
def test_a_kv_bits_bench_reports_the_quantized_caches_pass_costs(kv_pair, tmp_path):
    from dflash.bench import run_bench
    from dflash.pair import Pair

    model, tokenizer, draft = kv_pair("llama")
    pair = Pair(model, tokenizer, draft, str(tmp_path / "target"), str(tmp_path / "draft"))
    kv = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}
    result = run_bench(pair=pair, prompts=[{"id": "sea", "prompt": "Where do boats go?"}],
                       block_sizes="4", max_tokens=24, warmup=False, kv=kv)
    assert result["identical"] is True
    # The fixture's float cache is calibrated; the quantized cache's costs are learnt from the
    # bench's own passes, and those are what its policy priced with.
    assert result["pass_costs"]["source"] == "learnt" and result["pass_costs"]["learnt"]
