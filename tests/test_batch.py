"""The batched engine (dflash.batch): every request's output is what it would be alone.

Greedy: token for token against mlx-lm's ``generate_step`` (the target alone) and the
single-sequence engine, with prompts of different lengths, more prompts than ``max_batch``
(queueing: sequences join mid-flight), different ``max_tokens`` (sequences leave mid-flight), stop
strings, cancellations, and a planted drafter that agrees for some rows and not others, on
attention (Llama, Qwen3) and hybrid (Qwen3.5: per-row GatedDeltaNet replay) targets. Sampled: the
chi-square test of tests/test_sampling_stats.py, through the batched engine.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from dflash.batch import BatchGenerator
from dflash.errors import GenerationConfigError
from dflash.model_mlx import batch_generate, generate

PROMPT_LENGTHS = (3, 29, 11, 47, 6)
MAX_TOKENS = (40, 12, 33, 40, 7)


def prompts_for(tokenizer) -> list[list[int]]:
    words = tokenizer.encode(" the sea, the sky and the long road home under a grey morning light"
                             " while gulls circle over the harbour and boats come back" * 3)
    return [words[i:i + n] for i, n in enumerate(PROMPT_LENGTHS)]


def alone(model, prompt, n) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def run_engine(engine: BatchGenerator, prompts, max_tokens, **settings):
    """Insert every prompt, step to the end; tokens, finish reasons and last stats by uid."""
    uids = [engine.insert(p, max_tokens=m, **settings) for p, m in zip(prompts, max_tokens)]
    tokens = {u: [] for u in range(engine.next_uid)}  # earlier insertions too
    finish, stats = {}, {}
    while engine.active or engine.pending:
        for e in engine.step():
            assert e.uid not in finish, "an event after the sequence finished"
            tokens[e.uid] += e.tokens
            stats[e.uid] = e.stats
            if e.finish_reason is not None:
                finish[e.uid] = e.finish_reason
    return [tokens[u] for u in uids], [finish[u] for u in uids], [stats[u] for u in uids]


class BatchOracle:
    """Wraps a real drafter; proposes each row's known continuation, with errors planted per
    (cycle, row, block position): accept-all, accept-some and accept-none rows in one pass."""

    def __init__(self, draft, references: dict[tuple, list[int]], plant):
        self.inner, self.references, self.plant = draft, references, plant
        self.cycle, self.engine = 0, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def block_scores_batch(self, target, anchors, block_len, cache):
        real, _ = self.inner.block_scores_batch(target, anchors, block_len, cache)
        vocab = target.vocab_size
        planted = np.zeros((len(anchors), block_len - 1, vocab), np.float32)
        for i, seq in enumerate(self.engine.rows):
            full = self.references[tuple(seq.request.prompt_ids)]
            pos = cache[0].lengths[i]  # the anchor's position
            assert full[pos] == anchors[i]
            for j in range(1, block_len):
                tok = full[pos + j] if pos + j < len(full) else 0
                if self.plant(self.cycle, i, j - 1):
                    tok = (tok + 1) % vocab
                planted[i, j - 1, tok] = 30.0
        self.cycle += 1
        return mx.array(planted) + 0 * real.sum(), None


def mixed_plant(cycle, row, j):
    return [j == 0, j == 2, False, j == (cycle % 5)][(cycle + row) % 4]


@pytest.mark.parametrize("kind", [pytest.param("qwen3", marks=pytest.mark.slow), "qwen3_5",
                                  pytest.param("llama", marks=pytest.mark.slow)])
@pytest.mark.parametrize("policy", ["fixed", "auto"])
def test_greedy_equals_each_request_alone(kind, policy, loaded_pair):
    model, tokenizer, draft = loaded_pair(kind)
    prompts = prompts_for(tokenizer)
    engine = BatchGenerator(model, draft, tokenizer, max_batch=3, prefill_chunk=16,
                            block_size=6, policy=policy)
    # A sampled neighbour with penalties shares the passes; its settings stay its own.
    sampled = engine.insert(prompts[0], max_tokens=20, temperature=1.0, top_k=50, seed=7,
                            repetition_penalty=1.3)
    progress = []
    tokens, finish, stats = run_engine(engine, prompts, MAX_TOKENS,
                                       prompt_progress_callback=lambda d, t: progress.append(d))
    for p, m, out, why, st in zip(prompts, MAX_TOKENS, tokens, finish, stats):
        assert out == alone(model, p, m)
        assert why == "length" and st.generation_tokens == m and st.prompt_tokens == len(p)
        assert st.priced_ms is None  # its passes were shared: no price of its own
    assert len(tokens) == len(prompts) and max(progress) == max(PROMPT_LENGTHS)
    assert sampled == 0


@pytest.mark.parametrize("kind", ["llama", "qwen3_5", pytest.param("qwen3", marks=pytest.mark.slow),
                                  pytest.param("qwen3_5_wrapped", marks=pytest.mark.slow)])
@pytest.mark.parametrize("policy", ["fixed", "auto"])
def test_planted_partial_acceptance_stays_exact(kind, policy, loaded_pair):
    model, tokenizer, draft = loaded_pair(kind)
    prompts = prompts_for(tokenizer)
    refs = {tuple(p): p + alone(model, p, m + 8) for p, m in zip(prompts, MAX_TOKENS)}
    oracle = BatchOracle(draft, refs, mixed_plant)
    engine = BatchGenerator(model, oracle, tokenizer, max_batch=4, prefill_chunk=8,
                            block_size=6, policy=policy)
    oracle.engine = engine
    tokens, _, stats = run_engine(engine, prompts, MAX_TOKENS)
    for p, m, out in zip(prompts, MAX_TOKENS, tokens):
        assert out == refs[tuple(p)][len(p):len(p) + m]
    taus = [st.mean_tau for st in stats if st.cycles]
    if policy == "fixed":  # proposals were accepted in every row, and partly rejected in most
        assert taus and min(taus) > 1.0 and sum(t < 6.0 for t in taus) >= len(taus) - 1
    elif taus:  # widths follow measured pass times: which planted cycles a row meets varies
        assert max(taus) > 1.0 and min(taus) < 6.0
    for st in stats:  # per-sequence statistics agree with the cycles
        assert st.cycles + st.plain_steps >= 1
        assert len(st.acceptance_by_position) == 5


class LoneOracle(BatchOracle):
    """:class:`BatchOracle` for batched cycles; for a lone sequence's single-sequence cycles
    (``block_scores``) each row's true token sits behind ``rank(cycle, j)`` wrong ones (as in
    tests/tiny_models.py's ranked oracle), so a draft tree accepts through runner-up branches."""

    def __init__(self, draft, references, plant, rank):
        super().__init__(draft, references, plant)
        self.rank, self.lone_cycles = rank, 0

    def block_scores(self, target, anchor, block_len, cache):
        real = self.inner.block_logits(target, anchor, block_len, cache)
        (seq,) = self.engine.rows
        full = self.references[tuple(seq.request.prompt_ids)]
        pos = cache[0].offset  # an ordinary KVCache: the lone path
        assert full[pos] == anchor
        planted = np.zeros((block_len - 1, real.shape[-1]), np.float32)
        for j in range(1, block_len):
            tok = full[pos + j] if pos + j < len(full) else 0
            r = self.rank(self.lone_cycles, j - 1)
            for i in range(r + 1):  # wrong tokens first, then the true one
                planted[j - 1, (tok + 1 + i) % real.shape[-1] if i < r else tok] = 30.0 - 0.5 * i
        self.lone_cycles += 1
        return mx.array(planted) + 0 * real, None


