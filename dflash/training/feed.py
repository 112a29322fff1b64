"""The feed of a training run: which samples each step trains on, with their target features.

A step reads its samples' target features (tap outputs and the teacher's top-k), which cost a
forward pass of the target each: far more than the drafter's step. So the feed fills the feature
cache first where it can (``--feature-workers``), keeps ``--stream-features`` workers computing
the samples of the next steps, and, while a step waits for a sample another process holds,
computes those of the steps ahead itself. It also owns the data order (and, with
``--refresh-data``, picks up the samples datagen wrote since the run started), because what
to compute ahead is what that order visits next. This is kept apart from
:class:`~dflash.training.trainer.Trainer` so that the loop reads as the steps it takes, and
how the features get ready can be followed in one place.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tqdm import tqdm

from ..console import log
from ..errors import TrainConfigError, TrainingDataError
from ..ranks import Ranks
from ..target import TargetParts
from .data import DataOrder, Sample, read_samples, seen_ids
from .features import FeatureStore, FeatureStream, precompute_features
from .options import TrainOptions
from .vocab import TrainingVocab

# Steps of samples the feature workers may compute ahead while the run evaluates (minutes of
# engine decoding on one core: the workers keep the other cores busy meanwhile)
EVAL_AHEAD_STEPS = 32


def status(message: str) -> None:
    """A status line on stderr that does not tear a progress bar drawn there."""
    with tqdm.external_write_mode(file=sys.stderr):
        log(message)


def feature_cache_dir(opts: TrainOptions, ckpt_dir: Path, taps: list[int]) -> Path | None:
    """The folder of this run's cached features (``--feature-cache``; ``auto``: beside the
    checkpoints), one sub-folder per tap set and top-k; ``None``: computed on demand."""
    if opts.feature_cache in ("none", "", None):
        return None
    base = ckpt_dir / "features" if opts.feature_cache == "auto" else Path(opts.feature_cache)
    return base / FeatureStore.signature(taps, opts.soft_topk)


class Feed:
    """The data order of a run (``data``) and the target features of its samples
    (``features``, and with ``--stream-features`` the ``stream`` of workers beside training).

    ``vocab`` grows with the samples ``--refresh-data`` adds (with ``--vocab data``).
    """

    def __init__(self, opts: TrainOptions, ranks: Ranks, parts: TargetParts, taps: list[int],
                 vocab: TrainingVocab, ckpt_dir: Path, samples: list[Sample]):
        self.opts, self.ranks, self.taps, self.vocab = opts, ranks, taps, vocab
        self.vocab_size = parts.vocab_size
        o = opts
        cache_dir = feature_cache_dir(o, ckpt_dir, taps)
        self.features = FeatureStore(parts, taps, o.soft_topk, cache_dir)
        self.precompute(samples)
        self.stream: FeatureStream | None = None
        if o.stream_features:
            if ranks.distributed:
                raise TrainConfigError("--stream-features: one process only (not under "
                                       "mlx.launch); use --feature-workers before the run")
            self.stream = FeatureStream(o.target, taps, o.soft_topk, cache_dir,
                                        o.stream_features)
        if o.only_cached:
            samples = self.cached(samples)
        self.data = DataOrder(samples, o.data, o.seed, o.val_percent, o.val_n,
                              self.reload if o.refresh_data else None)

    def reload(self) -> list[Sample]:
        """Pick up samples datagen wrote since the run started (at an epoch boundary)."""
        o = self.opts
        new = read_samples(o.data, o.max_len, o.skip_truncated, self.vocab_size)
        if len(new) > len(self.data.samples):
            status(f"train: data grew {len(self.data.samples)} -> {len(new)} samples")
        self.precompute(new)
        if o.only_cached:
            new = self.cached(new)
        if o.vocab == "data":
            self.vocab.add_seen(seen_ids(new))
        return new

    def precompute(self, samples: list[Sample]) -> None:
        """With ``--feature-workers N``: fill the cache for all samples with N processes first."""
        o = self.opts
        if not o.feature_workers or self.features.cache_dir is None:
            return
        missing = sum(not self.features.has(s) for s in samples)
        if missing and self.ranks.is_main:
            status(f"train: computing target features of {missing} samples with "
                   f"{o.feature_workers} processes")
            precompute_features(o.target, o.data, self.taps, o.soft_topk, self.features.cache_dir,
                                o.max_len, o.skip_truncated, o.feature_workers, o.progress)
        self.ranks.barrier()  # the others wait for rank 0's cache

    def cached(self, samples: list[Sample]) -> list[Sample]:
        """``--only-cached``: the samples whose features are in the cache already."""
        if self.features.cache_dir is None:
            raise TrainConfigError("--only-cached needs a feature cache (--feature-cache)")
        kept = [s for s in samples if self.features.has(s)]
        if not kept:
            raise TrainingDataError(f"data set {self.opts.data}: no sample has cached features in "
                                    f"{self.features.cache_dir} yet (run --features-only first)")
        return kept

    def next_samples(self) -> list[Sample]:
        """This rank's sequences of the step: every rank advances the same data order by
        ``batch_seqs * ranks`` and takes its own shard."""
        return self.ranks.shard(self.data.next_samples(self.opts.batch_seqs * self.ranks.size))

    def prepare(self, samples: list[Sample]) -> None:
        """Compute this step's features that no worker has claimed; while a worker finishes the
        others (a long-context record takes minutes), compute those of the next steps instead of
        waiting."""
        self.features.prepare(samples)
        if self.stream is None:
            return
        ahead = None
        while not all(self.features.has(s) for s in samples):
            ahead = ahead or self.upcoming(EVAL_AHEAD_STEPS)
            if not self.features.prepare_one(ahead):
                return  # nothing left to take: make_batch waits for the workers' files

    def upcoming(self, steps: int) -> list[Sample]:
        """The samples of the next ``steps`` steps (of this epoch), all ranks'."""
        return self.data.peek(steps * self.opts.batch_seqs * self.ranks.size)

    def stream_ahead(self, steps: int) -> None:
        """Ask the feature workers for the samples of the next ``steps`` steps."""
        if self.stream is not None:
            self.stream.ahead(self.upcoming(steps))

    def feature_counts(self) -> dict:
        """Target features computed by this invocation: samples (this process and the stream's
        workers) and the seconds this process spent on them (what the cache saves)."""
        n = self.features.samples_computed
        counts = {"feat_s": round(self.features.compute_time, 1)}
        if self.stream is not None:
            n += self.stream.samples_computed()
            counts["stream_cpu_s"] = round(self.stream.cpu_seconds(), 1)
        return {"feat_n": n, **counts}

    def close(self) -> None:
        """Stop the stream's workers (a sample one was computing is taken over later)."""
        if self.stream is not None:
            self.stream.close()
