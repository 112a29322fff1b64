"""The options of a training run, in one dataclass that also defines the ``dflash train`` flags.

Each field carries its CLI metadata (help text, and the flag or choices where they differ from the
field's name), so that a default is written once: :func:`add_arguments` builds the argparse
arguments, their types and defaults from the fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from ..errors import TrainConfigError

_REQUIRED = dataclasses.MISSING
ARCHS = ("dflash", "dflash2")


def option(default: Any = _REQUIRED, help: str | None = None, *, flag: str | None = None,
           choices: tuple | None = None, required: bool = False) -> Any:
    """A field of :class:`TrainOptions` with its ``dflash train`` flag.

    The flag is ``--field-name`` unless ``flag`` says otherwise; a boolean defaulting to true gets a
    ``--no-field-name`` switch, one defaulting to false a ``--field-name`` switch. A field without a
    default is required from Python; ``required`` makes the flag required on the command line too.
    """
    meta = {"help": help, "flag": flag, "choices": choices, "required": required}
    return field(default=default, metadata={"cli": meta})


@dataclass
class TrainOptions:
    target: str = option(help="mlx-lm target folder (default: the built-in SmolLM2 target)")
    data: str = option(help="folder written by `dflash datagen` (or a JSONL); several: A,B",
                       required=True)
    out: str = option(help="output drafter folder (Hugging Face DFlash)")
    arch: str = option(
        "dflash", "drafter architecture: dflash (v1: each position's argmax) or dflash2 "
        "(block-local convolutions and a candidate selector; docs/training.md)",
        choices=ARCHS)
    init_from: str | None = option(
        None, "start from this v1 drafter folder (its weights, taps, mask id, block size and "
        "draft vocabulary); with --arch dflash2 it is upgraded: identity convolutions and a zero "
        "successor codebook, so its first proposals are the v1 drafter's")
    grow_layers: int = option(
        0, "with --init-from: append this many layers to the drafter, each a copy of its last "
        "layer with the attention and MLP output projections zeroed (block expansion), so the "
        "grown drafter's first proposals are exactly its own; more depth without starting over")
    selector_weight: float = option(
        1.0, "DFlash2: weight of the selector's cross-entropy over its top-k candidates "
        "(teacher-forced predecessor) added to the DFlash loss; 0 leaves the selector untrained")
    selector_rank: int = option(256, "DFlash2: low-rank width of the selector's codebooks")
    selector_top_k: int = option(16, "DFlash2: candidates per position")
    conv_kernel_size: int = option(2, "DFlash2: convolution taps (<= block size)")
    conv_group_size: int = option(16, "DFlash2: channels per dynamic coefficient")
    sliding_window: int | None = option(
        None, "DFlash2: attention window of every layer (default: 2048 from scratch, the v1 "
        "drafter's own with --init-from)")
    draft_window: int | None = option(
        None, "train with the draft window it will run with: each block sees at most the last N "
        "positions of its context, in every layer (v1 and dflash2; >= --block-size); written to "
        "the drafter's config, so it runs with that window unless told another (default: none, "
        "the whole context)")
    layers: int = option(1, "drafter layers (default 1)")
    block_size: int = option(16)
    taps: str | None = option(
        None, "target layer ids to condition on, e.g. 1,8,14,20,27 (default: 5 spread)")
    mask_token_id: int | None = option(
        None, "mask id (default: a spare special token of the target vocabulary)")
    steps: int = option(2000)
    batch_seqs: int = option(4, "sequences per step")
    anchors: int = option(32, "anchors (blocks) per sequence")
    lr: float = option(6e-4)
    warmup: float = option(0.04, "warm-up fraction of --steps (of the CPU budget with "
                           "--lr-schedule cpu)")
    lr_schedule: str = option(
        "steps", "what the warm-up and cosine decay run over: steps (--steps) or cpu (the "
        "fraction of --cpu-budget spent: a budgeted run anneals when its budget ends, however "
        "many CPU-seconds a step costs on the machines it runs on; --steps is then only a cap)",
        choices=("steps", "cpu"))
    min_lr_ratio: float = option(0.0)
    weight_decay: float = option(0.01)
    grad_clip: float = option(1.0)
    gamma: float | None = option(None, "loss decay along the block (default 7 for block 16)")
    soft_weight: float = option(
        0.5, "weight of the soft-target term (target's own distribution), 0..1")
    soft_topk: int = option(16, "top-k of the target distribution kept for soft targets (0: none)")
    loss: str = option(
        "mix", "training loss: mix (hard-label cross-entropy and the teacher's top-k, weighted by "
        "--soft-weight), kl (forward KL to the teacher's top-k only), ce (hard labels only)",
        choices=("mix", "kl", "ce"))
    optimizer: str = option(
        "adamw", "adamw, or muon (Muon for the 2-D weight matrices of the drafter layers, AdamW "
        "for the rest: norms, the context projection, anything not 2-D)",
        choices=("adamw", "muon"))
    muon_lr: float = option(0.02, "peak learning rate of the Muon part (--optimizer muon)")
    init: str = option(
        "none", "initialise drafter layers from target layers: "
        "none|first|last|spread|aligned|ids (aligned: the layers after the "
        "deepest tap, with fc selecting that tap)")
    vocab: str = option(
        "data", "training-loss vocabulary: ids seen in the data (fast) or the full head",
        choices=("data", "full"))
    export_vocab: bool = option(
        True, "with --vocab data, do not record the training vocabulary as "
        "dflash_config.draft_vocab_ids (the engine then drafts from the full head)")
    negatives: int = option(
        1024, "random ids from outside the training vocabulary joining each step's "
        "softmax (the engine drafts with the full head)")
    mine_every: int = option(
        10, "every N steps, add ids that win the full head on training rows to the "
        "training vocabulary (0: never)")
    feature_cache: str = option(
        "auto", "folder for cached target features, `auto` (<out>/train/features) or none")
    feature_workers: int = option(
        0, "processes that fill the feature cache before training (0: compute lazily)")
    stream_features: int = option(
        0, "processes that compute, while training runs, the target features of the samples "
        "the next steps read (cached as they go; the training process computes what they have not "
        "reached). Their CPU counts in the run's")
    only_cached: bool = option(
        False, "train only on samples whose features are already cached (a separate "
        "--features-only job fills the cache as datagen writes new samples)")
    max_len: int = option(1024, "cut longer records to this length: the front of the prompt "
                                "first (the target still reads it for the features), then the end")
    skip_truncated: bool = option(False, "drop responses that hit datagen's length cap")
    refresh_data: bool = option(False, "pick up newly generated samples at each epoch boundary")
    val_percent: float = option(2.0)
    val_n: int = option(16)
    checkpoint_every: int = option(100)
    keep_checkpoints: int = option(2)
    eval_every: int = option(
        0, "steps between evaluations (validation loss, and τ with --eval-prompts)")
    eval_prompts: str | None = option(
        None, "held-out prompts JSONL for τ (per domain too when ids span several: gsm8k-0, "
        "chat-0, ...)")
    eval_n: int = option(4, "held-out prompts of each domain")
    eval_max_tokens: int = option(128)
    eval_block_sizes: str = option("16")
    seed: int = option(0)
    max_minutes: float | None = option(None, "stop (with a checkpoint) after this much wall time")
    time_budget: float | None = option(
        None, "stop cleanly after SECONDS of wall time: checkpoint, export, exit 0 (continue "
        "with --resume)")
    cpu_budget: float | None = option(
        None, "stop cleanly after SECONDS of the run's CPU time (all threads, startup included, "
        "evaluations not, summed over --resume invocations): checkpoint, export, exit 0; fair "
        "budgets on a shared machine, where wall time depends on the other jobs")
    stop_after: int | None = option(
        None, "stop (with a checkpoint) after this many steps of this invocation")
    resume: bool = option(False, "continue from the last checkpoint")
    force: bool = option(False, "overwrite an existing output folder")
    checkpoint_dir: str | None = option(None, "default: <out>/train")
    progress: bool = option(True)

    def check(self) -> None:
        """Raise :class:`TrainConfigError` for a setting outside its valid range."""
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise TrainConfigError(f"--block-size {self.block_size}: must be an integer >= 2")
        if self.layers < 1:
            raise TrainConfigError(f"--layers {self.layers}: must be >= 1")
        if self.steps < 1 or self.batch_seqs < 1 or self.anchors < 1:
            raise TrainConfigError("--steps, --batch-seqs and --anchors must be >= 1")
        if not 0.0 <= self.soft_weight <= 1.0:
            raise TrainConfigError(f"--soft-weight {self.soft_weight}: must be in [0, 1]")
        if self.loss == "kl" and self.soft_topk < 1:
            raise TrainConfigError("--loss kl needs the teacher's top-k (--soft-topk >= 1)")
        if self.arch not in ARCHS:
            raise TrainConfigError(f"--arch {self.arch!r}: one of {', '.join(ARCHS)}")
        if self.grow_layers < 0 or (self.grow_layers and not self.init_from):
            raise TrainConfigError(f"--grow-layers {self.grow_layers}: must be >= 0 and needs "
                                   "--init-from (the drafter to grow)")
        if self.init_from and self.init != "none":
            raise TrainConfigError(f"--init {self.init} and --init-from: choose one (target "
                                   "layers or a v1 drafter)")
        if self.selector_weight < 0:
            raise TrainConfigError(f"--selector-weight {self.selector_weight}: must be >= 0")
        if self.arch == "dflash2":
            if not 1 <= self.conv_kernel_size <= self.block_size:
                raise TrainConfigError(f"--conv-kernel-size {self.conv_kernel_size}: must be in "
                                       f"1..--block-size ({self.block_size})")
            for name in ("conv_group_size", "selector_rank", "selector_top_k"):
                if getattr(self, name) < 1:
                    raise TrainConfigError(f"--{name.replace('_', '-')}: must be >= 1")
        if self.draft_window is not None and (
                not isinstance(self.draft_window, int) or isinstance(self.draft_window, bool)
                or self.draft_window < self.block_size):
            raise TrainConfigError(f"--draft-window {self.draft_window!r}: must be an integer >= "
                                   f"--block-size ({self.block_size})")
        if self.sliding_window is not None and self.sliding_window < 2:
            raise TrainConfigError(f"--sliding-window {self.sliding_window}: must be >= 2")
        if self.stream_features < 0:
            raise TrainConfigError(f"--stream-features {self.stream_features}: must be >= 0")
        if self.stream_features and self.only_cached:
            raise TrainConfigError("--stream-features with --only-cached: nothing would be "
                                   "streamed (a run on the cached samples only)")
        if self.stream_features and self.feature_cache in ("none", "", None):
            raise TrainConfigError("--stream-features needs a feature cache (--feature-cache): "
                                   "the workers hand the features over through it")
        if self.lr_schedule == "cpu" and self.cpu_budget is None:
            raise TrainConfigError("--lr-schedule cpu: needs --cpu-budget (what it runs over)")
        for name in ("time_budget", "max_minutes", "cpu_budget"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise TrainConfigError(f"--{name.replace('_', '-')} {value}: must be > 0")

    @property
    def loss_soft_weight(self) -> float:
        """The weight of the soft (teacher top-k) term that ``--loss`` means: the loss is
        ``(1 - w) * hard-label CE + w * CE to the teacher's top-k``; the latter is the forward KL
        to the top-k up to the teacher's entropy, a constant."""
        return {"ce": 0.0, "kl": 1.0}.get(self.loss, self.soft_weight)

    @property
    def budget_seconds(self) -> float | None:
        """Wall time after which the run stops cleanly (``--time-budget``, ``--max-minutes``)."""
        limits = [x for x in (self.time_budget,
                              None if self.max_minutes is None else 60 * self.max_minutes)
                  if x is not None]
        return min(limits) if limits else None


