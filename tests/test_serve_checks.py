"""``dflash serve`` refuses, at start, settings every request would be refused with.

A ``--kv-group-size`` that does not divide the target's head dimension, ``--kv-bits`` on a
target whose caches mlx-lm cannot quantize, a ``--draft-window`` shorter than the drafter's
block, a ``--block-size`` longer than the draft window: one line naming the option and exit 1,
before the port is bound (not a server that answers every request with a 400). The checks are
the engine's own (a one-token request with the server's settings), run once the pair is loaded.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from tiny_models import write_drafter, write_target

from dflash.errors import GenerationConfigError

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Targets with head dimension 32 (kv_group_size 32 divides it, 64 does not): one plain,
    one with sliding-window layers (mlx-lm's rotating caches); drafters of block size 8."""
    root = tmp_path_factory.mktemp("serve-checks")
    target = write_target(root / "target", "llama", hidden=128)
    swa = root / "swa"
    write_target(swa, "llama", hidden=128)
    cfg = json.loads((swa / "config.json").read_text())
    cfg.update(sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2)
    (swa / "config.json").write_text(json.dumps(cfg))
    return {"plain": (target, write_drafter(root / "draft", target)),
            "swa": (swa, write_drafter(root / "swa-draft", swa))}


# (pair, settings, what create_server names, the serve options)
REFUSED = [
    ("plain", {"kv_bits": 8, "kv_group_size": 64},
     r"^kv_group_size=64: does not divide target layer 0's head dimension 32",
     ["--kv-bits", "8", "--kv-group-size", "64"]),
    ("swa", {"kv_bits": 4}, r"^kv_bits=4: target layer 0 uses a rotating",
     ["--kv-bits", "4"]),
    ("plain", {"draft_window": 4}, r"^draft_window=4: must be at least the drafter's block size",
     ["--draft-window", "4"]),
    ("plain", {"draft_window": 8, "block_size": 12},
     r"^block_size=12: more than the draft window \(8 tokens\)",
     ["--draft-window", "8", "--block-size", "12"]),
]


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dflash-engine" and t.is_alive()]


@pytest.mark.parametrize("kind, settings, message, _", REFUSED)
def test_create_server_refuses_what_every_request_would_fail_on(pairs, kind, settings, message, _):
    from dflash.serving import create_server

    target, draft = pairs[kind]
    with pytest.raises(GenerationConfigError, match=message):
        create_server(str(target), str(draft), quiet=True, **settings)
    assert not engine_threads()  # the loader's thread has ended


def test_create_server_starts_with_settings_that_fit(pairs):
    """The same checks pass what the engine accepts: a group that divides the head dimension,
    a block as long as the window."""
    from dflash.serving import create_server

    target, draft = pairs["plain"]
    server = create_server(str(target), str(draft), quiet=True, kv_bits=8, kv_group_size=32,
                           draft_window=8, block_size=8)
    try:
        assert server.kv == {"kv_bits": 8, "kv_group_size": 32,
                             "quantized_kv_start": server.kv["quantized_kv_start"]}
    finally:
        server.worker.stop()


@pytest.mark.slow  # a dflash subprocess each
@pytest.mark.parametrize("kind, options, line", [
    ("plain", REFUSED[0][3], "--kv-group-size=64: does not divide target layer 0's head "
                             "dimension 32"),
    ("swa", REFUSED[1][3], "--kv-bits=4: target layer 0 uses a rotating"),
    ("plain", REFUSED[3][3], "--block-size=12: more than the draft window (8 tokens)"),
])
def test_cli_serve_refuses_before_binding_the_port(pairs, kind, options, line):
    """The real command: exit 1 and one line naming the option. The port is held by the test
    meanwhile, so a server that got as far as binding it would have failed otherwise ("address
    in use"), and it never announces that it serves."""
    target, draft = pairs[kind]
    env = dict(os.environ, PYTHONIOENCODING="utf-8", PYTHONUNBUFFERED="1")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "dflash", "serve", "--model", str(target), "--draft",
             str(draft), "--port", str(port), *options],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    errors = [s for s in proc.stderr.splitlines() if "error" in s]
    assert len(errors) == 1 and errors[0].startswith(f"dflash serve: error: {line}"), proc.stderr
    assert "serving `" not in proc.stderr and "Traceback" not in proc.stderr
    assert "address" not in proc.stderr.lower()
