"""One training run, ``Trainer(opts).run()``, composed of the parts in this package.

The trainer owns the loop (batches, optimizer steps, logging, when to evaluate and checkpoint);
where a run starts and the drafter it starts with (:mod:`~dflash.training.start`), the data order
and the target features fed to each step (:class:`~dflash.training.feed.Feed`), the training
vocabulary (:class:`~dflash.training.vocab.TrainingVocab`), checkpoints and evaluation live in
their own modules. All state needed to resume is in checkpoints: a resumed run takes the same
steps, on the same data, with the same numbers as one that never stopped.

Under ``mlx.launch`` the run is data-parallel (:mod:`dflash.ranks`): every rank
walks the same data order, takes its own ``batch_seqs`` of each step's ``batch_seqs * ranks``
sequences, and the gradients are averaged, so all ranks hold the same weights; rank 0 alone
writes checkpoints, metrics and the export, and all ranks resume from the same checkpoint.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map
from tqdm import tqdm

from ..console import log
from ..drafter import DFlashConfig
from ..errors import TrainConfigError
from ..ranks import init_ranks
from ..target import load_target as load
from ..target import target_parts
from . import checkpoints
from .batches import Batch, make_batch
from .data import DataOrder, Sample, read_samples
from .evaluation import engine_tau, load_eval_prompts, validation_metrics
from .features import FeatureStore, FeatureStream
from .feed import EVAL_AHEAD_STEPS, Feed, status
from .initialise import export_draft, head_matrix, target_config
from .jsonl import open_append
from .loss import block_loss, block_stats
from .options import TrainOptions
from .recipe import default_gamma, loss_weights
from .start import new_drafter, resume_point, start_config
from .vocab import TrainingVocab


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _is_muon_weight(path: str, weight: mx.array) -> bool:
    """Muon takes the 2-D weight matrices of the drafter layers; AdamW everything else."""
    return path.startswith("layers.") and weight.ndim == 2


def _lr_schedule(opts: TrainOptions, peak: float, cpu_seconds: Callable[[], float]
                 ) -> Callable[[mx.array], mx.array]:
    """Linear warm-up to ``peak``, then cosine decay to ``peak * --min-lr-ratio``: over
    ``--steps``, or with ``--lr-schedule cpu`` over the fraction of ``--cpu-budget`` spent
    (``cpu_seconds()``: the run's training CPU so far)."""
    o = opts
    if o.lr_schedule == "cpu":
        return lambda _step: mx.array(
            cpu_schedule(peak, cpu_seconds() / o.cpu_budget, o.warmup, o.min_lr_ratio),
            mx.float32)
    warm = max(1, int(round(o.warmup * o.steps)))
    return optim.join_schedules(
        [optim.linear_schedule(peak * 1e-3, peak, warm),
         optim.cosine_decay(peak, max(1, o.steps - warm), peak * o.min_lr_ratio)],
        [warm])


def _make_optimizer(opts: TrainOptions, cpu_seconds: Callable[[], float]
                    ) -> tuple[optim.Optimizer, optim.AdamW]:
    """AdamW; with ``--optimizer muon``, Muon for the layers' weight matrices (AdamW last:
    it is the fallback of :class:`~mlx.optimizers.MultiOptimizer`). Also the AdamW alone: its
    learning rate is the one logged."""
    adamw = optim.AdamW(learning_rate=_lr_schedule(opts, opts.lr, cpu_seconds),
                        weight_decay=opts.weight_decay, bias_correction=True)
    if opts.optimizer == "adamw":
        return adamw, adamw
    muon = optim.Muon(learning_rate=_lr_schedule(opts, opts.muon_lr, cpu_seconds),
                      weight_decay=opts.weight_decay)
    return optim.MultiOptimizer([muon, adamw], [_is_muon_weight]), adamw


def _check_one_process(opts: TrainOptions, distributed: bool) -> None:
    """Refuse what several ranks (``mlx.launch``) cannot run together."""
    if distributed and opts.lr_schedule == "cpu":
        # each rank's CPU time is its own: their learning rates would drift apart
        raise TrainConfigError("--lr-schedule cpu: one process only (not under mlx.launch)")
    if distributed and opts.refresh_data:
        # each rank would reread a growing data set at its own moment and split another order
        raise TrainConfigError("--refresh-data: not with several ranks (mlx.launch); restart "
                               "the run with --resume to pick up new samples")


class _CpuClock:
    """CPU time of a run (``time.process_time()``: all threads of this process) over all its
    invocations, its evaluations' kept apart: validation loss and τ through the engine are
    measurement, not training, so budgets and curves count training alone."""

    def __init__(self) -> None:
        # this invocation counts from here (target load and data reading included); earlier
        # invocations' CPU comes from the checkpoint (``cpu_seconds``, ``eval_cpu_seconds``)
        self.start = time.process_time()
        self.before = 0.0
        self.eval = 0.0
        self.eval_before = 0.0

    def restore(self, saved: dict) -> None:
        self.before = float(saved.get("cpu_seconds", 0.0))
        self.eval_before = float(saved.get("eval_cpu_seconds", 0.0))

    def training_seconds(self, streamed: float) -> float:
        """Training CPU so far, the feature workers' ``streamed`` seconds included."""
        return self.before + time.process_time() - self.start - self.eval + streamed

    @property
    def eval_seconds(self) -> float:
        return self.eval_before + self.eval

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """Count the CPU of the block as evaluation (not if it raises: the run stops then)."""
        t0 = time.process_time()
        yield
        self.eval += time.process_time() - t0


class Trainer:
    """One training run; ``Trainer(opts).run()``. All state needed to resume is in checkpoints."""

    def __init__(self, opts: TrainOptions):
        self.opts = o = opts
        o.check()
        self.clock = _CpuClock()
        self.out = Path(o.out)
        self.ckpt_dir = Path(o.checkpoint_dir) if o.checkpoint_dir else self.out / "train"
        self.ranks = init_ranks()
        _check_one_process(o, self.ranks.distributed)
        self.resume_from = resume_point(o, self.ranks, self.out, self.ckpt_dir)
        saved = checkpoints.read_state(self.resume_from) if self.resume_from else None

        # Target
        self.model, self.tokenizer = load(o.target)
        self.parts = target_parts(self.model)  # UnsupportedTargetError: layers cannot be tapped
        self.tcfg = target_config(Path(o.target)) if Path(o.target).is_dir() else {}
        samples = read_samples(o.data, o.max_len, o.skip_truncated, self.parts.vocab_size)

        self.cfg_dict, vocab_ids, v1 = start_config(o, self.parts, self.tokenizer, self.tcfg,
                                                    saved, samples)
        self.cfg = DFlashConfig.from_dict(self.cfg_dict)
        self.taps = self.cfg.target_layer_ids
        self.gamma = o.gamma or default_gamma(self.cfg.block_size)
        self.row_w = loss_weights(self.cfg.block_size, self.gamma)[1:]
        self.draft = new_drafter(o, self.cfg, self.parts, saved, v1)

        # Frozen target pieces
        self.vocab = TrainingVocab(head_matrix(self.parts), self.parts.vocab_size, vocab_ids)
        self.embed = self.parts.embed_tokens
        self.parts.model.freeze()

        # Data order and the target features of its samples
        self.feed = Feed(o, self.ranks, self.parts, self.taps, self.vocab, self.ckpt_dir, samples)
        # the feed's parts, under the names the loop and the trainer's users know (set once)
        self.data: DataOrder = self.feed.data
        self.features: FeatureStore = self.feed.features
        self.stream: FeatureStream | None = self.feed.stream
        self.optimizer, self._adamw = _make_optimizer(o, lambda: self.cpu_seconds)

        # Step
        self.step = 0
        self.history: list[dict] = []
        self.ema = None
        if saved:
            self._restore(saved)
        else:
            self.data.start()
        self.data.check_resumable()
        self.eval_prompts = None
        if o.eval_prompts and o.eval_every:
            self.eval_prompts = load_eval_prompts(o.eval_prompts, self.tokenizer, o.eval_n)
        self._vg = None

    # -- views of the parts ----------------------------------------------------------------
    @property
    def samples(self) -> list[Sample]:
        return self.data.samples

    @property
    def epoch(self) -> int:
        return self.data.epoch

    @property
    def cursor(self) -> int:
        return self.data.cursor

    @property
    def order(self) -> list[str]:
        return self.data.order

    @property
    def vocab_ids(self) -> np.ndarray:
        return self.vocab.ids

    @property
    def head_w(self) -> mx.array:
        return self.vocab.head_w

    # -- one step --------------------------------------------------------------------------
    def _step_rng(self) -> np.random.Generator:
        """The step's anchors and negatives (each rank draws its own)."""
        key = [self.opts.seed, self.step, 3] + ([self.ranks.rank] if self.ranks.distributed else [])
        return np.random.default_rng(key)

    def make_batch(self, samples: list[Sample], rng: np.random.Generator,
                   n_anchors: int | None = None) -> Batch:
        o = self.opts
        return make_batch(samples, rng, self.features, self.vocab, self.draft,
                          n_anchors or o.anchors, self.row_w, o.loss_soft_weight, o.negatives)

    def train_step(self, batch: Batch) -> dict:
        if self._vg is None:
            def loss_fn(draft, head_w, batch):
                return block_loss(draft, self.embed, head_w, batch, self.opts.loss_soft_weight,
                                  self.opts.selector_weight)

            self._vg = nn.value_and_grad(self.draft, loss_fn)
        (loss, hard, correct, hidden), grads = self._vg(self.draft, self.vocab.head_w, batch)
        grads = self.ranks.average_gradients(grads)
        grads, gnorm = optim.clip_grad_norm(grads, self.opts.grad_clip)
        self.optimizer.update(self.draft, grads)
        mx.eval(self.draft.parameters(), self.optimizer.state, loss, hard, correct, gnorm)
        stats = block_stats(np.array(correct), np.array(batch.labels))
        stats.update(loss=float(loss), ce=float(hard), gnorm=float(gnorm))
        o = self.opts
        if o.vocab == "data" and o.mine_every and (self.step + 1) % o.mine_every == 0:
            rng = np.random.default_rng([o.seed, self.step, 11])
            new = self.ranks.union(self.vocab.mine_candidates(hidden, np.array(batch.labels) >= 0,
                                                              rng))
            if len(new):
                self.vocab.add(new)
        return stats

    # -- evaluation ------------------------------------------------------------------------
    def evaluate_loss(self, samples: list[Sample]) -> dict:
        """Loss/accuracy/τ-estimate on validation samples (fixed anchors, no update)."""
        return validation_metrics(self.draft, self.embed, self.vocab, samples, self.make_batch,
                                  self.opts.batch_seqs, self.opts.seed)

    def evaluate_tau(self) -> dict:
        """τ through the engine on the held-out prompts, at each ``--eval-block-sizes``."""
        o = self.opts
        return engine_tau(self.model, self.tokenizer, self.draft, self.eval_prompts,
                          o.eval_block_sizes, o.eval_max_tokens, self._draft_vocab())

    # -- checkpoints and export ------------------------------------------------------------
    def _state(self) -> dict:
        return {
            "step": self.step, **self.data.state(), "vocab_ids": self.vocab.ids.tolist(),
            "draft_config": self.cfg_dict, "options": asdict(self.opts),
            "history": self.history[-200:], "ema": self.ema, "data_samples": len(self.samples),
            "cpu_seconds": round(self.cpu_seconds, 3),
            "eval_cpu_seconds": round(self.eval_cpu_seconds, 3),
        }

    @property
    def cpu_seconds(self) -> float:
        """CPU time of the run so far (``time.process_time()``: all threads of this process), over
        all its invocations, less its evaluations': what ``--cpu-budget`` limits."""
        return self.clock.training_seconds(self.stream.cpu_seconds() if self.stream else 0.0)

    @property
    def eval_cpu_seconds(self) -> float:
        """CPU time the run's evaluations took, over all its invocations."""
        return self.clock.eval_seconds

    @property
    def cpu_before(self) -> float:
        """CPU time of the run's earlier invocations (from the checkpoint resumed)."""
        return self.clock.before

    @property
    def eval_cpu_before(self) -> float:
        return self.clock.eval_before

    def save_checkpoint(self) -> Path | None:
        """Checkpoint and export (rank 0; the other ranks hold the same weights)."""
        if not self.ranks.is_main:
            return None
        final = checkpoints.save_checkpoint(self.ckpt_dir, self.step, self.draft, self.optimizer,
                                            self._state(), self.opts.keep_checkpoints)
        self.export()
        return final

    def export(self, out: Path | None = None) -> Path:
        meta = {"step": self.step, "samples": len(self.samples), "seed": self.opts.seed,
                "arch": self.opts.arch, "init_from": self.opts.init_from,
                "grow_layers": self.opts.grow_layers,
                "soft_weight": self.opts.loss_soft_weight, "loss": self.opts.loss,
                "optimizer": self.opts.optimizer, "init": self.opts.init, "gamma": self.gamma,
                "ranks": self.ranks.size}
        if self.history:
            last = {k: v for k, v in self.history[-1].items() if k.startswith(("tau_", "val_"))}
            meta.update(last)
        cfg = self.cfg_dict
        vocab = self._draft_vocab()
        if vocab is not None:
            cfg = dict(cfg, dflash_config=dict(cfg["dflash_config"], draft_vocab_ids=vocab))
        return export_draft(self.draft, cfg, out or self.out, meta)

    def _draft_vocab(self) -> list[int] | None:
        """With ``--vocab data`` (and not ``--no-export-vocab``): the ids the drafter may propose
        at inference, i.e. its training vocabulary (``dflash_config.draft_vocab_ids``)."""
        if self.opts.vocab != "data" or not self.opts.export_vocab:
            return None
        return sorted(int(i) for i in self.vocab.ids)

    def _restore(self, saved: dict) -> None:
        checkpoints.load_weights(self.resume_from, self.draft, self.optimizer)
        self.step = saved["step"]
        self.data.restore(saved)
        self.history = saved.get("history", [])
        self.ema = saved.get("ema")
        self.clock.restore(saved)
        log(f"train: resumed from {self.resume_from} (step {self.step}, epoch {self.epoch}, "
            f"sample {self.cursor}/{len(self.order)})")

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> Path:
        # SIGTERM (what `kill` sends; a background job ignores Ctrl-C) ends the run as Ctrl-C
        # does: the step in flight is undone and checkpointed, so --resume loses nothing
        main_thread = threading.current_thread() is threading.main_thread()
        before = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
        try:
            return self._run()
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, before)
            self.feed.close()

    def _run(self) -> Path:
        o = self.opts
        t_start = time.time()
        end_step = o.steps if o.stop_after is None else min(o.steps, self.step + o.stop_after)
        main = self.ranks.is_main
        bar = tqdm(total=o.steps, initial=self.step, desc="train", unit="step",
                   disable=not (o.progress and main), dynamic_ncols=True, mininterval=2.0)
        val = self.data.validation()
        rows = 0
        t_rows = time.perf_counter()
        if main:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        if o.init_from and o.eval_every and main and self.step == 0 and not self.history:
            # a continued drafter starts far from τ 1: its curve starts where it starts
            self.feed.stream_ahead(EVAL_AHEAD_STEPS)
            self._record({"step": 0, "cpu_s": round(self.cpu_seconds, 1), **self._evaluate(val)})
        while self.step < end_step:
            rng = self._step_rng()
            before = self._snapshot()
            try:
                samples = self.feed.next_samples()
                # the workers take the next steps' samples while this process computes what
                # they have not claimed of this step's (and waits for the rest)
                self.feed.stream_ahead(2 * max(1, o.stream_features))
                self.feed.prepare(samples)
                batch = self.make_batch(samples, rng)
                st = self.train_step(batch)
            except KeyboardInterrupt:
                # The step did not happen: put weights, optimizer and data cursor back, save, stop.
                self._undo(before)
                bar.close()
                if self.step > 0 and main:
                    log(f"train: interrupted; checkpoint at step {self.step} "
                        f"({self.save_checkpoint()}); continue with --resume")
                raise
            self.step += 1
            rows += batch.n_rows
            rows_s = rows / (time.perf_counter() - t_rows)
            self.ema = st if self.ema is None else {k: 0.95 * self.ema[k] + 0.05 * st[k]
                                                    for k in st}
            lr = float(self._adamw.learning_rate)
            bar.set_postfix(loss=f"{self.ema['loss']:.3f}", acc1=f"{self.ema['acc1']:.2f}",
                            tau=f"{self.ema['tau']:.2f}", lr=f"{lr:.1e}", rows_s=f"{rows_s:.0f}")
            bar.update(1)
            last = self.step >= end_step
            out_of_time = self._out_of_time(t_start)
            record = None
            if self.step % 10 == 0 or last or out_of_time:
                record = self._step_record(st, lr, t_start, rows_s)
            if o.eval_every and main and (self.step % o.eval_every == 0 or last):
                record = record or {"step": self.step}
                self.feed.stream_ahead(EVAL_AHEAD_STEPS)  # an evaluation takes minutes
                record.update(self._evaluate(val))
            if record and main:
                self._record(record)
            if self.step % o.checkpoint_every == 0 or last or out_of_time:
                self.save_checkpoint()
            if out_of_time:
                if main:
                    status(f"train: time budget reached at step {self.step} "
                            f"({self.cpu_seconds:.0f} CPU-s); resume with --resume")
                break
        bar.close()
        if self.step >= o.steps and main:
            self.export()
        return self.out

    def _snapshot(self) -> tuple[dict, dict, dict]:
        """What a step changes (data position, weights, optimizer state), to undo it."""
        return (self.data.state(), self.draft.parameters(),
                tree_map(lambda x: x, self.optimizer.state))

    def _undo(self, snapshot: tuple[dict, dict, dict]) -> None:
        position, params, opt_state = snapshot
        self.data.restore(position)
        self.draft.update(params)
        self.optimizer.state = opt_state

    def _out_of_time(self, t_start: float) -> bool:
        """``--budget-seconds`` or ``--cpu-budget`` spent, on any rank: all ranks stop at the
        same step, or the others would wait for it forever."""
        o = self.opts
        return self.ranks.any(
            (o.budget_seconds is not None and time.time() - t_start > o.budget_seconds)
            or (o.cpu_budget is not None and self.cpu_seconds > o.cpu_budget))

    def _step_record(self, st: dict, lr: float, t_start: float, rows_s: float) -> dict:
        """The metrics record of the step just taken (``st``: its own stats)."""
        return {"step": self.step, "epoch": self.epoch, "lr": lr,
                "time": round(time.time() - t_start, 1), "rows_s": round(rows_s, 1),
                "cpu_s": round(self.cpu_seconds, 1),
                **{k: round(v, 4) for k, v in self.ema.items()},
                "step_loss": round(st["loss"], 5), "vocab": len(self.vocab.ids),
                **self.feed.feature_counts()}

    def _evaluate(self, val: list[Sample]) -> dict:
        """Validation metrics (and τ with ``--eval-prompts``), reported on stderr; their CPU
        time is not the run's (``eval_cpu_s``: all evaluations so far)."""
        with self.clock.evaluating():
            res = {k: round(v, 4) for k, v in self.evaluate_loss(val).items()}
            if self.eval_prompts:
                res.update(self.evaluate_tau())
        res["eval_cpu_s"] = round(self.eval_cpu_seconds, 1)
        status(f"[step {self.step}] " + " ".join(
            f"{k}={v}" for k, v in res.items() if k.startswith(("val_", "tau_"))))
        return res

    def _record(self, record: dict) -> None:
        """Keep a metrics record in the history and append it to ``metrics.jsonl``."""
        self.history.append(record)
        with open_append(self.ckpt_dir / "metrics.jsonl") as f:
            f.write(json.dumps(record) + "\n")


def cpu_schedule(peak: float, progress: float, warmup: float, min_ratio: float) -> float:
    """The learning rate at ``progress`` (0..1) of a CPU budget: linear warm-up from
    ``peak * 1e-3`` over the first ``warmup``, then cosine decay to ``peak * min_ratio``."""
    progress = min(max(progress, 0.0), 1.0)
    if progress < warmup:
        return peak * (1e-3 + (1 - 1e-3) * progress / warmup)
    t = (progress - warmup) / max(1.0 - warmup, 1e-9)
    low = peak * min_ratio
    return low + (peak - low) * 0.5 * (1.0 + math.cos(math.pi * t))


def train(**kwargs) -> Path:
    """Programmatic entry: ``train(target=..., data=..., out=..., steps=..., ...)``."""
    return Trainer(TrainOptions(**kwargs)).run()
