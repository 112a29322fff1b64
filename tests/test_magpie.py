"""Chat prompts written by the target (Magpie): filters, near-duplicates, a stable split, resume."""

from __future__ import annotations

import json

import pytest
from tiny_models import write_target

from dflash.errors import DataSetError
from dflash.prompts import read_prompts
from dflash.training.magpie import (
    NearDuplicates,
    clean_turn,
    held_out,
    user_header,
    write_user_turns,
)


def test_clean_turn_filters_length_language_and_markup():
    assert clean_turn("  How do I bake bread at home?  ") == "How do I bake bread at home?"
    assert clean_turn("Hi?") is None  # too short
    assert clean_turn("word " * 200) is None  # too long
    assert clean_turn("Как испечь хлеб дома, подскажите?") is None  # another script
    assert clean_turn("Tell me <|im_start|>assistant about it") is None  # template markup


def test_near_duplicates_catch_copies_not_different_questions():
    d = NearDuplicates()
    base = "Can you give me some tips on how to stay motivated during a busy work week at home?"
    assert not d.seen(base)
    assert d.seen(base.replace("busy", "very busy"))  # one word changed: a near-copy
    assert d.seen(base.lower() + "!")
    assert not d.seen("Write a Python function that reverses a linked list in place.")
    assert not d.seen("What are the main causes of inflation in a small open economy today?")


def test_held_out_split_is_stable_and_about_the_asked_share():
    ids = [f"chat-{i:06d}" for i in range(4000)]
    side = [held_out(i, 5.0) for i in ids]
    assert side == [held_out(i, 5.0) for i in ids]  # the same id, the same side, every time
    assert 0.03 < sum(side) / len(side) < 0.07
    assert side[:100] == [held_out(i, 5.0) for i in ids[:100]]  # growing data moves nothing


def test_user_header_is_the_template_up_to_the_users_text(tiny_pair):
    from dflash.model_mlx import load

    model, tok = load(str(tiny_pair("llama")[0]))
    header = user_header(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=False)
    assert full.startswith(tok.decode(header))
    assert "hello" not in tok.decode(header)


@pytest.mark.slow
def test_a_target_that_writes_no_usable_turn_is_an_error_not_a_loop(tmp_path):
    target = write_target(tmp_path / "t", "llama", layers=2, hidden=32)
    with pytest.raises(DataSetError, match="user turns passed the filters"):
        write_user_turns(str(target), tmp_path / "chat.jsonl", 2, max_tokens=8, batch_size=8,
                         max_attempts=16)


@pytest.mark.slow
def test_write_user_turns_appends_resumes_and_splits(tmp_path):
    """On the built-in target (a real chat model): kept turns, a stable split, resumed ids."""
    from dflash.default_pair import default_target_path

    target = str(default_target_path())
    out = tmp_path / "chat.jsonl"
    heldout = out.with_name("chat-heldout.jsonl")

    def written() -> tuple[list[dict], list[dict]]:
        rows = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
        held = [json.loads(x) for x in heldout.read_text().splitlines()] \
            if heldout.exists() else []
        return rows, held

    write_user_turns(target, out, 4, max_tokens=64, batch_size=8, heldout_percent=50, seed=3)
    rows, held = written()
    ids = [r["id"] for r in rows + held]
    assert len(ids) == len(set(ids)) == 4
    assert all(held_out(r["id"], 50) for r in held)
    assert not any(held_out(r["id"], 50) for r in rows)
    assert all(clean_turn(r["messages"][-1]["content"]) for r in rows + held)
    write_user_turns(target, out, 2, max_tokens=64, batch_size=8, heldout_percent=50, seed=3)
    rows, held = written()
    ids2 = [r["id"] for r in rows + held]
    assert len(ids2) == len(set(ids2)) == 6  # resumed numbering: no id repeats
    assert set(ids) < set(ids2)
    if rows:
        assert all(item["messages"][-1]["role"] == "user" for item in read_prompts(out))
