"""Replay recorded agent sessions against ``dflash serve`` and ``mlx_lm.server`` over HTTP.

Why: what an agent feels is each turn's first token and end-to-end time with the whole
conversation resent every turn, not decode speed alone. This starts both servers on the same
weights (dflash with the built-in drafter, mlx-lm with its defaults), sends each recorded
request to each with the official ``openai`` client (streamed, greedy), and prints per request
the time to first token, end to end, cached prompt tokens and the ratio, and checks that the
answers are identical; each server first answers one short request, so start-up work is not
turn 1's. Then, optionally, the last turn again (a retry), the last turn after a
restart of dflash with ``--prompt-cache-dir``, and cold prompts of chosen lengths.

Sessions are ``requests.jsonl`` files written by ``dflash serve --record DIR``; ``--make NAME``
records one of the scripted sessions (``edit-file``: four turns each returning an edited file;
``interleaved``: a main agent and a sub-agent sharing a system prompt, turns interleaved).

    python benchmarks/replay.py --session benchmarks/sessions/edit-file.jsonl --retry --restart
    python benchmarks/replay.py --cold 512,2048,8000
    python benchmarks/replay.py --make edit-file --out benchmarks/sessions/edit-file.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash.default_pair import default_target_path  # noqa: E402
from dflash.serving.record import read_session  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(kind: str, model: Path, log: Path, *extra: str):
    """``dflash serve`` (kind ``dflash``) or ``mlx_lm.server`` on a free port; its base URL."""
    port = free_port()
    if kind == "dflash":
        cmd = [sys.executable, "-m", "dflash", "serve", "--port", str(port),
               "--log-level", "warning", *extra]
    else:
        # the BLAS dflash binds (dflash.backend.configure), so both servers multiply alike: with
        # the Linux wheel's reference BLAS mlx_lm.server took 45 s for a 508-token cold prompt
        # that dflash answered in 2.1 s
        boot = ("import sys, runpy, dflash.backend as b; b.configure(); "
                "sys.argv = ['mlx_lm.server'] + sys.argv[1:]; "
                "runpy.run_module('mlx_lm.server', run_name='__main__')")
        cmd = [sys.executable, "-c", boot, "--model", str(model), "--port", str(port), *extra]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{kind} exited:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                    break
            if time.time() > deadline:
                raise SystemExit(f"{kind} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def ask(base: str, body: dict, model: str = "default") -> dict:
    """One chat request, streamed: first-token and end-to-end seconds, the text, usage
    (``model``: what mlx_lm.server is asked for, its loaded folder, or it loads another)."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=600, max_retries=0)
    fields = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "model")}
    fields["temperature"] = 0
    tic = time.perf_counter()
    first, text, usage = None, [], None
    stream = client.chat.completions.create(model=model, stream=True,
                                            stream_options={"include_usage": True}, **fields)
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content or ""
            if piece and first is None:
                first = time.perf_counter() - tic
            text.append(piece)
    total = time.perf_counter() - tic
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    return {"ttft": first if first is not None else total, "e2e": total, "text": "".join(text),
            "prompt_tokens": getattr(usage, "prompt_tokens", None),
            "completion_tokens": getattr(usage, "completion_tokens", None),
            "cached": getattr(details, "cached_tokens", None) if details is not None else None}


