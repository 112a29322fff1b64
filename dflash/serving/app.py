"""The FastAPI app over the worker, SSE streaming, and the entry points ``create_server``/``run``.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, Anthropic's
``POST /v1/messages``, OpenAI's Responses API ``POST /v1/responses`` (each streamed over SSE or
not) and ``/v1/messages/count_tokens``,
``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text format). Bad requests get
an OpenAI-style ``{"error": {...}}`` body (Anthropic's shape on ``/v1/messages``) with a 4xx
status; this is the one place that turns the lower layers' exceptions (``QueueFull``,
``GenerationCancelled``, the engine's ``GenerationConfigError``) into HTTP statuses. A streaming
client that disconnects cancels its generation at the next cycle and frees the worker.

With API keys (``--api-key``), every route but ``/`` and ``/health`` needs one (``Authorization:
Bearer KEY`` or ``x-api-key: KEY``, as the OpenAI and Anthropic clients send them), and a request
runs in its key's scope (:mod:`.scopes`: whose earlier text its index and prefix cache hold).

FastAPI, uvicorn and prometheus_client are imported only when a server is built
(the ``serve`` extra: ``pip install 'mlx-dflash-spec[serve]'``).
"""

# No ``from __future__ import annotations``: FastAPI reads the route handlers' annotations
# (``request: Request``, imported inside ``build_app``) at runtime.
import asyncio
import contextlib
import contextvars
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable

from .. import __version__
from ..console import log
from ..errors import (
    APIError,
    DFlashError,
    GenerationCancelled,
    QueueFull,
    RankLost,
    ServerConfigError,
    ServerStartError,
    missing_extra,
)
from ..lookup import DEFAULT_BUDGET
from ..pair import Pair, load_pair
from ..prompt_cache import DEFAULT_DISK_BYTES, DEFAULT_ENTRIES
from ..ranks import Ranks
from ..request import build_request
from ..settings import GenerationSettings
from ..speculative import DFlashResponse
from ..stats import generation_stats
from ..target import QUANTIZED_KV_START, KVQuantization, target_parts
from .anthropic_format import (
    MessageStream,
    error_body,
    matched_stop,
    message_response,
    parse_messages_request,
)
from .logprobs_format import LogprobFormat
from .openai_format import StreamFormat, full_response, model_card
from .reasoning import ThinkSplitter, think_tags
from .record import Recorder
from .requests import CompletionRequest, ServedModel, config_error, parse_request, read_json
from .responses_format import (
    ResponseStore,
    ResponseStream,
    parse_responses_request,
    response_body,
)
from .scopes import LOCAL_HOSTS, APIKeys, Scopes
from .sharded import follow
from .tools import AnswerSplitter, ToolCallSplitter, tool_format
from .worker import RANK_TIMEOUT, Job, Worker

# Larger bodies get a 413 (no prompt that fits a context comes near it).
MAX_BODY_BYTES = 32 * 1024 * 1024
# Answered without an API key: liveness only (Claude Code sends ``HEAD /`` without its key
# before its first request).
OPEN_PATHS = ("/", "/health")
# Seconds a sharded server whose other ranks are gone keeps answering 503 before it exits.
LOST_GRACE = 10.0
# A stream with no output yet (queued, or a long prompt being processed) sends a keepalive every
# KEEPALIVE_SECONDS (see ``keepalive``), so that clients and proxies with an idle timeout keep
# waiting. The first one commits the response to 200: errors raised later are reported in the
# stream, so it comes only after errors raised at once had their JSON 4xx.
KEEPALIVE = ": keepalive\n\n"  # an SSE comment: every SSE parser skips it
PING = 'event: ping\ndata: {"type": "ping"}\n\n'  # Anthropic's, skipped by its clients
KEEPALIVE_SECONDS = 10.0
SHARED = {"key": "index and prefix cache per API key",
          "all": "index and prefix cache shared by all clients",
          "none": "no index or prefix cache across requests"}
# The scope (API key) of the request being handled: set by the key check around every route,
# read where a generation is submitted, so that every endpoint runs in its caller's scope.
CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar("dflash_caller",
                                                                    default=None)


