"""``dflash serve``: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over the DFlash engine.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming over SSE or not),
``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text format).

One generation runs at a time: requests queue for a single worker thread that owns the model, so
no two generations ever share state. A streaming client that disconnects cancels its generation at
the next cycle and frees the worker. Every response carries its own acceptance statistics in the
``dflash`` extension field. Bad requests get an OpenAI-style ``{"error": {...}}`` body with a 4xx
status.

FastAPI and uvicorn are imported only when the app is built (``pip install dflash[serve]``).
"""

import argparse
import asyncio
import contextlib
import json
import queue
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .console import log
from .errors import MissingDependencyError
from .prompts import encode_text

# ---------------------------------------------------------------------------------------------
# Options


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists "
                        "(default: the target folder's name)")
    g.add_argument("--max-context", type=int, default=None,
                   help="longest prompt + answer in tokens (default: the target's "
                        "max_position_embeddings)")
    g.add_argument("--default-max-tokens", type=int, default=512,
                   help="answer length when a request gives no max_tokens (default 512)")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per draft block (default: the drafter's)")
    g.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for the model before new ones get 429 "
                        "(default 64)")
    g.add_argument("--reasoning", choices=("auto", "on", "off"), default="auto",
                   help="split <think>…</think> into reasoning_content: auto (when the "
                        "tokenizer knows thinking tags), on, off (default auto)")
    g.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn log level (default info)")


# ---------------------------------------------------------------------------------------------
# Errors


class APIError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type_, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _config_error(e: Exception) -> APIError:
    """Map a ``GenerationConfigError`` ("name=value: rule") to a 400 naming the parameter."""
    message = str(e)
    param = message.split("=", 1)[0] if "=" in message.split(":", 1)[0] else None
    if param and not param.replace("_", "").replace("[", "").replace("]", "").isalnum():
        param = None
    return APIError(400, message, param=param, code="invalid_value")


# ---------------------------------------------------------------------------------------------
# Reasoning split


