"""Soak test of `dflash serve`: many clients at once, disconnects, malformed requests, exactness.

Starts a real server on localhost (the built-in pair unless ``--model``/``--draft``), or uses one
already running (``--url``, with ``--pid`` to watch its memory), and runs ``--clients`` threads for
``--duration`` seconds. Each thread sends requests through the official ``openai`` and
``anthropic`` clients: held-out questions (the shipped ``heldout-mix`` set), greedy, mixed
``max_tokens``, streamed and not, on chat, completions and messages. Some clients leave mid-way
(a stream closed after a few chunks, a non-streamed request given up after a short timeout), and
some requests are malformed (bad JSON, bad fields, broken tools schemas, unknown Anthropic fields,
an oversize body; a few from each client, and one more client sends only those) and must get the
4xx the server documents.

Afterwards every completed response is checked against the same request run alone through the
library (``dflash.model_mlx.generate``, one reference per distinct prompt and ``max_tokens``, computed in
this process after the load so it does not compete with the server): same text, same number of
tokens, same finish reason; a stream the client closed must be a prefix of its reference. The
server's RSS is sampled all along (psutil if installed, else /proc/PID/status); after a settling
time (``--settle``, a quarter of the run: the prompt cache and MLX's buffer pool reach their working
size) the last quartile of the samples must not rise above the first quartile's high-water mark
by more than ``--max-growth`` (see ``memory_growth``).

The server's continuation indexes (earlier prompts and answers, one per scope) are read from
``/metrics`` (``dflash_index_tokens``, ``dflash_index_bytes``, ``dflash_index_scopes``) every few
seconds. The soak's own server gets a small ``--index-budget`` so that the run fills it many times
over; the tokens must never exceed the budget (times the scopes), the index must reach it (or the
run tested nothing) and its bytes must not grow once it is full (see ``index_check``).

Exit status 1 on any 5xx, unexpected error, server crash (exit, traceback in its log), inexact
response, memory growth above ``--max-growth`` or an index past its budget; the summary table
goes to stdout.

    python benchmarks/soak.py                      # 16 clients, 300 s, the built-in pair
    python benchmarks/soak.py --quick              # 4 clients, 30 s
    python benchmarks/soak.py --url http://127.0.0.1:8080 --pid 1234 --clients 8 --duration 120
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import anthropic
import httpx
import openai

from dflash.console import log
from dflash.prompts import prompt_file

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = prompt_file("heldout-mix")
MAX_BODY_BYTES = 32 * 1024 * 1024  # = dflash.serving.app.MAX_BODY_BYTES (not imported: no FastAPI)
FINISH = {"max_tokens": "length", "end_turn": "stop", "stop_sequence": "stop"}  # Anthropic's


@dataclass
class Outcome:
    """One request of the soak and what came back."""

    api: str  # "chat", "completions", "messages" or "malformed"
    stream: bool = False
    key: tuple | None = None  # (prompt form, question index, max_tokens): the reference to match
    outcome: str = ""  # completed, cancelled, 4xx, 429, 5xx, error
    text: str = ""
    tokens: int | None = None
    finish: str | None = None
    ttft: float | None = None  # seconds from sending to the first text (streams)
    detail: str = ""


@dataclass
class Summary:
    clients: int
    duration: float
    url: str
    counts: dict = field(default_factory=dict)  # api -> outcome -> n
    exact: int = 0
    inexact: list = field(default_factory=list)
    prefixes_checked: int = 0
    references: int = 0
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    rss_first_mib: float | None = None
    rss_last_mib: float | None = None
    rss_growth: float | None = None
    rss_samples: int = 0
    rss_peak_mib: float | None = None  # the high-water mark up to the first quartile's end
    rss_mean_growth: float | None = None  # last quartile's mean over the first's
    rss_mib: list = field(default_factory=list)  # (seconds since the start, MiB) per sample
    index_budget: int | None = None  # tokens per scope's index (None: not known, --url)
    index_full_bytes: float | None = None  # the indexes' bytes when they first held the budget
    index_last_tokens: float | None = None
    index_last_bytes: float | None = None
    index_max_tokens: float | None = None
    index_max_bytes: float | None = None
    index_samples: list = field(default_factory=list)  # (seconds, tokens, bytes, scopes)
    server_statuses: dict = field(default_factory=dict)
    server_cancelled: float | None = None
    failures: list = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# The server and its memory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def started_server(args, log_path: Path):
    """``dflash serve`` in a subprocess on a free port; yields ``(url, process)``."""
    port = free_port()
    cmd = [sys.executable, "-m", "dflash", "serve", "--port", str(port), "--log-level",
           "warning", "--reasoning", "off"]  # off: the whole answer is `content`, as generated
    if args.model:
        cmd += ["--model", args.model]
    if args.draft:
        cmd += ["--draft", args.draft]
    if args.index_budget:
        cmd += ["--index-budget", str(args.index_budget)]
    cmd += shlex.split(args.serve_args)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    with log_path.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"soak: the server exited with {proc.returncode}:\n"
                                 + log_path.read_text())
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit("soak: the server did not start:\n" + log_path.read_text())
            time.sleep(0.5)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def rss_bytes(pid: int) -> int | None:
    """Resident memory of process ``pid`` (None once it is gone)."""
    try:
        import psutil
    except ImportError:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None


class MemorySampler(threading.Thread):
    """Samples the server's RSS every ``every`` seconds until ``stop`` is set."""

    def __init__(self, pid: int, every: float):
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            rss = rss_bytes(self.pid)
            if rss is not None:
                self.samples.append((time.monotonic(), rss))
            self.stop.wait(self.every)


