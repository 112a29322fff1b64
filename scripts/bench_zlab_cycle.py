"""The engine's cycle against z-lab's reference MLX loop, at a fixed chain, on the same weights.

Issue 13 asks that our cycle (draft a block, verify it, accept, roll back) stay >= 1.2x cheaper
than z-lab's (PyPI ``dflash`` 0.1.0, ``dflash/model_mlx.py``) at a fixed chain. Both loops run in
this one process, alternating prompt by prompt, so background load hits both alike:

* ours: ``policy="fixed"`` (every drafted row verified), greedy;
* z-lab's: its ``stream_generate``, which always verifies the whole block, greedy.

Same target folder (the built-in float32 target unless ``--model``), same drafter weights: ours
loads the 6-bit checkpoint and (on the CPU) computes in float32; z-lab's loader reads only
unquantized safetensors, so it gets the same weights dequantized (``--zlab-draft float32``: the
numbers our engine computes with) or re-quantized by its own ``--draft-bits`` path
(``--zlab-draft 6bit``: ``nn.quantize`` 6-bit, group 64, as its CLI does). Same prompt token ids.

A cycle's time is decode wall time (first token to last, prefill excluded) over the cycles run;
the ratio is z-lab ms/cycle over ours (> 1: ours is cheaper). Per-token times are printed too:
they also fold in each side's acceptance (z-lab proposes over the full vocabulary; our engine
honours the checkpoint's ``draft_vocab_ids``).

z-lab's package is also called ``dflash``; install it apart and point ``--zlab`` at it:

    pip install --target /tmp/zlab --no-deps dflash==0.1.0
    python scripts/bench_zlab_cycle.py --zlab /tmp/zlab [--prompts docs/bench/heldout-mix.jsonl]
        [--limit 6] [--max-tokens 96] [--block-size 16] [--repeats 2] [--zlab-draft float32]

Its code is only imported and called here (as ``zlab_dflash``), never copied.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# isort: off
import dflash  # noqa: F401  (OpenBLAS before mlx, for both loops alike)
import mlx.core as mx
import mlx.nn as nn
# isort: on
from mlx.utils import tree_flatten

from dflash.bench import load_prompts
from dflash.model_mlx import load, load_draft
from dflash.prompts import encode_prompt
from dflash.speculative import stream_generate


def import_zlab(root: Path):
    """z-lab's ``dflash`` package from ``root`` under the name ``zlab_dflash`` (ours keeps
    ``dflash``); returns its ``model_mlx`` module."""
    init = root / "dflash" / "__init__.py"
    if not init.is_file():
        sys.exit(f"{init} not found: pip install --target {root} --no-deps dflash==0.1.0")
    spec = importlib.util.spec_from_file_location(
        "zlab_dflash", init, submodule_search_locations=[str(init.parent)])
    package = importlib.util.module_from_spec(spec)
    sys.modules["zlab_dflash"] = package
    spec.loader.exec_module(package)
    import zlab_dflash.model_mlx as zmlx  # noqa: E402  (registered just above)

    return zmlx


def zlab_draft(zmlx, draft_dir: Path, our_draft, bits: int | None):
    """z-lab's drafter with our drafter's weights: written unquantized (as our engine computes
    them) to a folder its loader reads, optionally quantized by its own ``--draft-bits`` path."""
    cfg = json.loads((draft_dir / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        cfg.pop(key, None)
    folder = Path(tempfile.mkdtemp(prefix="zlab-draft-"))
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"),
                        dict(tree_flatten(our_draft.parameters())))
    # Its loader resolves every id through the Hugging Face hub; a local folder is its own
    # snapshot. Rebinding the name in its module keeps the loader itself untouched.
    zmlx.snapshot_download = lambda repo_id, **_: repo_id
    draft = zmlx.load_draft(str(folder))
    if bits is not None:  # what its CLI does for --draft-bits
        nn.quantize(draft, group_size=64, bits=bits)
        mx.eval(draft.parameters())
    return draft


def run_ours(model, draft, tokenizer, ids: list[int], max_tokens: int, block: int) -> dict:
    first, last, tokens = None, None, []
    for r in stream_generate(model, draft, tokenizer, ids, block_size=block,
                             max_tokens=max_tokens, policy="fixed"):
        if first is None:
            first = time.perf_counter()
        tokens.extend(r.tokens)
        last = r
    end = time.perf_counter()
    return {"time": end - first, "cycles": last.cycles, "tokens": tokens}


def run_zlab(zmlx, model, draft, tokenizer, ids: list[int], max_tokens: int, block: int) -> dict:
    first, cycles, tokens = None, 0, []
    for r in zmlx.stream_generate(model, draft, tokenizer, mx.array(ids), block_size=block,
                                  max_tokens=max_tokens, temperature=0.0):
        if first is None:
            first = time.perf_counter()
        elif r.accepted is not None:  # one response per cycle (not the first token, not the end)
            cycles += 1
        tokens.extend(r.tokens)
    end = time.perf_counter()
    return {"time": end - first, "cycles": cycles, "tokens": tokens}


def spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f}, n={len(xs)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zlab", type=Path, default=Path("/tmp/zlab"),
                    help="folder holding z-lab's `dflash` package (pip install --target)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts", default="docs/bench/heldout-mix.jsonl")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--zlab-draft", choices=("float32", "6bit"), default="float32")
    args = ap.parse_args()

    from dflash.pair import default_paths

    model_path, draft_path = default_paths(args.model, args.draft)
    zmlx = import_zlab(args.zlab)
    model, tokenizer = load(model_path)
    draft = load_draft(draft_path)
    zmodel, _ = zmlx.load(model_path)  # its own copy: its loop wraps the target's layers
    zdraft = zlab_draft(zmlx, Path(draft_path), draft,
                        6 if args.zlab_draft == "6bit" else None)
    _, items = load_prompts(args.prompts, args.limit)
    prompts = [(item["id"], encode_prompt(tokenizer, item)) for item in items]
    print(f"target {model_path}\ndrafter {draft_path} (z-lab: {args.zlab_draft})\n"
          f"device {mx.default_device()} · mlx {mx.__version__} · block {args.block_size} · "
          f"max tokens {args.max_tokens} · {len(prompts)} prompts x {args.repeats} repeats")

    def ours(ids):
        return run_ours(model, draft, tokenizer, ids, args.max_tokens, args.block_size)

    def theirs(ids):
        return run_zlab(zmlx, zmodel, zdraft, tokenizer, ids, args.max_tokens, args.block_size)

    ours(prompts[0][1][:32])  # warm-up both
    theirs(prompts[0][1][:32])
    cycle_ratios, token_ratios = [], []
    print("prompt                 rep  ours ms/cycle  z-lab ms/cycle  ratio  ours tau  z-lab tau"
          "  same tokens")
    for pid, ids in prompts:
        for rep in range(args.repeats):
            order = (ours, theirs) if rep % 2 == 0 else (theirs, ours)
            results = {fn: fn(ids) for fn in order}
            a, b = results[ours], results[theirs]
            ms_a = 1e3 * a["time"] / max(a["cycles"], 1)
            ms_b = 1e3 * b["time"] / max(b["cycles"], 1)
            tau_a = (len(a["tokens"]) - 1) / max(a["cycles"], 1)
            tau_b = (len(b["tokens"]) - 1) / max(b["cycles"], 1)
            cycle_ratios.append(ms_b / ms_a)
            token_ratios.append((b["time"] / max(len(b["tokens"]) - 1, 1))
                                / (a["time"] / max(len(a["tokens"]) - 1, 1)))
            same = "yes" if a["tokens"] == b["tokens"] else "no"
            print(f"{pid:22s} {rep:3d}  {ms_a:13.1f}  {ms_b:14.1f}  {ms_b / ms_a:5.2f}  "
                  f"{tau_a:8.2f}  {tau_b:9.2f}  {same}", flush=True)
    print(f"cycle cost z-lab / ours: {spread(cycle_ratios)}")
    print(f"time per token z-lab / ours: {spread(token_ratios)}")


if __name__ == "__main__":
    main()
