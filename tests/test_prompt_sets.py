"""The prompt sets shipped with the package: read by name wherever dflash is installed
(``dflash bench --prompts heldout-mix``), a file of the same name in the working folder first."""

from __future__ import annotations

import json

import pytest

from dflash.errors import PromptFileError
from dflash.prompts import prompt_domain, prompt_file, prompt_sets, read_prompts


def test_the_shipped_sets_read_by_name():
    assert {"heldout-mix", "heldout-prompts", "chat-heldout"} <= set(prompt_sets())
    items = read_prompts("heldout-mix")
    domains = [prompt_domain(i["id"]) for i in items]
    assert len(items) == 16 and {d: domains.count(d) for d in set(domains)} == {
        "gsm8k": 6, "chat": 6, "HumanEval": 4}


def test_a_file_in_the_working_folder_comes_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "heldout-mix").write_text(json.dumps({"id": "mine", "prompt": "Hi"}) + "\n")
    assert prompt_file("heldout-mix").resolve() == (tmp_path / "heldout-mix").resolve()
    assert [i["id"] for i in read_prompts("heldout-mix")] == ["mine"]


def test_an_unknown_name_lists_the_shipped_sets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PromptFileError, match="does not exist .*heldout-mix"):
        read_prompts("no-such-set")


def test_the_five_domain_set_is_drawn_from_the_held_out_files():
    """heldout-domains (the training arms' τ): the held-out mix, plus agent turns and long
    contexts taken whole from the held-out splits fixed before any record was generated."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "datasets" / "smollm2" / "heldout"
    items = read_prompts("heldout-domains")
    domains = [prompt_domain(i["id"]) for i in items]
    assert {d: domains.count(d) for d in set(domains)} == {
        "gsm8k": 6, "chat": 6, "HumanEval": 4, "agent": 4, "long": 2}
    assert items[:16] == read_prompts("heldout-mix")
    split = {json.loads(line)["id"]: json.loads(line) for name in ("agent", "long")
             for line in (root / f"{name}.jsonl").read_text().splitlines()}
    shipped = [json.loads(line) for line in prompt_file("heldout-domains").read_text().splitlines()]
    for item in shipped[16:]:
        assert split[item["id"]] == item
    agent_sources = {i["source"] for i in shipped if prompt_domain(i["id"]) == "agent"}
    assert agent_sources == {"edit-file", "tool-call", "tool-result", "tool-history"}