class IndexSampler(threading.Thread):
    """Reads the server's index gauges from ``/metrics`` every ``every`` seconds until ``stop``
    is set: ``(time, tokens, bytes, scopes)`` per sample."""

    def __init__(self, url: str, every: float):
        super().__init__(daemon=True)
        self.url, self.every = url, every
        self.samples: list[tuple[float, float, float, float]] = []
        self.stop = threading.Event()

    def sample(self) -> None:
        with contextlib.suppress(httpx.HTTPError):
            gauges = index_gauges(httpx.get(self.url + "/metrics", timeout=30).text)
            if gauges is not None:
                self.samples.append((time.monotonic(), *gauges))

    def run(self) -> None:
        while not self.stop.wait(self.every):
            self.sample()


def index_gauges(metrics: str) -> tuple[float, float, float] | None:
    """``(tokens, bytes, scopes)`` of the continuation indexes in a ``/metrics`` text (None: a
    server that does not export them)."""
    found = {}
    for line in metrics.splitlines():
        name, _, value = line.partition(" ")
        if name in ("dflash_index_tokens", "dflash_index_bytes", "dflash_index_scopes"):
            found[name] = float(value)
    if len(found) < 3:
        return None
    return found["dflash_index_tokens"], found["dflash_index_bytes"], found["dflash_index_scopes"]


def index_check(samples: list[tuple[float, float, float, float]],
                budget: int | None) -> tuple[dict, list[str]]:
    """What the index samples show, and the failures: tokens over ``budget`` per scope, an index
    that never filled (the run did not reach its bound), bytes that grew after it was full (with
    as many scopes as then), or no samples at all. ``budget`` None: the tokens are not checked."""
    if not samples:
        return {}, ["no continuation index figures in /metrics"]
    failures = []
    facts = {"last_tokens": samples[-1][1], "last_bytes": samples[-1][2],
             "max_tokens": max(s[1] for s in samples), "max_bytes": max(s[2] for s in samples)}
    if budget is not None:
        over = [(tokens, scopes) for _, tokens, _, scopes in samples if tokens > budget * scopes]
        if over:
            failures.append(f"the continuation indexes held {over[0][0]:.0f} tokens in "
                            f"{over[0][1]:.0f} scope(s), over the budget of {budget} per scope")
    full = [s for s in samples if budget is not None and s[3] > 0 and s[1] >= budget * s[3]]
    if budget is not None and not full:
        failures.append(f"the continuation index never reached its budget ({budget} tokens; "
                        f"at most {facts['max_tokens']:.0f}): the run did not test its bound")
    # Once full, an index takes what it holds: its bytes must not grow (new scopes add theirs).
    start = full[0] if full else samples[0]
    facts["full_bytes"] = start[2]
    per_scope = start[2] / max(start[3], 1)
    later = [s for s in samples if s[0] >= start[0]]
    grew = [s for s in later if s[2] > per_scope * max(s[3], 1)]
    if grew:
        failures.append(f"the continuation indexes grew from {per_scope:.0f} bytes per scope "
                        f"to {grew[0][2] / max(grew[0][3], 1):.0f} after filling")
    return facts, failures


