"""What a pair's generations taught the ``auto`` policy, kept for later ones when asked
(PairMemory).

A generation with a memory starts calibrated and behind the losing streak (at most
INHERITED_LOSSES long), a winning pair starts drafting as deep as it verified, the memory is capped
and decayed toward the prior at each generation's start so new text re-steers it at once, and a
running generation never sees another's updates. Nothing carries over, and nothing is read or
written on disk, unless the caller asks: ``memory=``, ``draft.policy_memory``, a path, or
``DFLASH_PAIR_MEMORY=1``. (With a real pair and the target's output: tests/test_plain_steps.py.)
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_plain_steps import FLAT_COST, ROWS_COST, confident, cost, observe

import dflash
from dflash.lookup import Match
from dflash.policy import (
    MAX_BACKOFF,
    MIN_DRAFT_ROWS,
    Chain,
    Continuation,
    Outcome,
    Policy,
    Unverified,
    make_policy,
)
from dflash.policy import memory as stored
from dflash.policy.memory import CARRY, INHERITED_LOSSES, MEMORY_CAP, PairMemory, memory_of


def VerifyPolicy(name, block, cost=None, memory=None):  # noqa: N802
    return make_policy(name, block, cost, memory=memory)


def lose(policy: Policy, cycles: int) -> None:
    """``cycles`` verified cycles in which the confident drafter's first proposal is wrong."""
    for _ in range(cycles):
        policy.plain_stretch(128, MAX_BACKOFF)
        log_probs, ids = confident(3)
        observe(policy, policy.after_draft((log_probs, ids), 0, 4), 0, log_probs[:, 0])


def win(policy: Policy, cycles: int, rows: int = 3) -> None:
    for _ in range(cycles):
        policy.plain_stretch(128, MAX_BACKOFF)
        log_probs = np.log(np.full((rows, 1), 0.999))
        plan = policy.after_draft((log_probs, np.arange(rows)[:, None]), 0, rows + 1)
        accepted = 0 if isinstance(plan, Unverified) else plan.rows
        observe(policy, plan, accepted, log_probs[:, 0], rows + 1)


def test_by_default_a_generation_inherits_the_drafters_calibration_only():
    """The continuations' calibration and the losing streak belong to the last text: a new one
    starts with the drafter's decayed calibration, a fresh continuation prior and no streak."""
    memory = PairMemory(15)
    first = VerifyPolicy("auto", 16, cost(ROWS_COST), memory=memory)
    conf = np.full(3, 0.97)
    lose(first, 6)
    first.calibration.continuation.update(np.full(3, 0.7), 3, 0)  # a continuation that lost
    memory.calibration.continuation.update(np.full(3, 0.7), 3, 0)
    assert memory.losses == 6 and memory.calibration.continuation.tried.sum() > 0
    second = VerifyPolicy("auto", 16, cost(ROWS_COST), memory=memory)
    assert second.predict(conf)[0] < 0.3  # the drafter's record is carried ...
    assert second.backoff.losses == 0 and second.draft_rate is None  # ... not the streak ...
    assert second.calibration.continuation.tried.sum() == 0  # ... nor the continuations'
    assert second.plain_stretch(128, MAX_BACKOFF) == 0


def test_a_losing_pair_can_start_its_next_generation_behind_the_streak():
    memory = PairMemory(15, inherit_streak=True)
    first = VerifyPolicy("auto", 16, cost(ROWS_COST), memory=memory)
    fresh = VerifyPolicy("auto", 16, cost(ROWS_COST))
    conf = np.full(3, 0.97)
    assert fresh.predict(conf)[0] > 0.9  # the raw confidence, before any evidence
    lose(first, 6)
    assert memory.losses == first.backoff.losses == 6
    second = VerifyPolicy("auto", 16, cost(ROWS_COST), memory=memory)
    assert second.backoff.losses == INHERITED_LOSSES and not second.backoff.agreed
    assert second.predict(conf)[0] < 0.3  # what the first generation measured
    assert second.plain_stretch(128, MAX_BACKOFF) == 0  # it probes first (the text may suit the drafter) ...
    assert second.draft_rows(16) == MIN_DRAFT_ROWS  # ... with the smallest draft ...
    plan = second.after_draft(confident(3), anchor=0, draft_rows=MIN_DRAFT_ROWS)
    assert isinstance(plan, Unverified)  # ... and verifies nothing it expects to lose
    observe(second, plan, draft_rows=MIN_DRAFT_ROWS)
    assert second.plain_stretch(128, MAX_BACKOFF) == 2 ** (INHERITED_LOSSES + 1)


