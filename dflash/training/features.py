"""Target features: the tapped layer outputs a drafter conditions on, and the teacher's top-k.

One teacher-forced target pass per sample yields both; they are the expensive part of a training
step, so they can be cached on disk (float16 / int32 per sample, computed once, reused every
epoch) and filled beforehand by one single-threaded process per core (``--feature-workers``), or
while training runs (``--stream-features``: processes that compute the samples the next steps
read, so that a run over records whose features do not exist yet keeps every core busy; on the
built-in target a sample costs ~5-10 CPU-s, a training step of 4 samples ~9 CPU-s, so the first
epoch over new records is mostly features).

Several processes fill one cache without computing a sample twice: a process about to compute a
sample first creates its claim file (``O_EXCL``, holding its pid) and the others wait for the
features instead; a claim whose process is gone is taken over.

A sample cut to ``--max-len`` from the front of its prompt (``Sample.prefix``) is computed over its
whole context, ``prefix + ids``, and keeps the rows of ``ids`` only: its features are those of the
uncut record at those positions, as the target sees them when it serves that document.
"""

from __future__ import annotations

import errno
import hashlib
import multiprocessing as mp
import os
import queue
import time
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..target import forward, make_cache, target_parts
from ..target import load_target as load
from ..workers import run_per_core, start_per_core
from .capture import filler_rows
from .data import Sample, read_samples

# Rows per pass when computing features (long-context records run several passes through one cache)
FEATURE_CHUNK = 1024


