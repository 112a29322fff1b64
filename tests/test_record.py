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