def _value_type(annotation) -> type:
    """``int`` for ``int`` and ``int | None`` (the type argparse converts the flag's value to)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return args[0]
    return annotation


def add_arguments(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One ``dflash train`` flag per :class:`TrainOptions` field (except ``skip``)."""
    hints = typing.get_type_hints(TrainOptions)
    for f in dataclasses.fields(TrainOptions):
        meta = f.metadata.get("cli")
        if meta is None or f.name in skip:
            continue
        kind = _value_type(hints[f.name])
        dashed = f.name.replace("_", "-")
        kw: dict[str, Any] = {"help": meta["help"]}
        if kind is bool:
            flag = meta["flag"] or (f"--no-{dashed}" if f.default else f"--{dashed}")
            kw.update(dest=f.name, action="store_false" if f.default else "store_true")
        else:
            flag = meta["flag"] or f"--{dashed}"
            if kind is not str:
                kw["type"] = kind
            if meta["choices"]:
                kw["choices"] = meta["choices"]
            if meta["required"]:
                kw["required"] = True
            else:
                kw["default"] = None if f.default is _REQUIRED else f.default
        p.add_argument(flag, **kw)


def from_args(args: argparse.Namespace) -> dict:
    """The :class:`TrainOptions` fields an argparse namespace holds."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainOptions)
            if hasattr(args, f.name)}
