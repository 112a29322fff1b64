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