def flat_costs():
    """A cost model where verify rows are free up to 64 (accelerator-like): under ``auto`` a
    lone sequence verifies draft trees, and a batch verifies wide chains."""
    from dflash.cost_model import CostModel

    rows = [1, 2, 4, 8, 16, 32, 64, 128]
    return CostModel(key="t", machine={}, rows=rows, contexts=[128],
                     verify_ms=[[10.0] * 7 + [20.0]], draft_rows=[2, 4, 8, 16],
                     draft_ms=[1.0, 1.0, 1.0, 1.0])


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("cached", [False, True])
def test_lone_sequence_runs_the_single_sequence_cycle_across_joins_and_leaves(kind, cached,
                                                                              loaded_pair):
    """1 -> 2 -> 1 -> 2 -> 1 sequences: a join while the lone one decodes (with draft trees on
    attention targets), a leave that leaves one; every output is the target's own. With a
    prompt cache (the server's), whose caches the next prompt starts from."""
    from dflash.prompt_cache import PromptCache

    model, tokenizer, draft = loaded_pair(kind)
    prompts = prompts_for(tokenizer)
    prompts[2] = prompts[1][:20] + prompts[2]  # C starts with B's first 20 tokens
    lengths = {0: 60, 1: 10, 2: 14}  # A decodes throughout; B and C join and leave
    refs = {tuple(prompts[i]): prompts[i] + alone(model, prompts[i], m + 8)
            for i, m in lengths.items()}
    oracle = LoneOracle(draft, refs, mixed_plant, RANKS)
    engine = BatchGenerator(model, oracle, tokenizer, max_batch=3, prefill_chunk=16,
                            block_size=8, policy="auto",
                            prompt_cache=PromptCache() if cached else None)
    engine.cost = flat_costs()  # before insert: each sequence's policy takes it
    oracle.engine = engine
    tokens, last, sizes = {}, {}, []

    def step():
        for e in engine.step():
            tokens.setdefault(e.uid, []).extend(e.tokens)
            last[e.uid] = e.stats
        lone = len(engine.rows) == 1 and engine.rows[0].state.cache is not None
        sizes.append("lone" if lone else len(engine.rows))

    a = engine.insert(prompts[0], max_tokens=lengths[0])
    while len(tokens.get(a, [])) < 12:
        step()
    b = engine.insert(prompts[1], max_tokens=lengths[1])  # joins while A decodes alone
    while b not in last or last[b].finish_reason is None:
        step()
    step()  # A alone again
    c = engine.insert(prompts[2], max_tokens=lengths[2])
    while engine.active or engine.pending:
        step()
    for uid, i in ((a, 0), (b, 1), (c, 2)):
        assert tokens[uid] == refs[tuple(prompts[i])][len(prompts[i]):][:lengths[i]]
        assert last[uid].finish_reason == "length"
    # (A step with one row while another prompt is still prefilling runs the batched cycle.)
    phases = [k for k in sizes if k != 1]
    runs = [k for i, k in enumerate(phases) if i == 0 or phases[i - 1] != k]
    assert runs[:4] == ["lone", 2, "lone", 2], sizes
    assert oracle.lone_cycles > 0  # the single-sequence cycle drafted
    stats = last[a]  # A's statistics span both engines' cycles
    assert stats.generation_tokens == lengths[0] and stats.cycles >= 2
    assert len(stats.acceptance_by_position) == 7
    if kind == "qwen3":  # attention-only: the lone cycles verified trees
        assert stats.tree_cycles > 0
    else:  # hybrid: chains, the GatedDeltaNet state carried across
        assert stats.tree_cycles == 0


