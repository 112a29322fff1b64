"""The engine's cycle against z-lab's reference MLX loop, at a fixed chain, on the same weights.

Issue 13 asks that our cycle (draft a block, verify it, accept, roll back) stay >= 1.2x cheaper
than z-lab's (PyPI ``dflash`` 0.1.0, ``dflash/model_mlx.py``) at a fixed chain. Both loops run in
this one process, on the same prompts:

* ours: ``policy="fixed"`` (every drafted row verified), greedy;
* z-lab's: its ``stream_generate``, which always verifies the whole block, greedy.

Same target folder (the built-in float32 target unless ``--model``), same drafter weights: ours
loads the 6-bit checkpoint and (on the CPU) computes in float32; z-lab's loader reads only
unquantized safetensors, so it gets the same weights dequantized (``--zlab-draft float32``: the
numbers our engine computes with) or re-quantized by its own ``--draft-bits`` path
(``--zlab-draft 6bit``: ``nn.quantize`` 6-bit, group 64, as its CLI does). Same prompt token ids.

A cycle's time is its wall time (prefill and first token excluded); the ratio is z-lab ms/cycle
over ours (> 1: ours is cheaper). The two loops advance in turn, one cycle each, each cycle timed
with the device work it queued, so load from other processes falls on both alike. Per-token times
are printed too: they also fold in each side's acceptance (z-lab proposes over the full
vocabulary; our engine honours the checkpoint's ``draft_vocab_ids``). z-lab's MLX path needs only
mlx, mlx-lm and huggingface_hub (its packaging installs MLX on Apple Silicon only; on Linux its CLI
uses Transformers); here it also gets the OpenBLAS routing ``import dflash`` sets up, without which
MLX's CPU matmuls use a reference BLAS.

z-lab's package is also called ``dflash``; install it apart and point ``--zlab`` at it:

    pip install --target "$DFLASH_HOME/zlab" --no-deps dflash==0.1.0
    python scripts/bench_zlab_cycle.py [--zlab FOLDER] [--prompts docs/bench/heldout-mix.jsonl]
        [--limit 6] [--max-tokens 96] [--block-size 16] [--repeats 2] [--zlab-draft float32]

Its code is only imported and called here (as ``zlab_dflash``), never copied.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
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


def ours(model, draft, tokenizer, ids: list[int], max_tokens: int, block: int):
    """Our loop, one response per cycle after the first token (no plain steps under ``fixed``)."""
    for r in stream_generate(model, draft, tokenizer, ids, block_size=block,
                             max_tokens=max_tokens, policy="fixed"):
        yield r.tokens


def zlab(zmlx, model, draft, tokenizer, ids: list[int], max_tokens: int, block: int):
    """z-lab's loop: one response per cycle after the first token, and a last empty one."""
    for r in zmlx.stream_generate(model, draft, tokenizer, mx.array(ids), block_size=block,
                                  max_tokens=max_tokens, temperature=0.0):
        if r.tokens:
            yield r.tokens


def interleaved(runs: dict) -> dict[str, dict]:
    """Advance the generators in turn, one cycle each, timing every cycle with the device work it
    left queued (``mx.synchronize``), so that each side pays for its own work and background load
    falls on both alike. The first step (prefill and first token) is not a cycle."""
    out = {name: {"cycle_s": [], "tokens": []} for name in runs}
    live = dict(runs)
    while live:
        for name, gen in list(live.items()):
            tic = time.perf_counter()
            tokens = next(gen, None)
            mx.synchronize()
            if tokens is None:
                del live[name]
                continue
            if out[name]["tokens"]:
                out[name]["cycle_s"].append(time.perf_counter() - tic)
            out[name]["tokens"].extend(tokens)
    return out


def spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f}, n={len(xs)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    home = Path(os.environ.get("DFLASH_HOME", Path.home() / ".cache" / "dflash"))
    ap.add_argument("--zlab", type=Path, default=home / "zlab",
                    help="folder holding z-lab's `dflash` package (pip install --target; "
                         "default $DFLASH_HOME/zlab)")
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

    def run(ids, limit=None):
        n = limit or args.max_tokens
        return interleaved({
            "ours": ours(model, draft, tokenizer, ids, n, args.block_size),
            "z-lab": zlab(zmlx, zmodel, zdraft, tokenizer, ids, n, args.block_size)})

    run(prompts[0][1], 16)  # warm-up both
    cycle_ratios, token_ratios = [], []
    print("prompt                 rep  ours ms/cycle  z-lab ms/cycle  ratio  ours tau  z-lab tau"
          "  same tokens")
    for pid, ids in prompts:
        for rep in range(args.repeats):
            res = run(ids)
            a, b = res["ours"], res["z-lab"]
            ms_a = 1e3 * statistics.mean(a["cycle_s"])
            ms_b = 1e3 * statistics.mean(b["cycle_s"])
            tau_a = (len(a["tokens"]) - 1) / len(a["cycle_s"])
            tau_b = (len(b["tokens"]) - 1) / len(b["cycle_s"])
            cycle_ratios.append(ms_b / ms_a)
            token_ratios.append(sum(b["cycle_s"]) / (len(b["tokens"]) - 1)
                                / (sum(a["cycle_s"]) / (len(a["tokens"]) - 1)))
            same = "yes" if a["tokens"] == b["tokens"] else "no"
            print(f"{pid:22s} {rep:3d}  {ms_a:13.1f}  {ms_b:14.1f}  {ms_b / ms_a:5.2f}  "
                  f"{tau_a:8.2f}  {tau_b:9.2f}  {same}", flush=True)
    print(f"cycle cost z-lab / ours: {spread(cycle_ratios)}")
    print(f"time per token z-lab / ours: {spread(token_ratios)}")


if __name__ == "__main__":
    main()