class FeatureStore:
    """Target features (concatenated tap outputs) and the target's top-k next-token distribution.

    ``feats[p]`` are the tap outputs for the token at position ``p``; ``top_ids[p]`` / ``top_logp[p]``
    the target's distribution of the token at ``p + 1`` (teacher-forced), over the full head so that
    one cache serves every run, for response rows ``p >= prompt_len`` (the only ones training
    reads: anchors lie in the response). Prompt rows hold the filler of ``capture`` (id 0,
    log-probability -inf) and never reach the head, which saves ~12 % of a long-context record's
    pass (4,836 tokens, 92 % prompt: 108-117 CPU-s instead of 123-135) and 10-16 % of short ones
    (six records, 42 % prompt). Stored per sample under ``cache_dir`` when given, else computed
    on demand.
    """

    def __init__(self, parts, taps: list[int], topk: int, cache_dir: Path | None):
        self.parts, self.taps, self.topk = parts, list(taps), int(topk)
        self.cache_dir = Path(cache_dir) if cache_dir else None
        if self.cache_dir:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.chunk = FEATURE_CHUNK
        self.compute_time = 0.0
        self.tokens_computed = 0
        self.samples_computed = 0

    @staticmethod
    def signature(taps, topk) -> str:
        """The cache sub-folder of one tap set and top-k: other settings never share files."""
        return "taps-" + "-".join(map(str, taps)) + f"_top{topk}"

    def path(self, sample: Sample) -> Path:
        """Where the features of ``sample`` are stored (a hash of its id and tokens; of its
        prefix too when it has one, so that the key of a record that fits never changes)."""
        h = hashlib.sha1(sample.id.encode() + b"|" + np.asarray(sample.ids, np.int32).tobytes())
        if len(sample.prefix):
            h.update(b"|prefix|" + np.asarray(sample.prefix, np.int32).tobytes())
        key = h.hexdigest()[:24]
        return self.cache_dir / key[:2] / f"{key}.npz"

    def _whole(self, sample: Sample) -> Path | None:
        """The file of the uncut ``prefix + ids`` (e.g. captured by ``dflash datagen`` over the
        whole record), whose rows past the prefix are this cut sample's; None without a prefix."""
        if not len(sample.prefix):
            return None
        whole = Sample(sample.id, np.concatenate([sample.prefix, sample.ids]).astype(np.int32),
                       sample.prompt_len + len(sample.prefix))
        return self.path(whole)

    def has(self, sample: Sample) -> bool:
        if self.cache_dir is None:
            return False
        whole = self._whole(sample)
        return self.path(sample).is_file() or (whole is not None and whole.is_file())

    def compute(self, ids: np.ndarray, prefix: np.ndarray | None = None,
                head_from: int = 0) -> dict[str, np.ndarray]:
        """Features and top-k of ``ids``, read by the target after ``prefix`` (its rows dropped);
        the top-k of rows of ``ids`` before ``head_from`` is filler (the head never sees them)."""
        t0 = time.perf_counter()
        skip = 0 if prefix is None else len(prefix)
        tokens = np.concatenate([prefix, ids]) if skip else np.asarray(ids)
        head_from = min(max(int(head_from), 0), len(ids))
        logits, feats = self._forward(tokens, skip, skip + head_from)
        feats = feats.astype(mx.float16)
        res = {}
        if self.topk:
            logits = logits.astype(mx.float32)
            lse = mx.logsumexp(logits, -1, keepdims=True)
            mx.eval(feats, logits, lse)
            lg = np.array(logits)
            k = min(self.topk, lg.shape[-1])
            top = np.argpartition(-lg, k - 1, axis=-1)[:, :k]
            logp = np.take_along_axis(lg, top, -1) - np.array(lse)
            filler_ids, filler_logp = filler_rows(head_from, k)
            res["top_ids"] = np.concatenate([filler_ids, top.astype(np.int32)])
            res["top_logp"] = np.concatenate([filler_logp, logp.astype(np.float16)])
        else:
            mx.eval(feats)
        res["feats"] = np.array(feats)
        if not np.isfinite(res["feats"]).all():
            # float16 overflow of a huge activation: keep the values, clipped (rare)
            res["feats"] = np.nan_to_num(res["feats"], nan=0.0, posinf=65504.0, neginf=-65504.0)
        self.tokens_computed += len(tokens)
        self.samples_computed += 1
        self.compute_time += time.perf_counter() - t0
        return res

    def _load(self, sample: Sample) -> dict[str, np.ndarray] | None:
        path = self.path(sample)
        for stored, skip in ((path, 0), (self._whole(sample), len(sample.prefix))):
            if stored is None or not stored.is_file():
                continue
            try:
                with np.load(stored) as z:
                    return {k: z[k][skip:] for k in z.files}
            except (EOFError, OSError, ValueError, zipfile.BadZipFile):
                pass  # a file cut short (written before writes were atomic, or a full disk): recompute
        return None

    def _claim_path(self, sample: Sample) -> Path:
        return self.path(sample).with_suffix(".claim")

    def claim(self, sample: Sample) -> bool:
        """Take the job of computing ``sample``: False while another live process holds it (a
        claim whose process is gone is taken over)."""
        claim = self._claim_path(sample)
        claim.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if _claim_alive(claim):
                    return False
                claim.unlink(missing_ok=True)  # its process is gone: take it over
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            return True
        return False

    def release(self, sample: Sample) -> None:
        self._claim_path(sample).unlink(missing_ok=True)

    def compute_and_store(self, sample: Sample) -> dict[str, np.ndarray]:
        """Compute ``sample``'s features and write them (atomically: a reader never sees half)."""
        res = self.compute(sample.ids, sample.prefix, sample.prompt_len)
        path = self.path(sample)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.stem + f".tmp{os.getpid()}.npz")
        try:
            np.savez(tmp, **res)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return res

    def prepare(self, samples: list[Sample]) -> None:
        """Compute (and store) those of ``samples`` that are neither cached nor claimed by
        another process; :meth:`get` then waits for the claimed ones only."""
        while self.prepare_one(samples):
            pass

    def _forward(self, tokens: np.ndarray, skip: int, head_from: int) -> tuple[mx.array, mx.array]:
        """Taps of the rows past ``skip`` and logits of the rows past ``head_from``: one
        teacher-forced pass, fed in chunks of ``self.chunk`` rows through one cache. The same
        rows as a single pass (to float rounding), without every layer's whole attention matrix
        at once: on a 4,836-token long-context record 105 CPU-s instead of 154."""
        cache = make_cache(self.parts)
        logits, feats = [], []
        for start in range(0, len(tokens), self.chunk):
            piece = tokens[start:start + self.chunk]
            keep = min(max(skip - start, 0), len(piece))  # rows of this piece inside the prefix
            head = min(max(head_from - start, 0), len(piece))  # rows of this piece before the head
            lg, ft = forward(self.parts, mx.array(piece)[None], cache, self.taps,
                             logits_rows=slice(head, None) if head else None)
            lg, ft = lg[0], ft[0, keep:]
            mx.eval(lg, ft, *[c.state for c in cache])  # the cache grows chunk by chunk
            logits.append(lg)
            feats.append(ft)
        return mx.concatenate(logits), mx.concatenate(feats)

    def prepare_one(self, candidates: list[Sample]) -> bool:
        """Compute the first of ``candidates`` that is neither cached nor claimed; False when
        there is none (what a process waiting for another's sample does meanwhile)."""
        if self.cache_dir is None:
            return False
        for s in candidates:
            if not self.has(s) and self.claim(s):
                try:
                    if not self.has(s):
                        self.compute_and_store(s)
                        return True
                finally:
                    self.release(s)
        return False

    def get(self, sample: Sample) -> dict[str, np.ndarray]:
        if self.cache_dir is None:
            return self.compute(sample.ids, sample.prefix, sample.prompt_len)
        while True:
            res = self._load(sample)
            if res is not None:
                return res
            if self.claim(sample):
                try:  # its claimant may have finished between the load and the claim
                    return self._load(sample) or self.compute_and_store(sample)
                finally:
                    self.release(sample)
            time.sleep(0.05)  # another process is computing it: its file appears soon


