"""``dflash train``: its arguments and what it runs (imported by :mod:`dflash.cli` when chosen).

The flags come from :class:`~dflash.training.options.TrainOptions`; ``--features-only`` is the one
flag that is not a training option: it fills the feature cache and exits.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..console import log
from ..default_pair import default_target_path
from ..errors import TrainConfigError
from ..ranks import init_ranks
from ..target import load_target as load
from ..target import target_parts
from .features import FeatureStore, precompute_features
from .options import TrainOptions, add_arguments, from_args
from .recipe import parse_taps
from .trainer import train


def add_train_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_arguments(p)
    p.add_argument("--features-only", action="store_true",
                   help="only fill the feature cache for --data (needs --feature-cache PATH) and exit")
    return p


def run_train(args: argparse.Namespace) -> Path:
    opts = from_args(args)
    if not opts.get("target"):
        opts["target"] = str(default_target_path())
    if getattr(args, "features_only", False):
        return features_only(TrainOptions(**opts))
    if not opts.get("out"):
        raise TrainConfigError("--out: the output drafter folder is required")
    out = train(**opts)
    if init_ranks().is_main:
        log(f"train: drafter written to {out}")
    return out


def features_only(o: TrainOptions) -> Path:
    """Fill ``--feature-cache`` for every sample of ``--data`` (with ``--feature-workers``)."""
    if o.feature_cache in (None, "", "auto", "none"):
        raise TrainConfigError("--features-only needs --feature-cache PATH")
    model, _ = load(o.target)
    taps = parse_taps(o.taps, target_parts(model).num_layers)
    del model  # the workers load their own copy
    path = Path(o.feature_cache) / FeatureStore.signature(taps, o.soft_topk)
    precompute_features(o.target, o.data, taps, o.soft_topk, path, o.max_len, o.skip_truncated,
                        max(1, o.feature_workers or 1), o.progress)
    log(f"train: features cached in {path}")
    return path