def memory_growth(samples: list[tuple[float, int]], settled: float) -> dict | None:
    """Quartiles of the RSS samples taken after ``settled`` (a time): the means of the first and
    the last, and ``growth``, the last quartile's mean over the first's high-water mark (settling
    samples included).

    A working set that reaches its size in bursts (the KV cache of the longest answer yet, MLX's
    buffer pool) touches its peak early and falls back between requests, so a mean of the first
    quartile understates it; a leak shows as a last quartile above every earlier peak.
    """
    after = [r for t, r in samples if t >= settled]
    if len(after) < 4:
        return None
    q = len(after) // 4
    end_first = len(samples) - len(after) + q
    peak = max(r for _, r in samples[:end_first])
    first, last = statistics.fmean(after[:q]), statistics.fmean(after[-q:])
    return {"first": first, "last": last, "peak": peak, "mean_growth": (last - first) / first,
            "growth": (last - peak) / peak, "samples": len(after)}


# ---------------------------------------------------------------------------------------------
# Requests


def load_questions(path: Path) -> list[str]:
    text = prompt_file(path).read_text()
    return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]


def messages_of(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def malformed_cases(model: str) -> list[tuple[str, str, object, int]]:
    """``(name, path, body, expected status)``; ``body`` bytes are sent as they are."""
    chat = {"model": model, "messages": messages_of("Hi"), "max_tokens": 4}
    msg = {"model": model, "max_tokens": 4, "messages": messages_of("Hi")}
    array_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    return [
        ("bad json", "/v1/chat/completions", b'{"model": "x", "messages": [', 400),
        ("not an object", "/v1/chat/completions", b"[1, 2, 3]", 400),
        ("not utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400),
        ("max_tokens a string", "/v1/chat/completions", {**chat, "max_tokens": "ten"}, 400),
        ("negative temperature", "/v1/chat/completions", {**chat, "temperature": -1}, 400),
        ("top_p 0, streamed", "/v1/chat/completions", {**chat, "top_p": 0, "stream": True}, 400),
        ("unknown model", "/v1/chat/completions", {**chat, "model": "no-such-model"}, 404),
        ("empty messages", "/v1/chat/completions", {**chat, "messages": []}, 400),
        ("max_tokens zero", "/v1/chat/completions", {**chat, "max_tokens": 0}, 400),
        ("token id outside the vocabulary", "/v1/completions",
         {"model": model, "prompt": [10**9], "max_tokens": 4}, 400),
        ("tools schema not an object", "/v1/chat/completions", {**chat, "tools": [array_schema]},
         400),
        ("tool without a name", "/v1/chat/completions",
         {**chat, "tools": [{"type": "function", "function": {"name": ""}}]}, 400),
        ("unknown tool_choice", "/v1/chat/completions",
         {**chat, "tools": [weather], "tool_choice": "always"}, 400),
        # Unknown fields are accepted and ignored (as real clients send them); a known one with
        # a bad value is not.
        ("anthropic temperature above 1", "/v1/messages", {**msg, "temperature": 1.5}, 400),
        ("anthropic without max_tokens", "/v1/messages",
         {k: v for k, v in msg.items() if k != "max_tokens"}, 400),
        ("anthropic image block", "/v1/messages", {**msg, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {}}]}]}, 400),
        ("anthropic tools schema", "/v1/messages",
         {**msg, "tools": [{"name": "f", "input_schema": {"type": "string"}}]}, 400),
        ("oversize body", "/v1/chat/completions", None, 413),  # built once, when first drawn
    ]


