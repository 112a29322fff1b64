"""The generation worker: one thread owns the model and runs every generation.

MLX state (the model, its caches, the scopes' prompt caches) belongs to a single thread, so no
two generations ever share it; the event loop talks to that thread only through each job's asyncio
queue. A job whose client left is stopped at its next cycle, or skipped if it is still queued.
Admission is first in, first out; ``max_queue`` jobs may wait, beyond that ``submit`` raises
``QueueFull``.

``max_concurrency`` is how many sequences decode together. Above 1 the worker drives the batched
engine (:class:`~dflash.batch.BatchGenerator`): jobs join it between engine steps while there is
room and leave when they finish or their client goes, so one drafter pass and one target pass
serve every active request (on this CPU 4 sequences x 4 rows cost what 1 x 16 does). A request
that asks for its own block size, verify policy, ``min_confidence`` or tree budget cannot share
the batch's: it waits for the batch to drain and runs alone through the single-sequence engine
(trees included). ``max_concurrency`` 1 is the single-sequence engine for every request.
Given the ranks of a sharded target, the worker hands each engine call to the other ranks
before it makes it (:mod:`.sharded`); a rank that is gone (a collective failed,
mlx.launch ended the launch, or no cycle finished for ``rank_timeout`` seconds) fails every open
and later job with ``RankLost``.
This module knows nothing of HTTP: a full queue raises ``QueueFull``, a cancelled job
``GenerationCancelled``, and a failed one re-raises the engine's own exception.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from .. import distributed
from ..backend import compute_dtype, release_thread_streams
from ..batch import BatchEvent, BatchGenerator
from ..console import log
from ..errors import GenerationCancelled, QueueFull, RankLost
from ..policy.memory import PairMemory
from ..ranks import Ranks
from ..settings import GenerationSettings
from ..speculative import DFlashResponse, stream_generate
from ..target import target_parts
from .scopes import Scope, Scopes
from .sharded import to_wire

MAX_DEFAULT_CONCURRENCY = 16
KV_MEMORY_SHARE = 0.5  # of the memory the weights leave free
# Seconds a sharded generation may go without finishing a cycle (or a prefill chunk) before the
# other ranks count as gone (a rank that hangs instead of exiting).
RANK_TIMEOUT = 20.0
# Seconds without a job before the replies kept for --prompt-cache-dir are written: an agent's
# next request follows its last reply within milliseconds (or after its tools ran), and a
# 4.8k-token entry's write (~220 MB, ~1 s of CPU) would share the 2 cores with its prefill.
IDLE_WRITE_S = 1.0


def _memory_bytes() -> int:
    """The memory models and caches can use: Metal's recommended working set, else the RAM."""
    import mlx.core as mx

    info = mx.device_info() if hasattr(mx, "device_info") else {}
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_bytes_per_token(model, kv_bits: int | None = None, kv_group_size: int = 64) -> float:
    """Bytes of attention cache one token adds to a sequence of ``model`` (keys and values);
    with ``kv_bits``, in mlx-lm's quantized KV cache (packed values, a scale and a bias per
    ``kv_group_size`` values)."""
    import mlx.core as mx

    dtype = compute_dtype() or mx.float16
    per_value = dtype.size if kv_bits is None else kv_bits / 8 + 2 * dtype.size / kv_group_size
    total = 0.0
    for layer in target_parts(model).layers:
        attn = getattr(layer, "self_attn", None)
        heads = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None)
        head_dim = getattr(attn, "head_dim", None)
        if heads and head_dim:
            total += 2 * heads * head_dim * per_value
    return total


