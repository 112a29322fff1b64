"""Regenerate responses with the target itself: a drafter must learn the target's own distribution.

``dflash datagen --target PATH --prompts FILE.jsonl --out DATA`` applies the target's chat template
and generates in one continuous batch (:mod:`dflash.training.capture`), appending one JSON record
per finished sample to ``DATA/gen-<run>-<worker>.jsonl``::

    {"id": ..., "prompt_ids": [...], "response_ids": [..., stop], "finish_reason": "stop"|"length",
     "domain": ...}

With features (the default) the same forward passes that generate a response also give its tap
features and the target's top-k distribution, stored under ``DATA/features/`` in the layout
``dflash train --feature-cache DATA/features`` reads: one target pass per token instead of two.
``DATA/dataset.json`` records the target's fingerprint and the taps; data of another target is
refused. ``response_ids`` keep the final stop token: a drafter must learn to end. Resumable: a
restart skips every prompt id already written (a line cut short by an interrupted run is ignored
and its prompt generated again).

Under ``mlx.launch`` (:mod:`dflash.ranks`) each rank generates its own shard of the
prompts still to do into its own ``gen-<run>-r<rank>-<worker>.jsonl``. Every rank reads which ids
are done, then rank 0 writes (or checks) the manifest, and only after a barrier do the others check
it and anyone write a record, so the ranks agree on the work and never race on the manifest.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..console import log
from ..default_pair import default_target_path
from ..errors import DataSetError, DFlashError
from ..prompts import encode_prompt, read_prompts
from ..ranks import init_ranks
from ..target import load_target as load
from ..target import target_parts
from ..workers import run_per_core
from .capture import RolloutEngine
from .data import Sample, read_records
from .dataset import FORMAT, check_manifest, save_features, target_fingerprint
from .features import FeatureStore
from .jsonl import open_append
from .recipe import parse_taps


def done_ids(out: Path) -> set[str]:
    """Ids of the prompts whose responses a data folder already holds (skipped on a restart)."""
    done = set()
    for path in Path(out).glob("gen-*.jsonl"):
        for _, rec in read_records(path):
            if isinstance(rec, dict) and "id" in rec and "response_ids" in rec:
                done.add(str(rec["id"]))
    return done


def _worker(target: str, items: list[dict], out: Path, shard: str, max_tokens: int,
            batch_size: int, temperature: float, seed: int, taps: list[int] | None, topk: int,
            chat_template: bool = True, system: str | None = None, progress: bool = True) -> None:
    """Generate ``items`` in one continuous batch; write features (if ``taps``) then records."""
    model, tokenizer = load(target)
    parts = target_parts(model)
    prompts = {it["id"]: encode_prompt(tokenizer, it, chat_template=chat_template, system=system)
               for it in items}
    items_by_id = {it["id"]: it for it in items}
    engine = RolloutEngine(parts, taps=taps or [], topk=topk, max_tokens=max_tokens,
                           batch_size=batch_size, stop_ids=tokenizer.eos_token_ids,
                           temperature=temperature, seed=seed, capture=bool(taps))
    store = (FeatureStore(parts, taps, topk, out / "features" / FeatureStore.signature(taps, topk))
             if taps else None)
    bar = tqdm(total=len(items), desc=f"datagen[{shard}]", unit="seq", disable=not progress,
               mininterval=5.0)
    with open_append(out / f"gen-{shard}.jsonl") as f:
        for r in engine.run(prompts.items()):
            if store is not None:  # features first: a record line always has its features
                ids = np.asarray(r.prompt_ids + r.response_ids, np.int32)
                save_features(store.path(Sample(r.id, ids, len(r.prompt_ids))), r)
            record = {"id": r.id, "prompt_ids": r.prompt_ids, "response_ids": r.response_ids,
                      "finish_reason": r.finish_reason}
            if items_by_id[r.id].get("domain"):
                record["domain"] = items_by_id[r.id]["domain"]
            if "messages" in items_by_id[r.id]:  # conversations can be continued (magpie)
                record["messages"] = items_by_id[r.id]["messages"]
            f.write(json.dumps(record) + "\n")
            f.flush()
            bar.update(1)
            bar.set_postfix(tok_s=f"{engine.stats.tokens_per_second:.0f}")
    bar.close()
    s = engine.stats
    log(f"datagen[{shard}]: {len(items)} sequences, {s.prompt_tokens} prompt + "
        f"{s.generated_tokens} generated tokens in {s.seconds:.0f} s "
        f"({s.tokens_per_second:.0f} record tokens/s, {s.rows / max(s.steps, 1):.1f} rows/step)")


def datagen(target: str | None, prompts: str | Path, out: str | Path, max_tokens: int = 512,
            batch_size: int = 32, workers: int = 1, temperature: float = 0.0,
            limit: int | None = None, seed: int = 0, chat_template: bool = True,
            system: str | None = None, progress: bool = True, features: bool = True,
            taps: str | list[int] | None = None, topk: int = 16, domain: str | None = None) -> Path:
    """Generate responses for every prompt of ``prompts`` not yet in ``out``; returns ``out``.

    With ``features`` (default) each record's tap features and top-k come from the passes that
    generated it, stored under ``out/features`` for training.
    """
    if target is None:
        target = str(default_target_path())
    if max_tokens < 1:
        raise DFlashError(f"--max-tokens {max_tokens}: must be >= 1")
    if batch_size < 1 or workers < 1:
        raise DFlashError("--batch-size and --workers must be >= 1")
    if features and topk < 1:
        raise DFlashError(f"--topk {topk}: must be >= 1")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DataSetError(f"--out {out}: exists and is not a folder")
    items = read_prompts(prompts)[:limit]
    if domain:
        items = [{**it, "domain": domain} for it in items]
    model, _ = load(str(target))
    parts = target_parts(model)
    tap_ids = parse_taps(taps, parts.num_layers) if features else None
    config = json.loads((Path(target) / "config.json").read_text()) \
        if (Path(target) / "config.json").is_file() else {}
    manifest = {"format": FORMAT, "target": str(target),
                "target_fingerprint": target_fingerprint(parts, config),
                "taps": tap_ids, "topk": topk if features else None}
    del model, parts
    ranks = init_ranks()
    finished = done_ids(out)  # before anyone writes: all ranks split the same work
    if ranks.is_main:
        out.mkdir(parents=True, exist_ok=True)
        check_manifest(out, manifest)
    ranks.barrier()
    if not ranks.is_main:
        check_manifest(out, manifest)  # rank 0 wrote it: only compares
    todo = [it for it in items if it["id"] not in finished]
    if ranks.is_main:
        log(f"datagen: {len(items)} prompts, {len(items) - len(todo)} already done, "
            f"{len(todo)} to go -> {out}" + (f" ({ranks.size} ranks)" if ranks.distributed else ""))
    todo = ranks.shard(todo)
    if not todo:
        return out
    t0 = time.time()
    workers = min(workers, len(todo))
    opts = dict(chat_template=chat_template, system=system, progress=progress)
    tag = time.strftime("%Y%m%d%H%M%S")  # a new file per run: appends never interleave
    if ranks.distributed:
        tag += f"-r{ranks.rank}"
    first = ranks.rank * workers  # a seed per (rank, worker): sampled runs differ across shards
    jobs = [(str(target), todo[w::workers], out, f"{tag}-{w:02d}", max_tokens, batch_size,
             temperature, seed + first + w, tap_ids, topk) for w in range(workers)]
    if workers <= 1:
        _worker(*jobs[0], **opts)
    else:
        run_per_core(_worker, jobs, "datagen", opts)
    log(f"datagen: finished in {time.time() - t0:.0f}s")
    return out


# ---------------------------------------------------------------------------------------------
# Command line (wired into ``dflash datagen`` by dflash/cli.py)


def add_datagen_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--target", help="mlx-lm target folder (default: the built-in SmolLM2 target)")
    p.add_argument("--prompts", required=True,
                   help="JSONL prompts: one object a line with messages, prompt, question or "
                        "instruction (GSM8K and HumanEval files read as they are)")
    p.add_argument("--out", required=True, help="data folder (gen-*.jsonl, appended, resumable)")
    p.add_argument("--max-tokens", type=int, default=512, help="response length cap")
    p.add_argument("--batch-size", type=int, default=32,
                   help="sequences decoded together in one continuous batch (default 32)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes (one per core is fastest on CPUs)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy, the mode the drafter will serve")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--no-features", dest="features", action="store_false",
                   help="store token ids only (no tap features / top-k for training)")
    p.add_argument("--taps", default=None,
                   help="target layers whose outputs to store (default: 5 spread over the depth)")
    p.add_argument("--topk", type=int, default=16,
                   help="entries of the target's next-token distribution to store (default 16)")
    p.add_argument("--domain", default=None,
                   help="tag every record with this domain (math, code, chat, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--system", default=None, help="system prompt to prepend")
    p.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                   help="feed the raw prompt text instead of the chat template")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def run_datagen(args: argparse.Namespace) -> Path:
    return datagen(args.target, args.prompts, args.out, max_tokens=args.max_tokens,
                   batch_size=args.batch_size, workers=args.workers,
                   temperature=args.temperature, limit=args.limit, seed=args.seed,
                   chat_template=getattr(args, "chat_template", True),
                   system=getattr(args, "system", None),
                   progress=getattr(args, "progress", True),
                   features=getattr(args, "features", True), taps=getattr(args, "taps", None),
                   topk=getattr(args, "topk", 16), domain=getattr(args, "domain", None))


__all__ = ["datagen", "done_ids", "add_datagen_args", "run_datagen"]