class Client:
    """One soak client: its own connections, random choices and a shared list of outcomes."""

    def __init__(self, index: int, url: str, model: str, questions: list[str], args,
                 outcomes: list[Outcome], lock: threading.Lock, oversize: dict):
        self.rng = random.Random(args.seed * 1000 + index)
        self.url, self.model, self.questions, self.args = url, model, questions, args
        self.outcomes, self.lock, self.oversize = outcomes, lock, oversize
        self.openai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                    timeout=args.request_timeout)
        self.anthropic = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0,
                                             timeout=args.request_timeout)
        self.http = httpx.Client(timeout=args.request_timeout)
        self.cases = malformed_cases(model)

    def run(self, end: float) -> None:
        while time.monotonic() < end:
            rng = self.rng
            if rng.random() < self.args.malformed_rate:
                out = self.malformed(*rng.choice(self.cases))
            else:
                api = rng.choices(("chat", "completions", "messages"), (0.45, 0.2, 0.35))[0]
                out = self.request(api, rng.randrange(len(self.questions)),
                                   rng.choice(self.args.max_tokens), rng.random() < 0.5)
            with self.lock:
                self.outcomes.append(out)

    def run_malformed(self, end: float) -> None:
        """Malformed requests only, every ``--malformed-every`` seconds: they arrive while the
        other clients' generations queue and run, however slow those are."""
        while time.monotonic() < end:
            out = self.malformed(*self.rng.choice(self.cases))
            with self.lock:
                self.outcomes.append(out)
            time.sleep(self.args.malformed_every)

    def malformed(self, name: str, path: str, body, expected: int) -> Outcome:
        out = Outcome("malformed", detail=name)
        if body is None:
            with self.lock:  # 32 MiB, built once and shared
                if "body" not in self.oversize:
                    self.oversize["body"] = json.dumps(
                        {"model": self.model, "messages": messages_of("x" * MAX_BODY_BYTES)}
                    ).encode()
            body = self.oversize["body"]
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            resp = self.http.post(self.url + path, content=content,
                                  headers={"content-type": "application/json"})
        except httpx.HTTPError as e:
            out.outcome, out.detail = "error", f"{name}: {type(e).__name__}: {e}"
            return out
        if resp.status_code >= 500:
            out.outcome, out.detail = "5xx", f"{name}: {resp.status_code} {resp.text[:200]}"
        elif resp.status_code != expected:
            out.outcome = "error"
            out.detail = f"{name}: expected {expected}, got {resp.status_code} {resp.text[:200]}"
        else:
            out.outcome = "4xx"
        return out

    def request(self, api: str, qi: int, max_tokens: int, stream: bool) -> Outcome:
        form = "text" if api == "completions" else "chat"
        out = Outcome(api, stream=stream, key=(form, qi, max_tokens))
        rng, question = self.rng, self.questions[qi]
        # A client that leaves: a stream closed after a few chunks, or a non-streamed request
        # given up after a short timeout (while it queues or generates).
        leave_after = rng.randint(1, 6) if stream and rng.random() < self.args.disconnect_rate \
            else None
        timeout = rng.uniform(0.2, 3.0) if not stream and \
            rng.random() < self.args.disconnect_rate / 2 else None
        tic = time.monotonic()
        try:
            if stream:
                self.streamed(out, api, question, max_tokens, leave_after, tic)
            else:
                self.whole(out, api, question, max_tokens, timeout)
        except (openai.APITimeoutError, anthropic.APITimeoutError):
            if timeout is None:
                out.outcome, out.detail = "error", f"timed out after {time.monotonic() - tic:.0f} s"
            else:
                out.outcome = "cancelled"
        except (openai.APIStatusError, anthropic.APIStatusError) as e:
            status = e.status_code
            out.outcome = "5xx" if status >= 500 else "429" if status == 429 else "error"
            out.detail = f"{status}: {e.message}"
        except (openai.APIError, anthropic.APIError, httpx.HTTPError) as e:
            out.outcome, out.detail = "error", f"{type(e).__name__}: {e}"
        return out

    def whole(self, out: Outcome, api: str, question: str, max_tokens: int,
              timeout: float | None) -> None:
        kw = {"timeout": timeout} if timeout is not None else {}
        if api == "chat":
            r = self.openai.chat.completions.create(
                model=self.model, messages=messages_of(question), max_tokens=max_tokens,
                temperature=0, **kw)
            out.text, out.finish = r.choices[0].message.content or "", r.choices[0].finish_reason
            out.tokens = r.usage.completion_tokens
        elif api == "completions":
            r = self.openai.completions.create(model=self.model, prompt=question,
                                               max_tokens=max_tokens, temperature=0, **kw)
            out.text, out.finish = r.choices[0].text, r.choices[0].finish_reason
            out.tokens = r.usage.completion_tokens
        else:
            r = self.anthropic.messages.create(model=self.model, max_tokens=max_tokens,
                                               messages=messages_of(question), **kw)
            out.text = "".join(b.text for b in r.content if b.type == "text")
            out.finish, out.tokens = FINISH.get(r.stop_reason, r.stop_reason), \
                r.usage.output_tokens
        out.outcome = "completed"

    def streamed(self, out: Outcome, api: str, question: str, max_tokens: int,
                 leave_after: int | None, tic: float) -> None:
        parts, chunks = [], 0
        if api == "messages":
            stream = self.anthropic.messages.create(
                model=self.model, max_tokens=max_tokens, messages=messages_of(question),
                stream=True)
        elif api == "chat":
            stream = self.openai.chat.completions.create(
                model=self.model, messages=messages_of(question), max_tokens=max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True})
        else:
            stream = self.openai.completions.create(
                model=self.model, prompt=question, max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True})
        try:
            for event in stream:
                text = self.read_event(out, api, event)
                if text:
                    if out.ttft is None:
                        out.ttft = time.monotonic() - tic
                    parts.append(text)
                    chunks += 1
                    if leave_after is not None and chunks >= leave_after:
                        out.outcome = "cancelled"
                        break
        finally:
            stream.close()  # mid-way: the connection closes, the server must notice
            out.text = "".join(parts)
        if out.outcome != "cancelled":
            out.outcome = "completed"

    @staticmethod
    def read_event(out: Outcome, api: str, event) -> str:
        """The text of one streamed event; the finish reason and token count kept in ``out``."""
        if api == "messages":
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                return event.delta.text
            if event.type == "message_delta":
                out.finish = FINISH.get(event.delta.stop_reason, event.delta.stop_reason)
                out.tokens = event.usage.output_tokens
            return ""
        if event.usage is not None:
            out.tokens = event.usage.completion_tokens
        if not event.choices:
            return ""
        choice = event.choices[0]
        out.finish = choice.finish_reason or out.finish
        return (choice.delta.content if api == "chat" else choice.text) or ""