def RANKS(cycle, j):  # noqa: N802  (a rank function, as tests/test_tree_decode.py's RANKS)
    return 1 if j == cycle % 3 else 0


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_a_burst_of_prompts_is_prefilled_before_decoding_and_stays_exact(kind, loaded_pair):
    """Prompts of different lengths arriving together: the short ones all get their first token
    before any sequence its second; a long one does not stall the others until it is done."""
    model, tokenizer, draft = loaded_pair(kind)
    words = prompts_for(tokenizer)
    prompts = [words[0][:3], words[2][:11], words[4][:6], (words[3] * 2)[:90]]
    engine = BatchGenerator(model, draft, tokenizer, max_batch=4, prefill_chunk=16,
                            block_size=6, policy="auto")
    uids = [engine.insert(p, max_tokens=12) for p in prompts]
    tokens, steps = {u: [] for u in uids}, []
    while engine.active or engine.pending:
        events = engine.step()
        steps.append({e.uid: len(e.tokens) for e in events})
        for e in events:
            tokens[e.uid] += e.tokens
    for p, u in zip(prompts, uids):
        assert tokens[u] == alone(model, p, 12)

    def first_step(uid, n):  # the step after which ``uid`` had ``n`` tokens
        total = 0
        for i, s in enumerate(steps):
            total += s.get(uid, 0)
            if total >= n:
                return i

    short = uids[:3]
    assert max(first_step(u, 1) for u in short) < min(first_step(u, 2) for u in short)
    # The long prompt (6 chunks) was prefilled alongside decoding: the others went on.
    assert any(first_step(u, 2) < first_step(uids[3], 1) for u in short)