def test_a_winning_pair_starts_drafting_as_deep_as_it_verified():
    memory = PairMemory(15)
    first = VerifyPolicy("auto", 16, cost(FLAT_COST), memory=memory)
    assert first.draft_rows(16) == MIN_DRAFT_ROWS  # nothing known yet
    win(first, 4, rows=5)
    assert memory.losses == 0
    second = VerifyPolicy("auto", 16, cost(FLAT_COST), memory=memory)
    assert second.backoff.losses == 0 and second.draft_rows(16) == 5 + 3
    assert second.predict(np.full(5, 0.999))[4] > 0.9


def test_the_memory_is_capped_so_new_text_steers_it():
    memory = PairMemory(15)
    lose(VerifyPolicy("auto", 16, cost(ROWS_COST), memory=memory), 200)
    assert memory.calibration.drafter.tried.max() == pytest.approx(MEMORY_CAP)
    later = VerifyPolicy("auto", 16, cost(FLAT_COST), memory=memory)
    conf = np.full(3, 0.97)
    assert later.predict(conf)[0] < 0.1
    win(later, int(MEMORY_CAP) * 2)  # a prompt on which the drafter is right
    assert later.predict(conf)[0] > 0.6
    assert memory.calibration.drafter.predict(conf)[0] > 0.6  # and the pair remembers that now


def test_a_running_generation_never_sees_another_generations_updates():
    memory = PairMemory(15)
    running = VerifyPolicy("auto", 16, cost(ROWS_COST), memory=memory)
    before = running.calibration.drafter.tried.copy(), running.calibration.drafter.accepted.copy()
    other = threading.Thread(
        target=lose, args=(VerifyPolicy("auto", 16, cost(ROWS_COST), memory=memory), 20))
    other.start()
    other.join()
    assert memory.calibration.drafter.tried.sum() > 0
    np.testing.assert_array_equal(running.calibration.drafter.tried, before[0])
    np.testing.assert_array_equal(running.calibration.drafter.accepted, before[1])
    assert running.backoff.losses == 0


def test_carried_calibration_decays_so_a_few_cycles_of_new_text_re_steer_it():
    """A memory of many losing cycles (math and chat, say) must not suppress a source the new
    text favours: a generation inherits at most CARRY observations per confidence bin, so four
    right cycles lift the first row's estimate above one half; carried whole, it stays low."""
    conf = np.full(3, 0.97)
    after = {}
    for carry in (CARRY, MEMORY_CAP * 15):
        memory = PairMemory(15, carry=carry)
        lose(VerifyPolicy("auto", 16, cost(ROWS_COST), memory=memory), 200)
        later = VerifyPolicy("auto", 16, cost(FLAT_COST), memory=memory)
        assert later.calibration.drafter.tried.sum(0).max() <= carry + 1e-9
        for _ in range(4):
            observe(later, Chain(3), 3, np.log(conf), 4)
        after[carry] = later.predict(conf)[0]
    assert after[CARRY] > 0.5 > 0.2 > after[MEMORY_CAP * 15]
    # The continuations' calibration is its own, and decays the same way.
    memory = PairMemory(15)
    policy = VerifyPolicy("auto", 16, cost(FLAT_COST), memory=memory)
    for _ in range(100):
        observe(policy, Continuation((1, 2, 3), 3), 0, draft_rows=0)
    assert memory.calibration.drafter.tried.sum() == 0
    fresh = VerifyPolicy("auto", 16, cost(FLAT_COST), memory=memory)
    assert fresh.calibration.continuation.tried.sum() <= CARRY + 1e-9
    for _ in range(4):
        observe(fresh, Continuation((1, 2, 3), 3), 3, draft_rows=0)
    assert fresh.lookup_expectation(Match((1, 2, 3), 3))[0] > 0.5