class ThinkSplitter:
    """Splits streamed text into reasoning (inside ``<think>…</think>``) and content.

    A reasoning block opens only before any content has been emitted; ``in_reasoning`` starts the
    stream inside a block (templates that put the opening tag into the prompt). Tags split across
    chunks are held back until they can be decided.
    """

    def __init__(self, start: str = "<think>", end: str = "</think>", in_reasoning: bool = False):
        self.start, self.end = start, end
        self.in_reasoning = in_reasoning
        self.buf = ""
        self.content_started = False
        self.strip_content = False
        self.strip_reasoning = in_reasoning

    @staticmethod
    def _partial(buf: str, tag: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
        for k in range(min(len(tag) - 1, len(buf)), 0, -1):
            if buf.endswith(tag[:k]):
                return k
        return 0

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning, content = "", ""
        while self.buf:
            if self.in_reasoning:
                i = self.buf.find(self.end)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf = self.buf[i + len(self.end):]
                    self.in_reasoning = False
                    self.strip_content = True
                    continue
                keep = 0 if final else self._partial(self.buf, self.end)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            if not self.content_started:
                stripped = self.buf.lstrip()
                if stripped.startswith(self.start):
                    self.buf = stripped[len(self.start):]
                    self.in_reasoning = True
                    self.strip_reasoning = True
                    continue
                if not final and (not stripped or self.start.startswith(stripped)):
                    break  # could still become an opening tag
            content += self.buf
            self.buf = ""
        if self.strip_reasoning and reasoning:
            reasoning = reasoning.lstrip("\n")
            self.strip_reasoning = not reasoning
        if self.strip_content and content:
            content = content.lstrip()
            self.strip_content = not content
        if content:
            self.content_started = True
        return reasoning, content


# ---------------------------------------------------------------------------------------------
# Metrics


class Metrics:
    """Counters for ``/metrics``; updated from the worker and the request handlers."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cycles = 0
        self.generation_seconds = 0.0
        self.prefill_seconds = 0.0
        self.draft_seconds = 0.0
        self.verify_seconds = 0.0
        self.cancelled = 0
        self.cycle_tokens = 0.0
        self.last_tps = 0.0
        self.last_tau = 0.0
        self.accepted_at: list[float] = []
        self.proposed_at: list[float] = []
        self.started = time.time()

    def request(self, endpoint: str, status: str) -> None:
        with self.lock:
            key = (endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1

    def generation(self, r) -> None:
        with self.lock:
            self.prompt_tokens += r.prompt_tokens
            self.generation_tokens += r.generation_tokens
            self.cycles += r.cycles
            self.cycle_tokens += r.mean_tau * r.cycles
            if r.generation_tps > 0:
                self.generation_seconds += r.generation_tokens / r.generation_tps
            if r.prompt_tps > 0:
                self.prefill_seconds += r.prompt_tokens / r.prompt_tps
            self.draft_seconds += r.draft_time
            self.verify_seconds += r.verify_time
            self.last_tps = r.generation_tps
            self.last_tau = r.mean_tau
            acc = r.acceptance_by_position
            if len(self.accepted_at) < len(acc):
                grow = len(acc) - len(self.accepted_at)
                self.accepted_at += [0.0] * grow
                self.proposed_at += [0.0] * grow
            for j, a in enumerate(acc):  # weighted by cycles: counts, approximately
                self.accepted_at[j] += a * r.cycles
                self.proposed_at[j] += r.cycles

    def render(self, info: dict, queue_depth: int, busy: bool) -> str:
        out: list[str] = []

        def metric(name, kind, help_text, samples):
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lab = ""
                if labels:
                    lab = "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"
                out.append(f"{name}{lab} {float(value)!r}")

        with self.lock:
            metric("dflash_info", "gauge", "The served model and drafter.", [(info, 1)])
            metric("dflash_requests_total", "counter",
                   "HTTP requests to the completion endpoints, by endpoint and outcome.",
                   [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())]
                   or [({"endpoint": "chat", "status": "ok"}, 0)])
            metric("dflash_cancelled_total", "counter",
                   "Generations stopped because the client went away.", [({}, self.cancelled)])
            metric("dflash_prompt_tokens_total", "counter", "Prompt tokens prefilled.",
                   [({}, self.prompt_tokens)])
            metric("dflash_generation_tokens_total", "counter", "Tokens generated.",
                   [({}, self.generation_tokens)])
            metric("dflash_cycles_total", "counter", "Draft-and-verify cycles.",
                   [({}, self.cycles)])
            metric("dflash_generation_seconds_total", "counter",
                   "Wall time spent decoding (after prefill).", [({}, self.generation_seconds)])
            metric("dflash_prefill_seconds_total", "counter", "Wall time spent on prefill.",
                   [({}, self.prefill_seconds)])
            metric("dflash_draft_seconds_total", "counter", "Time spent in drafter passes.",
                   [({}, self.draft_seconds)])
            metric("dflash_verify_seconds_total", "counter",
                   "Time spent in target verify passes.", [({}, self.verify_seconds)])
            tau = self.cycle_tokens / self.cycles if self.cycles else 0.0
            metric("dflash_mean_tau", "gauge",
                   "Tokens per cycle over all generations (acceptance length tau).", [({}, tau)])
            tps = (self.generation_tokens / self.generation_seconds
                   if self.generation_seconds else 0.0)
            metric("dflash_tokens_per_second", "gauge",
                   "Decode tokens per second over all generations.", [({}, tps)])
            metric("dflash_last_tokens_per_second", "gauge",
                   "Decode tokens per second of the last generation.", [({}, self.last_tps)])
            metric("dflash_last_mean_tau", "gauge", "Mean tau of the last generation.",
                   [({}, self.last_tau)])
            metric("dflash_acceptance_by_position", "gauge",
                   "Share of cycles whose draft token at this block position was accepted.",
                   [({"position": str(j + 1)}, a / p if p else 0.0)
                    for j, (a, p) in enumerate(zip(self.accepted_at, self.proposed_at))])
            metric("dflash_queue_depth", "gauge", "Requests waiting for the model.",
                   [({}, queue_depth)])
            metric("dflash_busy", "gauge", "1 while a generation runs.", [({}, int(busy))])
            metric("dflash_uptime_seconds", "gauge", "Seconds since the server started.",
                   [({}, time.time() - self.started)])
        return "\n".join(out) + "\n"


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


# ---------------------------------------------------------------------------------------------
# The engine: one worker thread owns the model


@dataclass
class Job:
    prompt_ids: list[int]
    kwargs: dict
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None

    def emit(self, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone: the server is shutting down
            self.cancel.set()


class Engine:
    """Loads the pair in its own thread and runs queued generations there, one at a time."""

    def __init__(self, loader: Callable[[], Any], max_queue: int = 64):
        self.loader = loader
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.max_queue = max_queue
        self.metrics = Metrics()
        self.pair = None
        self.current: Job | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)

    def start(self) -> "Engine":
        self.thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error
        return self

    def cancel_all(self) -> None:
        """Stop the running generation at its next cycle and drop every queued one."""
        job = self.current
        if job is not None:
            job.cancel.set()
        kept = []
        while True:
            try:
                pending = self.jobs.get_nowait()
            except queue.Empty:
                break
            if pending is None:
                kept.append(pending)
            else:
                pending.cancel.set()
                pending.emit("cancelled")
        for item in kept:
            self.jobs.put(item)

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything and end the worker thread (MLX must be idle before exit)."""
        self.cancel_all()
        self.jobs.put(None)
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return self.jobs.qsize()

    def submit(self, job: Job) -> None:
        if self.jobs.qsize() >= self.max_queue:
            raise APIError(429, f"{self.jobs.qsize()} requests are already waiting; retry later",
                           type_="rate_limit_error", code="queue_full")
        self.jobs.put(job)

    def _run(self) -> None:
        try:
            self.pair = self.loader()
        except BaseException as e:  # reported to start() in the main thread
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        from .model_mlx import PromptCache, stream_generate

        # One worker serves every request, so one cache: shared prefixes (system prompts,
        # earlier turns) are not prefilled again.
        prompt_cache = PromptCache()

        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.cancel.is_set():  # its client left while it waited
                with self.metrics.lock:
                    self.metrics.cancelled += 1
                job.emit("cancelled")
                continue
            self.current = job
            job.started = time.perf_counter()
            last = None
            try:
                gen = stream_generate(self.pair.model, self.pair.draft, self.pair.tokenizer,
                                      job.prompt_ids, prompt_cache=prompt_cache, **job.kwargs)
                for r in gen:
                    last = r
                    job.emit("chunk", r)
                    if job.cancel.is_set():
                        gen.close()
                        break
                if job.cancel.is_set() and (last is None or last.finish_reason is None):
                    with self.metrics.lock:
                        self.metrics.cancelled += 1
                    job.emit("cancelled")
                else:
                    job.emit("done")
            except Exception as e:  # reported to the client; the worker keeps serving
                if not isinstance(e, ValueError):
                    traceback.print_exc()
                job.emit("error", e)
            finally:
                if last is not None:
                    self.metrics.generation(last)
                self.current = None


# ---------------------------------------------------------------------------------------------
# Request parsing


def _number(body: dict, name: str, default, kind=float, lo=None, hi=None,
            lo_open=False) -> Any:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok:
        raise APIError(400, f"{name}={value!r}: must be {'an integer' if kind is int else 'a number'}",
                       param=name, code="invalid_type")
    value = kind(value)
    if lo is not None and (value < lo or (lo_open and value == lo)):
        rule = f"> {lo}" if lo_open else f">= {lo}"
        raise APIError(400, f"{name}={value!r}: must be {rule}", param=name, code="invalid_value")
    if hi is not None and value > hi:
        raise APIError(400, f"{name}={value!r}: must be <= {hi}", param=name,
                       code="invalid_value")
    return value


def _content_text(content, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(
                    part.get("text"), str):
                parts.append(part["text"])
            else:
                raise APIError(400, f"messages[{index}].content: only text parts are supported",
                               param="messages", code="invalid_value")
        return "".join(parts)
    raise APIError(400, f"messages[{index}].content: must be a string or a list of text parts",
                   param="messages", code="invalid_type")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages: a non-empty list of {role, content} objects is required",
                       param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}]: needs a string `role`", param="messages",
                           code="invalid_value")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": _content_text(m.get("content"), i)}
        for key in ("name", "tool_calls", "tool_call_id"):
            if key in m:
                msg[key] = m[key]
        out.append(msg)
    return out


