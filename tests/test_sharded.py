"""A target sharded over two ranks (``mlx.launch -n 2 --backend ring`` on localhost).

Each test starts one launch of this file as a worker (``python tests/test_sharded.py worker ...``)
or of ``python -m dflash ...``: both ranks load the same tiny even-headed fixture with mlx-lm's
tensor-parallel sharding. The reference for greedy output is mlx-lm's own generation of the same
sharded model in the same launch (tensor parallelism reorders float sums, so one process is not
it). The pure pieces of :mod:`dflash.distributed` (fingerprints, shardability, agreed settings)
are tested in this process.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
# Seconds per launch: each takes well under a minute on an idle two-core machine; a loaded one
# (other jobs on the same cores) can take minutes.
LAUNCH_TIMEOUT = 300


def launch(*command: str, timeout: int = LAUNCH_TIMEOUT, ranks: int = 2, stdin: str | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``command`` on ``ranks`` ranks of the ring backend on localhost (``env``: variables set
    for every rank besides this process's)."""
    launcher = shutil.which("mlx.launch")
    if launcher is None:
        pytest.skip("mlx.launch is not on PATH")
    root = Path(__file__).parents[1]
    env = dict(os.environ, **(env or {}), PYTHONPATH=str(root))
    # A session of its own, so that a launch past its time is ended with both of its ranks.
    proc = subprocess.Popen([launcher, "-n", str(ranks), "--backend", "ring", sys.executable,
                             *command],
                            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=root, start_new_session=True)
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def untied_hybrid(root: Path) -> Path:
    """The qwen3_5 fixture with its own output head: mlx-lm splits the head's vocabulary over
    the ranks and gathers the logits (dflash's head must gather them too)."""
    import mlx.core as mx
    import tiny_models

    target = tiny_models.write_target(root, "qwen3_5")
    config = json.loads((target / "config.json").read_text())
    config["tie_word_embeddings"] = False
    weights = mx.load(str(target / "model.safetensors"))
    embed = weights["language_model.model.embed_tokens.weight"]
    mx.random.seed(5)
    weights["language_model.lm_head.weight"] = mx.random.normal(embed.shape) * embed.std()
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """``runs(kind)``: both ranks' worker results for a dense (qwen3) or hybrid (qwen3_5, its
    head split over the ranks) fixture, one launch each, once per module."""
    import tiny_models

    root, done = tmp_path_factory.mktemp("sharded"), {}

    def runs(kind: str) -> tuple[list[dict], Path, Path]:
        if kind not in done:
            target = (untied_hybrid(root / kind / "target") if kind == "qwen3_5"
                      else tiny_models.write_target(root / kind / "target", kind))
            draft = tiny_models.write_drafter(root / kind / "draft", target, taps=(0, 2))
            done[kind] = worker_results(root / kind, target, draft), target, draft
        return done[kind]

    return runs


def worker_results(tmp_path: Path, target: Path, draft: Path) -> list[dict]:
    out = tmp_path / "worker"
    run = launch(__file__, "worker", str(target), str(draft), str(out))
    # mlx.launch may exit 0 when a rank failed: the answer is the files both ranks wrote
    assert run.returncode == 0 and all(out.with_suffix(f".{r}.json").is_file() for r in range(2)), \
        run.stderr[-3000:]
    return [json.loads((out.with_suffix(f".{r}.json")).read_text()) for r in range(2)]


# ---------------------------------------------------------------------------------------------
# Two ranks


