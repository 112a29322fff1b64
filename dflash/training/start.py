"""Where a training run starts, and the drafter it starts with.

A run starts in one of three ways: it resumes a checkpoint (``--resume``), it continues a
released v1 drafter (``--init-from``), or it trains a new drafter from scratch (``--arch``,
``--layers``, ``--init``, ...). Which one, and the config and vocabulary that follow from it, is
decided once, before the first step, and then fixed: a resumed run takes its config and
vocabulary from its checkpoint and never from the options, so it goes on exactly as the run that
wrote the checkpoint would have. These decisions live here, apart from
:class:`~dflash.training.trainer.Trainer`'s loop, so that they can be read on their own; each
function takes what it needs as arguments and keeps no state.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..drafter import DFlashConfig, DFlashDraftModel
from ..errors import TrainConfigError
from ..ranks import Ranks
from ..target import TargetParts
from . import checkpoints
from .data import Sample, seen_ids
from .initialise import (
    DEFAULT_WINDOW,
    align_context,
    dflash2_config_dict,
    draft_config_dict,
    grow_identity_layers,
    grown_config,
    init_from_target,
    init_layer_ids,
    new_draft,
    read_v1_drafter,
)
from .options import TrainOptions
from .recipe import parse_taps, pick_mask_token
from .vocab import initial_vocab


def resume_point(opts: TrainOptions, ranks: Ranks, out: Path, ckpt_dir: Path) -> Path | None:
    """The checkpoint this run resumes from, if any: rank 0 checks the output folder and
    chooses; every other rank resumes from rank 0's choice (the ranks must hold the same
    weights, so they cannot each pick the newest checkpoint they happen to see)."""
    resume_from = None
    if ranks.is_main:
        resume_from = checkpoints.prepare_output(out, ckpt_dir, opts.resume, opts.force,
                                                 bool(opts.checkpoint_dir))
    if ranks.distributed:
        step = ranks.from_main(-1 if resume_from is None else checkpoints.step_of(resume_from))
        resume_from = None if step < 0 else checkpoints.checkpoint_path(ckpt_dir, step)
    return resume_from


def start_config(opts: TrainOptions, parts: TargetParts, tokenizer, tcfg: dict,
                 saved: dict | None, samples: list[Sample]
                 ) -> tuple[dict, np.ndarray, DFlashDraftModel | None]:
    """The drafter's config, its training vocabulary and the v1 drafter it starts from (with
    ``--init-from``): a resumed run's from its checkpoint (``saved``), a new one's from the
    options. ``tcfg``: the target's ``config.json`` (empty when it is not a local folder)."""
    if saved:
        return saved["draft_config"], np.asarray(saved["vocab_ids"], dtype=np.int64), None
    v1 = None
    seen = seen_ids(samples)
    if opts.init_from:
        cfg_dict, v1 = v1_start(opts, parts, seen)
    else:
        cfg_dict = new_config(opts, parts, tokenizer, tcfg, seen)
    vocab_ids = initial_vocab(opts.vocab, seen, parts.vocab_size)
    if opts.vocab == "data" and v1 is not None and v1.config.draft_vocab_ids is not None:
        # keep what the v1 drafter may propose: its first proposals stay its own
        vocab_ids = np.union1d(vocab_ids, v1.config.draft_vocab_ids).astype(np.int64)
    if opts.draft_window is not None:  # trained with the window it will run with
        cfg_dict["dflash_config"]["draft_window"] = int(opts.draft_window)
    return cfg_dict, vocab_ids, v1


def new_config(opts: TrainOptions, parts: TargetParts, tokenizer, tcfg: dict,
               seen: set[int]) -> dict:
    """The config of a drafter trained from scratch (``--arch``, ``--layers``, ...); ``seen``:
    the token ids of the data, among which no mask token is picked."""
    taps = parse_taps(opts.taps, parts.num_layers)
    mask_id = opts.mask_token_id
    if mask_id is None:
        mask_id = pick_mask_token(tokenizer, parts.vocab_size, seen)
    if not 0 <= mask_id < parts.vocab_size:
        raise TrainConfigError(f"--mask-token-id {mask_id}: outside the target vocabulary")
    cfg = draft_config_dict(parts, tcfg, opts.layers, opts.block_size, taps, mask_id)
    if opts.arch == "dflash2":
        cfg = as_dflash2(opts, cfg, opts.sliding_window or DEFAULT_WINDOW)
    return cfg


def v1_start(opts: TrainOptions, parts: TargetParts, seen: set[int]
             ) -> tuple[dict, DFlashDraftModel]:
    """``--init-from``: the v1 drafter's config (upgraded with ``--arch dflash2``; its
    window kept unless ``--sliding-window``) and the drafter itself. Refuses a drafter of
    another target: its vocabulary or taps would not fit this one's."""
    cfg, v1 = read_v1_drafter(opts.init_from)
    if cfg.get("vocab_size") != parts.vocab_size or \
            max(v1.config.target_layer_ids) >= parts.num_layers:
        raise TrainConfigError(f"--init-from {opts.init_from}: drafter of another target "
                               f"(vocab {cfg.get('vocab_size')}, taps "
                               f"{v1.config.target_layer_ids})")
    cfg["dflash_config"].pop("draft_vocab_ids", None)  # the run exports its own
    if opts.grow_layers:
        cfg = grown_config(cfg, opts.grow_layers)
    if opts.arch == "dflash2":
        cfg = as_dflash2(opts, cfg, opts.sliding_window or v1.config.sliding_window)
    return cfg, v1


def as_dflash2(opts: TrainOptions, cfg: dict, window: int | None) -> dict:
    """``cfg`` upgraded to DFlash2 with the options' convolution and selector settings (one
    place for both ways a DFlash2 run starts: from scratch and from a v1 drafter)."""
    return dflash2_config_dict(cfg, opts.conv_kernel_size, opts.conv_group_size,
                               opts.selector_rank, opts.selector_top_k, window)


def new_drafter(opts: TrainOptions, cfg: DFlashConfig, parts: TargetParts, saved: dict | None,
                v1: DFlashDraftModel | None) -> DFlashDraftModel:
    """The drafter in training mode: ``v1``'s (grown by identity layers, so that it starts
    out drafting as ``v1`` did), or a new run's initialised from the target's layers
    (``--init``). A resumed run's weights are loaded later, with the optimizer's state, into
    the drafter built here from its checkpoint's config."""
    mx.random.seed(opts.seed)
    draft = new_draft(cfg, v1)
    if v1 is not None and len(draft.layers) > len(v1.layers):
        grow_identity_layers(draft, len(v1.layers))
    if not saved and opts.init != "none" and v1 is None:
        taps = cfg.target_layer_ids
        ids = init_layer_ids(opts.init, cfg.num_hidden_layers, parts.num_layers, taps)
        init_from_target(draft, parts, ids)
        if opts.init == "aligned":
            align_context(draft, parts, taps, ids[0])
    draft.train()
    return draft