# ---------------------------------------------------------------------------------------------
# The app


class Server:
    """Request handling around an :class:`Engine`; ``app`` is the FastAPI application."""

    def __init__(self, engine: Engine, model_name: str, max_context: int | None = None,
                 default_max_tokens: int = 512, block_size: int | None = None,
                 reasoning: str = "auto"):
        self.engine = engine
        self.pair = engine.pair
        self.tokenizer = self.pair.tokenizer
        self.model_name = model_name
        self.max_context = max_context or self.pair.max_context
        self.default_max_tokens = default_max_tokens
        self.block_size = block_size
        self.created = int(time.time())
        from .target import target_parts

        self.vocab_size = target_parts(self.pair.model).vocab_size
        tok = self.tokenizer
        has_thinking = bool(getattr(tok, "has_thinking", False))
        self.think_tags = None
        if reasoning == "on" or (reasoning == "auto" and has_thinking):
            self.think_tags = (getattr(tok, "think_start", None) or "<think>",
                               getattr(tok, "think_end", None) or "</think>")
        self.app = self._build_app()

    # -- validation ----------------------------------------------------------------------------

    def _check_model(self, body: dict) -> None:
        name = body.get("model")
        if name is None:
            return
        if name not in (self.model_name, self.pair.model_path, "dflash", "default"):
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                           f"`{self.model_name}`", param="model", code="model_not_found")

    def _generation_kwargs(self, body: dict, n_prompt: int, param: str) -> dict:
        from .errors import GenerationConfigError
        from .sampling import SamplingConfig

        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        explicit = max_tokens is not None
        max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", self.default_max_tokens,
                             int, lo=1)
        if body.get("n", 1) not in (1, None):
            raise APIError(400, "n: only n=1 is supported", param="n", code="invalid_value")
        rejected = {"logprobs": bool(body.get("logprobs")),
                    "top_logprobs": bool(body.get("top_logprobs")),
                    "echo": body.get("echo") is True,
                    "best_of": body.get("best_of") not in (None, 1),
                    "suffix": bool(body.get("suffix"))}
        for name, bad in rejected.items():
            if bad:
                raise APIError(400, f"{name}: not supported by this server", param=name,
                               code="unsupported_parameter")
        if self.max_context is not None:
            if n_prompt >= self.max_context:
                raise APIError(400, f"This model's maximum context length is "
                               f"{self.max_context} tokens, but the prompt has {n_prompt} tokens",
                               param=param, code="context_length_exceeded")
            room = self.max_context - n_prompt
            if explicit and max_tokens > room:
                raise APIError(400, f"This model's maximum context length is "
                               f"{self.max_context} tokens; the prompt has {n_prompt} tokens "
                               f"and max_tokens={max_tokens} asks for {n_prompt + max_tokens}",
                               param="max_tokens", code="context_length_exceeded")
            max_tokens = min(max_tokens, room)
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list) or len(stop) > 16
                                 or any(not isinstance(s, str) or not s for s in stop)):
            raise APIError(400, "stop: a string or a list of non-empty strings",
                           param="stop", code="invalid_value")
        logit_bias = body.get("logit_bias")
        if logit_bias is not None:
            if not isinstance(logit_bias, dict):
                raise APIError(400, "logit_bias: must map token ids to numbers",
                               param="logit_bias", code="invalid_type")
            try:
                logit_bias = {int(k): v for k, v in logit_bias.items()}
            except (TypeError, ValueError):
                raise APIError(400, "logit_bias: keys must be token ids", param="logit_bias",
                               code="invalid_value") from None
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise APIError(400, f"seed={seed!r}: must be an integer", param="seed",
                           code="invalid_type")
        block_size = _number(body, "block_size", self.block_size, int, lo=2)
        sampling = dict(
            temperature=_number(body, "temperature", 0.0, float, lo=0, hi=2),
            top_p=_number(body, "top_p", 1.0, float, lo=0, hi=1, lo_open=True),
            top_k=_number(body, "top_k", 0, int, lo=0),
            min_p=_number(body, "min_p", 0.0, float, lo=0, hi=1),
            repetition_penalty=_number(body, "repetition_penalty", None, float, lo=0,
                                       lo_open=True),
            presence_penalty=_number(body, "presence_penalty", 0.0, float, lo=-2, hi=2),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, float, lo=-2, hi=2),
            seed=seed, logit_bias=logit_bias)
        proposal = body.get("proposal", "sample")
        try:
            SamplingConfig(proposal=proposal, **sampling).validate(self.vocab_size)
        except GenerationConfigError as e:
            raise _config_error(e) from None
        if sampling["repetition_penalty"] == 1.0:
            sampling["repetition_penalty"] = None
        min_confidence = _number(body, "min_confidence", None, float, lo=0, hi=1)
        return dict(sampling, max_tokens=max_tokens, stop=stop, block_size=block_size,
                    proposal=proposal, min_confidence=min_confidence)

    def _chat_prompt(self, body: dict) -> tuple[list[int], bool]:
        """Prompt ids of a chat request and whether the prompt opens a reasoning block."""
        messages = _messages(body)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise APIError(400, "chat_template_kwargs: must be an object",
                           param="chat_template_kwargs", code="invalid_type")
        for key in ("enable_thinking", "reasoning_effort"):
            if key in body and key not in kwargs:
                kwargs[key] = body[key]
        if "reasoning_effort" in kwargs and "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = kwargs["reasoning_effort"] not in (None, "none")
        kwargs.pop("reasoning_effort", None)
        from .prompts import encode_prompt

        try:
            ids = encode_prompt(self.tokenizer, {"messages": messages}, **kwargs)
        except APIError:
            raise
        except Exception as e:
            raise APIError(400, f"messages: the chat template rejected them ({e})",
                           param="messages", code="invalid_value") from None
        opens = False
        if self.think_tags is not None:
            tail = self.tokenizer.decode(ids[-16:])
            opens = tail.rfind(self.think_tags[0]) > tail.rfind(self.think_tags[1])
        return ids, opens

    def _completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return encode_text(self.tokenizer, prompt)
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(not 0 <= t < self.vocab_size for t in prompt):
                raise APIError(400, "prompt: token id outside the vocabulary", param="prompt",
                               code="invalid_value")
            return list(prompt)
        raise APIError(400, "prompt: a non-empty string or list of token ids (one prompt)",
                       param="prompt", code="invalid_value")

    # -- generation ----------------------------------------------------------------------------

    def _stats(self, r, job: Job) -> dict:
        waited = (job.started or job.submitted) - job.submitted
        return {
            "mean_tau": round(r.mean_tau, 4),
            "cycles": r.cycles,
            "verified_tokens": r.verified_tokens,
            "reused_prompt_tokens": r.reused_prompt_tokens,
            "acceptance_by_position": [round(a, 4) for a in r.acceptance_by_position],
            "block_size": job.kwargs.get("block_size") or self.pair.draft.block_size,
            "prompt_tps": round(r.prompt_tps, 2),
            "generation_tps": round(r.generation_tps, 2),
            "draft_time": round(r.draft_time, 4),
            "verify_time": round(r.verify_time, 4),
            "queue_time": round(waited, 4),
            "peak_memory_gb": round(r.peak_memory, 4),
        }

    async def _run(self, prompt_ids: list[int], kwargs: dict):
        """Submit a job; yield ``DFlashResponse`` chunks. Closing the iterator cancels it."""
        loop = asyncio.get_running_loop()
        job = Job(prompt_ids, kwargs, loop, asyncio.Queue())
        self.engine.submit(job)
        try:
            while True:
                kind, value = await job.out.get()
                if kind == "chunk":
                    yield job, value
                elif kind == "done":
                    return
                elif kind == "cancelled":
                    raise APIError(503, "the generation was cancelled", type_="server_error",
                                   code="cancelled")
                elif kind == "error":
                    from .errors import DFlashError

                    if isinstance(value, DFlashError):
                        raise _config_error(value)
                    raise APIError(500, f"generation failed: {value}", type_="server_error",
                                   code="internal_error")
        finally:
            job.cancel.set()  # no-op when finished; stops the worker when the client left

    async def _collect(self, request, prompt_ids, kwargs):
        """Run to the end; a client that leaves (even while queued) cancels the job."""
        text, last, job = [], None, None
        gen = self._run(prompt_ids, kwargs)
        watcher = asyncio.ensure_future(_watch_disconnect(request))
        try:
            while True:
                step = asyncio.ensure_future(gen.__anext__())
                await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    step.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await step
                    raise APIError(499, "the client closed the request", code="client_closed")
                try:
                    job, r = step.result()
                except StopAsyncIteration:
                    break
                text.append(r.text)
                last = r
        finally:
            watcher.cancel()
            await gen.aclose()
        return "".join(text), last, job

    # -- endpoints -----------------------------------------------------------------------------

    def _build_app(self):
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
        from starlette.exceptions import HTTPException as StarletteHTTPException

        app = FastAPI(title="dflash", version=_version(), docs_url=None, redoc_url=None)

        @app.exception_handler(APIError)
        async def api_error(_request, e: APIError):
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_request, e):
            kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
            return JSONResponse(APIError(e.status_code, str(e.detail), type_=kind).body(),
                                status_code=e.status_code)

        @app.exception_handler(RequestValidationError)
        async def validation_error(_request, e):
            return JSONResponse(APIError(400, str(e)).body(), status_code=400)

        class CancellingStream(StreamingResponse):
            """A streaming response that closes its source however the response ends."""

            on_close = None

            async def __call__(self, scope, receive, send):
                try:
                    await super().__call__(scope, receive, send)
                finally:
                    if self.on_close is not None:
                        await self.on_close()

        self._Stream, self._JSON = CancellingStream, JSONResponse

        async def read_body(request: Request) -> dict:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise APIError(400, f"the request body is not valid JSON ({e})",
                               code="invalid_json") from None
            if not isinstance(body, dict):
                raise APIError(400, "the request body must be a JSON object", code="invalid_json")
            return body

        self._read_body = read_body

        @app.get("/health")
        async def health():
            return {"status": "ok", "model": self.model_name, "draft": self.pair.draft_path,
                    "queue_depth": self.engine.queue_depth,
                    "busy": self.engine.current is not None}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str):
            if model_id != self.model_name:
                raise APIError(404, f"The model `{model_id}` does not exist", param="model",
                               code="model_not_found")
            return self._model_card()

        @app.get("/metrics")
        async def metrics():
            info = {"model": self.model_name, "draft": self.pair.draft_path}
            return PlainTextResponse(
                self.engine.metrics.render(info, self.engine.queue_depth,
                                           self.engine.current is not None),
                media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._endpoint(request, "chat")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._endpoint(request, "completions")

        return app

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "dflash", "root": self.pair.model_path,
                "dflash": {"draft": self.pair.draft_path,
                           "block_size": self.block_size or self.pair.draft.block_size,
                           "max_context": self.max_context}}

    async def _endpoint(self, request, endpoint):
        try:
            body = await self._read_body(request)
            self._check_model(body)
            if endpoint == "chat":
                ids, opens = self._chat_prompt(body)
                param = "messages"
            else:
                ids, opens = self._completion_prompt(body), False
                param = "prompt"
            kwargs = self._generation_kwargs(body, len(ids), param)
            if body.get("stream", False):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                splitter = (ThinkSplitter(*self.think_tags, in_reasoning=opens)
                            if endpoint == "chat" and self.think_tags else None)
                events = self._sse(endpoint, ids, kwargs, splitter, include_usage)
                # Wait for the first event (the generation has started) before answering, so
                # that errors raised before any output still get a JSON error and a 4xx.
                first = await _first_or_disconnect(request, events)
                if first is None:
                    self.engine.metrics.request(endpoint, "cancelled")
                    return self._JSON(APIError(499, "client closed the request").body(),
                                      status_code=499)
                response = self._Stream(_prepend(first, events), media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache",
                                                 "X-Accel-Buffering": "no"})
                response.on_close = events.aclose
                return response
            text, last, job = await self._collect(request, ids, kwargs)
            result = self._full_response(endpoint, ids, text, last, job, opens)
            self.engine.metrics.request(endpoint, "ok")
            return self._JSON(result)
        except APIError as e:
            self.engine.metrics.request(endpoint, str(e.status))
            return self._JSON(e.body(), status_code=e.status)

    def _full_response(self, endpoint, ids, text, last, job, opens) -> dict:
        usage = {"prompt_tokens": len(ids), "completion_tokens": last.generation_tokens,
                 "total_tokens": len(ids) + last.generation_tokens}
        created = int(time.time())
        tail = {"usage": usage, "system_fingerprint": f"dflash-{_version()}",
                "dflash": self._stats(last, job)}
        if endpoint == "completions":
            return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                    "created": created, "model": self.model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": last.finish_reason}], **tail}
        message = {"role": "assistant", "content": text}
        if self.think_tags is not None:
            splitter = ThinkSplitter(*self.think_tags, in_reasoning=opens)
            reasoning, content = splitter.feed(text, final=True)
            message = {"role": "assistant", "content": content,
                       "reasoning_content": reasoning or None}
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": created, "model": self.model_name,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": last.finish_reason}], **tail}

    async def _sse(self, endpoint, ids, kwargs, splitter, include_usage):
        """Server-sent events of one generation; the first item is yielded before any output."""
        chat = endpoint == "chat"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: dict, **extra) -> str:
            data = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                    "system_fingerprint": f"dflash-{_version()}", "choices": [choice], **extra}
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        def delta(text: str, final: bool) -> list[str]:
            if not chat:
                return [chunk({"index": 0, "text": text, "logprobs": None,
                               "finish_reason": None})] if text else []
            reasoning, content = (splitter.feed(text, final) if splitter else ("", text))
            d = {}
            if reasoning:
                d["reasoning_content"] = reasoning
            if content:
                d["content"] = content
            return [chunk({"index": 0, "delta": d, "logprobs": None,
                           "finish_reason": None})] if d else []

        gen = self._run(ids, kwargs)
        status, started = "ok", False
        try:
            job, r = await gen.__anext__()  # errors before any output propagate to the handler
            started = True
            if chat:
                yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
            else:
                yield ""  # an empty first item: the generation has started
            while True:
                for line in delta(r.text, r.finish_reason is not None):
                    yield line
                if r.finish_reason is not None:
                    break
                job, r = await gen.__anext__()
            final = {"index": 0, "logprobs": None, "finish_reason": r.finish_reason}
            if chat:
                final["delta"] = {}
            else:
                final["text"] = ""
            usage = {"prompt_tokens": len(ids), "completion_tokens": r.generation_tokens,
                     "total_tokens": len(ids) + r.generation_tokens}
            yield chunk(final, dflash=self._stats(r, job),
                        **({} if include_usage else {"usage": usage}))
            if include_usage:
                data = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                        "choices": [], "usage": usage, "dflash": self._stats(r, job)}
                yield f"data: {json.dumps(data)}\n\n"
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        except APIError as e:
            status = "cancelled" if e.code == "cancelled" else str(e.status)
            if not started:
                raise
            # Headers are gone: report in-band, as OpenAI does, and end the stream.
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            await gen.aclose()
            if started:
                self.engine.metrics.request(endpoint, status)


