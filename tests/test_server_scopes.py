"""API keys, and whose earlier text may speed up a request (``--share``), on the real server.

What one client sent or was sent must not make another client's request faster: the speed of an
answer would tell whether a guessed text was seen for someone else. With per-key scopes (the
default) key B's cycles and prefix-cache hits are the same whether or not key A sent the same
request before; with ``--share all`` they differ, which shows the comparison can see a leak.
Also: keys on every route but ``/health`` (OpenAI's and Anthropic's 401 shapes), the keys file,
and what agent clients send (a ``max_tokens`` beyond the context, fields this server does not
implement, tool schemas that are not JSON Schema).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from dflash.errors import APIError, ServerConfigError
from dflash.serving.requests import ServedModel, parse_request
from dflash.serving.scopes import ANONYMOUS, APIKeys, Scopes, read_keys_file, scope_name

KEY_A, KEY_B = "sk-alpha-0123456789", "sk-bravo-9876543210"
SERVED = ServedModel(name="tiny", path="/models/tiny", vocab_size=100, max_context=64,
                     default_max_tokens=16)


# ---------------------------------------------------------------------------------------------
# Without a model


def test_keys_match_in_either_header_and_name_their_scope():
    keys = APIKeys([KEY_A, KEY_B, KEY_A])
    assert len(keys) == 2
    b = keys.check(f"Bearer {KEY_B}", None)
    assert b == keys.check("bearer  " + KEY_B, "x") == scope_name(KEY_B)
    assert keys.check(None, KEY_A) == scope_name(KEY_A) != b
    # named by the key, not its place: a list in another order names the same scopes
    assert APIKeys([KEY_B, KEY_A]).check(None, KEY_A) == scope_name(KEY_A)
    assert KEY_A not in scope_name(KEY_A) and scope_name(KEY_A).startswith("key-")
    for auth, x in [(None, None), ("Bearer", None), (KEY_A, None), ("Basic " + KEY_A, None),
                    ("Bearer " + KEY_A[:-1], None), (None, KEY_A + "x"), (None, "")]:
        assert keys.check(auth, x) is None, (auth, x)
    assert APIKeys().check(None, None) == APIKeys([]).check("Bearer z", None) == ANONYMOUS
    with pytest.raises(ServerConfigError, match="--api-key"):
        APIKeys(["two words"])


def test_keys_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# operators\n\n{KEY_A}\n  {KEY_B}  \n#{KEY_A}x\n")
    assert read_keys_file(path) == [KEY_A, KEY_B]
    for text in ("", "\n# only a comment\n   \n"):
        path.write_text(text)
        with pytest.raises(ServerConfigError, match=f"--api-keys-file {path}: holds no key"):
            read_keys_file(path)
    with pytest.raises(ServerConfigError, match="no such file"):
        read_keys_file(tmp_path / "missing")


def test_scopes_per_key_shared_or_none():
    per_key = Scopes("key", 1000)
    a, b = per_key.get("key-0"), per_key.get("key-1")
    assert a is per_key.get("key-0") and a.index is not b.index
    assert a.prompt_cache is not b.prompt_cache and a.index.budget == 1000
    shared = Scopes("all")
    assert shared.get("key-0") is shared.get("key-1")
    none = Scopes("none").get("key-0")
    assert none.index is None and none.prompt_cache is None
    a.index.add(list(range(10)))
    assert per_key.index_tokens == 11  # ten and the separator
    for share, budget in [("some", 10), ("key", 0), ("key", -5), ("key", 2.5)]:
        with pytest.raises(ServerConfigError, match="--share" if share == "some"
                           else "--index-budget"):
            Scopes(share, budget)


def _completion(**fields):
    return parse_request("completions", {"model": "tiny", "prompt": [1, 2, 3], **fields},
                         tokenizer=None, served=SERVED)


def test_agent_clients_requests_are_accepted(capsys):
    # max_tokens beyond the room left (64 - 3 positions): the room.
    assert _completion(max_tokens=32000).settings.max_tokens == 61
    # Fields this server does not implement: ignored, said once per name.
    for _ in range(2):
        _completion(frobnicate_scopes_test={"x": 1}, context_management_scopes_test=None)
    err = capsys.readouterr().err
    assert err.count("`frobnicate_scopes_test`") == 1
    assert err.count("`context_management_scopes_test`") == 1
    # Known fields with bad values are still a 400 naming them.
    with pytest.raises(APIError) as e:
        _completion(max_tokens="many")
    assert e.value.param == "max_tokens"


def test_tool_schemas_must_be_json_schema():
    pytest.importorskip("jsonschema")
    from dflash.serving.requests import parse_checked_tools

    good = {"type": "object", "properties": {"path": {"type": "string"}},
            "required": ["path"], "additionalProperties": False,
            "$schema": "https://json-schema.org/draft/2020-12/schema"}
    tools = [{"type": "function", "function": {"name": "read", "parameters": good}},
             {"type": "function", "function": {"name": "write", "parameters": {
                 "type": "object", "properties": {"path": {"type": "strnig"}}}}}]
    assert parse_checked_tools(tools[:1], None) is not None
    with pytest.raises(APIError) as e:
        parse_checked_tools(tools, None)
    assert e.value.status == 400 and e.value.param == "tools[1].function.parameters"
    assert "'write'" in e.value.message and ".properties.path.type" in e.value.message


def test_open_host_warning_and_cli_errors(tmp_path):
    from dflash.serving.app import open_warning

    assert open_warning("0.0.0.0", APIKeys()) is not None
    assert open_warning("0.0.0.0", APIKeys([KEY_A])) is None
    assert all(open_warning(h, APIKeys()) is None for h in ("127.0.0.1", "localhost", "::1"))
    for args, words in [(["--api-keys-file", str(tmp_path / "nope")], f"{tmp_path / 'nope'}"),
                        (["--index-budget", "0"], "--index-budget 0")]:
        r = subprocess.run([sys.executable, "-m", "dflash", "serve", *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and words in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------
# The real server (slow)

PROMPT = ("Repeat this list exactly: alpha bravo charlie delta echo foxtrot golf hotel india "
          "juliett kilo lima mike november oscar papa quebec romeo sierra tango.")
SCOPE_STATS = ("cycles", "verified_tokens", "plain_steps", "lookup_cycles", "index_cycles",
               "reused_prompt_tokens", "acceptance_by_position")


def _ask(httpx, base: str, key: str, content: str = PROMPT, max_tokens: int = 48) -> dict:
    r = httpx.post(base + "/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": "tiny-target", "max_tokens": max_tokens, "temperature": 0,
                         "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.json()


def _b_after(tiny_pair, tmp_path, share: str, a_first: bool, *extra: str) -> dict:
    """Key B's answer to PROMPT on a fresh server, after key A sent the same (or nothing)."""
    httpx = pytest.importorskip("httpx")
    from test_server import KIND, launch_server

    target, draft = tiny_pair(KIND)
    log = tmp_path / f"{share}-{a_first}.log"
    with launch_server(target, draft, log, "--api-key", KEY_A, "--api-key", KEY_B,
                       "--share", share, *extra) as s:
        if a_first:
            _ask(httpx, s["base"], KEY_A)
        # What an agent's second turn looks like: the first turn's prefix, then more.
        b = _ask(httpx, s["base"], KEY_B)
        metrics = httpx.get(s["base"] + "/metrics", timeout=30,
                            headers={"x-api-key": KEY_B}).text
    stats = b["dflash"]
    return {"text": b["choices"][0]["message"]["content"],
            "cached": b["usage"]["prompt_tokens_details"]["cached_tokens"],
            "metrics": metrics, **{k: stats[k] for k in SCOPE_STATS}}


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", ["1", "2"])
def test_one_keys_text_never_speeds_up_anothers(tiny_pair, tmp_path, concurrency):
    pytest.importorskip("fastapi")
    extra = ("--max-concurrency", concurrency)
    alone = _b_after(tiny_pair, tmp_path, "key", False, *extra)
    after_a = _b_after(tiny_pair, tmp_path, "key", True, *extra)
    shared = _b_after(tiny_pair, tmp_path, "all", True, *extra)
    nobody = _b_after(tiny_pair, tmp_path, "none", True, *extra)
    assert alone["text"] == after_a["text"] == shared["text"] == nobody["text"]  # exact
    for name in (*SCOPE_STATS, "cached"):
        assert after_a[name] == alone[name], (name, alone, after_a)
        assert nobody[name] == alone[name], (name, alone, nobody)
    assert alone["cached"] == 0
    # The power of the comparison: a shared scope does reuse A's text.
    assert shared["cached"] > 0 and shared["reused_prompt_tokens"] == shared["cached"]
    assert alone["index_cycles"] == 0 < shared["index_cycles"]  # A's answer, verified for B
    assert [shared[k] for k in SCOPE_STATS] != [alone[k] for k in SCOPE_STATS]
    assert "dflash_index_tokens" in after_a["metrics"]
    assert "dflash_index_tokens 0.0" in nobody["metrics"]