class Server:
    """Request handling around a started :class:`Worker`; ``app`` is the FastAPI application."""

    def __init__(self, worker: Worker, model_name: str, max_context: int | None = None,
                 default_max_tokens: int = 512, block_size: int | None = None,
                 reasoning: str = "auto", keys: APIKeys | None = None,
                 kv: dict | None = None, keepalive: float = KEEPALIVE_SECONDS,
                 recorder: Recorder | None = None):
        self.worker = worker
        self.recorder = recorder  # --record: each accepted request written down
        self.keepalive = keepalive  # seconds between keepalives before the first output
        self.kv = kv or {}  # the target's KV cache settings, the same for every request
        self.keys = keys if keys is not None else APIKeys()
        self.pair = worker.pair
        self.tokenizer = self.pair.tokenizer
        self.created = int(time.time())
        self.served = ServedModel(
            name=model_name, path=self.pair.model_path,
            vocab_size=target_parts(self.pair.model).vocab_size,
            max_context=max_context or self.pair.max_context,
            default_max_tokens=default_max_tokens, block_size=block_size,
            think_tags=think_tags(self.tokenizer, reasoning),
            tool_format=tool_format(self.tokenizer))
        self.metrics = worker.metrics
        self.metrics.watch({"model": model_name, "draft": self.pair.draft_path},
                           queue_depth=lambda: worker.queue_depth, busy=lambda: worker.busy,
                           batch_size=lambda: worker.batch_size,
                           max_concurrency=worker.max_concurrency)
        self.metrics.watch_index(lambda: worker.scopes.index_tokens,
                                 lambda: len(worker.scopes.scopes()),
                                 lambda: worker.scopes.index_bytes)
        self.responses = ResponseStore()  # kept for previous_response_id
        self.app = build_app(self)

    @property
    def model_name(self) -> str:
        return self.served.name

    @property
    def max_context(self) -> int | None:
        return self.served.max_context

    @property
    def think_tags(self) -> tuple[str, str] | None:
        return self.served.think_tags

    def health(self) -> dict:
        return {"status": "ok", "model": self.model_name, "draft": self.pair.draft_path,
                "queue_depth": self.worker.queue_depth, "busy": self.worker.busy,
                "max_concurrency": self.worker.max_concurrency,
                "max_queue": self.worker.max_queue}

    def model_card(self) -> dict:
        return model_card(self.model_name, self.created, self.pair.model_path, {
            "draft": self.pair.draft_path,
            "block_size": self.served.block_size or self.pair.draft.block_size,
            "max_context": self.max_context})

    def stats(self, r: DFlashResponse, job: Job) -> dict:
        """The ``dflash`` field of a response: the generation's statistics and the server's own."""
        return {**generation_stats(r),
                "block_size": job.settings.block_size or self.pair.draft.block_size,
                "queue_time": round(job.queue_time, 4)}

    async def generate(self, req: CompletionRequest) -> AsyncIterator[tuple[Job, DFlashResponse]]:
        """The worker's ``(job, response)`` stream, its failures as ``APIError``s."""
        stream = self.worker.stream(req.prompt_ids, req.settings.replace(**self.kv),
                                    scope=CALLER.get())
        try:
            async for item in stream:
                yield item
        except QueueFull as e:
            raise APIError(429, str(e), type_="rate_limit_error", code="queue_full") from None
        except GenerationCancelled:
            raise APIError(503, "the generation was cancelled", type_="server_error",
                           code="cancelled") from None
        except RankLost as e:
            raise APIError(503, str(e), type_="server_error", code="rank_lost") from None
        except DFlashError as e:  # the engine rejected a setting: the client's to fix
            raise config_error(e) from None
        except Exception as e:  # anything else the engine raised, reported to the client
            raise APIError(500, f"generation failed: {e}", type_="server_error",
                           code="internal_error") from None
        finally:
            await stream.aclose()

    def splitter(self, req: CompletionRequest) -> AnswerSplitter:
        """What reads a chat answer: the reasoning split, and the tool calls if it may make any."""
        think = (ThinkSplitter(*self.think_tags, in_reasoning=req.opens_reasoning)
                 if self.think_tags else None)
        if not req.parses_tools:
            return AnswerSplitter(think)
        return AnswerSplitter(think, ToolCallSplitter(req.tool_format, req.tools.tools),
                              req.answer_prefix)

    def logprob_format(self, req: CompletionRequest) -> LogprobFormat | None:
        """What writes ``req``'s log-probabilities (``None``: not asked)."""
        top = req.settings.logprobs
        return None if top is None else LogprobFormat(self.tokenizer, top)

    def stream_format(self, req: CompletionRequest):
        """The SSE writer of ``req``'s endpoint."""
        if req.endpoint == "responses":
            return ResponseStream(req, self.model_name, self.splitter(req), self.tokenizer,
                                  self.logprob_format(req))
        if req.endpoint == "messages":
            return MessageStream(self.model_name, self.splitter(req), self.tokenizer,
                                 req.settings.stop)
        return StreamFormat(req.endpoint, self.model_name,
                            self.splitter(req) if req.endpoint == "chat" else None,
                            include_usage=req.include_usage, logprobs=self.logprob_format(req),
                            echo=(req.prompt_ids, req.prompt_text) if req.echo_prompt else None)

    def response(self, req: CompletionRequest, text: str, tokens: list[int], last,
                 job: Job) -> dict:
        """The body of a non-streamed answer of ``req``'s endpoint."""
        n_prompt, stats = len(req.prompt_ids), self.stats(last, job)
        if req.endpoint == "responses":
            return response_body(req, self.model_name, text, last, stats, self.splitter(req),
                                 self.tokenizer, self.logprob_format(req))
        if req.endpoint == "messages":
            stop = matched_stop(self.tokenizer, tokens, req.settings.stop)
            return message_response(self.model_name, n_prompt, text, last, stats,
                                    self.splitter(req), stop)
        return full_response(req.endpoint, self.model_name, n_prompt, text, last, stats,
                             self.splitter(req) if req.endpoint == "chat" else None,
                             self.logprob_format(req),
                             (req.prompt_ids, req.prompt_text) if req.echo_prompt else None)

    async def collect(self, request, req: CompletionRequest):
        """Run to the end; a client that leaves (even while queued) cancels the job."""
        text, tokens, last, job = [], [], None, None
        scores, prompt_scores = [], None
        gen = self.generate(req)
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
                tokens += r.tokens
                if r.logprobs is not None:
                    scores += r.logprobs
                prompt_scores = prompt_scores or r.prompt_logprobs
                last = r
        finally:
            watcher.cancel()
            await gen.aclose()
        if last is not None and req.settings.logprobs is not None:
            # The last response carries the whole answer's log-probabilities (each response has
            # its own cycle's), and the prompt's (the first response's).
            last = dataclasses.replace(last, logprobs=scores, prompt_logprobs=prompt_scores)
        return "".join(text), tokens, last, job

    async def events(self, req: CompletionRequest) -> AsyncIterator[str]:
        """Server-sent events of one generation; the first item is yielded before any output."""
        fmt = self.stream_format(req)
        gen = self.generate(req)
        status, started = "ok", False
        first = asyncio.ensure_future(gen.__anext__())
        try:
            while not (await asyncio.wait({first}, timeout=self.keepalive))[0]:
                started = True  # the headers go with the first keepalive
                yield keepalive(fmt)
            job, r = first.result()  # errors before any output propagate to the handler
            started = True
            yield fmt.opening(len(req.prompt_ids), r)  # "" for completions: it has started
            while True:
                for line in fmt.add(r):
                    yield line
                if r.finish_reason is not None:
                    break
                job, r = await gen.__anext__()
            for line in fmt.closing(len(req.prompt_ids), r, self.stats(r, job)):
                yield line
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        except APIError as e:
            status = "cancelled" if e.code == "cancelled" else str(e.status)
            if not started:
                raise
            # Headers are gone: report in-band, as OpenAI and Anthropic do, and end the stream.
            yield fmt.error(e)
        finally:
            if not first.done():
                first.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await first
            await gen.aclose()
            if started:
                self.metrics.request(req.endpoint, status)