def test_the_memory_is_the_callers_and_only_autos(loaded_pair, monkeypatch):
    model, _, draft = loaded_pair("llama")
    monkeypatch.delenv(stored.ENV, raising=False)
    assert memory_of(model, draft) is None  # nothing unless asked
    memory = PairMemory(7)
    monkeypatch.setattr(draft, "policy_memory", memory, raising=False)
    assert memory_of(model, draft) is memory  # the drafter holds one: its generations share it
    lose(VerifyPolicy("auto", 8, cost(ROWS_COST), memory=memory), 3)
    fixed = make_policy("fixed", 16, memory=memory)
    assert getattr(fixed, "memory", None) is None and not hasattr(fixed, "backoff")


@pytest.mark.parametrize("kind", ["llama"])
def test_generations_carry_over_only_through_a_memory_they_are_given(kind, loaded_pair):
    """Without a memory two generations start alike; with one, the second starts from what the
    first taught (and the output is the same either way)."""
    from dflash.model_mlx import generate

    model, tokenizer, draft = loaded_pair(kind)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]

    def run(**kw):
        return generate(model, draft, tokenizer, prompt, max_tokens=24, block_size=8, **kw)

    first, second = run(), run()
    assert first.tokens == second.tokens and first.stats.cycles == second.stats.cycles
    memory = PairMemory(7)
    taught = run(memory=memory)
    assert memory.calibration.drafter.tried.sum() > 0 and memory.depths
    again = run(memory=memory)
    assert again.tokens == taught.tokens == first.tokens
    with pytest.raises(dflash.errors.GenerationConfigError, match="memory="):
        run(memory="memory.json")


# ---------------------------------------------------------------------------------------------
# Stored: the next process starts where this one ended, when asked

ONE_SHOT = """
import json, sys
import dflash
from dflash.model_mlx import generate, load, load_draft
from dflash.policy.memory import PairMemory, memory_of
model, tokenizer = load(sys.argv[1])
draft = load_draft(sys.argv[2])
memory = PairMemory.open(sys.argv[3]) if sys.argv[3] != "-" else memory_of(model, draft)
before = None if memory is None else {
    "source": memory.source, "tried": memory.calibration.drafter.tried.tolist(),
    "losses": memory.losses}
r = generate(model, draft, tokenizer, "The sea is", max_tokens=40, policy="auto", memory=memory)
print(json.dumps({"before": before, "tokens": r.tokens,
                  "tried": None if memory is None else memory.calibration.drafter.tried.tolist(),
                  "losses": None if memory is None else memory.losses}))
"""


@pytest.fixture
def storing(tiny_pair, tmp_path, monkeypatch):
    """A DFLASH_HOME of the test's own (the tiny pair built first: its tokenizer comes from the
    built-in target in the real DFLASH_HOME), the stored memory off unless a test turns it on."""
    tiny_pair("llama")
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(stored.ENV, raising=False)
    return tmp_path / "home" / "calibration"


def one_shot(pair, path="-", **env) -> dict:
    import json
    import os
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", ONE_SHOT, *map(str, pair), str(path)],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, **env))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_new_process_starts_where_the_last_one_ended_when_asked(tiny_pair, storing, tmp_path):
    pair = tiny_pair("llama")
    path = tmp_path / "pair.json"
    first = one_shot(pair, path)
    assert first["before"]["source"].startswith("fresh") and not np.any(first["before"]["tried"])
    assert np.sum(first["tried"]) > 0  # the random drafter was verified and lost
    assert path.is_file()  # saved when the generation ended
    second = one_shot(pair, path)
    assert second["before"]["source"] == f"stored {path}"
    np.testing.assert_allclose(second["before"]["tried"], first["tried"], atol=1e-4)
    assert second["before"]["losses"] == first["losses"]
    assert second["tokens"] == first["tokens"]  # the memory steers the cost, never the output
    # Not asked: nothing read, nothing written.
    plain = one_shot(pair)
    assert plain["before"] is None and plain["tokens"] == first["tokens"]
    assert not storing.exists() or not list(storing.glob("memory-*.json"))
    # DFLASH_PAIR_MEMORY=1: the pair's own file under DFLASH_HOME, read by the next process.
    on = one_shot(pair, **{stored.ENV: "1"})
    (file,) = storing.glob("memory-*.json")
    assert on["before"]["source"].startswith("fresh") and np.sum(on["tried"]) > 0
    assert one_shot(pair, **{stored.ENV: "1"})["before"]["source"] == f"stored {file}"