@pytest.mark.slow
def test_keys_on_every_route_but_health(tiny_pair, tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    from test_server import KIND, MODEL_NAME, launch_server

    target, draft = tiny_pair(KIND)
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# the second key\n{KEY_B}\n")
    with launch_server(target, draft, tmp_path / "server.log", "--api-key", KEY_A,
                       "--api-keys-file", str(keys_file), "--max-concurrency", "1") as s:
        base = s["base"]
        assert httpx.get(base + "/health").status_code == 200
        msg = {"model": MODEL_NAME, "max_tokens": 4,
               "messages": [{"role": "user", "content": "Hi"}]}
        for method, path, body in [("GET", "/v1/models", None), ("GET", "/metrics", None),
                                   ("POST", "/v1/chat/completions", msg),
                                   ("POST", "/v1/completions", {"prompt": "Hi"}),
                                   ("POST", "/v1/messages", msg),
                                   ("POST", "/v1/messages/count_tokens", msg),
                                   ("GET", "/v1/nothing", None)]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": KEY_A + "x"}):
                r = httpx.request(method, base + path, json=body, headers=headers, timeout=60)
                assert r.status_code == 401, (path, headers, r.text)
                if path.startswith("/v1/messages"):
                    assert r.json()["error"]["type"] == "authentication_error"
                    assert r.json()["type"] == "error"
                else:
                    assert r.json()["error"]["code"] == "invalid_api_key"
        for headers in ({"Authorization": f"Bearer {KEY_A}"}, {"x-api-key": KEY_B}):
            assert httpx.get(base + "/metrics", headers=headers).status_code == 200
        # The official clients send their keys as their vendors' APIs expect.
        oa = openai.OpenAI(base_url=base + "/v1", api_key=KEY_B, max_retries=0)
        assert [m.id for m in oa.models.list().data] == [MODEL_NAME]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()
        an = anthropic.Anthropic(base_url=base, api_key=KEY_A, max_retries=0)
        assert an.messages.create(**msg).content[0].type == "text"
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=base, api_key="nope", max_retries=0).messages.create(
                **msg)

        # What agent clients send: their own max_tokens, their vendors' newest fields.
        headers = {"x-api-key": KEY_A}
        n = httpx.post(base + "/v1/messages/count_tokens", json=msg, headers=headers).json()
        long_msg = {**msg, "max_tokens": 32000, "context_management": {"edits": []},
                    "messages": [{"role": "user", "content": "Hi " * 4000}]}
        n_long = httpx.post(base + "/v1/messages/count_tokens", json=long_msg,
                            headers=headers).json()["input_tokens"]
        assert n["input_tokens"] < n_long < 4096 - 4  # the tiny target has 4,096 positions
        for _ in range(2):
            r = httpx.post(base + "/v1/messages", json=long_msg, headers=headers, timeout=120)
            assert r.status_code == 200, r.text
        answer = r.json()
        if answer["usage"]["output_tokens"] == 4096 - n_long:
            assert answer["stop_reason"] == "max_tokens"
        assert answer["usage"]["output_tokens"] <= 4096 - n_long
        r = httpx.post(base + "/v1/chat/completions", headers=headers, timeout=120, json={
            "model": MODEL_NAME, "max_completion_tokens": 32000, "reasoning_effort": "low",
            "messages": [{"role": "user", "content": "Hi " * 4000}]})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] in ("length", "stop")
        # ... while a known field with a bad value is still a 400 naming it,
        r = httpx.post(base + "/v1/messages", headers=headers, json={**msg, "max_tokens": "x"})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
        # and a tool whose input_schema is not JSON Schema is a 400 naming the tool.
        if _has("jsonschema"):
            bad_tool = {"name": "edit_file", "input_schema": {
                "type": "object", "properties": {"path": {"type": 7}}}}
            r = httpx.post(base + "/v1/messages", headers=headers,
                           json={**msg, "tools": [bad_tool]})
            assert r.status_code == 400 and "'edit_file'" in r.json()["error"]["message"]
            assert "tools.0.input_schema" in r.json()["error"]["message"]
    log = (tmp_path / "server.log").read_text()
    assert log.count("`context_management`") == 1, log


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True