def _claim_alive(claim: Path) -> bool:
    """Whether the process named in a claim file still runs (an unreadable claim counts as alive:
    its writer may not have written its pid yet)."""
    try:
        pid = int(claim.read_text() or 0)
    except (OSError, ValueError):
        return True
    if pid <= 0:
        return time.time() - _mtime(claim) < 60  # created, pid not yet written
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


class FeatureStream:
    """``--stream-features N``: N processes computing, beside training, the features of the
    samples the next steps read (:meth:`ahead`); their CPU time (:meth:`cpu_seconds`) is the
    run's too. Each loads its own copy of the target."""

    def __init__(self, target: str, taps: list[int], topk: int, cache_dir: Path, workers: int):
        self.store = FeatureStore(None, taps, topk, cache_dir)
        ctx = mp.get_context("spawn")
        self.requests = ctx.Queue()
        self.cpu = ctx.Array("d", workers)
        self.computed = ctx.Array("i", workers)  # samples each worker computed
        self.sent: set[str] = set()
        self.procs = start_per_core(
            _stream_worker, [(str(target), list(taps), int(topk), str(cache_dir), self.requests,
                              self.cpu, self.computed, w) for w in range(workers)], daemon=True)

    def ahead(self, samples: list[Sample]) -> None:
        """Ask for the features of ``samples`` (in this order), once each."""
        for s in samples:
            if s.id not in self.sent and not self.store.has(s):
                self.sent.add(s.id)
                self.requests.put(s)

    def cpu_seconds(self) -> float:
        """CPU time the workers spent so far (updated after each sample they finish)."""
        return float(sum(self.cpu[:]))

    def samples_computed(self) -> int:
        return int(sum(self.computed[:]))

    def close(self) -> None:
        for _ in self.procs:
            self.requests.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()  # in the middle of a sample: its claim is taken over later
                p.join()


def _stream_worker(target: str, taps: list[int], topk: int, cache_dir: str, requests,
                   cpu, computed, worker: int) -> None:
    parent = os.getppid()
    model, _ = load(target)
    store = FeatureStore(target_parts(model), taps, topk, Path(cache_dir))
    cpu[worker] = time.process_time()
    while True:
        try:
            sample = requests.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return  # the run is gone
            continue
        if sample is None:
            return
        store.prepare([sample])
        cpu[worker] = time.process_time()
        computed[worker] = store.samples_computed


def _feature_worker(target: str, data: str, taps: list[int], topk: int, cache_dir: str,
                    max_len: int, skip_truncated: bool, worker: int, workers: int,
                    progress: bool) -> None:
    model, _ = load(target)
    parts = target_parts(model)
    store = FeatureStore(parts, taps, topk, Path(cache_dir))
    samples = read_samples(data, max_len, skip_truncated, parts.vocab_size)
    # In a fixed shuffled order, not by id (which groups the domains): a run training on the
    # cache while it fills (--only-cached --refresh-data) sees every domain from the start.
    shuffled = sorted(samples, key=lambda s: hashlib.sha1(s.id.encode()).digest())
    todo = [s for s in shuffled[worker::workers] if not store.has(s)]
    bar = tqdm(todo, desc=f"features[{worker}]", position=worker, disable=not progress,
               unit="seq", mininterval=5.0)
    for s in bar:
        store.prepare([s])  # a sample another process is computing is left to it
        bar.set_postfix(tok_s=f"{store.tokens_computed / max(store.compute_time, 1e-9):.0f}")
    bar.close()


def precompute_features(target: str, data: str, taps: list[int], topk: int, cache_dir: Path,
                        max_len: int = 1024, skip_truncated: bool = False, workers: int = 1,
                        progress: bool = True) -> Path:
    """Fill the feature cache for every sample of ``data`` (one process per worker).

    One single-threaded process per core beats one process with several BLAS threads here.
    """
    cache_dir = Path(cache_dir)
    args = (str(target), str(data), list(taps), int(topk), str(cache_dir), max_len, skip_truncated)
    if workers <= 1:
        _feature_worker(*args, 0, 1, progress)
        return cache_dir
    run_per_core(_feature_worker, [(*args, w, workers, progress) for w in range(workers)],
                 "feature")
    return cache_dir