@pytest.mark.slow
def test_calibrate_refresh_forgets_the_stored_memory(tiny_pair, storing):
    import os
    import subprocess
    import sys

    pair = tiny_pair("llama")
    one_shot(pair, **{stored.ENV: "1"})
    (memory_file,) = storing.glob("memory-*.json")
    p = subprocess.run([sys.executable, "-m", "dflash", "calibrate", "--model", str(pair[0]),
                        "--draft", str(pair[1]), "--refresh"], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ))
    assert p.returncode == 0, p.stderr
    assert not memory_file.exists() and str(memory_file) in p.stderr
    assert one_shot(pair, **{stored.ENV: "1"})["before"]["source"].startswith("fresh")


@pytest.mark.slow
def test_the_cli_reads_and_saves_the_memory_it_is_given(tiny_pair, storing, tmp_path):
    import json
    import os
    import subprocess
    import sys

    target, draft = tiny_pair("llama")
    path = tmp_path / "pair.json"

    def generate() -> subprocess.CompletedProcess:
        p = subprocess.run([sys.executable, "-m", "dflash", "generate", "--model", str(target),
                            "--draft", str(draft), "--prompt", "The sea is", "--max-tokens", "24",
                            "--json", "--no-speedup-estimate", "--pair-memory", str(path)],
                           capture_output=True, text=True, timeout=300, env=dict(os.environ))
        assert p.returncode == 0, p.stderr
        return p

    first = generate()
    assert "pair memory: fresh" in first.stderr and path.is_file()
    second = generate()
    assert f"pair memory: stored {path}" in second.stderr
    assert json.loads(first.stdout)["tokens"] == json.loads(second.stdout)["tokens"]
    assert not storing.exists() or not list(storing.glob("memory-*.json"))  # nothing else


def test_the_stored_file_belongs_to_the_weights_not_the_folder(tiny_pair):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from dflash.model_mlx import load_draft

    _, draft_path = tiny_pair("llama")
    a, b = load_draft(str(draft_path)), load_draft(str(draft_path))
    assert stored.fingerprint(a) == stored.fingerprint(b) is not None
    name, weight = next((k, v) for k, v in tree_flatten(b.parameters()) if v.ndim == 2)
    b.load_weights([(name, weight + 1e-3 * mx.ones_like(weight))], strict=False)
    assert stored.fingerprint(b) != stored.fingerprint(a)  # re-trained in place: starts fresh
    assert stored.fingerprint(object()) is None  # not a loaded model: kept in process only


def stored_copy(memory: PairMemory, **changes) -> dict:
    data = memory._to_dict()
    data.update(changes)
    return data


def test_a_corrupt_or_foreign_file_is_said_once_and_replaced(tmp_path, capsys):
    import json

    path = tmp_path / "pair.json"
    good = PairMemory(7)
    lose(VerifyPolicy("auto", 8, cost(ROWS_COST), memory=good), 3)
    bad = ["not json", "[]", "null", json.dumps(stored_copy(good, format="dflash-cost/2")),
           json.dumps(stored_copy(good, acceptance={"accepted": [[1.0]], "tried": [[0.0]]}))]
    # Values that parse but would poison or crash the policy: each is refused as a whole.
    for key, value in [("depths", [1e309]), ("depths", [-1]), ("losses", -2), ("losses", 1.5),
                       ("draft_rate", "fast"), ("draft_rate", float("nan")),
                       ("nodes", {"hits": {"sibling": 1.0, "branch": 0.3},
                                  "mass": {"sibling": 0.0, "branch": 1.0}}),
                       ("nodes", {"hits": {"sibling": float("nan"), "branch": 0.3},
                                  "mass": {"sibling": 1.0, "branch": 1.0}}),
                       ("lookup", {"accepted": [[float("nan")] * 10], "tried": [[1.0] * 10]})]:
        bad.append(json.dumps(stored_copy(good, **{key: value})))  # NaN/Infinity: JSON's extension
    for text in bad:
        path.write_text(text)
        memory = PairMemory.open(path, 7)  # no exception: said, and started fresh
        assert memory.source == "fresh" and not memory.calibration.drafter.tried.any(), text
        assert memory.losses == 0 and not memory.depths and memory.draft_rate is None, text
        assert str(path) in capsys.readouterr().err, text
    lose(VerifyPolicy("auto", 8, cost(ROWS_COST), memory=memory), 3)
    memory.save()
    reread = PairMemory(7)
    reread.load(json.loads(path.read_text()))  # replaced by a good one
    np.testing.assert_allclose(reread.calibration.drafter.tried, memory.calibration.drafter.tried,
                               atol=1e-4)


