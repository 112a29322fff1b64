"""Regenerate responses with the target itself: a drafter must learn the target's own distribution.

Resumable: each worker appends finished samples to its own JSONL file in the output folder, and a
restart skips every prompt id already written. One process per core (``OPENBLAS_NUM_THREADS=1``)
beats one process with two threads on these CPUs.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

from tqdm import tqdm

from .prompts import encode_prompt, read_prompts


def done_ids(out: Path) -> set[str]:
    done = set()
    for path in out.glob("gen-*.jsonl"):
        with path.open() as f:
            for line in f:
                try:
                    done.add(json.loads(line)["id"])
                except (json.JSONDecodeError, KeyError):
                    continue  # a line cut short by an interrupted run: regenerated
    return done


def load_samples(data: str | Path) -> list[dict]:
    """All generated samples in a data folder (``prompt_ids``, ``response_ids``)."""
    data = Path(data)
    files = sorted(data.glob("gen-*.jsonl")) if data.is_dir() else [data]
    samples = []
    for path in files:
        with path.open() as f:
            for line in f:
                try:
                    samples.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    samples.sort(key=lambda s: s["id"])
    if not samples:
        raise ValueError(f"data set {data} holds no samples (run `dflash datagen` first)")
    return samples


def _worker(target: str, items: list[dict], out: Path, worker: int, max_tokens: int,
            batch_size: int, temperature: float, seed: int, position: int) -> None:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    from .model_mlx import load

    model, tokenizer = load(target)
    mx.random.seed(seed + worker)
    eos = sorted(tokenizer.eos_token_ids)
    sampler = make_sampler(temp=temperature)
    path = out / f"gen-{worker:02d}.jsonl"
    bar = tqdm(total=len(items), desc=f"datagen[{worker}]", position=position, unit="prompt")
    prompts = {it["id"]: encode_prompt(tokenizer, it) for it in items}
    gen = BatchGenerator(model, stop_tokens=[[t] for t in eos], sampler=sampler,
                         completion_batch_size=batch_size)
    uids = gen.insert(list(prompts.values()), [max_tokens] * len(items))
    id_of = dict(zip(uids, prompts))
    tokens = {u: [] for u in uids}
    with path.open("a") as f:
        while responses := gen.next_generated():
            for r in responses:
                # Keep the stop token (mlx-lm drops it): the drafter must learn to end.
                tokens[r.uid].append(r.token)
                if r.finish_reason is not None:
                    sample_id = id_of[r.uid]
                    f.write(json.dumps({
                        "id": sample_id, "prompt_ids": prompts[sample_id],
                        "response_ids": tokens.pop(r.uid), "finish_reason": r.finish_reason,
                    }) + "\n")
                    f.flush()
                    bar.update(1)
    gen.close()
    bar.close()


def datagen(target: str, prompts: str | Path, out: str | Path, max_tokens: int = 512,
            batch_size: int = 16, workers: int = 1, temperature: float = 0.0,
            limit: int | None = None, seed: int = 0) -> Path:
    out = Path(out)
    items = read_prompts(prompts)[:limit]
    out.mkdir(parents=True, exist_ok=True)
    finished = done_ids(out)
    todo = [it for it in items if it["id"] not in finished]
    print(f"datagen: {len(items)} prompts, {len(finished)} already done, {len(todo)} to go -> {out}")
    if not todo:
        return out
    t0 = time.time()
    if workers <= 1:
        _worker(target, todo, out, 0, max_tokens, batch_size, temperature, seed, 0)
    else:
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(target, todo[w::workers], out, w, max_tokens,
                                                   batch_size, temperature, seed, w))
                 for w in range(workers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        bad = [p.exitcode for p in procs if p.exitcode]
        if bad:
            raise RuntimeError(f"datagen worker failed with exit code {bad[0]}")
    print(f"datagen: finished in {time.time() - t0:.0f}s")
    return out
