"""Regenerate responses with the target itself: a drafter must learn the target's own distribution.

``dflash datagen --target PATH --prompts FILE.jsonl --out DATA`` applies the target's chat template,
generates in batches with mlx-lm's ``BatchGenerator`` and appends one JSON record per finished
sample to ``DATA/gen-<worker>.jsonl``::

    {"id": ..., "prompt_ids": [...], "response_ids": [..., stop], "finish_reason": "stop"|"length"}

``response_ids`` keep the final stop token (mlx-lm leaves it out): a drafter must learn to end.
Resumable: a restart skips every prompt id already written (a line cut short by an interrupted run
is ignored and its prompt generated again). One process per core (``OPENBLAS_NUM_THREADS=1``) beats
one process with two threads on these CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler
from tqdm import tqdm

from ..console import log
from ..default_pair import default_target_path
from ..errors import DataSetError, DFlashError
from ..model_mlx import load
from ..prompts import encode_prompt, read_prompts
from ..workers import run_per_core
from .data import read_records


def done_ids(out: Path) -> set[str]:
    """Ids of the prompts whose responses a data folder already holds (skipped on a restart)."""
    done = set()
    for path in Path(out).glob("gen-*.jsonl"):
        for _, rec in read_records(path):
            if isinstance(rec, dict) and "id" in rec and "response_ids" in rec:
                done.add(str(rec["id"]))
    return done


def _open_append(path: Path):
    """Append mode that first ends a line an interrupted run left unfinished."""
    f = path.open("a+b")
    if f.tell() > 0:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")
    f.close()
    return path.open("a")


def _worker(target: str, items: list[dict], out: Path, worker: int, max_tokens: int,
            batch_size: int, temperature: float, seed: int, position: int,
            chat_template: bool = True, system: str | None = None, progress: bool = True) -> None:
    model, tokenizer = load(target)
    mx.random.seed(seed + worker)
    eos = sorted(tokenizer.eos_token_ids)
    sampler = make_sampler(temp=temperature)
    path = out / f"gen-{worker:02d}.jsonl"
    bar = tqdm(total=len(items), desc=f"datagen[{worker}]", position=position, unit="prompt",
               disable=not progress, mininterval=2.0)
    prompts = {it["id"]: encode_prompt(tokenizer, it, chat_template=chat_template, system=system)
               for it in items}
    gen = BatchGenerator(model, stop_tokens=[[t] for t in eos], sampler=sampler,
                         completion_batch_size=batch_size)
    uids = gen.insert(list(prompts.values()), [max_tokens] * len(items))
    id_of = dict(zip(uids, prompts))
    tokens = {u: [] for u in uids}
    n_tokens, t0 = 0, time.perf_counter()
    with _open_append(path) as f:
        while responses := gen.next_generated():
            for r in responses:
                # Keep the stop token (mlx-lm drops it): the drafter must learn to end.
                tokens[r.uid].append(int(r.token))
                n_tokens += 1
                if r.finish_reason is not None:
                    sample_id = id_of[r.uid]
                    f.write(json.dumps({
                        "id": sample_id, "prompt_ids": prompts[sample_id],
                        "response_ids": tokens.pop(r.uid), "finish_reason": r.finish_reason,
                    }) + "\n")
                    f.flush()
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{n_tokens / (time.perf_counter() - t0):.0f}")
    gen.close()
    bar.close()


def datagen(target: str | None, prompts: str | Path, out: str | Path, max_tokens: int = 512,
            batch_size: int = 16, workers: int = 1, temperature: float = 0.0,
            limit: int | None = None, seed: int = 0, chat_template: bool = True,
            system: str | None = None, progress: bool = True) -> Path:
    """Generate responses for every prompt of ``prompts`` not yet in ``out``; returns ``out``."""
    if target is None:
        target = str(default_target_path())
    if max_tokens < 1:
        raise DFlashError(f"--max-tokens {max_tokens}: must be >= 1")
    if batch_size < 1 or workers < 1:
        raise DFlashError("--batch-size and --workers must be >= 1")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DataSetError(f"--out {out}: exists and is not a folder")
    items = read_prompts(prompts)[:limit]
    out.mkdir(parents=True, exist_ok=True)
    finished = done_ids(out)
    todo = [it for it in items if it["id"] not in finished]
    log(f"datagen: {len(items)} prompts, {len(items) - len(todo)} already done, "
          f"{len(todo)} to go -> {out}")
    if not todo:
        return out
    t0 = time.time()
    workers = min(workers, len(todo))
    opts = dict(chat_template=chat_template, system=system, progress=progress)
    if workers <= 1:
        _worker(str(target), todo, out, 0, max_tokens, batch_size, temperature, seed, 0, **opts)
    else:
        run_per_core(_worker, [(str(target), todo[w::workers], out, w, max_tokens, batch_size,
                                temperature, seed, w) for w in range(workers)],
                     "datagen", opts)
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
    p.add_argument("--batch-size", type=int, default=16, help="sequences decoded together")
    p.add_argument("--workers", type=int, default=1,
                   help="processes (one per core is fastest on CPUs)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy, the mode the drafter will serve")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
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
                   progress=getattr(args, "progress", True))


__all__ = ["datagen", "done_ids", "add_datagen_args", "run_datagen"]