# ---------------------------------------------------------------------------------------------
# Exactness


class References:
    """Greedy output of the library for each distinct (prompt form, question, max_tokens)."""

    def __init__(self, model_path: str, draft_path: str, questions: list[str]):
        from dflash.model_mlx import load, load_draft

        self.model, self.tokenizer = load(model_path)
        self.draft = load_draft(draft_path)
        self.questions = questions
        self.cache: dict[tuple, tuple[str, int, str]] = {}

    def get(self, key: tuple) -> tuple[str, int, str]:
        """``(text, number of tokens, finish reason)`` of the request ``key`` run alone."""
        if key not in self.cache:
            from dflash.model_mlx import generate
            from dflash.prompts import encode_prompt, encode_text

            form, qi, max_tokens = key
            question = self.questions[qi]
            ids = (encode_text(self.tokenizer, question) if form == "text" else
                   encode_prompt(self.tokenizer, {"messages": messages_of(question)}))
            r = generate(self.model, self.draft, self.tokenizer, ids, max_tokens=max_tokens)
            self.cache[key] = (r.text, len(r.tokens), r.finish_reason)
        return self.cache[key]


def check_exact(outcomes: list[Outcome], reference) -> tuple[int, int, list[str]]:
    """Compare completed responses (whole) and cut streams (prefix) with ``reference(key)``.

    Returns ``(exact, prefixes checked, mismatches)``; a stream is cut only where a reference was
    computed for a completed response anyway (references cost as much as the requests).
    """
    exact, prefixes, bad = 0, 0, []
    done = [o for o in outcomes if o.outcome == "completed" and o.key is not None]
    for o in done:
        text, n, finish = reference(o.key)
        got = (o.text, o.tokens, o.finish)
        if got == (text, n, finish):
            exact += 1
        else:
            bad.append(f"{o.api} stream={o.stream} {o.key}: got {got!r:.300}, "
                       f"library {(text, n, finish)!r:.300}")
    keys = {o.key for o in done}
    for o in outcomes:
        if o.outcome == "cancelled" and o.stream and o.key in keys:
            prefixes += 1
            if not reference(o.key)[0].startswith(o.text):
                bad.append(f"{o.api} cut stream {o.key}: {o.text!r:.200} is not a prefix of "
                           f"the library's {reference(o.key)[0]!r:.200}")
    return exact, prefixes, bad


