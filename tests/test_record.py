"""``dflash serve --record DIR``: accepted requests written one JSON line each, read back for
``benchmarks/replay.py``; bad folders and bad lines named."""

from __future__ import annotations

import json
import threading

import pytest

from dflash.errors import ServerConfigError, TraceFileError
from dflash.serving.record import FILE, Recorder, read_session


def test_requests_are_appended_whole_and_read_back(tmp_path):
    rec = Recorder(tmp_path / "rec")
    bodies = [{"messages": [{"role": "user", "content": f"turn {i} " + "x" * 5000}]}
              for i in range(40)]
    threads = [threading.Thread(target=rec.write, args=("chat", b, "key-abc"))
               for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    session = read_session(tmp_path / "rec")  # the folder or the file
    assert session == read_session(tmp_path / "rec" / FILE)
    assert sorted(json.dumps(r["body"]) for r in session) == sorted(map(json.dumps, bodies))
    assert {r["endpoint"] for r in session} == {"chat"} and session[0]["scope"] == "key-abc"
    # a second recorder on the folder (a restart) appends
    Recorder(tmp_path / "rec").write("messages", {"max_tokens": 3}, None)
    assert read_session(tmp_path / "rec")[-1] == read_session(tmp_path / "rec")[-1] | {
        "endpoint": "messages", "scope": "-", "body": {"max_tokens": 3}}


def test_bad_folders_and_lines_are_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ServerConfigError, match="--record .*file"):
        Recorder(blocker / "rec")
    bad = tmp_path / "bad.jsonl"
    for text, match in [("{not json\n", "bad.jsonl:1: not JSON"),
                        ('{"endpoint": "chat"}\n', "bad.jsonl:1: .*`endpoint` and `body`"),
                        ('\n{"endpoint": "x", "body": {}}\n', "bad.jsonl:2")]:
        bad.write_text(text)
        with pytest.raises(TraceFileError, match=match):
            read_session(bad)
    with pytest.raises(TraceFileError, match="cannot be read"):
        read_session(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("name, endpoint", [("codex", "responses"),
                                            ("claude-code", "messages")])
def test_shipped_agent_sessions_render_for_mlx_lm(name, endpoint):
    """The real agent sessions shipped for ``benchmarks/replay.py`` (recorded from the Codex CLI
    and Claude Code against ``dflash serve`` on the built-in pair) read back, each request
    renders to a prompt text that encodes back to the same ids (what mlx_lm.server, which has
    neither endpoint, is sent as a completion), and every turn's prompt extends an earlier
    one: the conversation is resent whole, so a cache holding prompt and reply serves it."""
    import sys
    from pathlib import Path

    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from tiny_models import tokenizer_source

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    import replay

    session = read_session(root / "benchmarks" / "sessions" / f"{name}.jsonl")
    assert len(session) >= 3 and {r["endpoint"] for r in session} == {endpoint}
    target = tokenizer_source()
    tokenizer = load_tokenizer(target)
    prompts = replay.rendered_prompts(session, target)
    ids = [tokenizer.encode(p) for p in prompts]
    assert all(ids)  # (rendered_prompts refuses text that does not encode back to its ids)
    shared = [len(_common(ids[k], ids[k - 1])) for k in range(1, len(ids))]
    # Each request shares at least the first one's whole prompt (system prompt, tools, first
    # message) with the one before it; most resend the previous prompt whole, with the reply
    # after it. Claude Code's `--continue` rebuilds the history of cut answers shorter (the two
    # requests of this session that do not extend the previous one whole).
    assert min(shared) >= len(ids[0]), shared
    whole = sum(n == len(ids[k]) for k, n in enumerate(shared))
    assert whole == len(shared) if name == "codex" else whole >= len(shared) - 2, shared


def _common(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]
