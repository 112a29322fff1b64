"""A target split by layers over two ranks (mlx-lm's pipeline-parallel ``sharded_load``: qwen3_5,
and qwen3_next), on localhost under ``mlx.launch -n 2 --backend ring``.

As in ``test_sharded.py``, both ranks run a worker of this file and the reference for greedy output
is mlx-lm's own generation of the same split model in the same launch. A split by layers does
not reorder any float sum (each layer runs whole on one rank), so the taps must also equal one
unsplit process's. The checks that need no launch (what ``--pipeline`` accepts, the stages'
layout) run in this process.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_sharded import (  # noqa: E402
    PROMPT,
    assert_kv_runs_match,
    assert_ranks_match_mlx_lm,
    config_folder,
    kv_fixture,
    kv_results,
    launch,
    serving,
    untied_hybrid,
)

HELLO, HELLO_TOKENS = "Hello there", 12


def indexed(target: Path, files: int = 2) -> Path:
    """Rewrite the fixture at ``target`` as an indexed checkpoint of ``files`` files split by
    layer (what ``mlx_lm.convert`` writes for a large model, and what mlx-lm's pipeline split
    reads each stage's files from)."""
    import re

    import mlx.core as mx

    weights = mx.load(str(target / "model.safetensors"))
    layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    names = [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
    shards: list[dict] = [{} for _ in names]
    weight_map = {}
    for key, value in weights.items():
        found = re.search(r"(?:^|\.)layers\.(\d+)\.", key)
        part = 0 if found is None else min(int(found.group(1)) * files // layers, files - 1)
        shards[part][key] = value
        weight_map[key] = names[part]
    (target / "model.safetensors").unlink()
    for name, shard in zip(names, shards):
        mx.save_safetensors(str(target / name), shard)
    (target / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return target


@pytest.fixture(scope="module")
def pipeline_pair(tmp_path_factory):
    """The untied hybrid fixture (qwen3_5, 4 layers) as an indexed checkpoint, and a drafter
    tapping layers 0 and 2, which live on different stages."""
    import tiny_models

    root = tmp_path_factory.mktemp("pipeline")
    target = indexed(untied_hybrid(root / "target"))
    draft = tiny_models.write_drafter(root / "draft", target, taps=(0, 2))
    return target, draft


def worker_runs(target: Path, draft: Path, out: Path, ranks: int = 2) -> list[dict]:
    """Every rank's ``_worker`` results for the pair split by layers over ``ranks`` ranks."""
    run = launch(__file__, "worker", str(target), str(draft), str(out), ranks=ranks)
    assert run.returncode == 0 and all(out.with_suffix(f".{r}.json").is_file()
                                       for r in range(ranks)), run.stderr[-3000:]
    return [json.loads(out.with_suffix(f".{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module")
def pipeline_runs(pipeline_pair, tmp_path_factory):
    target, draft = pipeline_pair
    return worker_runs(target, draft, tmp_path_factory.mktemp("pipeline-runs") / "worker")


def assert_stages_match_mlx_lm(runs: list[dict], starts: list[int]) -> None:
    """Every rank holds mlx-lm's stage of the 4 layers (``starts``: each rank's first layer), its
    taps are one unsplit process's, and every rank's output is mlx-lm's own split generation's."""
    for got in runs:
        assert got["stage"] == [starts, 4], f"not mlx-lm's split of 4 layers over {len(runs)} ranks"
        assert got["taps_unsplit"], "taps differ from one unsplit process's"
    assert_ranks_match_mlx_lm(runs)


@pytest.mark.slow
def test_two_stages_match_mlx_lm_pipeline(pipeline_runs):
    assert_stages_match_mlx_lm(pipeline_runs, [2, 0])


@pytest.mark.slow
def test_three_stages_match_mlx_lm_pipeline(pipeline_pair, tmp_path):
    """Three ranks (three machines' worth of stages): mlx-lm splits the 4 layers 2/1/1, so rank
    1 is a middle stage that receives from rank 2 and sends to rank 0 in every pass, and the two
    taps (layers 0 and 2) live on the first and the last stage. Every policy's greedy tokens are
    mlx-lm's own three-stage generation's in the same launch; the taps one unsplit process's."""
    target, draft = pipeline_pair
    assert_stages_match_mlx_lm(worker_runs(target, draft, tmp_path / "worker", ranks=3),
                               [2, 1, 0])


@pytest.mark.slow
def test_qwen3_next_two_stages_match_mlx_lm_pipeline(tmp_path):
    """A qwen3_next target (tests/test_qwen3_next.py's: GatedDeltaNet layers 0-2, attention
    layer 3, sparse-MoE MLPs) split by layers: rank 1's stage holds two GatedDeltaNet layers
    (its last cache a recurrent one, which holds the send), rank 0's one of each. Every policy's
    greedy tokens are mlx-lm's own pipeline generation's in the same launch, and the taps (both
    on GatedDeltaNet layers, one per stage) one unsplit process's."""
    import tiny_models
    from test_qwen3_next import write_qwen3_next

    target = indexed(write_qwen3_next(tmp_path / "target"))
    draft = tiny_models.write_drafter(tmp_path / "draft", target, taps=(0, 2))
    assert_stages_match_mlx_lm(worker_runs(target, draft, tmp_path / "worker"), [2, 0])


@pytest.mark.slow
def test_generate_command_with_pipeline(pipeline_pair, pipeline_runs):
    """``dflash generate --pipeline`` on two ranks: one JSON answer, mlx-lm's tokens."""
    target, draft = pipeline_pair
    run = launch("-m", "dflash", "generate", "--model", str(target), "--draft", str(draft),
                 "--prompt", PROMPT, "--no-chat-template", "--max-tokens", "24", "--json",
                 "--no-speedup-estimate", "--pipeline")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, run.stdout
    assert json.loads(lines[0])["tokens"] == pipeline_runs[0]["mlx_lm_greedy"][:24]
    assert run.stderr.count("sharded pipeline-parallel (by layers) over 2 ranks") == 1, run.stderr


@pytest.fixture(scope="module")
def pipeline_hello(pipeline_pair, pipeline_runs) -> str:
    """``dflash generate --pipeline``'s greedy answer to the chat message ``HELLO`` on two ranks,
    whose tokens are mlx-lm's own pipeline generation's (checked here): the reference of
    ``chat`` and ``serve`` on the same split."""
    target, draft = pipeline_pair
    gen = launch("-m", "dflash", "generate", "--model", str(target), "--draft", str(draft),
                 "--max-tokens", str(HELLO_TOKENS), "--prompt", HELLO, "--json",
                 "--no-speedup-estimate", "--pipeline")
    assert gen.returncode == 0, gen.stderr[-3000:]
    answer = json.loads(next(x for x in gen.stdout.splitlines() if x.startswith("{")))
    assert answer["tokens"] == pipeline_runs[0]["mlx_lm_hello"]
    return answer["text"]


@pytest.mark.slow
def test_chat_with_pipeline(pipeline_pair, pipeline_hello):
    """``dflash chat --pipeline`` on two ranks: rank 0 reads the lines and hands them over (the
    session ends with /exit: mlx.launch never closes stdin), the answer is ``generate``'s."""
    target, draft = pipeline_pair
    chat = launch("-m", "dflash", "chat", "--model", str(target), "--draft", str(draft),
                  "--max-tokens", str(HELLO_TOKENS), "--quiet", "--pipeline",
                  stdin=f"{HELLO}\n/exit\n")
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert chat.stdout == pipeline_hello + "\n"


@pytest.mark.slow
def test_serve_with_pipeline(pipeline_pair, pipeline_hello, tmp_path):
    """``dflash serve --pipeline`` on two ranks: rank 0 serves, rank 1 follows. A greedy chat
    completion, streamed or not, alone (the batch's only row: ``auto``'s plans from rank 0),
    three at once (the batched engine's ``auto`` on both stages: rank 0's decisions) or run alone
    with ``fixed``, is ``generate``'s answer; seeded sampled requests reproduce."""
    openai = pytest.importorskip("openai")
    target, draft = pipeline_pair
    with serving(target, draft, tmp_path, "--pipeline") as (_, base, logs):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=120)
        hello = dict(model="default", messages=[{"role": "user", "content": HELLO}],
                     max_tokens=HELLO_TOKENS, temperature=0)

        def answer(**extra) -> str:
            return client.chat.completions.create(**{**hello, **extra}).choices[0] \
                .message.content

        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(**hello, stream=True) if c.choices)
        assert answer() == pipeline_hello and streamed == pipeline_hello, logs()
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            together = list(pool.map(lambda _: answer(), range(3)))
        assert together == [pipeline_hello] * 3, logs()
        assert answer(extra_body={"policy": "fixed"}) == pipeline_hello, logs()
        # Seeded, without lookups (the earlier answers in the scope's index are continuations
        # a cycle may verify, which changes its draws, as on one process).
        sampled = [answer(temperature=0.9, seed=3, extra_body={"lookup": False})
                   for _ in range(2)]
        assert sampled[0] == sampled[1]


@pytest.mark.slow
def test_bench_with_pipeline(pipeline_pair):
    """``dflash bench --pipeline`` on two ranks: rank 0 prints the speed-up against mlx-lm's
    own pipeline generation in the same launch, outputs identical."""
    target, draft = pipeline_pair
    run = launch("-m", "dflash", "bench", "--model", str(target), "--draft", str(draft),
                 "--limit", "1", "--max-tokens", "12", "--no-chat-template", "--no-warmup",
                 "--pipeline")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("target sharded pipeline-parallel (by layers) over 2 ranks") == 1, \
        run.stdout
    assert run.stdout.count("speed-up") == 1 and "identical at T=0: yes" in run.stdout


def split_keys(model, draft) -> dict[str, str]:
    """The pass costs' key of ``model`` (loaded whole in this process) with ``draft``: unsplit,
    split over 2 ranks tensor-parallel, by layers over 2 and over 4 ranks (as each rank of such a
    launch computes it)."""
    import dataclasses
    from unittest import mock

    from dflash import cost_model as costs
    from dflash import distributed
    from dflash.target import Stage, pipeline_starts, target_parts

    parts = target_parts(model)
    keys = {"one process": costs.cost_key(parts, draft)}
    with mock.patch.object(distributed, "shard_count", lambda _: 2):
        keys["tensor 2"] = costs.cost_key(parts, draft)
    for n in (2, 4):
        staged = dataclasses.replace(parts, stage=Stage(0, n, pipeline_starts(n, parts.num_layers),
                                                        parts.num_layers, None))
        keys[f"layers {n}"] = costs.cost_key(staged, draft)
    return keys


def test_pass_costs_are_keyed_by_split(loaded_pair):
    """A split by layers costs otherwise than a tensor-parallel one over as many ranks, and both
    than one process: each stores (and reads) its calibration and learnt costs under a key of
    its own."""
    model, _, draft = loaded_pair("qwen3_5")
    keys = split_keys(model, draft)
    assert len(set(keys.values())) == len(keys), keys


@pytest.mark.slow
def test_calibrate_with_pipeline(pipeline_pair, tmp_path):
    """``dflash calibrate --pipeline`` on two ranks: the passes are measured once, split by
    layers, and stored under the key of a 2-rank split by layers (not one process's, nor the
    tensor-parallel split's); a later ``--pipeline`` launch reads them instead of measuring."""
    from dflash import cost_model as costs
    from dflash.model_mlx import load, load_draft

    target, draft = pipeline_pair
    home = tmp_path / "home"
    command = ("-m", "dflash", "calibrate", "--model", str(target), "--draft", str(draft),
               "--pipeline")
    first = launch(*command, "--out", str(tmp_path / "out"), env={"DFLASH_HOME": str(home)})
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stderr.count("measuring this machine's verify and draft costs") == 1, \
        first.stderr
    # Every rank measures; rank 0 alone writes --out.
    assert first.stderr.count("wrote ") == 1 and (tmp_path / "out" / "calibration.json").is_file()
    (stored,) = (home / "calibration").glob("*.json")
    model = costs._read(stored, stored.stem)
    assert model is not None and model.verify(16) > 0
    assert stored.stem == split_keys(load(str(target))[0], load_draft(str(draft)))["layers 2"]
    again = launch(*command, env={"DFLASH_HOME": str(home)})
    assert again.returncode == 0, again.stderr[-3000:]
    assert "measuring" not in again.stderr and f"calibration {stored}" in again.stderr
    assert again.stdout.startswith(costs.format_table(model)), again.stdout


@pytest.mark.slow
def test_batch_auto_with_pipeline(pipeline_pair, tmp_path):
    """The batched engine's ``auto`` split by layers: rank 0 decides each pass, rank 1 takes its
    decisions; three prompts batched give mlx-lm's pipeline greedy tokens for each alone, under
    ``auto`` and ``fixed``, and the ranks count the same plans."""
    from test_sharded import assert_batches_match, batch_results

    target, draft = pipeline_pair
    assert_batches_match(batch_results(tmp_path, target, draft, "pipeline"))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_serve_with_pipeline_when_a_stage_goes(pipeline_pair, tmp_path, how):
    """``dflash serve --pipeline`` on two ranks, rank 1 (the stage of the first layers) killed
    or stopped (SIGSTOP: no collective fails; ``--rank-timeout 5``) mid-stream: the open stream
    ends with an error naming rank 1 within 30 s, a new request and ``/health`` get a 503
    naming it, and rank 0 exits (as tensor-parallel, ``test_sharded.py``)."""
    import os
    import signal

    from test_sharded import assert_everybody_hears, long_stream_then, rank_pid

    target, draft = pipeline_pair
    killed = how == "killed"
    extra = () if killed else ("--rank-timeout", "5")
    message = "rank 1 of the sharded target" if killed else \
        "no answer from rank 1 of the sharded target"
    with serving(target, draft, tmp_path, "--pipeline", *extra) as (proc, base, logs):
        follower = rank_pid(proc.pid, 1)
        assert follower is not None
        try:
            tail, took = long_stream_then(
                base, lambda: os.kill(follower, signal.SIGKILL if killed else signal.SIGSTOP),
                logs)
            assert_everybody_hears(base, proc, logs, message, tail, took)
        finally:
            if not killed:
                os.kill(follower, signal.SIGCONT)  # mlx.launch waits for it to take its SIGTERM


@pytest.mark.slow
def test_quantized_kv_cache_with_pipeline(tmp_path):
    """``kv_bits=8`` split by layers (both stages end with an attention layer, whose cache
    becomes mlx-lm's quantized one, keys a tuple): greedy output identical to mlx-lm's pipeline
    generation with the same KV settings, switching at the start and mid-generation."""
    target, draft = kv_fixture(tmp_path, "qwen3_5", pipeline=True)
    assert_kv_runs_match(kv_results(tmp_path, target, draft, "pipeline"))


def test_pipeline_checks_name_what_is_missing(tmp_path):
    from dflash import distributed
    from dflash.errors import UnsupportedTargetError

    def folder(name, **config):
        return config_folder(tmp_path, name, **config)

    dense = folder("dense", model_type="qwen3", num_attention_heads=4, num_key_value_heads=2,
                   num_hidden_layers=4, hidden_size=64, intermediate_size=128)
    # mlx-lm has no pipeline split for qwen3: refused, naming what is supported
    with pytest.raises(UnsupportedTargetError,
                       match="'qwen3' cannot be split by layers.*qwen3_5, qwen3_next"):
        distributed.check_shardable(dense, 2, pipeline=True)
    hybrid = folder("hybrid", model_type="qwen3_5", num_hidden_layers=4, num_attention_heads=4,
                    hidden_size=64, intermediate_size=128)
    with pytest.raises(UnsupportedTargetError, match="model.safetensors.index.json"):
        distributed.check_shardable(hybrid, 2, pipeline=True)
    (hybrid / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    distributed.check_shardable(hybrid, 2, pipeline=True)
    distributed.check_shardable(hybrid, 4, pipeline=True)
    with pytest.raises(UnsupportedTargetError, match="num_hidden_layers=4 cannot be split.* 8 "):
        distributed.check_shardable(hybrid, 8, pipeline=True)
    # qwen3_next: split by layers (mlx-lm's pipeline), not tensor-parallel (mlx-lm has no shard()
    # for it): the refusal says --pipeline
    nxt = folder("next", model_type="qwen3_next", num_hidden_layers=4)
    with pytest.raises(UnsupportedTargetError, match="'qwen3_next' cannot be sharded.*--pipeline"):
        distributed.check_shardable(nxt, 2)
    with pytest.raises(UnsupportedTargetError, match="model.safetensors.index.json"):
        distributed.check_shardable(nxt, 2, pipeline=True)
    (nxt / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    distributed.check_shardable(nxt, 2, pipeline=True)
    with pytest.raises(UnsupportedTargetError, match="num_hidden_layers=4 cannot be split.* 8 "):
        distributed.check_shardable(nxt, 8, pipeline=True)


def test_stage_starts_follow_mlx_lm():
    """Every rank's first layer, read from mlx-lm's own split: in reverse, the low ranks get the
    extra layers; each layer's tap comes from the one stage that holds it."""
    from dflash.target import Stage, pipeline_starts

    assert pipeline_starts(2, 4) == (2, 0)
    assert pipeline_starts(3, 10) == (6, 3, 0)
    stage = Stage(0, 3, pipeline_starts(3, 10), 10, None)
    assert [stage.owner(i) for i in range(10)] == [2, 2, 2, 1, 1, 1, 0, 0, 0, 0]


# ---------------------------------------------------------------------------------------------
# The worker both ranks run


def _worker(target: str, draft: str, out: str) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step, generation_stream
    from mlx_lm.sample_utils import make_logits_processors

    from dflash import distributed
    from dflash.cli import build_parser
    from dflash.cli_args import encode
    from dflash.pair import load_pair
    from dflash.speculative import stream_generate
    from dflash.target import forward, load_target, make_cache, target_parts

    ranks = distributed.join()
    pair = load_pair(target, draft, pipeline=True)
    args = build_parser().parse_args(["generate", "--prompt", PROMPT, "--no-chat-template"])
    ids = encode(pair, {"prompt": PROMPT}, args)
    parts = target_parts(pair.model)

    def same_everywhere(values) -> bool:
        mine = mx.array(np.asarray(values, dtype=np.float32).reshape(1, -1))
        every = np.array(mx.distributed.all_gather(mine, group=ranks.group))
        return bool((every == every[0]).all())

    def mlx_lm(prompt: list[int] = ids, **settings) -> list[int]:
        tokens = [int(t) for t, _ in generate_step(mx.array(prompt), pair.model, **settings)]
        mx.synchronize(generation_stream)  # its queued pass ends before the next collective
        return tokens

    tap_ids = pair.draft.target_layer_ids
    _, taps = forward(parts, mx.array(ids)[None], make_cache(parts), tap_ids)
    whole = target_parts(load_target(target)[0])  # every layer in this process
    _, taps_whole = forward(whole, mx.array(ids)[None], make_cache(whole), tap_ids)
    n = 24
    reference = mlx_lm(max_tokens=n)
    penalised = mlx_lm(max_tokens=n,
                       logits_processors=make_logits_processors(repetition_penalty=1.5))
    long_reference = mlx_lm(max_tokens=4 * n)
    # The chat message "Hello there" in the chat template: what chat, serve and generate answer
    chat = build_parser().parse_args(["generate", "--prompt", HELLO])
    hello = mlx_lm(encode(pair, {"prompt": HELLO}, chat), max_tokens=HELLO_TOKENS)
    plans = []

    def run(**settings) -> list[int]:
        settings = distributed.agreed_settings(ranks, {"max_tokens": n, **settings})
        tokens, last = [], None
        for last in stream_generate(pair.model, pair.draft, pair.tokenizer, ids, **settings):
            tokens += last.tokens
        plans.extend([last.cycles, last.plain_steps, last.tree_cycles, last.lookup_cycles,
                      last.verified_tokens])
        return tokens

    greedy = run()  # the default policy: auto, rank 0 plans, rank 1 takes its plans
    greedy_penalised = run(repetition_penalty=1.5)
    fixed = run(policy="fixed", repetition_penalty=1.5)
    long = run(max_tokens=4 * n)
    sampled = [run(temperature=0.8, seed=7), run(temperature=0.8, seed=7)]
    result = {"rank": ranks.rank, "size": ranks.size,
              "stage": [list(parts.stage.starts), parts.stage.total],
              "taps_equal": same_everywhere(taps),
              "taps_unsplit": bool(np.array_equal(np.array(taps), np.array(taps_whole))),
              "mlx_lm_greedy": reference, "dflash_greedy": greedy, "mlx_lm_penalised": penalised,
              "dflash_penalised": greedy_penalised, "dflash_fixed": fixed,
              "mlx_lm_long": long_reference, "dflash_long": long, "sampled": sampled,
              "mlx_lm_hello": hello,
              "plans": plans, "plans_agree": same_everywhere(plans),
              "ranks_agree": same_everywhere(greedy + long + sampled[0])}
    Path(out).with_suffix(f".{ranks.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.path.insert(0, str(Path(__file__).parents[1]))  # the launcher passes no PYTHONPATH
    _worker(*sys.argv[2:5])
