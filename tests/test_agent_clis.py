"""Real agent CLIs from npm against ``dflash serve`` on the built-in pair (slow tier).

A new user's first try: Claude Code in print mode pointed at the server with
``ANTHROPIC_BASE_URL`` and an API key must answer and exit 0, and the server must have refused
nothing it sent (no 4xx in its access log: the ``HEAD /`` it sends first without its key, its
``max_tokens`` of 32,000 beyond the context, its newest request fields). Claude Code's own system
prompt and tool list do not fit the built-in target's 8,192 positions, hence ``--bare``,
``--system-prompt`` and ``--tools ""``. Tool-call round trips are tested through the SDKs
(test_server_agents.py). The CLIs are installed with npm under ``$DFLASH_HOME/npm`` (``.ci/run``
does it); without npm or a network the tests skip, saying why.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

KEY = "sk-dflash-agent-test"
NPM_TIMEOUT = 600


def agent_cli(package: str, binary: str) -> str:
    """The path of an npm CLI: ``$DFLASH_HOME/npm``'s, else one on PATH, else installed there
    now; skips the test when it cannot be had."""
    from dflash.default_pair import cache_dir

    prefix = cache_dir() / "npm"
    local = prefix / "node_modules" / ".bin" / binary
    if local.exists():
        return str(local)
    found = shutil.which(binary)
    if found:
        return found
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"`{binary}` is not installed and npm is not there to install {package}")
    try:
        r = subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                            package], capture_output=True, text=True, timeout=NPM_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.skip(f"npm install {package} took longer than {NPM_TIMEOUT} s")
    if not local.exists():
        pytest.skip(f"npm could not install {package}: {(r.stderr or r.stdout)[-400:]}")
    return str(local)


def cli_env(home: Path, **extra: str) -> dict:
    """A clean environment for an agent CLI: its own HOME, no telemetry, no vendor credentials
    of the machine's user."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_"))}
    home.mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(home), DISABLE_TELEMETRY="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
               NO_COLOR="1", **extra)
    return env


def refused(log: str) -> list[str]:
    """The access-log lines of requests the server answered with a 4xx."""
    return [line for line in log.splitlines() if re.search(r'HTTP/[0-9.]+" 4\d\d ', line)]


@pytest.fixture(scope="module")
def builtin_server(tmp_path_factory):
    """``dflash serve`` on the built-in pair with an API key, uvicorn's access log on."""
    from test_server import launch_server

    from dflash.default_pair import DEFAULT_TARGET_NAME, default_draft_path, default_target_path

    try:
        target = default_target_path()
    except Exception as e:  # no built-in target on this machine (scripts/setup.sh installs it)
        pytest.skip(f"the built-in target is not available: {e}")
    log = tmp_path_factory.mktemp("agents") / "server.log"
    with launch_server(target, default_draft_path(), log, "--api-key", KEY,
                       "--served-model-name", DEFAULT_TARGET_NAME, "--log-level", "info") as s:
        yield {**s, "model": DEFAULT_TARGET_NAME}


def test_claude_code_answers_in_print_mode(builtin_server, tmp_path):
    claude = agent_cli("@anthropic-ai/claude-code", "claude")
    env = cli_env(tmp_path / "home", ANTHROPIC_BASE_URL=builtin_server["base"],
                  ANTHROPIC_API_KEY=KEY)
    # (A 135M model asked to "Be brief." under Claude Code's preamble loops until the context
    # is full; asked for one sentence it answers one and ends its turn.)
    r = subprocess.run([claude, "-p", "Say hi", "--bare", "--system-prompt",
                        "Answer in one short sentence.", "--tools", "", "--model",
                        builtin_server["model"]],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
    log = Path(builtin_server["log"]).read_text()
    assert r.returncode == 0, f"stdout: {r.stdout}\nstderr: {r.stderr}\nserver log:\n{log}"
    assert r.stdout.strip(), r.stderr
    assert "POST /v1/messages" in log  # it did ask this server
    assert not refused(log), "\n".join(refused(log))