def keepalive(fmt) -> str:
    """What a stream with no output yet sends every ``--keepalive`` seconds, in the form its
    official clients skip: an SSE comment for chat and completions, Anthropic's own ``ping``
    event for messages, and for the Responses API its opening events, then ``keepalive`` events
    (:meth:`ResponseStream.keepalive`: Codex times out on events, not bytes)."""
    if isinstance(fmt, ResponseStream):
        return fmt.keepalive()
    if isinstance(fmt, MessageStream):
        return PING
    return KEEPALIVE


def build_app(server: Server):
    """The FastAPI application: routes and the handlers that give every error OpenAI's shape."""
    from fastapi import FastAPI

    app = FastAPI(title="dflash", version=__version__, docs_url=None, redoc_url=None)
    app.add_middleware(KeyCheck, keys=server.keys)
    app.add_middleware(OpenRequests, worker=server.worker)
    _add_error_handlers(app)
    _add_info_routes(app, server)
    _add_generation_routes(app, server)
    return app


def _error(endpoint: str, e: APIError):
    """``e`` as a JSON response in the endpoint's API's error shape (Anthropic's or OpenAI's)."""
    from fastapi.responses import JSONResponse

    body = error_body(e) if endpoint == "messages" else e.body()
    return JSONResponse(body, status_code=e.status)


