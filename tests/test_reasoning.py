"""The reasoning split (``<think>…</think>`` -> ``reasoning_content``) on its own: pure text, so
these run without FastAPI or an HTTP client."""

from __future__ import annotations

import pytest

from dflash.serving.reasoning import ThinkSplitter


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 100])
def test_think_splitter_any_chunking(chunk):
    text = "<think>\nLet me add 2 and 2.\n</think>\n\nThe answer is 4. <think> stays text"
    s = ThinkSplitter()
    reasoning, content = "", ""
    pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)]
    for k, piece in enumerate(pieces):
        r, c = s.feed(piece, final=k == len(pieces) - 1)
        reasoning += r
        content += c
    assert reasoning == "Let me add 2 and 2.\n"
    assert content == "The answer is 4. <think> stays text"


def test_think_splitter_prompt_opens_block_and_plain_text():
    s = ThinkSplitter(in_reasoning=True)
    r1, c1 = s.feed("thinking hard</thi")
    r2, c2 = s.feed("nk>Done.", final=True)
    assert (r1 + r2, c1 + c2) == ("thinking hard", "Done.")
    s = ThinkSplitter()
    assert s.feed("No tags <here>.", final=True) == ("", "No tags <here>.")
    s = ThinkSplitter()
    assert s.feed("<thi") == ("", "")
    assert s.feed("s is not a tag", final=True) == ("", "<this is not a tag")
    s = ThinkSplitter()
    assert s.feed("<think>never closed", final=True) == ("never closed", "")