def ask_responses(base: str, body: dict, max_tokens: int) -> dict:
    """One Responses request as its client sent it, streamed, greedy, at most ``max_tokens``
    out (Codex sends no limit: the answer could run to the end of the context)."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=600, max_retries=0)
    # Fields as the client sent them (some newer than this SDK: sent as they are)
    fields = {k: v for k, v in body.items() if k not in ("stream", "model", "input")}
    fields.update(temperature=0, max_output_tokens=max_tokens)
    tic = time.perf_counter()
    first, text, usage = None, [], None
    for event in client.responses.create(model="default", stream=True, input=body["input"],
                                         extra_body=fields):
        if event.type == "response.output_text.delta" and event.delta:
            first = time.perf_counter() - tic if first is None else first
            text.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete"):
            usage = event.response.usage
    total = time.perf_counter() - tic
    return {"ttft": first if first is not None else total, "e2e": total, "text": "".join(text),
            "prompt_tokens": usage.input_tokens, "completion_tokens": usage.output_tokens,
            "cached": usage.input_tokens_details.cached_tokens}


def ask_messages(base: str, body: dict, max_tokens: int) -> dict:
    """One Anthropic Messages request as its client sent it, streamed, greedy (``max_tokens``
    at most: the recorded one, or less)."""
    from anthropic import Anthropic

    client = Anthropic(base_url=base, api_key="unused", timeout=600, max_retries=0)
    fields = {k: v for k, v in body.items()
              if k not in ("stream", "model", "max_tokens", "messages")}
    fields["temperature"] = 0
    tic = time.perf_counter()
    first, text = None, []
    with client.messages.stream(model="default", max_tokens=min(max_tokens, body["max_tokens"]),
                                messages=body["messages"], extra_body=fields) as stream:
        for piece in stream.text_stream:
            if piece and first is None:
                first = time.perf_counter() - tic
            text.append(piece)
        usage = stream.get_final_message().usage
    total = time.perf_counter() - tic
    cached = usage.cache_read_input_tokens or 0
    return {"ttft": first if first is not None else total, "e2e": total, "text": "".join(text),
            "prompt_tokens": usage.input_tokens + cached, "completion_tokens": usage.output_tokens,
            "cached": cached}


def ask_completion(base: str, prompt: str, max_tokens: int, model: str) -> dict:
    """The prompt text a request renders to, as a streamed, greedy ``/v1/completions``."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=600, max_retries=0)
    tic = time.perf_counter()
    first, text, usage = None, [], None
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.text and first is None:
                first = time.perf_counter() - tic
            text.append(choice.text or "")
    total = time.perf_counter() - tic
    details = getattr(usage, "prompt_tokens_details", None)
    return {"ttft": first if first is not None else total, "e2e": total, "text": "".join(text),
            "prompt_tokens": getattr(usage, "prompt_tokens", None),
            "completion_tokens": getattr(usage, "completion_tokens", None),
            "cached": getattr(details, "cached_tokens", None)}


def rendered_prompt(endpoint: str, body: dict, tokenizer, target: Path) -> str:
    """The prompt text dflash's ``/v1/responses`` or ``/v1/messages`` renders ``body`` to (its
    instructions, tools and history through the chat template): mlx_lm.server has neither
    endpoint, so it gets this text as a completion. Checked to encode back to the same ids."""
    from dflash.serving.anthropic_format import parse_messages_request
    from dflash.serving.reasoning import think_tags
    from dflash.serving.requests import ServedModel
    from dflash.serving.responses_format import parse_responses_request
    from dflash.serving.tools import tool_format

    served = ServedModel(name="default", path=str(target), vocab_size=len(tokenizer.vocab),
                         max_context=None, think_tags=think_tags(tokenizer),
                         tool_format=tool_format(tokenizer))
    parse = parse_messages_request if endpoint == "messages" else parse_responses_request
    ids = parse(dict(body, model="default"), tokenizer, served).prompt_ids
    text = tokenizer.decode(ids)
    if tokenizer.encode(text) != list(ids):
        raise SystemExit("the rendered prompt does not encode back to its token ids: "
                         "mlx_lm.server would see another prompt")
    return text


def replay(base: str, requests: list[dict], model: str = "default", *,
           max_tokens: int = 200, prompts: list[str | None] | None = None) -> list[dict]:
    """Each request in turn: chat requests as sent; Responses and Messages requests as sent to
    dflash (``model == "default"``) and as their rendered ``prompts`` to mlx_lm.server."""
    out = []
    for k, r in enumerate(requests):
        if r["endpoint"] == "chat":
            out.append(ask(base, r["body"], model))
        elif model != "default":
            out.append(ask_completion(base, prompts[k], min(max_tokens, r["body"].get(
                "max_tokens", max_tokens)), model))
        elif r["endpoint"] == "messages":
            out.append(ask_messages(base, r["body"], max_tokens))
        else:
            out.append(ask_responses(base, r["body"], max_tokens))
    return out