def test_bad_stored_values_and_settings_raise_typed_errors():
    """What ``load`` refuses is a PairMemoryFileError and a bad ``carry`` a GenerationConfigError,
    both ValueErrors, so callers that catch ValueError keep working."""
    good = stored_copy(PairMemory(7))
    for data in ([], dict(good, format="dflash-cost/2"), dict(good, losses=-2)):
        with pytest.raises(dflash.errors.PairMemoryFileError) as e:
            PairMemory(7).load(data)
        assert isinstance(e.value, ValueError)
    with pytest.raises(dflash.errors.GenerationConfigError, match="carry="):
        PairMemory(7, carry=-1)


def test_another_machines_memory_keeps_acceptance_not_timings(tmp_path):
    import json

    there = PairMemory(7)
    lose(VerifyPolicy("auto", 8, cost(ROWS_COST), memory=there), 5)
    path = tmp_path / "pair.json"
    path.write_text(json.dumps(stored_copy(there, machine={"cpu": "another"})))
    here = PairMemory.open(path, 7)
    assert here.source.endswith("(another machine: acceptance only)")
    np.testing.assert_allclose(here.calibration.drafter.tried, there.calibration.drafter.tried,
                               atol=1e-4)
    assert there.losses == 5 and here.losses == 0 and here.draft_rate is None


def test_an_unwritable_folder_keeps_the_memory_in_process(tmp_path, capsys):
    (tmp_path / "home").write_text("a file where a folder should be")
    memory = PairMemory.open(tmp_path / "home" / "pair.json", 7)
    lose(VerifyPolicy("auto", 8, cost(ROWS_COST), memory=memory), 3)
    memory.save()
    assert memory.path is None and "keeping it in this process" in capsys.readouterr().err
    assert memory.calibration.drafter.tried.sum() > 0


def test_a_full_disk_leaves_the_stored_file_whole(small_disk, capsys):
    import json

    memory = PairMemory.open(small_disk.path / "home" / "pair.json", 7)
    lose(VerifyPolicy("auto", 8, cost(ROWS_COST), memory=memory), 2)
    memory.save()
    good = memory.path.read_text()
    small_disk.fill()
    lose(VerifyPolicy("auto", 8, cost(ROWS_COST), memory=memory), 2)
    path = memory.path
    memory.save()  # fails: said once, kept in the process from now on
    assert memory.path is None and "keeping it in this process" in capsys.readouterr().err
    assert path.read_text() == good and json.loads(good)["format"] == stored.FORMAT
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    small_disk.free()


def test_a_stored_memory_keeps_longer_blocks_than_this_process_drafts():
    """A pair that verified continuations of 12 rows keeps them when the next process drafts
    blocks of 4 (nothing stored is cut), and its continuation calibration grows with the chains."""
    import json

    long = PairMemory(15)
    long.observe(Outcome(Continuation(tuple(range(12)), 2), 9))
    short = PairMemory(3)
    short.load(json.loads(json.dumps(long._to_dict())))
    lookup, long_lookup = short.calibration.continuation, long.calibration.continuation
    assert lookup.rows == 15 and lookup.tried.sum() == long_lookup.tried.sum()
    short.observe(Outcome(Continuation(tuple(range(20)), 2), 18))
    lookup = short.calibration.continuation
    assert lookup.rows == 20 and lookup.tried[17].sum() > 0