def default_max_concurrency(pair, max_context: int | None) -> int:
    """Sequences whose full-context attention caches fit in half the memory the weights leave.

    ``(memory - weights) * 0.5 // (kv_bytes_per_token * max_context)``, between 1 and 16; memory
    is Metal's recommended working set (elsewhere the machine's RAM), weights those of the target
    and the drafter. Recurrent (GatedDeltaNet) layers hold a fixed state and are not counted.
    """
    from mlx.utils import tree_flatten

    weights = sum(v.nbytes for m in (pair.model, pair.draft)
                  for _, v in tree_flatten(m.parameters()))
    per_sequence = kv_bytes_per_token(pair.model) * (max_context or 4096)
    free = (_memory_bytes() - weights) * KV_MEMORY_SHARE
    if per_sequence <= 0:
        return MAX_DEFAULT_CONCURRENCY
    return int(max(1, min(MAX_DEFAULT_CONCURRENCY, free // per_sequence)))


@dataclass
class Job:
    """One generation: its prompt, its settings and the queue its events go to."""

    prompt_ids: list[int]
    settings: GenerationSettings
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancel: threading.Event = field(default_factory=threading.Event)
    scope: Scope | None = None  # whose index and prefix cache it reads and adds to
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_token: float | None = None  # when the first generated token was ready
    last: DFlashResponse | None = None  # the latest response handed to the client

    @property
    def queue_time(self) -> float:
        """Seconds the job waited for the worker (so far, while it still waits)."""
        return (self.started or self.submitted) - self.submitted

    def emit(self, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone: the server is shutting down
            self.cancel.set()


class Worker:
    """Loads the pair in its own thread and runs queued generations there, one at a time.

    ``metrics`` receives ``generation(last_response, ttft=..., tpot=...)`` and
    ``cancelled_generation()``.
    """

    def __init__(self, loader: Callable[[], Any], metrics: Any, max_queue: int = 64,
                 max_concurrency: int | None = 1, max_context: int | None = None,
                 block_size: int | None = None, pair_memory: str | None = None,
                 scopes: Scopes | None = None, ranks: Ranks | None = None,
                 rank_timeout: float = RANK_TIMEOUT):
        self.loader = loader
        self.metrics = metrics
        self.jobs: queue.Queue[Job | None] = queue.Queue()  # FIFO: admission in arrival order
        self.max_queue = max_queue
        self.max_concurrency = max_concurrency
        self.max_context = max_context  # for the memory-derived default of max_concurrency
        self.block_size = block_size  # the served block size (None: the drafter's)
        self.pair_memory = pair_memory  # the file the pair's memory is kept in (None: none)
        self.memory: PairMemory | None = None  # the loaded pair's, shared by every request
        # The index and prefix cache of each scope (one for everyone unless told otherwise).
        self.scopes = scopes if scopes is not None else Scopes("all")
        self.pair = None
        self.current: Job | None = None
        self.running: dict[int, Job] = {}  # batched jobs by engine uid
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
        # A sharded target's ranks (None: one process), what went wrong with them, who hears it.
        self.ranks = ranks if ranks is not None and ranks.distributed else None
        self.rank_timeout = rank_timeout
        self.lost: RankLost | None = None
        self.on_lost: Callable[[], None] | None = None
        self._lost_lock = threading.Lock()
        self._beat = time.monotonic()  # when the sharded engine last finished a step
        self._stopping = threading.Event()
        self._open_requests, self._open_lock = 0, threading.Lock()  # POSTs open (the server)

    def start(self) -> Worker:
        """Start the thread and wait until the pair is loaded (re-raising a load error here)."""
        self.thread.start()
        self._ready.wait()
        if self._load_error is not None:
            # Let the thread release its MLX streams before the error can reach the exit.
            self.thread.join()
            raise self._load_error
        if self.ranks is not None:
            threading.Thread(target=self._watch_ranks, name="dflash-ranks", daemon=True).start()
        return self

    def lose(self, reason: str) -> None:
        """The other ranks are gone: every running, queued and later job fails with
        ``RankLost(reason)``; ``on_lost`` hears it once."""
        with self._lost_lock:
            if self.lost is not None:
                return
            self.lost = RankLost(reason)
            # Under the lock: a job becomes open (``_claim``) either before, and hears it
            # here, or after, and hears it there; none is left waiting on a dead collective.
            told = [*self._open_jobs(), *self._take_queued()]
        for job in told:  # before logging: a write to stderr can block (a full pipe)
            job.emit("error", RankLost(reason))
        log(f"error: {reason}")
        if self.on_lost is not None:
            self.on_lost()

    def _watch_ranks(self) -> None:
        """A rank that hangs never fails a collective: a generation with no step finished for
        ``rank_timeout`` seconds counts the other ranks as gone."""
        while not self._stopping.wait(1.0) and self.lost is None:
            waited = time.monotonic() - self._beat
            if (self.current is not None or self.running) and waited > self.rank_timeout:
                self.lose(f"no answer from {distributed.other_ranks(self.ranks)} of the sharded "
                          f"target for {waited:.0f} s (a rank hangs or its link is down); this "
                          "server cannot generate until the launch is restarted")

    def _claim(self, job: Job, uid: int | None = None) -> bool:
        """Make ``job`` an open job (the current one, or running as ``uid``) unless the ranks
        are lost; then it hears why and ``False`` is returned."""
        with self._lost_lock:
            if self.lost is None:
                if uid is None:
                    self.current = job
                else:
                    self.running[uid] = job
                return True
        job.emit("error", RankLost(str(self.lost)))
        return False

    def _open_jobs(self) -> list[Job]:
        """The jobs generating now."""
        return [job for job in [self.current, *list(self.running.values())] if job is not None]

    def _take_queued(self) -> list[Job]:
        """Every queued job, taken off the queue (the shutdown marker stays on it)."""
        taken, kept = [], []
        while True:
            try:
                pending = self.jobs.get_nowait()
            except queue.Empty:
                break
            (kept if pending is None else taken).append(pending)
        for item in kept:
            self.jobs.put(item)
        return taken

    def cancel_all(self) -> None:
        """Stop the running generation at its next cycle and drop every queued one."""
        for job in self._open_jobs():
            job.cancel.set()
        for pending in self._take_queued():
            pending.cancel.set()
            pending.emit("cancelled")

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything and end the worker thread (MLX must be idle before exit)."""
        self._stopping.set()
        self.cancel_all()
        self.jobs.put(None)
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)
        if self.scopes is not None:
            self.scopes.flush()  # the last replies' files: the next start finds them

    @property
    def queue_depth(self) -> int:
        return self.jobs.qsize()

    @property
    def busy(self) -> bool:
        return self.current is not None or bool(self.running)

    @property
    def batch_size(self) -> int:
        """Sequences decoding (or prefilling) now."""
        return len(self.running) or int(self.current is not None)

    def submit(self, job: Job) -> None:
        if self.lost is not None:
            raise RankLost(str(self.lost))
        if self.jobs.qsize() >= self.max_queue:
            raise QueueFull(f"{self.jobs.qsize()} requests are already waiting; retry later")
        self.jobs.put(job)

    async def stream(self, prompt_ids: list[int], settings: GenerationSettings,
                     scope: str | None = None) -> AsyncIterator[tuple[Job, DFlashResponse]]:
        """Submit a job in ``scope`` (a key's name, see :class:`Scopes`); yield
        ``(job, response)`` per cycle. Closing the iterator cancels it."""
        job = Job(prompt_ids, settings, asyncio.get_running_loop(), asyncio.Queue(),
                  scope=self.scopes.get(scope))
        self.submit(job)
        try:
            while True:
                kind, value = await job.out.get()
                if kind == "chunk":
                    yield job, value
                elif kind == "done":
                    return
                elif kind == "cancelled":
                    raise GenerationCancelled("the generation was cancelled")
                elif kind == "error":
                    raise value
        finally:
            job.cancel.set()  # no-op when finished; stops the worker when the client left

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            release_thread_streams()  # MLX ran here: a stream left behind aborts the exit

    def _serve(self) -> None:
        try:
            self.pair = self.loader()
        except BaseException as e:  # reported to start() in the main thread
            self._load_error = e
            self._ready.set()
            return
        if self.max_concurrency is None:
            self.max_concurrency = default_max_concurrency(
                self.pair, self.max_context or self.pair.max_context)
        # What the requests' generations teach the auto policy, for the next ones.
        rows = self.pair.draft.block_size - 1
        self.memory = PairMemory(rows) if self.pair_memory is None else \
            PairMemory.open(self.pair_memory, rows)
        self._ready.set()
        # Shared prefixes (system prompts, earlier turns) are not prefilled again: each job
        # brings its scope's prefix cache (none with --share none).
        batch: BatchGenerator | None = None
        solo: Job | None = None  # a job waiting for the batch to drain, to run alone

        while True:
            if self.max_concurrency > 1 and self.lost is None:
                if batch is None:
                    try:
                        batch = self._new_batch()
                    except Exception as e:
                        if self.ranks is None:
                            raise
                        self.lose(self._gone(e))  # the call did not reach the other ranks
                        continue
                if solo is None:
                    solo = self._admit(batch)
                    if solo is False:  # shutting down
                        self._drop_running()
                        if self.ranks is not None and self.lost is None:
                            self._release_followers()
                        return
                if self.running:
                    if not self._batch_step(batch):
                        batch = None  # its caches may be mid-update: start a fresh one
                        self.scopes.clear_prompt_caches()
                    continue
                if solo is None:
                    continue
            job = solo if solo is not None else self._wait_for_job()
            solo = None
            if job is None:
                if self.ranks is not None and self.lost is None:
                    self._release_followers()
                return
            if job.cancel.is_set():  # its client left while it waited
                self.metrics.cancelled_generation()
                job.emit("cancelled")
                continue
            if self.lost is not None:
                job.emit("error", RankLost(str(self.lost)))
            elif self.ranks is not None:
                self._run_sharded(job)
            else:
                self._run_alone(job)

    def request_opened(self) -> None:
        """An HTTP request has come in (called by the server for every POST)."""
        with self._open_lock:
            self._open_requests += 1

    def request_closed(self) -> None:
        with self._open_lock:
            self._open_requests -= 1

    def _wait_for_job(self) -> Job | None:
        """The next job, waited for; once nothing has come for :data:`IDLE_WRITE_S` and no
        request is open (a long agent prompt takes a while to template), the replies queued for
        the cache folder are written first (in this thread: MLX's)."""
        while True:
            try:
                return self.jobs.get(timeout=IDLE_WRITE_S)
            except queue.Empty:
                with self._open_lock:
                    idle = self._open_requests == 0
                if idle:
                    self.scopes.write_deferred()
                    return self.jobs.get()

    def _drop_running(self) -> None:
        for job in self.running.values():
            job.emit("cancelled")
        self.running.clear()

    def _new_batch(self) -> BatchGenerator:
        """The batched engine (sharded: built on every rank; its ``auto`` decides each pass on
        rank 0 and the other ranks take the decisions, :func:`dflash.policy.agreed.agreed_batch`)."""
        policy = "auto"
        if self.ranks is not None:
            distributed.call_to_followers(self.ranks, {
                "op": "batch", "max_batch": self.max_concurrency, "block_size": self.block_size,
                "policy": policy})
        return BatchGenerator(self.pair.model, self.pair.draft, self.pair.tokenizer,
                              max_batch=self.max_concurrency, block_size=self.block_size,
                              memory=self.memory, policy=policy)

    def _batchable(self, job: Job, batch: BatchGenerator) -> bool:
        """Whether the job's engine settings are the batch's (else it runs alone)."""
        s = job.settings
        return (s.block_size in (None, batch.block_size) and s.policy in (None, batch.policy)
                and not s.min_confidence and s.tree_budget is None)

    def _admit(self, batch: BatchGenerator) -> Job | None | bool:
        """Move queued jobs into the batch while it has room (waiting when nothing runs).

        Returns a job that must run alone once the batch has drained (first in, first out: later
        jobs wait behind it), ``False`` at shutdown, else ``None``."""
        while len(self.running) < self.max_concurrency:
            try:
                job = self.jobs.get(block=False) if self.running else self._wait_for_job()
            except queue.Empty:
                return None
            if job is None:
                return False
            if job.cancel.is_set():
                self.metrics.cancelled_generation()
                job.emit("cancelled")
                continue
            if self.lost is not None:
                job.emit("error", RankLost(str(self.lost)))
                continue
            if not self._batchable(job, batch):
                return job
            settings = job.settings.per_request()
            try:
                if self.ranks is not None:
                    self._beat_now()
                    if settings.seed is None:  # every rank draws from rank 0's seed
                        settings = settings.replace(seed=distributed.random_seed())
                    distributed.call_to_followers(self.ranks, {
                        "op": "insert", "prompt_ids": list(job.prompt_ids),
                        "kwargs": to_wire(settings.changed()), "scope": job.scope.name})
                uid = batch.insert(job.prompt_ids, settings=settings, **_scoped(job))
            except ValueError as e:  # a bad request: reported to its client only
                job.emit("error", e)
                continue
            except Exception as e:
                if self.ranks is not None:  # the call did not reach the other ranks
                    reason = self._gone(e)
                    self.lose(reason)
                    job.emit("error", RankLost(reason))
                else:
                    job.emit("error", e)
                continue
            job.started = time.perf_counter()
            self._claim(job, uid)
        return None

    def _batch_step(self, batch: BatchGenerator) -> bool:
        """One engine step for every running job, events to their clients; False if it failed."""
        cancels = [uid for uid, job in self.running.items() if job.cancel.is_set()]
        for uid in cancels:
            batch.cancel(uid)
        try:
            if self.ranks is not None:
                self._beat_now()
                distributed.call_to_followers(self.ranks, {"op": "step", "cancel": cancels})
            events = batch.step()
        except Exception as e:  # the whole batch failed: every running job hears it
            if self.ranks is not None:  # the ranks may be out of step: nobody is served
                self.lose(self._gone(e))
                self.running.clear()
                return False
            traceback.print_exc()
            for job in self.running.values():
                job.emit("error", e)
            self.running.clear()
            return False
        for event in events:
            self._deliver(event)
        return True

    def _deliver(self, event: BatchEvent) -> None:
        job = self.running.get(event.uid)
        if job is None:
            return
        last = event.stats
        if event.finish_reason == "cancelled":
            del self.running[event.uid]
            self.metrics.cancelled_generation()
            job.emit("cancelled")
            return
        if job.first_token is None and event.tokens:
            job.first_token = time.perf_counter()
        job.emit("chunk", last)
        if event.finish_reason is not None:
            del self.running[event.uid]
            job.emit("done")
            self.metrics.generation(last, **job_timing(job, last))

    def _run_alone(self, job: Job) -> None:
        """The single-sequence engine for one job."""
        self.current = job
        job.started = time.perf_counter()
        try:
            gen = stream_generate(self.pair.model, self.pair.draft, self.pair.tokenizer,
                                  job.prompt_ids, memory=self.memory, **_scoped(job),
                                  settings=job.settings)
            self._relay(job, gen, lambda: not job.cancel.is_set())
        except Exception as e:  # reported to the client; the worker keeps serving
            if not isinstance(e, ValueError):
                traceback.print_exc()
            job.emit("error", e)
        finally:
            self._finished(job)

    def _relay(self, job: Job, gen, go_on: Callable[[], bool]) -> None:
        """Each response of ``gen`` to the job's client until it ends, or until ``go_on()``
        (asked after each) says stop; then "done", or "cancelled" when its client left."""
        for r in gen:
            self._beat_now()
            job.last = r
            if job.first_token is None and r.tokens:
                job.first_token = time.perf_counter()
            job.emit("chunk", r)
            if not go_on():
                gen.close()
                break
        if job.cancel.is_set() and (job.last is None or job.last.finish_reason is None):
            self.metrics.cancelled_generation()
            job.emit("cancelled")
        else:
            job.emit("done")

    def _finished(self, job: Job) -> None:
        if job.last is not None:
            self.metrics.generation(job.last, **job_timing(job, job.last))
        self.current = None


    def _beat_now(self, *_progress) -> None:
        self._beat = time.monotonic()

    def _release_followers(self) -> None:
        """Tell the other ranks there are no more calls (they exit)."""
        try:
            distributed.call_to_followers(self.ranks, None)
        except Exception:  # they are gone already
            pass

    def _run_sharded(self, job: Job) -> None:
        """One job on every rank: its call handed to the other ranks, then the single-sequence
        engine here, and after each cycle whether the ranks go on (the same cycle everywhere)."""
        self._beat_now()  # before it is current: the watchdog times a current job from here
        if not self._claim(job):
            return
        job.started = time.perf_counter()
        settings = job.settings
        if settings.seed is None:  # sampled: every rank draws from rank 0's seed
            settings = settings.replace(seed=distributed.random_seed())
        scope = job.scope if job.scope is not None else self.scopes.get(None)
        try:
            distributed.call_to_followers(self.ranks, {
                "op": "generate", "prompt_ids": list(job.prompt_ids), "kwargs": to_wire(settings.changed()),
                "scope": scope.name})
            gen = stream_generate(self.pair.model, self.pair.draft, self.pair.tokenizer,
                                  job.prompt_ids, memory=self.memory, index=scope.index,
                                  prompt_cache=scope.prompt_cache,
                                  prompt_progress_callback=self._beat_now, settings=settings)
            # the same stop decision on every rank: rank 0's
            self._relay(job, gen, lambda: bool(self.ranks.from_main(int(not job.cancel.is_set()))))
        except ValueError as e:  # a setting the engine refused, on every rank alike
            job.emit("error", e)
        except Exception as e:  # a collective failed, or the ranks are out of step
            self.lose(self._gone(e))
        finally:
            self._finished(job)

    def _gone(self, error: Exception) -> str:
        """Why the sharded server stops generating, after ``error`` (printed once)."""
        if self.lost is None:
            traceback.print_exc()
        return (f"{distributed.other_ranks(self.ranks)} of the sharded target is gone ({error}); "
                "this server cannot generate until the launch is restarted")


def _scoped(job: Job) -> dict:
    """The engine's arguments for the job's scope: its index and its prefix cache."""
    scope = job.scope
    return {"index": None if scope is None else scope.index,
            "prompt_cache": None if scope is None else scope.prompt_cache}


def job_timing(job: Job, last: DFlashResponse) -> dict:
    """Time to first token (from submission, queue included) and mean time per later token."""
    if job.first_token is None:
        return {}
    timing = {"ttft": job.first_token - job.submitted}
    if last.generation_tokens > 1:
        timing["tpot"] = (time.perf_counter() - job.first_token) / (last.generation_tokens - 1)
    return timing
