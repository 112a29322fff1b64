"""Real agent CLIs from npm against ``dflash serve`` on the built-in pair (slow tier).

A new user's first try: Claude Code in print mode pointed at the server with
``ANTHROPIC_BASE_URL`` and an API key, and ``codex exec`` through a model provider speaking the
Responses API, must answer and exit 0, and the server must have refused nothing they sent (no
4xx in its access log: Claude Code's ``HEAD /`` without its key, its ``max_tokens`` of 32,000
beyond the context, the newest request fields of both). Claude Code's own system
prompt and tool list do not fit the built-in target's 8,192 positions, hence ``--bare``,
``--system-prompt`` and ``--tools ""``; Codex's are cut by its config (docs/agents.md, "Fitting
the built-in target"). Tool-call round trips are tested through the SDKs
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


def _first_request(cli, env: dict, cwd: Path) -> dict:
    """The body of the first POST an agent CLI makes to a stand-in server (which answers every
    POST with a 400, so that the CLI gives up at once). ``cli``: the command line, or a function
    of the stand-in's base URL that gives it (a CLI configured by a file)."""
    import http.server
    import json
    import threading

    bodies: list[dict] = []

    class Capture(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 (http.server's names)
            self.send_response(200)
            self.end_headers()

        def do_POST(self):  # noqa: N802
            raw = self.rfile.read(int(self.headers.get("content-length", 0)))
            if not bodies:
                bodies.append(json.loads(raw))
            body = b'{"type": "error", "error": {"type": "invalid_request_error", "message": "x"}}'
            self.send_response(400)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Capture)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        argv = cli(base) if callable(cli) else cli
        subprocess.run(argv, env={**env, "ANTHROPIC_BASE_URL": base}, cwd=cwd,
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    finally:
        server.shutdown()
        server.server_close()
    if not bodies:
        pytest.fail(f"{argv[0]} sent no request")
    return bodies[0]


def test_claude_codes_own_tool_list_validates(tmp_path):
    """Claude Code's full tool list (it does not fit the built-in target, so it is checked
    here without a model): every tool is a valid definition, its schema valid JSON Schema."""
    from dflash.serving.anthropic_format import _tools

    claude = agent_cli("@anthropic-ai/claude-code", "claude")
    env = cli_env(tmp_path / "home", ANTHROPIC_API_KEY=KEY)
    body = _first_request([claude, "-p", "Say hi", "--model", "dflash"], env, tmp_path)
    tools = body.get("tools") or []
    assert len(tools) >= 5, sorted(body)  # Read, Edit, Write, Bash, ...
    spec = _tools(tools, body.get("tool_choice"))
    assert [t["function"]["name"] for t in spec.tools] == [t["name"] for t in tools]


# ---------------------------------------------------------------------------------------------
# Codex (OpenAI's Responses API)


def test_codex_exec_answers_and_resumes_through_the_responses_api(builtin_server, tmp_path):
    codex = agent_cli("@openai/codex", "codex")
    home = tmp_path / "codex-home"
    home.mkdir()
    instructions = home / "instructions.md"
    instructions.write_text(CODEX_INSTRUCTIONS)
    (home / "config.toml").write_text(CODEX_CONFIG.format(
        model=builtin_server["model"], instructions=instructions, base=builtin_server["base"]))
    env = cli_env(tmp_path / "home", CODEX_HOME=str(home), DFLASH_API_KEY=KEY)
    log_path = Path(builtin_server["log"])
    before = log_path.read_text().count('"POST /v1/responses HTTP/1.1" 200')
    runs = []
    # A first turn, then the same session resumed: the second request replays the history
    # (Codex's own message items, ids and all) before the new prompt.
    for k, turn in enumerate((["Say hi"], ["resume", "--last", "Now say bye"])):
        last = tmp_path / f"last-message-{k}.txt"
        runs.append((last, subprocess.run(
            [codex, "exec", "--skip-git-repo-check", "--sandbox", "read-only", "--color",
             "never", "-C", str(tmp_path), "-o", str(last), *turn],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
            stdin=subprocess.DEVNULL)))
    log = log_path.read_text()
    for last, r in runs:
        report = (f"{r.args[-1]!r}: exit {r.returncode}\nstderr: {r.stderr[-3000:]}\n"
                  f"server log:\n{log}")
        assert r.returncode == 0, report
        assert last.read_text().strip(), report
    assert log.count('"POST /v1/responses HTTP/1.1" 200') - before == 2, log
    assert not refused(log), "\n".join(refused(log))


# Codex's own instructions (~21,000 characters) and tools (~19,000) make a first request of
# about 6,500 tokens on the built-in target: it fits 8,192 positions but leaves little for a
# second turn. These settings cut it to about 1,100: short instructions, no permissions or
# environment text, no web search, no shell, sub-agent, goal, app, plugin or image tools.
CODEX_INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence.\n"
CODEX_CONFIG = """\
model = "{model}"
model_provider = "dflash"
model_instructions_file = "{instructions}"
include_permissions_instructions = false
include_environment_context = false
web_search = "disabled"

[model_providers.dflash]
name = "dflash"
base_url = "{base}/v1"
wire_api = "responses"
env_key = "DFLASH_API_KEY"

[features]
shell_tool = false
goals = false
apps = false
plugins = false
image_generation = false
skill_search = false

[agents]
enabled = false
"""


def test_codexs_own_request_is_read_whole(tmp_path):
    """Codex's first request with its defaults (the built-in target runs it too slowly on a CPU
    to test with the model): its function tools are valid definitions and JSON Schema, its hosted
    tools are ignored, and the whole body makes a prompt that fits the built-in target."""
    from mlx_lm.utils import load_tokenizer

    from dflash.default_pair import default_target_path
    from dflash.serving.requests import ServedModel
    from dflash.serving.responses_format import parse_response_tools, parse_responses_request
    from dflash.serving.tools import tool_format

    codex = agent_cli("@openai/codex", "codex")
    home = tmp_path / "codex"
    home.mkdir()

    def argv(base: str) -> list[str]:  # the provider only: Codex's own defaults otherwise
        (home / "config.toml").write_text(
            'model = "dflash"\nmodel_provider = "dflash"\n\n[model_providers.dflash]\n'
            f'name = "dflash"\nbase_url = "{base}/v1"\nwire_api = "responses"\n'
            'env_key = "DFLASH_API_KEY"\n')
        return [codex, "exec", "--ephemeral", "--skip-git-repo-check", "--sandbox", "read-only",
                "Say hi"]

    env = cli_env(tmp_path / "home", CODEX_HOME=str(home), DFLASH_API_KEY=KEY)
    body = _first_request(argv, env, tmp_path)
    functions = [t["name"] for t in body.get("tools", ()) if t.get("type") == "function"]
    assert "exec_command" in functions, sorted(body)
    spec, _ = parse_response_tools(body["tools"], body.get("tool_choice"))
    assert [t["function"]["name"] for t in spec.tools] == functions
    try:
        target = default_target_path()
    except Exception as e:  # no built-in target on this machine
        pytest.skip(f"the built-in target is not available: {e}")
    tokenizer = load_tokenizer(Path(target))
    served = ServedModel(name="dflash", path=str(target), vocab_size=tokenizer.vocab_size,
                         max_context=8192, tool_format=tool_format(tokenizer))
    req = parse_responses_request(body, tokenizer, served)
    assert len(req.prompt_ids) < 8192 and req.store is None and req.stream