def _add_error_handlers(app) -> None:
    """Every error the framework raises, in OpenAI's shape."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

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


def _add_info_routes(app, server: Server) -> None:
    """Health, the model list and the metrics."""
    from fastapi.responses import JSONResponse, PlainTextResponse

    from .metrics import CONTENT_TYPE

    @app.get("/health")
    async def health():
        if server.worker.lost is not None:
            return JSONResponse({"status": "error", "error": str(server.worker.lost)},
                                status_code=503)
        return server.health()

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != server.model_name:
            raise APIError(404, f"The model `{model_id}` does not exist", param="model",
                           code="model_not_found")
        return server.model_card()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics.render(), media_type=CONTENT_TYPE)


def _answerer(server: Server):
    """The handler of every generating endpoint: parse, queue, then stream or collect."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, StreamingResponse

    class CancellingStream(StreamingResponse):
        """A streaming response that closes its source however the response ends."""

        on_close = None

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                if self.on_close is not None:
                    await self.on_close()

    async def answer(request: Request, endpoint: str):
        """``POST /v1/chat/completions`` ("chat"), ``/v1/completions`` or ``/v1/messages``."""
        try:
            body = read_json(await _read_body(request))
            if endpoint == "messages":
                req = parse_messages_request(body, server.tokenizer, server.served)
            elif endpoint == "responses":
                req = parse_responses_request(body, server.tokenizer, server.served,
                                              server.responses, CALLER.get() or "")
            else:
                req = parse_request(endpoint, body, server.tokenizer, server.served)
            if server.recorder is not None:  # accepted requests only: a replay sends these
                server.recorder.write(endpoint, body, CALLER.get())
            if req.stream:
                events = server.events(req)
                # Wait for the first event (the generation has started) before answering, so
                # that errors raised before any output still get a JSON error and a 4xx.
                first = await _first_or_disconnect(request, events)
                if first is None:
                    server.metrics.request(endpoint, "cancelled")
                    return _error(endpoint, APIError(499, "client closed the request"))
                response = CancellingStream(_prepend(first, events),
                                            media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache",
                                                     "X-Accel-Buffering": "no"})
                response.on_close = events.aclose
                return response
            text, tokens, last, job = await server.collect(request, req)
            result = server.response(req, text, tokens, last, job)
            server.metrics.request(endpoint, "ok")
            return JSONResponse(result)
        except APIError as e:
            server.metrics.request(endpoint, str(e.status))
            return _error(endpoint, e)

    return answer


def _add_generation_routes(app, server: Server) -> None:
    """The OpenAI, Responses and Anthropic endpoints."""
    from fastapi import Request

    answer = _answerer(server)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, "completions")

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await answer(request, "responses")

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await answer(request, "messages")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        """Anthropic's token count: the prompt a ``/v1/messages`` body would have."""
        try:
            body = read_json(await _read_body(request))
            body.pop("stream", None)
            req = parse_messages_request({**body, "max_tokens": 1}, server.tokenizer,
                                         server.served)
        except APIError as e:
            return _error("messages", e)
        return {"input_tokens": len(req.prompt_ids)}


class OpenRequests:
    """ASGI middleware: tells the worker while a POST is open (being read, templated, queued,
    answered), so that it writes its deferred prompt cache files only when no request is on its
    way (:meth:`~.worker.Worker.request_opened`)."""

    def __init__(self, app, worker):
        self.app, self.worker = app, worker

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        self.worker.request_opened()
        try:
            await self.app(scope, receive, send)
        finally:
            self.worker.request_closed()