def test_a_cycle_with_nothing_proposed_teaches_nothing():
    """The last token of a generation is a one-row pass with no proposal: counted, priced, but
    neither a verified depth nor a lost bet on the drafter (which the next generation inherits)."""
    memory, flat = PairMemory(15), cost(FLAT_COST)
    policy = VerifyPolicy("auto", 16, flat, memory=memory)
    win(policy, 2, rows=3)
    depths = list(policy.depths)
    assert policy.backoff.losses == memory.losses == 0
    policy.observe(Outcome(Chain(0), 0, draft_rows=1, context=128))
    assert list(policy.depths) == list(memory.depths) == depths
    assert policy.backoff.losses == memory.losses == 0
    assert policy.stats.speculative_cycles == 3
    assert policy.stats.priced_ms == pytest.approx(2 * (flat.draft(4) + flat.verify(4, 128))
                                                   + flat.verify(1, 128))


def test_a_continuation_that_ends_a_losing_streak_is_remembered():
    memory = PairMemory(15)
    policy = VerifyPolicy("auto", 16, cost(FLAT_COST), memory=memory)
    lose(policy, 3)
    assert memory.losses == policy.backoff.losses > 0
    policy.plain_stretch(128, 0)
    plan = Continuation((1, 2, 3, 4, 5), 3, drafter_value=1.0)  # beat a drafted block
    observe(policy, plan, 5)
    assert policy.backoff.losses == 0 and memory.losses == 0


def test_rival_continuations_are_priced_alike_after_a_save_and_a_load(tmp_path):
    """The calibration of rival continuations (off-spine nodes of continuation trees) is stored
    with the rest: a policy started from the file prices a tree of rivals as one started from the
    memory that wrote it, and both unlike the prior. A file written before it was stored starts
    the rivals from the prior and keeps the rest."""
    import json

    from test_policy import CHEAP_ROWS, auto, rivals_match

    from dflash.policy.calibration import RIVAL_PRIORS

    path = tmp_path / "pair.json"
    memory = PairMemory(15, path)
    teacher = auto(CHEAP_ROWS, losses=1, trees=True, memory=memory)
    plan = teacher.before_draft(128, MAX_BACKOFF, rivals_match())
    tree = plan.tree
    rival = next(i for i in range(1, len(tree)) if tree.tokens[i] == 7)  # right; the spine not
    below = [i for i in range(1, len(tree)) if tree.parents[i] == rival]
    for _ in range(6):
        memory.observe(Outcome(plan, 2, (rival, below[0]), context=128))
    memory.save()

    def priced(m: PairMemory | None) -> tuple:
        policy = auto(CHEAP_ROWS, losses=1, trees=True, memory=m)
        chosen = policy.before_draft(128, MAX_BACKOFF, rivals_match())
        return tuple(chosen.tree.tokens), round(policy.expected, 9)

    reread = PairMemory.open(path, 15)
    assert reread.source == f"stored {path}"
    assert reread.calibration.rivals.hits == pytest.approx(memory.calibration.rivals.hits,
                                                           abs=1e-6)
    assert reread.calibration.rivals.mass == pytest.approx(memory.calibration.rivals.mass,
                                                           abs=1e-6)
    assert priced(reread) == priced(memory) != priced(None)

    older = json.loads(path.read_text())
    del older["rivals"]
    path.write_text(json.dumps(older))
    before = PairMemory.open(path, 15)
    assert before.source == f"stored {path}"
    assert (before.calibration.rivals.hits, before.calibration.rivals.mass) == (
        {k: h for k, (h, _) in RIVAL_PRIORS.items()}, {k: m for k, (_, m) in RIVAL_PRIORS.items()})
    assert priced(before) == priced(None)
    np.testing.assert_allclose(before.calibration.continuation.tried,
                               memory.calibration.continuation.tried, atol=1e-4)
    for bad in ({"hits": {"sibling": 1.0}, "mass": {"sibling": 1.0, "branch": 1.0}},
                {"hits": {"sibling": 1.0, "branch": 1.0}, "mass": {"sibling": 0.0, "branch": 1.0}},
                "many"):
        with pytest.raises(ValueError, match="rivals"):
            PairMemory(15).load({**older, "rivals": bad})