def rendered_prompts(requests: list[dict], target: Path) -> list[str | None]:
    """Per request, the prompt text mlx_lm.server gets for it (``None``: a chat request, sent
    as it is)."""
    if all(r["endpoint"] == "chat" for r in requests):
        return [None] * len(requests)
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(target)
    return [None if r["endpoint"] == "chat" else
            rendered_prompt(r["endpoint"], r["body"], tokenizer, target) for r in requests]


def cold_prompts(lengths: list[int]) -> list[dict]:
    """One request per length: a long user message of about that many tokens (unrelated text
    from the standard library's documentation, a different stretch each time: never cached),
    then a question; one token out, so the time is the prefill's."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from dflash.contexts import filler_text
    from dflash.default_pair import default_target_path

    tokenizer = load_tokenizer(default_target_path())
    ids = tokenizer.encode(filler_text())
    out, start = [], 0
    for n in lengths:
        text = tokenizer.decode(ids[start:start + n - 40])
        start += n
        out.append({"body": {"messages": [{"role": "user", "content": text + "\n\nSummarise."}],
                             "max_tokens": 1}, "length": n})
    return out


# Sent to each server once before what is measured: start-up work (first-call compilation,
# buffer allocation) is neither server's first turn.
WARM_UP = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 1}


def cold_rows(target: Path, tmp: Path, lengths: list[int]) -> list[dict]:
    """Each server started fresh, warmed by one short request (start-up work is not the
    prefill's), then sent each cold prompt; a line per prompt as soon as both have answered."""
    prompts = cold_prompts(lengths)
    ours, rows = [], []
    with server("dflash", target, tmp / "dflash-cold.log") as base:
        ask(base, WARM_UP)
        for r in prompts:
            ours.append(ask(base, r["body"]))
            print(f"dflash cold {r['length']}: first token {ours[-1]['ttft']:.2f} s", flush=True)
    with server("mlx", target, tmp / "mlx-cold.log") as base:
        ask(base, WARM_UP, str(target))
        for r, d in zip(prompts, ours):
            rows.append(row(f"cold {r['length']}", d, ask(base, r["body"], str(target))))
            print(f"mlx_lm cold {r['length']}: first token {rows[-1]['mlx_ttft']:.2f} s",
                  flush=True)
    print("\ncold prompts (one token out: the first token is the prefill)")
    show(rows)
    return rows


def row(name: str, d: dict, m: dict) -> dict:
    return {"request": name, "dflash_ttft": d["ttft"], "mlx_ttft": m["ttft"],
            "dflash_e2e": d["e2e"], "mlx_e2e": m["e2e"], "dflash_cached": d["cached"],
            "mlx_cached": m["cached"], "prompt_tokens": d["prompt_tokens"],
            "tokens": d["completion_tokens"], "same": d["text"] == m["text"],
            "e2e_ratio": m["e2e"] / d["e2e"], "ttft_ratio": d["ttft"] / m["ttft"]}


def show(rows: list[dict]) -> None:
    print(f"{'request':<22}{'prompt':>7}{'out':>5}{'cached d/m':>13}{'ttft d':>8}{'ttft m':>8}"
          f"{'ttft d/m':>9}{'e2e d':>8}{'e2e m':>8}{'speed-up':>9}  same")
    for r in rows:
        cached = f"{r['dflash_cached']}/{r['mlx_cached']}"
        print(f"{r['request']:<22}{r['prompt_tokens'] or 0:>7}{r['tokens'] or 0:>5}{cached:>13}"
              f"{r['dflash_ttft']:>8.2f}{r['mlx_ttft']:>8.2f}{r['ttft_ratio']:>8.2f}x"
              f"{r['dflash_e2e']:>8.2f}{r['mlx_e2e']:>8.2f}{r['e2e_ratio']:>8.2f}x  "
              f"{'yes' if r['same'] else 'NO'}")
    if rows:
        d = sum(r["dflash_e2e"] for r in rows)
        m = sum(r["mlx_e2e"] for r in rows)
        print(f"{'all':<22}{'':>33}{'':>8}{'':>8}{'':>9}{d:>8.2f}{m:>8.2f}{m / d:>8.2f}x")


# -- scripted sessions ---------------------------------------------------------------------------

FILE = '''def parse(line):
    parts = line.split(",")
    name = parts[0].strip()
    count = int(parts[1])
    return name, count


def total(lines):
    result = 0
    for line in lines:
        name, count = parse(line)
        result += count
    return result


def report(lines):
    for line in lines:
        name, count = parse(line)
        print(name, count)
'''
EDITS = ["Rename `result` to `sum_of_counts`.", "Add a docstring to `parse`.",
         "Make `report` print the total at the end.", "Add type hints to every function."]
SYSTEM = ("You are a careful coding agent working in a repository. Tools: read_file, "
          "edit_file, run_tests. When asked to edit a file, answer with the whole edited file "
          "in one fenced code block and nothing else.")


def make_session(name: str, out: Path, max_tokens: int) -> None:
    from openai import OpenAI

    with tempfile.TemporaryDirectory() as tmp, \
            server("dflash", default_target_path(), Path(tmp) / "serve.log",
                   "--record", tmp) as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

        def turn(messages: list[dict]) -> str:
            r = client.chat.completions.create(model="default", messages=messages,
                                               temperature=0, max_tokens=max_tokens)
            return r.choices[0].message.content or ""

        convs = {"main": [{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": f"Here is stats.py:\n```python\n{FILE}```\n"
                                                      f"{EDITS[0]}"}]}
        if name == "interleaved":
            convs["sub"] = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": "Summarise what stats.py does:\n"
                                                        f"```python\n{FILE}```"}]
        asks = {"main": EDITS[1:], "sub": ["Which function would you test first?",
                                           "Write that test."]}
        for k in range(len(EDITS) if name == "edit-file" else 3):
            for who, messages in convs.items():
                reply = turn(messages)
                if k < len(asks[who]):
                    messages += [{"role": "assistant", "content": reply},
                                 {"role": "user", "content": asks[who][k]}]
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(tmp) / "requests.jsonl", out)
    print(f"recorded {sum(1 for _ in out.open())} requests in {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--session", action="append", default=[], help="a recorded requests.jsonl")
    p.add_argument("--retry", action="store_true", help="send the last request again")
    p.add_argument("--restart", action="store_true",
                   help="then restart dflash with --prompt-cache-dir and send the last request")
    p.add_argument("--cold", default=None, help="cold prompts of these lengths, e.g. 512,2048")
    p.add_argument("--make", choices=["edit-file", "interleaved"], default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--max-tokens", type=int, default=200,
                   help="tokens out for --make, and for Responses requests (Codex sends no limit)")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = p.parse_args()
    if args.make:
        make_session(args.make, args.out or ROOT / f"benchmarks/sessions/{args.make}.jsonl",
                     args.max_tokens)
        return
    target = default_target_path()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache_dir = tmp / "prompt-cache"
        for path in args.session:
            requests = [r for r in read_session(path) if r["endpoint"] in ("chat", "responses", "messages")]
            prompts = rendered_prompts(requests, target)
            names = [f"turn {i + 1}" for i in range(len(requests))]
            if args.retry:
                requests, names = requests + requests[-1:], names + ["retry of the last"]
            with server("dflash", target, tmp / "dflash.log",
                        "--prompt-cache-dir", str(cache_dir)) as base:
                ask(base, WARM_UP)
                ours = replay(base, requests, max_tokens=args.max_tokens)
            with server("mlx", target, tmp / "mlx.log") as base:
                ask(base, WARM_UP, str(target))
                theirs = replay(base, requests, str(target), max_tokens=args.max_tokens,
                                prompts=prompts)
            rows = [row(n, d, m) for n, d, m in zip(names, ours, theirs)]
            if args.restart:
                with server("dflash", target, tmp / "dflash2.log",
                            "--prompt-cache-dir", str(cache_dir)) as base:
                    again = replay(base, requests[-1:], max_tokens=args.max_tokens)[0]
                warm = theirs[len(requests) - (2 if args.retry else 1)]
                rows.append(row("last, after restart", again, warm))
            print(f"\n{path}")
            show(rows)
            results[str(path)] = rows
        if args.cold:
            results["cold"] = cold_rows(target, tmp, [int(n) for n in args.cold.split(",")])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