class KeyCheck:
    """ASGI middleware: a 401 (in the API's own error shape) for a request without a valid key,
    on every path but :data:`OPEN_PATHS`; the others run with :data:`CALLER` set to their key's
    scope name (the same one for everybody on a server without keys)."""

    def __init__(self, app, keys: APIKeys):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from fastapi.responses import JSONResponse
        from starlette.datastructures import Headers

        path = scope.get("path", "")
        if path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        sent = headers.get("authorization"), headers.get("x-api-key")
        name = self.keys.check(*sent)
        if name is None:
            message = ("invalid API key" if any(sent) else "no API key: send `Authorization: "
                       "Bearer KEY` or `x-api-key: KEY`")
            e = APIError(401, message, type_="invalid_request_error", code="invalid_api_key")
            body = error_body(e) if path.startswith("/v1/messages") else e.body()
            response = JSONResponse(body, status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        token = CALLER.set(name)
        try:
            await self.app(scope, receive, send)
        finally:
            CALLER.reset(token)


async def _read_body(request) -> bytes:
    """The request body, or a 413 when it is larger than ``MAX_BODY_BYTES`` (checked as it comes,
    so a huge body is not held in memory)."""
    too_large = APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes",
                         type_="request_too_large", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    if first:
        yield first
    async for item in rest:
        yield item


async def _first_or_disconnect(request, events: AsyncIterator[str]) -> str | None:
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


# ---------------------------------------------------------------------------------------------
# Entry points


def create_server(model: str | None = None, draft: str | None = None, *,
                  served_model_name: str | None = None, max_context: int | None = None,
                  default_max_tokens: int = 512, block_size: int | None = None,
                  max_queue: int = 64, max_concurrency: int | None = None,
                  reasoning: str = "auto", quiet: bool = False,
                  pair_memory: str | None = None, api_keys: list[str] | None = None,
                  share: str = "key", index_budget: int = DEFAULT_BUDGET,
                  prompt_cache_size: int = DEFAULT_ENTRIES, prompt_cache_bytes: int | None = None,
                  prompt_cache_dir: str | None = None,
                  prompt_cache_dir_bytes: int = DEFAULT_DISK_BYTES,
                  kv_bits: int | None = None, kv_group_size: int = 64,
                  quantized_kv_start: int = QUANTIZED_KV_START,
                  draft_window: int | None = None,
                  rank_timeout: float = RANK_TIMEOUT,
                  keepalive: float = KEEPALIVE_SECONDS, record: str | None = None) -> Server:
    """Load the pair in the worker's thread and build the app (``server.app``).

    ``max_concurrency`` ``None``: derived from memory (``default_max_concurrency``);
    ``pair_memory``: the file the pair's policy memory is read from and saved to (``None``: kept
    in the server's process only); ``api_keys``: the keys every route but ``/`` and
    ``/health`` needs (``None``: anyone may use it, as one tenant); ``share``: who shares a
    continuation index and a prefix cache, ``"key"`` (one per API key), ``"all"`` or ``"none"``
    (:class:`~.scopes.Scopes`); ``index_budget``: tokens each index holds;
    ``prompt_cache_size``, ``prompt_cache_bytes``: conversations (prompt and reply) each scope's
    prefix cache holds, and their bytes (``None``: no byte bound); ``prompt_cache_dir``,
    ``prompt_cache_dir_bytes``: those conversations also kept on disk there, each scope in a
    folder of its own within that budget, so a restart finds them; ``kv_bits``,
    ``kv_group_size``, ``quantized_kv_start``: mlx-lm's quantized KV cache for every request
    (one sequence at a time: ``max_concurrency`` 1; ``quantized_kv_start`` defaults to mlx-lm's).
    Under ``mlx.launch`` with a sharded target this is rank 0's server (the other ranks run
    :func:`follow_server`; rank 0 plans every batch and generation, the others take its plans);
    ``rank_timeout``: seconds without a finished cycle before the other ranks count as gone.
    ``keepalive``: seconds between the SSE comments a stream sends before its first output
    (:data:`KEEPALIVE`). ``record``: a folder each accepted request is appended to
    (:mod:`.record`, for ``benchmarks/replay.py``).
    """
    if not keepalive > 0:
        raise ServerConfigError(f"--keepalive {keepalive!r}: must be > 0 seconds")
    keys = APIKeys(api_keys)  # bad values: before loading
    recorder = None if record is None else Recorder(record)
    scopes = Scopes(share, index_budget, prompt_cache_size, prompt_cache_bytes,
                    prompt_cache_dir, prompt_cache_dir_bytes, defer_writes=True)
    if draft_window is not None:  # the drafter's context window; its block-size bound: once loaded
        from ..drafter import check_window

        check_window(draft_window, 1, "draft_window")
    kv = KVQuantization.from_settings(kv_bits, kv_group_size, quantized_kv_start)
    if kv is not None:
        if max_concurrency is not None and max_concurrency > 1:
            raise ServerConfigError(
                f"kv_bits={kv_bits}: quantized KV caches decode one sequence at a time; "
                f"max_concurrency={max_concurrency} must be 1")
        max_concurrency = 1
    ranks = sharded_ranks()  # rank 0 of a sharded target: the others follow its engine calls
    if ranks is not None:
        scopes.on_rank(ranks.rank)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise missing_extra("serve", "the server needs FastAPI, uvicorn and "
                            "prometheus_client") from None
    from .metrics import Metrics

    # What every request runs with unless it says otherwise: checked once the pair is loaded.
    kv_settings = None if kv is None else {"kv_bits": kv.bits, "kv_group_size": kv.group_size,
                                           "quantized_kv_start": kv.start}
    served = {"block_size": block_size, **(kv_settings or {})}
    worker = Worker(pair_loader(model, draft, draft_window, quiet, served), Metrics(),
                    max_queue=max_queue, max_concurrency=max_concurrency,
                    max_context=max_context, block_size=block_size,
                    pair_memory=pair_memory, scopes=scopes, ranks=ranks,
                    rank_timeout=rank_timeout).start()
    return Server(worker, served_model_name or worker.pair.name, max_context=max_context,
                  default_max_tokens=default_max_tokens, block_size=block_size,
                  reasoning=reasoning, keys=keys, keepalive=keepalive, kv=kv_settings,
                  recorder=recorder)


def sharded_ranks() -> Ranks | None:
    """The ranks of a launch that shards the target (``None``: one process, or one rank)."""
    from .. import distributed

    if not distributed.launched():
        return None
    ranks = distributed.join()
    return ranks if ranks.distributed else None


def pair_loader(model: str | None, draft: str | None, draft_window: int | None = None,
                quiet: bool = False, served: dict | None = None) -> Callable[[], Pair]:
    """What loads the served pair (every rank of a sharded target loads it the same way);
    ``served``: the settings every request runs with, refused once loaded if the engine would
    refuse them (:func:`check_served`)."""
    def load():
        pair = load_pair(model, draft, log=None if quiet else log)
        if draft_window is not None:  # tokens of context the drafter attends to
            pair.draft.set_window(draft_window, "draft_window")
        if served is not None:
            check_served(pair, served)
        return pair

    return load


def check_served(pair: Pair, served: dict) -> None:
    """Settings every request would be refused with, refused at start instead: a one-token
    request with the server's own settings (``block_size``, ``kv_bits``, ``kv_group_size``,
    ``quantized_kv_start``) checked as the engine checks each request
    (:func:`~dflash.request.build_request`: a block longer than the draft window, a target
    whose caches mlx-lm cannot quantize, a group size that does not divide its head dimension),
    a ``GenerationConfigError`` naming the setting."""
    build_request(target_parts(pair.model), pair.draft, pair.tokenizer, [0],
                  GenerationSettings.from_call(max_tokens=1, **served))


def follow_server(model: str | None = None, draft: str | None = None, *, share: str = "key",
                  index_budget: int = DEFAULT_BUDGET, prompt_cache_size: int = DEFAULT_ENTRIES,
                  prompt_cache_bytes: int | None = None, prompt_cache_dir: str | None = None,
                  prompt_cache_dir_bytes: int = DEFAULT_DISK_BYTES, kv_bits: int | None = None,
                  kv_group_size: int = 64, quantized_kv_start: int = QUANTIZED_KV_START,
                  draft_window: int | None = None) -> None:
    """A rank other than 0 of a sharded server: the same checks as :func:`create_server`, then
    every generation rank 0's server runs, until it stops (:func:`.sharded.follow`)."""
    ranks = sharded_ranks()
    scopes = Scopes(share, index_budget, prompt_cache_size, prompt_cache_bytes,  # as rank 0's
                    prompt_cache_dir, prompt_cache_dir_bytes)
    scopes.on_rank(ranks.rank)
    if draft_window is not None:
        from ..drafter import check_window

        check_window(draft_window, 1, "draft_window")
    KVQuantization.from_settings(kv_bits, kv_group_size, quantized_kv_start)
    follow(ranks, pair_loader(model, draft, draft_window, quiet=True), scopes)


def open_warning(host: str, keys: APIKeys) -> str | None:
    """What to say when a server without keys listens beyond this machine (``None``: nothing)."""
    if keys or host in LOCAL_HOSTS:
        return None
    return (f"warning: listening on {host} without an API key: anyone who reaches the port "
            "can use the model (give keys with --api-key or --api-keys-file)")


def run(server: Server, host: str = "127.0.0.1", port: int = 8080,
        log_level: str = "info") -> None:
    """Serve until Ctrl-C or SIGTERM; ``ServerStartError`` if it could not listen."""
    import uvicorn

    share = server.worker.scopes.share
    # Without keys there is one tenant: per key means shared by everybody.
    shared = SHARED["all" if share == "key" and not server.keys else share]
    log(f"serving `{server.model_name}` at http://{host}:{port}/v1 "
        f"(max context {server.max_context}, max concurrency {server.worker.max_concurrency}, "
        f"queue {server.worker.max_queue}, reasoning split "
        f"{'on' if server.think_tags else 'off'}, {len(server.keys) or 'no'} API "
        f"key{'' if len(server.keys) == 1 else 's'}, {shared}); "
        "Ctrl-C stops")
    warning = open_warning(host, server.keys)
    if warning:
        log(warning)
    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5,
                            access_log=log_level in ("info", "debug"))
    worker = server.worker

    class UvicornServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if worker.ranks is not None and sig == signal.SIGTERM:
                # mlx.launch ends the other ranks this way when one of them exits: every
                # client hears it (503) until the server stops, LOST_GRACE seconds later.
                from .. import distributed

                # Not in the handler itself: it interrupts the event loop's thread, which may be
                # writing to stderr (lose() logs; a re-entrant write raises).
                threading.Thread(target=worker.lose, daemon=True, args=(
                    f"{distributed.other_ranks(worker.ranks)} of the sharded target stopped "
                    "(mlx.launch is ending the launch); this server cannot generate until the "
                    "launch is restarted",)).start()
                return
            # End open streams now (they get an in-band error and close), so that the graceful
            # shutdown does not have to wait for long generations.
            worker.cancel_all()
            super().handle_exit(sig, frame)
            # uvicorn raises the signal again once it has shut down, which ends the process
            # before the worker is stopped (and the prompt cache folder written): re-raised
            # below, after that.
            exit_signals.append(sig)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    exit_signals: list[int] = []

    userver = UvicornServer(config)

    def stop_later():  # new clients still get the 503 for a while, then the server exits
        timer = threading.Timer(LOST_GRACE, lambda: setattr(userver, "should_exit", True))
        timer.daemon = True
        timer.start()

    worker.on_lost = stop_later
    try:
        userver.run()
    except SystemExit:
        if userver.started:
            raise
        # uvicorn exits the process when it cannot bind; report it as one line instead.
    finally:
        worker.stop(timeout=2.0 if worker.lost is not None else 30.0)
    if exit_signals and worker.lost is None:
        # as uvicorn would, under the handlers it restored: SIGTERM's exit status, and Ctrl-C
        # the KeyboardInterrupt the CLI reports
        signal.raise_signal(exit_signals[-1])
    if worker.lost is not None:
        if worker.thread.is_alive():
            # The engine thread waits inside a collective no other rank will join; it cannot
            # be ended, and the interpreter's exit would wait for it. (lose() logged why.)
            sys.stderr.flush()
            os._exit(1)
        raise worker.lost
    if not userver.started:
        raise ServerStartError(f"could not listen on {host}:{port}")