async def _prepend(first, rest):
    if first:
        yield first
    async for item in rest:
        yield item


async def _first_or_disconnect(request, events):
    """The first event of ``events``, or ``None`` (and ``events`` closed) if the client left."""
    first = asyncio.ensure_future(events.__anext__())
    watcher = asyncio.ensure_future(_watch_disconnect(request))
    try:
        await asyncio.wait({first, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if first.done():
        return first.result()  # raises the generation's APIError, if any
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, APIError):
        await first
    await events.aclose()
    return None


async def _watch_disconnect(request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


def _version() -> str:
    from . import __version__

    return __version__


# ---------------------------------------------------------------------------------------------
# Entry points


def create_server(model: str | None = None, draft: str | None = None, *,
                  served_model_name: str | None = None, max_context: int | None = None,
                  default_max_tokens: int = 512, block_size: int | None = None,
                  max_queue: int = 64, reasoning: str = "auto", quiet: bool = False) -> Server:
    """Load the pair in the engine's thread and build the app (``server.app``)."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            "the server needs FastAPI and uvicorn: pip install 'dflash[serve]'") from None
    from .pair import load_pair

    engine = Engine(lambda: load_pair(model, draft, log=None if quiet else log),
                    max_queue=max_queue).start()
    name = served_model_name or engine.pair.name
    return Server(engine, name, max_context=max_context, default_max_tokens=default_max_tokens,
                  block_size=block_size, reasoning=reasoning)


def serve(args: argparse.Namespace) -> int:
    """``dflash serve``: load, then run uvicorn until Ctrl-C."""
    from .cli import CLIError

    for name in ("port", "default_max_tokens", "max_queue"):
        if getattr(args, name) < (0 if name == "port" else 1):
            raise CLIError(f"--{name.replace('_', '-')} {getattr(args, name)}: out of range",
                           code=2)
    if args.max_context is not None and args.max_context < 2:
        raise CLIError(f"--max-context {args.max_context}: must be >= 2", code=2)
    if args.block_size is not None and args.block_size < 2:
        raise CLIError(f"--block-size {args.block_size}: must be >= 2", code=2)
    server = create_server(args.model, args.draft, served_model_name=args.served_model_name,
                           max_context=args.max_context,
                           default_max_tokens=args.default_max_tokens,
                           block_size=args.block_size, max_queue=args.max_queue,
                           reasoning=args.reasoning)
    import uvicorn

    log(f"serving `{server.model_name}` at http://{args.host}:{args.port}/v1 "
        f"(max context {server.max_context}, reasoning split "
        f"{'on' if server.think_tags else 'off'}); Ctrl-C stops")
    config = uvicorn.Config(server.app, host=args.host, port=args.port,
                            log_level=args.log_level, timeout_graceful_shutdown=5,
                            access_log=args.log_level in ("info", "debug"))
    engine = server.engine

    class UvicornServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # End open streams now (they get an in-band error and close), so that the graceful
            # shutdown does not have to wait for long generations.
            engine.cancel_all()
            super().handle_exit(sig, frame)

    userver = UvicornServer(config)
    try:
        userver.run()
    finally:
        engine.stop()
    if not userver.started:
        raise CLIError(f"could not listen on {args.host}:{args.port}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    print("run `dflash serve --help`", file=sys.stderr)