# ---------------------------------------------------------------------------------------------
# The run


def server_metrics(url: str) -> tuple[dict, float | None]:
    """``dflash_requests_total`` by status and ``dflash_cancelled_total`` from ``/metrics``."""
    statuses: Counter = Counter()
    cancelled = None
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("dflash_requests_total{"):
            status = line.split('status="', 1)[1].split('"', 1)[0]
            statuses[status] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("dflash_cancelled_total "):
            cancelled = float(line.rsplit(" ", 1)[1])
    return dict(statuses), cancelled


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def run_load(url: str, pid: int | None, args, proc=None) -> tuple[Summary, list[Outcome], dict]:
    """The clients' run against ``url``; returns the summary so far, the outcomes, the model card."""
    card = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
    questions = load_questions(args.prompts)
    summary = Summary(args.clients, args.duration, url)
    outcomes: list[Outcome] = []
    lock, oversize = threading.Lock(), {}
    if args.warmup:  # the first requests compile and allocate; keep that out of the samples
        log("soak: warm-up request")
        warm = Client(-1, url, card["id"], questions, args, outcomes, lock, oversize)
        outcomes.append(warm.request("chat", 0, max(args.max_tokens), True))
    sampler = MemorySampler(pid, args.sample_every) if pid else None
    if sampler:
        sampler.start()
    indexes = IndexSampler(url, args.index_every)
    indexes.sample()  # after the warm-up: one scope, its index made
    indexes.start()
    log(f"soak: {args.clients} clients for {args.duration:.0f} s on {url}")
    start = time.monotonic()
    end = start + args.duration
    clients = [Client(i, url, card["id"], questions, args, outcomes, lock, oversize)
               for i in range(args.clients)]
    threads = [threading.Thread(target=c.run, args=(end,), daemon=True) for c in clients]
    if args.malformed_every > 0:
        bad = Client(len(clients), url, card["id"], questions, args, outcomes, lock, oversize)
        threads.append(threading.Thread(target=bad.run_malformed, args=(end,), daemon=True))
    for t in threads:
        t.start()
    for t in threads:  # the requests in flight at the end run to their end
        t.join(args.duration + args.request_timeout + 60)
    if sampler:
        sampler.stop.set()
        sampler.join()
    indexes.stop.set()
    indexes.join()
    log(f"soak: {len(outcomes)} requests done")
    if any(t.is_alive() for t in threads):
        summary.failures.append("clients still waiting long after the end")

    # The server: still up, and no 5xx in its own counts.
    if proc is not None and proc.poll() is not None:
        summary.failures.append(f"the server exited with {proc.returncode}")
    else:
        summary.server_statuses, summary.server_cancelled = server_metrics(url)
        indexes.sample()  # every request done
    server_5xx = {s: n for s, n in summary.server_statuses.items() if s.startswith("5")}
    if server_5xx:
        summary.failures.append(f"the server counted 5xx answers: {server_5xx}")

    counts: dict[str, Counter] = {}
    for o in outcomes:
        counts.setdefault(o.api, Counter())[o.outcome] += 1
        if o.outcome in ("5xx", "error"):
            summary.failures.append(f"{o.outcome}: {o.api} stream={o.stream} {o.detail}")
    summary.counts = {api: dict(c) for api, c in sorted(counts.items())}
    if not any(c.get("completed") for c in summary.counts.values()):
        summary.failures.append("no request completed")
    ttfts = [o.ttft for o in outcomes if o.ttft is not None]
    summary.ttft_p50, summary.ttft_p95 = percentile(ttfts, 0.5), percentile(ttfts, 0.95)

    summary.index_budget = args.index_budget
    facts, failures = index_check(indexes.samples, summary.index_budget)
    summary.failures += failures
    summary.index_samples = [(round(t - start, 1), tokens, nbytes, scopes)
                             for t, tokens, nbytes, scopes in indexes.samples]
    summary.index_full_bytes = facts.get("full_bytes")
    summary.index_last_tokens, summary.index_last_bytes = (facts.get("last_tokens"),
                                                           facts.get("last_bytes"))
    summary.index_max_tokens, summary.index_max_bytes = (facts.get("max_tokens"),
                                                         facts.get("max_bytes"))

    if sampler is not None:
        # The first --settle seconds (caches and MLX's buffer pool reaching their working size)
        # are kept in the timeline, not in the comparison.
        settled = start + args.settle * args.duration
        summary.rss_mib = [(round(t - start, 1), round(r / 2**20, 1))
                           for t, r in sampler.samples]
        growth = memory_growth(sampler.samples, settled)
        if growth is None:
            summary.failures.append("too few memory samples")
        else:
            summary.rss_samples, summary.rss_growth = growth["samples"], growth["growth"]
            summary.rss_first_mib, summary.rss_last_mib = (growth["first"] / 2**20,
                                                           growth["last"] / 2**20)
            summary.rss_peak_mib, summary.rss_mean_growth = (growth["peak"] / 2**20,
                                                             growth["mean_growth"])
            if summary.rss_growth > args.max_growth:
                summary.failures.append(f"server memory grew {summary.rss_growth:+.1%} over its "
                                        f"early peak (limit {args.max_growth:.0%})")
    return summary, outcomes, card