def assert_ranks_match_mlx_lm(ranks: list[dict], tree: bool = False) -> None:
    """What the ranks of a split target must show (tensor-parallel or by layers): every policy's
    greedy tokens equal to mlx-lm's own split generation in the same launch, a seeded sampled run
    reproduced, and every rank with the same taps, tokens and plans (``tree``: the tree policy's
    too)."""
    for r, got in enumerate(ranks):
        assert got["size"] == len(ranks) and got["rank"] == r
        assert got["taps_equal"], "tapped hidden states differ between the ranks"
        assert got["dflash_greedy"] == got["mlx_lm_greedy"], f"rank {r}"
        assert got["dflash_penalised"] == got["mlx_lm_penalised"], f"rank {r}"
        assert got["dflash_fixed"] == got["mlx_lm_penalised"], f"rank {r}"
        assert got["dflash_long"] == got["mlx_lm_long"], f"rank {r}"
        if tree:
            assert got["dflash_tree"] == got["mlx_lm_penalised"], f"rank {r}"
        assert got["sampled"][0] == got["sampled"][1], "a seeded sampled run did not reproduce"
        if "dflash_constrained" in got:  # (the kv-cache worker runs no grammar)
            assert got["dflash_constrained"] == got["mlx_lm_constrained"], f"rank {r}"
            text = got["constrained_sampled"]
            assert re.fullmatch(r"[a-z]{2,7}( [a-z]{2,7}){3,12}\.", text) or \
                re.fullmatch(r"[a-z]{2,7}( [a-z]{2,7}){0,12} ?[a-z]{0,7}", text), text
        assert got["ranks_agree"], "the ranks generated different tokens"
        assert got["plans_agree"], "the ranks verified different plans"
    for other in ranks[1:]:
        assert other["dflash_greedy"] == ranks[0]["dflash_greedy"]
        assert other["sampled"] == ranks[0]["sampled"]
        assert other.get("constrained_sampled") == ranks[0].get("constrained_sampled")
        assert other["plans"] == ranks[0]["plans"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_two_ranks_match_mlx_lm_sharded(kind, two_rank_runs):
    ranks, _, _ = two_rank_runs(kind)
    assert all(got["sharded"] for got in ranks), "the target was not sharded"
    # attention-only: the tree policy runs
    assert_ranks_match_mlx_lm(ranks, tree=kind == "qwen3")


@pytest.mark.slow
def test_generate_command_under_launch(two_rank_runs):
    """``dflash generate`` on two ranks: one JSON answer (rank 0 prints), mlx-lm's tokens."""
    ranks, target, draft = two_rank_runs("qwen3")
    run = launch("-m", "dflash", "generate", "--model", str(target), "--draft", str(draft),
                 "--prompt", PROMPT, "--no-chat-template", "--max-tokens", "24", "--json",
                 "--no-speedup-estimate")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, run.stdout
    assert json.loads(lines[0])["tokens"] == ranks[0]["mlx_lm_greedy"][:24]
    assert run.stderr.count("sharded tensor-parallel over 2 ranks") == 1, run.stderr


@pytest.mark.slow
def test_generate_command_with_trees_under_launch(two_rank_runs):
    """``dflash generate --policy tree`` on two ranks: rank 0's trees verified on both, mlx-lm's
    tokens."""
    ranks, target, draft = two_rank_runs("qwen3")
    run = launch("-m", "dflash", "generate", "--model", str(target), "--draft", str(draft),
                 "--prompt", PROMPT, "--no-chat-template", "--max-tokens", "24", "--json",
                 "--no-speedup-estimate", "--policy", "tree")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert json.loads(lines[0])["tokens"] == ranks[0]["mlx_lm_greedy"][:24]


@pytest.mark.slow
def test_bench_under_launch(two_rank_runs):
    """``dflash bench`` on two ranks: rank 0 prints the speed-up against mlx-lm's sharded
    generation in the same launch, outputs identical."""
    _, target, draft = two_rank_runs("qwen3_5")
    run = launch("-m", "dflash", "bench", "--model", str(target), "--draft", str(draft),
                 "--limit", "1", "--max-tokens", "12", "--no-chat-template", "--no-warmup")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("target sharded tensor-parallel over 2 ranks") == 1, run.stdout
    assert run.stdout.count("speed-up") == 1 and "identical at T=0: yes" in run.stdout


@pytest.fixture(scope="module")
def hello_answer(two_rank_runs) -> str:
    """``dflash generate``'s greedy answer to the chat message "Hello there" (12 tokens) on two
    ranks of the dense fixture: the reference of ``chat`` and ``serve`` on the same setup."""
    _, target, draft = two_rank_runs("qwen3")
    gen = launch("-m", "dflash", "generate", "--model", str(target), "--draft", str(draft),
                 "--max-tokens", "12", "--prompt", "Hello there", "--json",
                 "--no-speedup-estimate")
    assert gen.returncode == 0, gen.stderr[-3000:]
    return json.loads(next(x for x in gen.stdout.splitlines() if x.startswith("{")))["text"]


@pytest.mark.slow
def test_chat_under_launch(two_rank_runs, hello_answer):
    """``dflash chat`` on two ranks: rank 0 reads the lines (mlx.launch copies stdin to every
    rank and never closes it, so the session ends with /exit), every rank runs each turn; the
    answer is ``dflash generate``'s on the same launch setup."""
    _, target, draft = two_rank_runs("qwen3")
    pair = ("--model", str(target), "--draft", str(draft), "--max-tokens", "12")
    chat = launch("-m", "dflash", "chat", *pair, "--quiet", stdin="Hello there\n/exit\n")
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert chat.stdout == hello_answer + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_pid(launcher: int, rank: int) -> int | None:
    """The process of ``rank`` that the launcher ``launcher`` started (read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher and f"MLX_RANK={rank}".encode() in env:
            return int(entry.name)
    return None


@contextlib.contextmanager
def serving(target: Path, draft: Path, tmp_path: Path, *extra: str):
    """``dflash serve`` on two ranks, once it answers ``/health``: ``(launcher, base URL, the
    last of its stderr)``; every process of the launch is ended on the way out."""
    httpx = pytest.importorskip("httpx")
    launcher = shutil.which("mlx.launch")
    if launcher is None:
        pytest.skip("mlx.launch is not on PATH")
    if not Path("/proc/self/environ").is_file():
        pytest.skip("finding rank 1's process reads /proc")
    port, root = free_port(), Path(__file__).parents[1]
    log = tmp_path / "serve.err"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [launcher, "-n", "2", "--backend", "ring", sys.executable, "-m", "dflash", "serve",
             "--model", str(target), "--draft", str(draft), "--port", str(port),
             "--log-level", "warning", *extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, cwd=root,
            start_new_session=True, env=dict(os.environ, PYTHONPATH=str(root)))
        base = f"http://127.0.0.1:{port}"
        logs = lambda: log.read_text()[-3000:]  # noqa: E731
        try:
            deadline = time.monotonic() + LAUNCH_TIMEOUT
            while True:
                assert proc.poll() is None, logs()
                assert time.monotonic() < deadline, logs()
                try:
                    if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            yield proc, base, logs
        finally:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)  # what the ranks still print reaches the log
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def long_stream_then(base: str, do, logs) -> tuple[str, float]:
    """Start a long streamed completion, call ``do()`` after its first event, read the rest:
    its last events and the seconds they took after ``do()``."""
    import httpx

    body = {"model": "default", "prompt": PROMPT, "max_tokens": 3000, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        seen = [next(lines)]
        do()
        done = time.monotonic()
        try:
            seen += list(lines)
        except httpx.RemoteProtocolError as e:  # the server went without a word
            time.sleep(3)
            raise AssertionError(f"{e}; the server's log:\n{logs()}") from None
    return "\n".join(seen[-3:]), time.monotonic() - done


def assert_everybody_hears(base: str, proc, logs, message: str, tail: str, took: float) -> None:
    """The open stream ended within 30 s with an error saying ``message``, a new request and
    ``/health`` get a 503 saying it, and rank 0 exits with it."""
    import httpx

    assert took < 30 and message in tail and '"finish_reason": "length"' not in tail, tail
    late = httpx.post(f"{base}/v1/completions", json={"model": "default", "prompt": "Hi",
                                                      "max_tokens": 4}, timeout=30)
    assert late.status_code == 503 and message in late.json()["error"]["message"]
    health = httpx.get(f"{base}/health", timeout=30)
    assert health.status_code == 503 and message in health.text
    deadline = time.monotonic() + 60
    while message not in logs() or "Node with rank 0 exited" not in logs():
        assert time.monotonic() < deadline, logs()
        time.sleep(0.5)


@pytest.mark.slow
def test_serve_under_launch(two_rank_runs, hello_answer, tmp_path):
    """``dflash serve`` on two ranks: rank 0 serves, rank 1 follows its generations. A chat
    completion, streamed or not, alone or three at once (batched under ``auto``: rank 0's
    decisions), or run alone with its own verify plan (tree included), is ``dflash generate``'s
    answer on the same setup; a seeded sampled one reproduces (batched, and alone); one whose client leaves
    mid-stream stops on both ranks. Rank 1 killed mid-stream: the open stream ends with an error
    naming it within 30 s, a new request gets a 503 naming it, and the server exits."""
    import httpx

    openai = pytest.importorskip("openai")
    _, target, draft = two_rank_runs("qwen3")
    with serving(target, draft, tmp_path) as (proc, base, logs):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=120)
        hello = dict(model="default", messages=[{"role": "user", "content": "Hello there"}],
                     max_tokens=12, temperature=0)
        whole = client.chat.completions.create(**hello).choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(**hello, stream=True) if c.choices)
        assert whole == hello_answer and streamed == hello_answer
        # Three at once: the batched engine on both ranks under auto (rank 0 decides each
        # pass, rank 1 takes its decisions), each answer the one it gets alone; twice, the
        # second time with the first's text in the scope's index (continuations verified).
        for _ in range(2):
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                together = list(pool.map(
                    lambda _: client.chat.completions.create(**hello).choices[0].message.content,
                    range(3)))
            assert together == [hello_answer] * 3, logs()
        # A request with its own verify plan runs alone (the single-sequence engine on every
        # rank): the same answer, rank 0's plans verified on both ranks for tree.
        for own in ({"min_confidence": 0.5}, {"policy": "fixed"}, {"policy": "tree"}):
            alone = client.chat.completions.create(**hello, extra_body=own)
            assert alone.choices[0].message.content == hello_answer, own
        # Seeded: the batch's auto without lookups (with them, the earlier requests' text in
        # the scope's index is a continuation the next request may verify, which changes the
        # draws of a cycle, as on one process), and fixed's alone.
        own = ({"lookup": False},) * 2 + ({"policy": "fixed"},) * 2
        sampled = [client.chat.completions.create(**{**hello, "temperature": 0.9, "seed": 3},
                                                  extra_body=extra)
                   .choices[0].message.content for extra in own]
        assert sampled[0] == sampled[1] and sampled[2] == sampled[3]
        # A client that leaves mid-stream stops the generation on both ranks at the same cycle:
        # the next request is answered, and alike.
        body = {"model": "default", "prompt": PROMPT, "max_tokens": 3000, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines), next(lines)
        assert client.chat.completions.create(**hello).choices[0].message.content == hello_answer

        follower = rank_pid(proc.pid, 1)
        assert follower is not None
        tail, took = long_stream_then(base, lambda: os.kill(follower, signal.SIGKILL), logs)
        assert_everybody_hears(base, proc, logs, "rank 1 of the sharded target", tail, took)


@pytest.mark.slow
def test_serve_under_launch_with_a_hung_rank(two_rank_runs, tmp_path):
    """Rank 1 stopped (not dead: no collective fails) mid-stream: after ``--rank-timeout``
    seconds rank 0 answers the open stream and every new request with an error naming rank 1,
    and exits."""
    _, target, draft = two_rank_runs("qwen3")
    with serving(target, draft, tmp_path, "--rank-timeout", "5") as (proc, base, logs):
        follower = rank_pid(proc.pid, 1)
        assert follower is not None
        try:
            tail, took = long_stream_then(base, lambda: os.kill(follower, signal.SIGSTOP),
                                          logs)
            assert_everybody_hears(base, proc, logs, "no answer from rank 1 of the sharded "
                                   "target", tail, took)
        finally:
            os.kill(follower, signal.SIGCONT)  # mlx.launch waits for it to take its SIGTERM


@pytest.mark.slow
def test_launch_of_one_rank_runs_unsharded(two_rank_runs):
    _, target, draft = two_rank_runs("qwen3")
    run = launch("-m", "dflash", "generate", "--model", str(target), "--draft", str(draft),
                 "--prompt", PROMPT, "--max-tokens", "4", "--no-speedup-estimate", ranks=1)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count("a launch of one rank: the target runs unsharded") == 1, run.stderr


# ---------------------------------------------------------------------------------------------
# One process: the pure pieces


def test_fingerprint_mismatch_names_rank_and_file(tmp_path):
    from dflash import distributed

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for folder, text in (("a", "one"), ("b", "two")):
        (tmp_path / folder / "config.json").write_text("{}")
        (tmp_path / folder / "model.safetensors").write_text(text)
    tables = [distributed._rows(distributed.folder_digests(tmp_path / f, "--model"))
              for f in ("a", "b")]
    names = {__import__("hashlib").blake2b(n.encode(), digest_size=16).digest(): n
             for n in distributed.folder_digests(tmp_path / "a", "--model")}
    assert distributed.mismatches(tables, names) == [
        "rank 1 has a different --model model.safetensors than rank 0"]
    assert distributed.mismatches([tables[0], tables[0][:1]], names) == [
        "rank 1 lacks --model model.safetensors"]
    assert distributed.mismatches([tables[0], np.array(tables[0])], names) == []


def test_big_file_fingerprint_reads_samples(tmp_path):
    from dflash import distributed

    big = tmp_path / "w.safetensors"
    big.write_bytes(b"\0" * (12 << 20))
    before = distributed.file_digest(big)
    with open(big, "r+b") as f:
        f.seek((12 << 20) - 1)
        f.write(b"\1")
    assert distributed.file_digest(big) != before  # the tail is read


def config_folder(root: Path, name: str, **config) -> Path:
    """A checkpoint folder holding only ``config.json`` (what the shardability checks read)."""
    p = root / name
    p.mkdir()
    (p / "config.json").write_text(json.dumps(config))
    return p


def test_unshardable_targets_are_named(tmp_path):
    from dflash import distributed
    from dflash.errors import UnsupportedTargetError

    def folder(name, **config):
        return config_folder(tmp_path, name, **config)

    odd = folder("odd", model_type="llama", num_attention_heads=9, num_key_value_heads=3,
                 hidden_size=576, intermediate_size=1536)
    with pytest.raises(UnsupportedTargetError, match="num_attention_heads=9 is not divisible by 2"):
        distributed.check_shardable(odd, 2)
    distributed.check_shardable(odd, 3)
    other = folder("gpt2", model_type="gpt2", n_head=4)
    with pytest.raises(UnsupportedTargetError, match="'gpt2' cannot be sharded.*llama, qwen3"):
        distributed.check_shardable(other, 2)


def test_other_ranks_print_only_errors(monkeypatch):
    from dflash import distributed

    for name in ("stdout", "stderr", "excepthook"):  # restored after the test
        monkeypatch.setattr(sys, name, getattr(sys, name))
    monkeypatch.setenv("MLX_RANK", "1")
    assert distributed.quiet_other_ranks() == 1
    print("rank 0's output")  # dropped
    assert distributed.error_stream() is sys.__stderr__
    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.setattr(sys, "stdout", sys.__stdout__)
    monkeypatch.setattr(sys, "stderr", sys.__stderr__)
    assert distributed.quiet_other_ranks() == 0 and distributed.error_stream() is sys.__stderr__


def test_settings_unchanged_without_a_launch():
    from dflash import distributed
    from dflash.ranks import Ranks

    settings = {"policy": None, "seed": None, "min_confidence": None}
    assert distributed.agreed_settings(Ranks(), settings) is settings


class _Wire:
    """Both ends of :meth:`~dflash.ranks.Ranks.ints_from_main` in one process: rank 0's messages
    queued for a follower that runs afterwards."""

    def __init__(self):
        self.queue: list[np.ndarray] = []

    def end(self, main: bool):
        wire = self

        class End:
            is_main, distributed = main, True

            def ints_from_main(self, values, width):
                if main:
                    message = np.zeros(width, dtype=np.int32)
                    message[:len(values)] = values
                    wire.queue.append(message)
                    return message
                return wire.queue.pop(0)

        return End()


def test_plans_cross_to_the_followers_exactly():
    from dflash.lookup import MAX_CHAIN
    from dflash.policy import Chain, Continuation, Plain, Tree
    from dflash.policy.agreed import UNVERIFIED, WIDTH, decode, encode
    from dflash.tree import DraftTree, continuation_tree

    tree = DraftTree([5, 9, 7, 11], [-1, 0, 0, 1], [0, 1, 1, 2], [0.0, -0.25, -1.5, -0.1 / 3],
                     [0, 0, 1, 0])
    rivals = continuation_tree(-1, [list(range(1, MAX_CHAIN + 1)), [1, 2, 99]],
                               [[0.9] * MAX_CHAIN, [0.5] * 3], MAX_CHAIN)
    plans = [Plain(7), Chain(0), Chain(15), Tree(tree),
             Tree(DraftTree([3, 4], [-1, 0], [0, 1], [0.0, -0.5])),
             Continuation(tuple(range(1, MAX_CHAIN + 1)), 64, 3, "index", 0.123456789, rivals),
             Continuation((4, 5), 2), Continuation((8,), 1, 1, "context", None, tree)]
    for plan in plans:
        message = encode(plan)
        assert message.shape == (WIDTH,) and message.dtype == np.int32
        assert decode(message)[1] == plan, plan
    assert decode(encode(UNVERIFIED, a=12))[::2] == (UNVERIFIED, 12)
    with pytest.raises(ValueError, match="at most"):
        encode(Continuation(tuple(range(MAX_CHAIN + 1)), 1))


def _engine_cycles(policy, script, block: int = 16) -> list:
    """``policy`` asked and told in the order :func:`dflash.speculative.speculative_step` and
    ``plain_steps`` ask and tell it, over scripted drafter candidates, continuations and
    acceptances; every plan it gave, in order."""
    from dflash.policy import Outcome, Plain, Tree, Unverified

    plans, context = [], 100
    for look, make_candidates, accepted, later in script:
        plan = policy.before_draft(context, 64, look)
        rows = log_conf = None
        if plan is None:
            rows = policy.draft_rows(block)
            candidates = make_candidates(rows - 1, policy.candidates)
            log_conf = candidates[0][:, 0]
            plan = policy.after_draft(candidates, 1, rows)
        plans.append(plan)
        if isinstance(plan, Unverified):
            policy.observe(Outcome(plan, log_conf=log_conf, draft_rows=rows, context=context))
            plan = Plain(1 + policy.plain_stretch(context, 63))
            plans.append(plan)
        if isinstance(plan, Plain):
            taken = 0
            for i in range(plan.steps):
                taken += 1
                context += 1
                policy.observe(Outcome(Plain(1), context=context))
                if i + 1 < plan.steps and policy.looks_up and policy.lookup_worth(later[i % 2]):
                    break
            policy.give_back(plan.steps - taken)
            continue
        a = min(accepted, plan.rows)
        path = tuple(range(1, a + 1)) if isinstance(plan, Tree) else None
        policy.observe(Outcome(plan, a, path, log_conf, rows or 0, context))
        context += a + 1
    return plans


def test_followers_plan_what_rank_0_plans():
    """Rank 0's auto policy (timings of its own) and a follower driven as the engine drives
    them: the follower's plans are rank 0's, every kind of plan included, and rank 0's are what
    the policy alone plans."""
    from dflash.cost_model import PassCosts
    from dflash.lookup import Match
    from dflash.policy import make_policy
    from dflash.policy.agreed import PlanFollower, PlanLeader, agreed

    rng = np.random.default_rng(3)

    def candidates_for(seed, spread):
        def make(rows, k):
            p = np.random.default_rng(seed).dirichlet(np.full(40, spread), size=rows)
            order = np.argsort(-p, axis=1, kind="stable")[:, :k]
            return np.log(np.take_along_axis(p, order, axis=1) + 1e-30), order + 2
        return make

    def match(n):
        return Match(tuple(int(t) for t in rng.integers(2, 90, n)), int(rng.integers(1, 20)),
                     int(rng.integers(1, 4))) if n else None

    # A drafter that is confident and right, then unsure and wrong (speculation loses: plain
    # stretches, unverified probes), then anything; continuations now and then.
    phases = [(0.005, 15, [0, 0, 0, 3]), (1.0, 0, [0]), (0.2, None, [0, 0, 3, 9])]
    script = [(match(int(rng.choice(looks))), candidates_for(i, spread),
               int(rng.integers(0, 9)) if accepted is None else accepted,
               (match(int(rng.choice([0, 2]))), None))
              for spread, accepted, looks in phases for i in range(60)]
    costs = PassCosts("test", {})
    for ms, rows in ((1.0, 1), (1.05, 4), (1.1, 16), (1.3, 33)):  # verifying rows costs little
        for _ in range(3):
            costs.observe("verify", rows, 100, ms / 1000)
    costs.observe("draft", 16, 100, 0.0004)

    kinds = set()
    for trees in (True, False):  # drafted trees on an attention-only target, else chains
        def auto(trees=trees):
            return make_policy("auto", 16, costs, trees=trees)

        alone = _engine_cycles(auto(), script)
        wire = _Wire()
        leader = agreed(auto(), wire.end(True))
        assert isinstance(leader, PlanLeader)
        led = _engine_cycles(leader, script)
        follower = agreed(auto(), wire.end(False))
        assert isinstance(follower, PlanFollower)
        followed = _engine_cycles(follower, script)
        assert followed == led == alone and not wire.queue
        assert follower.stats.plain_steps == leader.stats.plain_steps
        kinds |= {type(p).__name__ for p in led}
    assert {"Chain", "Tree", "Plain", "Unverified", "Continuation"} <= kinds, kinds
    # fixed and confidence price nothing: not wrapped
    fixed = make_policy("fixed", 16)
    assert agreed(fixed, wire.end(False)) is fixed


def _batch_decisions(speculation, wrap, script, costs) -> list:
    """``speculation`` (a batch policy) asked and told in the order
    :meth:`dflash.batch.BatchGenerator._cycle` asks and tells it, over scripted rows; every
    decision (drafted rows, width, rows verifying their continuation), in order. ``wrap``: what
    each row's own policy is on this rank."""
    from dflash.policy import make_policy

    policies = [wrap(make_policy("auto", 16, costs)) for _ in range(3)]
    decisions = []
    for context, (confs, looked, committed) in enumerate(script, start=100):
        rows = list(zip(policies, confs))
        if speculation.want_draft(rows, looked, context, 16):
            drafted = speculation.draft_rows(16)
            width, use_look = speculation.width_after_draft(rows, looked, context, drafted)
        else:
            drafted, (width, use_look) = 0, speculation.width_without_draft(looked, context)
        speculation.judge(rows, use_look, looked, committed, context, drafted, width)
        decisions.append((drafted, width, list(use_look)))
    return decisions


def test_batch_followers_take_rank_0s_decisions():
    """The batched engine's ``auto`` on rank 0 (its rows' policies wrapped as a sharded target
    wraps them) and on a follower (whose rows' policies price nothing): the follower's every
    decision is rank 0's, and rank 0's are what the batch policy alone decides. ``fixed`` is not
    wrapped."""
    from dflash.cost_model import PassCosts
    from dflash.policy import make_batch_policy
    from dflash.policy.agreed import (
        BatchFollower,
        BatchLeader,
        PlanFollower,
        PlanLeader,
        agreed_batch,
    )

    costs = PassCosts("test", {})
    for ms, rows in ((1.0, 1), (1.05, 4), (1.1, 16), (1.3, 48)):
        for _ in range(3):
            costs.observe("verify", rows, 100, ms / 1000)
    costs.observe("draft", 48, 100, 0.0004)
    rng = np.random.default_rng(5)
    # Confident drafting, then hopeless drafting (plain passes, back-off), then anything; rows
    # with a continuation now and then.
    script = [([np.sort(rng.uniform(0.0, top, 15))[::-1] for _ in range(3)],
               [None if rng.random() < 0.6 else rng.uniform(0.2, 1.0, int(rng.integers(1, 15)))
                for _ in range(3)],
               int(rng.integers(3, 30)))
              for top in (1.0, 0.02, 0.6) for _ in range(40)]
    alone = _batch_decisions(make_batch_policy("auto", costs), lambda p: p, script, costs)
    wire = _Wire()
    leader = agreed_batch(make_batch_policy("auto", costs), wire.end(True))
    assert isinstance(leader, BatchLeader)
    led = _batch_decisions(leader, lambda p: PlanLeader(p, wire.end(True)), script, costs)
    follower = agreed_batch(make_batch_policy("auto", costs), wire.end(False))
    assert isinstance(follower, BatchFollower)
    followed = _batch_decisions(follower, lambda p: PlanFollower(p, wire.end(False)), script,
                                costs)
    assert followed == led == alone and not wire.queue
    assert {d[0] > 0 for d in led} == {True, False}, "never drafted, or always"
    assert any(any(use) for _, _, use in led), "no row verified its continuation"
    assert len({width for _, width, _ in led}) > 2
    fixed = make_batch_policy("fixed", costs)
    assert agreed_batch(fixed, wire.end(False)) is fixed


def test_engine_calls_cross_to_the_followers_unchanged():
    from dflash import distributed
    from dflash.ranks import Ranks
    from dflash.serving.sharded import from_wire, to_wire

    kwargs = {"temperature": 0.7, "top_p": 0.9, "seed": 12, "stop": ["\n\n"], "max_tokens": 5,
              "logit_bias": {17: -100.0, 3: 2.5}, "policy": "fixed", "kv_bits": None}
    assert from_wire(json.loads(json.dumps(to_wire(kwargs)))) == kwargs
    from dflash.grammar import Grammar

    constrained = {"grammar": Grammar.json_schema({"type": "object"}), "max_tokens": 3}
    assert from_wire(json.loads(json.dumps(to_wire(constrained)))) == constrained
    # one rank: the call is what rank 0 holds, no collective
    assert distributed.call_to_followers(Ranks(), {"a": 1}) is None
    assert distributed.call_from_main(Ranks()) is None
    assert distributed.other_ranks(Ranks(0, 2)) == "rank 1"
    # one rank: rank 0's values, padded, no collective
    assert Ranks().ints_from_main(np.array([3, -1]), 4).tolist() == [3, -1, 0, 0]
    with pytest.raises(ValueError, match="at most width=1"):
        Ranks().ints_from_main(np.array([3, -1]), 1)
    assert distributed.other_ranks(Ranks(0, 4)) == "one of ranks 1-3"


def test_a_lost_rank_fails_every_open_queued_and_later_job():
    from dflash.errors import RankLost
    from dflash.ranks import Ranks
    from dflash.serving.worker import Job, Worker

    class Loop:  # delivers at once, as the event loop would
        def call_soon_threadsafe(self, put, item):
            put(item)

    class Out(list):
        put_nowait = list.append

    heard = []
    worker = Worker(loader=lambda: None, metrics=None, ranks=Ranks(0, 2))
    worker.on_lost = lambda: heard.append(True)
    running, queued = (Job([1], {}, loop=Loop(), out=Out()) for _ in range(2))
    worker.current = running
    worker.submit(queued)
    worker.lose("rank 1 of the sharded target is gone")
    worker.lose("a second time: ignored")
    for job in (running, queued):
        assert [(k, str(v)) for k, v in job.out] == [
            ("error", "rank 1 of the sharded target is gone")]
    assert worker.queue_depth == 0 and heard == [True]
    with pytest.raises(RankLost, match="rank 1 of the sharded target is gone"):
        worker.submit(Job([1], {}, loop=Loop(), out=Out()))


# ---------------------------------------------------------------------------------------------
# The worker both ranks run


def _worker(target: str, draft: str, out: str) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step, generation_stream
    from mlx_lm.sample_utils import make_logits_processors

    from dflash import distributed
    from dflash.cli import build_parser
    from dflash.cli_args import encode
    from dflash.grammar import Grammar, logits_processor
    from dflash.pair import load_pair
    from dflash.speculative import stream_generate
    from dflash.target import forward, make_cache, target_parts, tree_supported

    ranks = distributed.join()
    pair = load_pair(target, draft)
    args = build_parser().parse_args(["generate", "--prompt", PROMPT, "--no-chat-template"])
    ids = encode(pair, {"prompt": PROMPT}, args)
    parts = target_parts(pair.model)

    def same_everywhere(values) -> bool:
        mine = mx.array(np.asarray(values, dtype=np.float32).reshape(1, -1))
        every = np.array(mx.distributed.all_gather(mine, group=ranks.group))
        return bool((every == every[0]).all())

    def mlx_lm(**settings) -> list[int]:
        tokens = [int(t) for t, _ in generate_step(mx.array(ids), pair.model, **settings)]
        # generate_step leaves its next pass queued on its stream: a collective issued on
        # another stream before that pass ends would pair with one of its all-sums.
        mx.synchronize(generation_stream)
        return tokens

    _, taps = forward(parts, mx.array(ids)[None], make_cache(parts), pair.draft.target_layer_ids)
    n = 24
    reference = mlx_lm(max_tokens=n)
    # A repetition penalty keeps a random-weight target from repeating one token: more varied
    # greedy tokens to compare.
    penalised = mlx_lm(max_tokens=n,
                       logits_processors=make_logits_processors(repetition_penalty=1.5))
    long_reference = mlx_lm(max_tokens=4 * n)
    # A grammar on a split target: each rank binds it to its own tokenizer; the masks agree
    # because the same tokens reach every rank's matcher.
    grammar = Grammar.regex(r"[a-z]{2,7}( [a-z]{2,7}){3,12}\.")
    constrained_reference = mlx_lm(max_tokens=n, logits_processors=[
        logits_processor(grammar.bind(pair.tokenizer, parts.vocab_size), len(ids))])
    eos = set(pair.tokenizer.eos_token_ids)  # generate_step goes on past the end; dflash stops
    constrained_reference = constrained_reference[:next(
        (i for i, t in enumerate(constrained_reference) if t in eos), n)]

    plans = []  # what each run's policy chose (counted on every rank from its own outcomes)

    def run(**settings) -> list[int]:
        settings = distributed.agreed_settings(ranks, {"max_tokens": n, **settings})
        tokens, last = [], None
        for last in stream_generate(pair.model, pair.draft, pair.tokenizer, ids, **settings):
            tokens += last.tokens
        plans.extend([last.cycles, last.plain_steps, last.tree_cycles, last.lookup_cycles,
                      last.verified_tokens])
        return tokens

    # The default policy (auto: rank 0 plans from its timings, rank 1 takes its plans), fixed,
    # and trees where the target verifies them.
    greedy = run()
    greedy_penalised = run(repetition_penalty=1.5)
    fixed = run(policy="fixed", repetition_penalty=1.5)
    trees = tree_supported(parts, make_cache(parts))
    tree = run(policy="tree", repetition_penalty=1.5) if trees else None
    long = run(max_tokens=4 * n)  # long enough for the context to repeat itself
    sampled = [run(temperature=0.8, seed=7), run(temperature=0.8, seed=7)]
    constrained = run(grammar=grammar)
    constrained_sampled = run(grammar=grammar, temperature=0.8, seed=3)
    sharded = any(type(m).__name__.startswith(("AllToSharded", "ShardedToAll"))
                  for _, m in pair.model.named_modules())
    result = {"rank": ranks.rank, "size": ranks.size, "taps_equal": same_everywhere(taps),
              "mlx_lm_greedy": reference, "dflash_greedy": greedy, "mlx_lm_penalised": penalised,
              "dflash_penalised": greedy_penalised, "dflash_fixed": fixed, "dflash_tree": tree,
              "mlx_lm_long": long_reference, "dflash_long": long, "sampled": sampled,
              "mlx_lm_constrained": constrained_reference, "dflash_constrained": constrained,
              "constrained_sampled": pair.tokenizer.decode(constrained_sampled),
              "plans": plans, "plans_agree": same_everywhere(plans),
              "ranks_agree": same_everywhere(greedy + long + sampled[0]), "sharded": sharded}
    Path(out).with_suffix(f".{ranks.rank}.json").write_text(json.dumps(result))


# The quantized KV cache's settings of the two-rank checks: the whole cache from the start, and a
# switch during the generation (a verify pass crossing it) for a prompt of PROMPT's length.
KV_STARTS = (0, 20)


def kv_fixture(root: Path, kind: str, pipeline: bool = False) -> tuple[Path, Path]:
    """A target of ``kind`` whose head dimension (32) a KV group of 32 divides, and its drafter
    (taps 0 and 2); with ``pipeline``, as an indexed checkpoint split by layer."""
    import tiny_models
    from test_kv_cache import write_fixture

    target = write_fixture(root / "target", kind, head_dim=32)
    if pipeline:
        from test_pipeline import indexed

        target = indexed(target)
    return target, tiny_models.write_drafter(root / "draft", target, taps=(0, 2))


def split_results(worker: str, tmp_path: Path, target: Path, draft: Path, split: str
                  ) -> list[dict]:
    """Both ranks' results of this file's ``worker`` (``kv-worker``, ``batch-worker``) on a
    ``split`` (tensor, pipeline) launch."""
    out = tmp_path / worker
    run = launch(__file__, worker, str(target), str(draft), str(out), split)
    assert run.returncode == 0 and all(out.with_suffix(f".{r}.json").is_file() for r in range(2)), \
        run.stderr[-3000:]
    return [json.loads((out.with_suffix(f".{r}.json")).read_text()) for r in range(2)]


def kv_results(tmp_path: Path, target: Path, draft: Path, split: str) -> list[dict]:
    """Both ranks' ``_kv_worker`` results for a ``split`` (tensor, pipeline) launch."""
    return split_results("kv-worker", tmp_path, target, draft, split)


def assert_kv_runs_match(ranks: list[dict]) -> None:
    for r, got in enumerate(ranks):
        assert got["size"] == 2 and got["rank"] == r
        for start in KV_STARTS:
            reference = got["mlx_lm"][str(start)]
            assert got["quantized"][str(start)], f"quantized_kv_start={start}: never quantized"
            for policy, tokens in got["dflash"][str(start)].items():
                assert tokens == reference, f"rank {r}, quantized_kv_start={start}, {policy}"
        assert got["ranks_agree"], "the ranks generated different tokens"


@pytest.mark.slow
def test_quantized_kv_cache_on_two_ranks(tmp_path):
    """``kv_bits=8`` on a tensor-parallel target: greedy output identical to mlx-lm's sharded
    generation with the same KV settings, switching at the start and mid-generation."""
    target, draft = kv_fixture(tmp_path, "qwen3_5")
    assert_kv_runs_match(kv_results(tmp_path, target, draft, "tensor"))


def _kv_worker(target: str, draft: str, out: str, split: str) -> None:
    """Both ranks: mlx-lm's sharded greedy generation with a quantized KV cache and dflash's
    (auto and fixed) with the same settings, for each of ``KV_STARTS``."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step, generation_stream
    from mlx_lm.models.cache import QuantizedKVCache
    from mlx_lm.sample_utils import make_logits_processors

    from dflash import distributed
    from dflash.cli import build_parser
    from dflash.cli_args import encode
    from dflash.pair import load_pair
    from dflash.speculative import stream_generate
    from dflash.target import make_cache, target_parts

    ranks = distributed.join()
    pair = load_pair(target, draft, pipeline=split == "pipeline")
    args = build_parser().parse_args(["generate", "--prompt", PROMPT, "--no-chat-template"])
    ids = encode(pair, {"prompt": PROMPT}, args)
    n = 48
    result = {"rank": ranks.rank, "size": ranks.size, "mlx_lm": {}, "dflash": {},
              "quantized": {}}
    everything = []
    for start in KV_STARTS:
        kv = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": start}
        cache = make_cache(target_parts(pair.model))
        reference = [int(t) for t, _ in generate_step(
            mx.array(ids), pair.model, max_tokens=n, prompt_cache=cache,
            logits_processors=make_logits_processors(repetition_penalty=1.5), **kv)]
        mx.synchronize(generation_stream)  # its queued pass ends before the next collective
        result["mlx_lm"][str(start)] = reference
        # Whether mlx-lm quantized a cache of this stage (every stage holds attention layers)
        result["quantized"][str(start)] = any(isinstance(c, QuantizedKVCache) for c in cache)
        runs = {}
        for policy in ("auto", "fixed"):
            settings = distributed.agreed_settings(ranks, {"max_tokens": n, "policy": policy,
                                                           "repetition_penalty": 1.5, **kv})
            runs[policy] = [t for r in stream_generate(pair.model, pair.draft, pair.tokenizer,
                                                       ids, **settings) for t in r.tokens]
            everything += runs[policy]
        result["dflash"][str(start)] = runs
    mine = mx.array(np.asarray(everything, dtype=np.float32).reshape(1, -1))
    every = np.array(mx.distributed.all_gather(mine, group=ranks.group))
    result["ranks_agree"] = bool((every == every[0]).all())
    Path(out).with_suffix(f".{ranks.rank}.json").write_text(json.dumps(result))


BATCH_PROMPTS = (PROMPT, "Hello there, how are you today?", "def fibonacci(n):")


def batch_results(tmp_path: Path, target: Path, draft: Path, split: str) -> list[dict]:
    """Both ranks' ``_batch_worker`` results for a ``split`` (tensor, pipeline) launch."""
    return split_results("batch-worker", tmp_path, target, draft, split)


def assert_batches_match(ranks: list[dict]) -> None:
    for r, got in enumerate(ranks):
        assert got["size"] == 2 and got["rank"] == r
        for policy in ("auto", "fixed"):
            assert got[policy] == got["mlx_lm"], f"rank {r}, policy {policy}"
        assert got["ranks_agree"], "the ranks generated different tokens or counted other plans"
    assert [got["speculation"] for got in ranks] == ["BatchLeader", "BatchFollower"]


@pytest.mark.slow
def test_batch_auto_on_two_ranks(tmp_path):
    """The batched engine's ``auto`` on a tensor-parallel target: rank 0 decides each pass (draft
    or not, how many rows, the width, the rows that verify a continuation) and the other rank
    takes its decisions; three prompts batched give mlx-lm's sharded greedy tokens for each
    alone, under ``auto`` and ``fixed``, and the ranks count the same plans."""
    import tiny_models

    target = tiny_models.write_target(tmp_path / "target", "qwen3")
    draft = tiny_models.write_drafter(tmp_path / "draft", target, taps=(0, 2))
    assert_batches_match(batch_results(tmp_path, target, draft, "tensor"))


def _batch_worker(target: str, draft: str, out: str, split: str) -> None:
    """Both ranks: mlx-lm's sharded greedy generation of each of ``BATCH_PROMPTS`` alone, and
    the three batched through dflash's batched engine under ``auto`` and ``fixed``."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step, generation_stream
    from mlx_lm.sample_utils import make_logits_processors

    from dflash import distributed
    from dflash.batch import BatchGenerator, batch_generate
    from dflash.pair import load_pair

    ranks = distributed.join()
    pair = load_pair(target, draft, pipeline=split == "pipeline")
    prompts = [pair.tokenizer.encode(p) for p in BATCH_PROMPTS]
    n = 32
    result = {"rank": ranks.rank, "size": ranks.size, "mlx_lm": [],
              "speculation": type(BatchGenerator(pair.model, pair.draft, pair.tokenizer,
                                                 max_batch=3).speculation).__name__}
    for ids in prompts:
        result["mlx_lm"].append([int(t) for t, _ in generate_step(
            mx.array(ids), pair.model, max_tokens=n,
            logits_processors=make_logits_processors(repetition_penalty=1.5))])
        mx.synchronize(generation_stream)  # its queued pass ends before the next collective
    counted = []
    for policy in ("auto", "fixed"):
        runs = batch_generate(pair.model, pair.draft, pair.tokenizer, prompts, max_batch=3,
                              policy=policy, max_tokens=n, repetition_penalty=1.5)
        result[policy] = [r.tokens for r in runs]
        counted += [t for r in runs for t in r.tokens]
        counted += [x for r in runs for x in (r.stats.cycles, r.stats.plain_steps,
                                              r.stats.verified_tokens, r.stats.lookup_cycles)]
    mine = mx.array(np.asarray(counted, dtype=np.float32).reshape(1, -1))
    every = np.array(mx.distributed.all_gather(mine, group=ranks.group))
    result["ranks_agree"] = bool((every == every[0]).all())
    Path(out).with_suffix(f".{ranks.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.path.insert(0, str(Path(__file__).parents[1]))  # the launcher passes no PYTHONPATH
    _worker(*sys.argv[2:5])
elif __name__ == "__main__" and sys.argv[1:2] == ["kv-worker"]:
    sys.path.insert(0, str(Path(__file__).parents[1]))
    _kv_worker(*sys.argv[2:6])
elif __name__ == "__main__" and sys.argv[1:2] == ["batch-worker"]:
    sys.path.insert(0, str(Path(__file__).parents[1]))
    _batch_worker(*sys.argv[2:6])