def test_stops_cancel_and_leaves_mid_flight(loaded_pair):
    model, tokenizer, draft = loaded_pair("qwen3")
    prompts = prompts_for(tokenizer)
    texts = [tokenizer.decode(alone(model, p, 30)) for p in prompts]
    stop = texts[2][len(texts[2]) // 2:][:3]  # a stop string in the middle of request 2's text
    engine = BatchGenerator(model, draft, tokenizer, max_batch=4, prefill_chunk=16,
                            block_size=4, policy="fixed")
    uids = [engine.insert(p, max_tokens=30, stop=stop) for p in prompts]
    tokens, text, finish, steps = {u: [] for u in uids}, {u: "" for u in uids}, {}, 0
    while engine.active or engine.pending:
        if steps == 6:
            engine.cancel(uids[1])
        for e in engine.step():
            tokens[e.uid] += e.tokens
            text[e.uid] += e.text
            if e.finish_reason is not None:
                finish[e.uid] = e.finish_reason
        steps += 1
    tokens, text, finish = ([d[u] for u in uids] for d in (tokens, text, finish))
    assert finish[1] == "cancelled"
    for i in (0, 2, 3, 4):
        expect = generate(model, draft, tokenizer, prompts[i], max_tokens=30, stop=stop)
        assert text[i] == expect.text and finish[i] == expect.finish_reason
        # A cycle's tokens past a stop string may differ with the cycle; never the target's.
        assert tokens[i] == alone(model, prompts[i], len(tokens[i]))
    assert finish[2] == "stop"
    n_cancelled = len(tokens[1])
    assert tokens[1] == alone(model, prompts[1], n_cancelled)  # what it had was exact


def test_stop_token_ids_and_queue(loaded_pair):
    model, tokenizer, draft = loaded_pair("llama")
    prompts = prompts_for(tokenizer)
    ref = alone(model, prompts[0], 20)
    stop_id = ref[9]
    out = batch_generate(model, draft, tokenizer, prompts, max_batch=2, max_tokens=20,
                         stop_token_ids=[stop_id], policy="fixed", block_size=4)
    for p, r in zip(prompts, out):
        expect = generate(model, draft, tokenizer, p, max_tokens=20, stop_token_ids=[stop_id])
        assert r.tokens == expect.tokens and r.text == expect.text
        assert r.finish_reason == expect.finish_reason
    assert out[0].finish_reason == "stop" and stop_id not in out[0].tokens


def test_unbatchable_drafter_falls_back_to_one_at_a_time(loaded_pair, tiny_pair, tmp_path,
                                                          capsys):
    from tiny_models import write_drafter

    from dflash.drafter import load_draft

    model, tokenizer, _ = loaded_pair("llama")
    target_path, _ = tiny_pair("llama")
    draft = load_draft(write_drafter(tmp_path / "swa", target_path, taps=(0, 2), extra={
        "layer_types": ["sliding_attention"], "sliding_window": 8}))
    prompts = prompts_for(tokenizer)[:3]
    out = batch_generate(model, draft, tokenizer, prompts, max_batch=2, max_tokens=16,
                         policy="tree")  # every single-sequence policy works there
    assert "one sequence at a time" in capsys.readouterr().err
    for p, r in zip(prompts, out):
        assert r.tokens == alone(model, p, 16)


def test_max_batch_one_is_the_single_sequence_engine(loaded_pair):
    model, tokenizer, draft = loaded_pair("llama")
    prompts = prompts_for(tokenizer)[:2]
    out = batch_generate(model, draft, tokenizer, prompts, max_batch=1, max_tokens=16,
                         policy="tree")  # trees: only the single-sequence engine verifies them
    for p, r in zip(prompts, out):
        assert r.tokens == alone(model, p, 16) and r.stats.tree_cycles > 0


def test_bad_input_names_the_field(loaded_pair):
    model, tokenizer, draft = loaded_pair("qwen3")
    engine = BatchGenerator(model, draft, tokenizer, policy="fixed")
    for settings, field in [({"temperature": -1}, "temperature"), ({"top_p": 2}, "top_p"),
                            ({"max_tokens": -3}, "max_tokens"), ({"block_size": 4}, "block_size"),
                            ({"policy": "tree"}, "policy"), ({"bogus": 1}, "bogus"),
                            ({"stop": [""]}, "stop")]:
        with pytest.raises(GenerationConfigError, match=field):
            engine.insert([1, 2, 3], **settings)
    with pytest.raises(GenerationConfigError, match=r"prefill_step_size=64: .*prefill_chunk="):
        engine.insert([1, 2, 3], prefill_step_size=64)
    for name, value in (("min_confidence", 0.5), ("tree_budget", 8)):
        with pytest.raises(GenerationConfigError, match=f"{name}=.*stream_generate does take"):
            engine.insert([1, 2, 3], **{name: value})
    with pytest.raises(GenerationConfigError, match="prompt"):
        engine.insert([])
    with pytest.raises(GenerationConfigError, match="prompt"):
        engine.insert([10**9])
    assert engine.pending == 0  # nothing half-inserted
    for kwargs, field in [({"max_batch": 0}, "max_batch"), ({"prefill_chunk": 0}, "prefill_chunk"),
                          ({"policy": "tree"}, "policy"), ({"policy": "nope"}, "policy"),
                          ({"block_size": 1}, "block_size")]:
        with pytest.raises(GenerationConfigError, match=field):
            BatchGenerator(model, draft, tokenizer, **kwargs)
    # max_tokens=0: finishes at once, empty
    assert batch_generate(model, draft, tokenizer, [[1, 2]], max_tokens=0)[0].tokens == []


# ---------------------------------------------------------------------------------------------
# Sampled requests keep the target's distribution


@pytest.mark.slow
def test_sampled_batch_keeps_the_target_distribution(tmp_path):
    import test_sampling_stats as st

    from dflash.drafter import load_draft

    model, dpath = st.sharp_target(tmp_path)
    draft = load_draft(dpath)
    settings = dict(st.CASES["card"])
    joint = st.exact_joint(st.reference_next(st.target_logits(model, st.all_prefixes(st.K - 1)),
                                             settings))
    engine = BatchGenerator(model, draft, None, max_batch=8, block_size=st.BLOCK,
                            policy="fixed")
    uids = [engine.insert(st.PROMPT, max_tokens=st.K, seed=s, **settings) for s in range(st.N)]
    tokens = {u: [] for u in uids}
    cycles = accepted = 0
    while engine.active or engine.pending:
        for e in engine.step():
            tokens[e.uid] += e.tokens
            if e.finish_reason is not None:
                cycles += e.stats.cycles
                accepted += round(e.stats.mean_tau * e.stats.cycles) - e.stats.cycles
    samples = np.array([tokens[u] for u in uids])
    stat, df, p = st.chi_square(samples, joint)
    print(f"\nbatched card/sample: chi2={stat:.1f} df={df} p={p:.3g} (90% power against "
          f"chi-square divergence >= {st.detectable(df):.3f}); accepted {accepted} proposals "
          f"in {cycles} cycles")
    assert p >= st.ALPHA
    assert accepted > 0.1 * cycles  # proposals were accepted and rejected: the paths ran

    # Power: the same test catches a batch whose rows share random streams (four requests per
    # seed: right marginals, correlated draws), a bug batching could bring.
    engine = BatchGenerator(model, draft, None, max_batch=8, block_size=st.BLOCK,
                            policy="fixed")
    uids = [engine.insert(st.PROMPT, max_tokens=st.K, seed=s // 4, **settings)
            for s in range(st.N)]
    tokens = {u: [] for u in uids}
    while engine.active or engine.pending:
        for e in engine.step():
            tokens[e.uid] += e.tokens
    stat, df, p = st.chi_square(np.array([tokens[u] for u in uids]), joint)
    print(f"shared random streams: chi2={stat:.1f} df={df} p={p:.3g}")
    assert p < st.ALPHA


# ---------------------------------------------------------------------------------------------
# The verify width across the batch, and the concurrency benchmark


def cpu_like_costs():
    """A cost model shaped like this project's CPU measurement (flat to ~16 rows, then linear)."""
    from dflash.cost_model import CostModel

    rows = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    verify = [10.0, 11.4, 12.5, 14.0, 17.0, 25.0, 45.0, 90.0, 180.0]
    return CostModel(key="t", machine={}, rows=rows, contexts=[128], verify_ms=[verify],
                     draft_rows=[2, 4, 8, 16], draft_ms=[1.5, 1.8, 2.3, 3.4])


def test_batch_width_turns_into_plain_decoding_as_the_batch_grows():
    from dflash.policy import batch_width

    cost = cpu_like_costs()
    good = np.full(7, 0.7)  # a drafter right 70 % of the time at every row
    widths = [batch_width([good] * b, cost, 128, cost.draft(4 * b))[0] for b in (1, 2, 4, 8, 32)]
    assert widths[0] > 2 and widths[-1] == 1
    assert widths == sorted(widths, reverse=True)  # never wider for a larger batch
    # A drafter that is never right: plain steps even alone.
    assert batch_width([np.full(7, 0.01)], cost, 128, cost.draft(8))[0] == 1


def test_concurrency_bench_reports_both_engines(loaded_pair, tiny_pair):
    from dflash.bench_concurrency import format_concurrency, run_concurrency_bench
    from dflash.pair import Pair

    model, tokenizer, draft = loaded_pair("llama")
    target_path, draft_path = tiny_pair("llama")
    pair = Pair(model, tokenizer, draft, str(target_path), str(draft_path))
    prompts = [{"id": f"p{i}", "prompt": text} for i, text in
               enumerate(["Tell me about the sea.", "Count to five.", "Name a colour."])]
    result = run_concurrency_bench(pair=pair, prompts=prompts, concurrency=2, max_tokens=12,
                                   warmup=False)
    assert result["identical"] is True  # greedy: mlx-lm's batching and ours agree (float32)
    assert [len(t) for t in result["dflash"]["tokens"]] == [12, 12, 12]
    assert result["dflash"]["generated"] == result["mlx_lm"]["generated"] == 36
    assert result["ratio"] > 0 and result["dflash"]["ttft_p95"] >= result["dflash"]["ttft_p50"]
    assert "mlx-lm batching" in format_concurrency(result)
    # One client through a batched engine with room for more (its lone-sequence path) against
    # the single-sequence engine: the same tokens.
    result = run_concurrency_bench(pair=pair, prompts=prompts, concurrency=1, max_batch=3,
                                   max_tokens=12, warmup=False)
    assert result["single"]["tokens"] == result["dflash"]["tokens"] == result["mlx_lm"]["tokens"]
    assert result["config"]["max_batch"] == 3 and result["batched_vs_single"] > 0
    assert "max_batch 3" in format_concurrency(result)


# ---------------------------------------------------------------------------------------------
# Continuations (dflash.lookup) in batched passes


def lookup_costs():
    """Verify rows free up to 64, a drafter pass dear: under ``auto`` the batch verifies the
    rows' own continuations without drafting."""
    from dflash.cost_model import CostModel

    rows = [1, 2, 4, 8, 16, 32, 64, 128]
    return CostModel(key="t", machine={}, rows=rows, contexts=[128],
                     verify_ms=[[10.0] * 7 + [20.0]], draft_rows=[2, 4, 8, 16],
                     draft_ms=[200.0] * 4)


class NeverRight:
    """A drafter whose every batched proposal is wrong (the real pass still runs)."""

    def __init__(self, draft):
        self.inner = draft

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def block_scores_batch(self, target, anchors, block_len, cache):
        real, columns = self.inner.block_scores_batch(target, anchors, block_len, cache)
        return -real, columns


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_batched_continuations_are_each_request_alone(kind, loaded_pair, monkeypatch):
    import dflash.batch as batch_module

    model, tokenizer, draft = loaded_pair(kind)
    monkeypatch.setattr(batch_module, "cost_model", lambda *a, **k: lookup_costs())
    prompts = prompts_for(tokenizer)
    engine = BatchGenerator(model, NeverRight(draft), tokenizer, max_batch=4, prefill_chunk=64,
                            block_size=6, policy="auto")
    tokens, _, stats = run_engine(engine, prompts, MAX_TOKENS)
    for p, m, out in zip(prompts, MAX_TOKENS, tokens):
        assert out == alone(model, p, m)
    # Continuations were verified in batched passes (tiny random targets repeat themselves),
    # and accepted.
    assert sum(s.lookup_cycles for s in stats) >= 5
    assert sum(round(s.mean_tau * s.cycles) - s.cycles for s in stats) > 0


@pytest.mark.slow
def test_sampled_batched_continuations_keep_the_target_distribution(tmp_path, monkeypatch):
    """Rows verifying a continuation (a proposal without q) beside rows taking plain steps in
    the same passes, at T > 0: the target's law (chi-square as in test_sampling_stats)."""
    import test_sampling_stats as st

    import dflash.batch as batch_module
    from dflash.drafter import load_draft
    from dflash.lookup import ContextLookup, Match

    model, dpath = st.sharp_target(tmp_path)
    draft = load_draft(dpath)
    monkeypatch.setattr(batch_module, "cost_model", lambda *a, **k: lookup_costs())
    # A stand-in continuation that always exists (a function of the history, right now and
    # then).
    monkeypatch.setattr(ContextLookup, "find", lambda self, history, length:
                        Match(tuple(history[::-1][:length]), 2))
    settings = dict(st.CASES["temperature"])
    joint = st.exact_joint(st.reference_next(st.target_logits(model, st.all_prefixes(st.K - 1)),
                                             settings))
    engine = BatchGenerator(model, draft, None, max_batch=8, block_size=st.BLOCK, policy="auto")
    uids = [engine.insert(st.PROMPT, max_tokens=st.K, seed=s, **settings) for s in range(st.N)]
    tokens = {u: [] for u in uids}
    lookups = 0
    while engine.active or engine.pending:
        for e in engine.step():
            tokens[e.uid] += e.tokens
            if e.finish_reason is not None:
                lookups += e.stats.lookup_cycles
    stat, df, p = st.chi_square(np.array([tokens[u] for u in uids]), joint)
    print(f"\nbatched continuations/temperature: chi2={stat:.1f} df={df} p={p:.3g} (90% power "
          f"against chi-square divergence >= {st.detectable(df):.3f}); {lookups} continuation "
          "chains")
    assert lookups >= st.N // 2
    assert p >= st.ALPHA