def check_references(summary: Summary, outcomes: list[Outcome], card: dict, args) -> None:
    """Run the library alone on every distinct completed request; record what differs."""
    log("soak: computing the library's references")
    questions = load_questions(args.prompts)
    refs = References(args.model or card["root"], args.draft or card["dflash"]["draft"],
                      questions)
    summary.exact, summary.prefixes_checked, summary.inexact = check_exact(outcomes, refs.get)
    summary.references = len(refs.cache)
    summary.failures += [f"inexact: {m}" for m in summary.inexact]


def print_summary(s: Summary, args) -> None:
    outcomes = ("completed", "cancelled", "4xx", "429", "5xx", "error")
    print(f"\nsoak: {s.clients} clients, {s.duration:.0f} s, {s.url}")
    print(f"{'requests':<12}" + "".join(f"{k:>10}" for k in outcomes))
    total = Counter()
    for api, c in s.counts.items():
        total.update(c)
        print(f"{api:<12}" + "".join(f"{c.get(k, 0):>10}" for k in outcomes))
    print(f"{'total':<12}" + "".join(f"{total.get(k, 0):>10}" for k in outcomes))
    print(f"exact: {s.exact}/{s.exact + sum(1 for m in s.inexact if 'cut stream' not in m)} "
          f"completed responses equal the library's ({s.references} references); "
          f"{s.prefixes_checked} cut streams checked as prefixes")
    if s.ttft_p50 is not None:
        print(f"time to first token (streams, client side, queue included): "
              f"p50 {s.ttft_p50:.2f} s, p95 {s.ttft_p95:.2f} s")
    if s.rss_growth is not None:
        print(f"server RSS: {s.rss_mib[0][1]:.1f} MiB at the start; after settling "
              f"({args.settle:.0%} of the run) first quartile {s.rss_first_mib:.1f} MiB "
              f"(peak so far {s.rss_peak_mib:.1f}), last quartile {s.rss_last_mib:.1f} MiB: "
              f"{s.rss_mean_growth:+.1%} on the mean, {s.rss_growth:+.1%} over the peak "
              f"(limit {args.max_growth:.0%}; {s.rss_samples} samples)")
    else:
        print("server RSS: not measured (give --pid with --url)")
    if s.index_last_tokens is not None:
        budget = f"budget {s.index_budget} tokens per scope" if s.index_budget else \
            "budget not known (give --index-budget with --url)"
        print(f"continuation index: {s.index_last_tokens:.0f} tokens, "
              f"{s.index_last_bytes / 2**20:.2f} MiB at the end (at most "
              f"{s.index_max_tokens:.0f} tokens, {s.index_max_bytes / 2**20:.2f} MiB; "
              f"{s.index_full_bytes / 2**20:.2f} MiB when first full; {budget}; "
              f"{len(s.index_samples)} samples)")
    print(f"server /metrics: requests by status {s.server_statuses}, "
          f"cancelled generations {s.server_cancelled}")
    print("result: " + ("PASS" if not s.failures else "FAIL"))
    for f in s.failures[:20]:
        print(f"  - {f}")
    if len(s.failures) > 20:
        print(f"  ... and {len(s.failures) - 20} more")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start one on a free port)")
    p.add_argument("--pid", type=int, help="the running server's process id (memory samples)")
    p.add_argument("--model", help="target to serve and to check against (default: built-in)")
    p.add_argument("--draft", help="drafter to serve and to check against (default: built-in)")
    p.add_argument("--serve-args", default="",
                   help="more `dflash serve` options, e.g. '--max-concurrency 8'")
    p.add_argument("--clients", type=int, help="concurrent clients (default 16; --quick 4)")
    p.add_argument("--duration", type=float, help="seconds (default 300; --quick 30)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 4 clients, 30 s")
    p.add_argument("--max-tokens", help="comma-separated answer lengths to mix "
                                        "(default 16,32,64,96; --quick 8,16,24)")
    p.add_argument("--malformed-rate", type=float, default=0.05,
                   help="share of each client's requests that are malformed (default 0.05)")
    p.add_argument("--malformed-every", type=float, default=1.0,
                   help="seconds between the requests of one more client that sends only "
                        "malformed ones (default 1; 0: none)")
    p.add_argument("--disconnect-rate", type=float, default=0.15,
                   help="share of streams closed after a few chunks; half of it: non-streamed "
                        "requests given up after 0.2-3 s (default 0.15)")
    p.add_argument("--max-growth", type=float, default=0.10,
                   help="largest RSS growth of the last quartile over the first's peak "
                        "(default 0.10)")
    p.add_argument("--settle", type=float, default=0.25,
                   help="share of the run left out of the memory comparison at its start, "
                        "while caches warm up (default 0.25)")
    p.add_argument("--sample-every", type=float, default=0.5, help="RSS sample period (s)")
    p.add_argument("--index-budget", type=int, default=None, metavar="TOKENS",
                   help="tokens each continuation index of the soak's server holds, small so "
                        "that the run fills it (default 4096; --quick 512); with --url, the "
                        "running server's, to check it (default: not checked)")
    p.add_argument("--index-every", type=float, default=2.0,
                   help="seconds between reads of the index gauges in /metrics (default 2)")
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--prompts", type=Path, default=PROMPTS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", type=Path, help="server log when started here "
                                            "(default: a temporary file)")
    p.add_argument("--json", type=Path, help="also write the summary here")
    args = p.parse_args(argv)
    args.clients = args.clients or (4 if args.quick else 16)
    if args.index_budget is None and not args.url:
        args.index_budget = 512 if args.quick else 4096
    if args.index_budget is not None and args.index_budget < 1:
        p.error(f"--index-budget {args.index_budget}: a positive number of tokens")
    args.duration = args.duration or (30.0 if args.quick else 300.0)
    args.max_tokens = [int(n) for n in (args.max_tokens or
                                        ("8,16,24" if args.quick else "16,32,64,96")).split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url:
        summary, outcomes, card = run_load(args.url.rstrip("/"), args.pid, args)
    else:
        import tempfile

        log_path = args.log or Path(tempfile.mkdtemp(prefix="dflash-soak-")) / "server.log"
        log(f"soak: starting `dflash serve` (log: {log_path})")
        with started_server(args, log_path) as (url, proc):
            summary, outcomes, card = run_load(url, proc.pid, args, proc)
        # Stopped now (shutdown included): a traceback anywhere in its log is a crash.
        if "Traceback" in log_path.read_text():
            summary.failures.append(f"a traceback in the server log ({log_path})")
    check_references(summary, outcomes, card, args)
    print_summary(summary, args)
    if args.json:
        args.json.write_text(json.dumps(asdict(summary), indent=1))
    return 1 if summary.failures else 0


if __name__ == "__main__":
    sys.exit(main())
