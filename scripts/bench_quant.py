"""What quantizing a drafter costs: τ, block-prediction KL and drafter step time, in one run.

For one drafter and its target, converts the drafter to each variant (checkpoint dtype, float32,
uniform 8/6/4-bit, the mixed recipes, the sensitivity-aware mix) with ``dflash.convert``, then
for each variant measures

- mean acceptance τ (greedy, block size from the drafter unless ``--block-size``) through the real
  engine ``dflash.speculative.generate`` on a fixed prompt set,
- the KL divergence of its block predictions from the unquantized drafter's and top-1 agreement
  (calibration blocks built from the target's own tapped features),
- the drafter step time: one drafter pass over a block with ``--context`` cached rows (microbench),
  and the drafter time per cycle inside generation.

Usage::

    python scripts/bench_quant.py --draft PATH --target PATH [--prompts FILE.jsonl]
        [--n-prompts 8] [--max-tokens 128] [--variants src,fp32,8,6,4,mixed_8_4,mixed_6_4,sensitivity]
        (DFlash2: e.g. 6+cbf = 6-bit with float codebooks, 6+cb4, 6+kf = float kernel projections)
        [--bit-budget 5] [--native] [--json OUT.json]

Without ``--draft``/``--target`` it uses the built-in pair (SmolLM2-135M and its drafter).

On MLX's CPU backend ``load_draft`` dequantizes drafters to float32 (the fast path there), so every
variant runs the same kernels and only τ/KL differ; ``--native`` keeps the quantized/bf16 layers to
time MLX's own kernels. On Metal/CUDA the drafter always runs as stored.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

# isort: off
import dflash  # noqa: F401  (routes OpenBLAS before mlx.core is imported)
import mlx.core as mx
# isort: on
import numpy as np

from dflash import backend
from dflash.acceptance import measure_tau
from dflash.checkpoint import read_weights
from dflash.convert import FIXED_PROMPTS, build_calibration, convert, prompt_token_ids
from dflash.dflash2 import walk
from dflash.drafter import DFlashConfig, build_draft, load_draft

DEFAULT_VARIANTS = "src,fp32,8,6,4,mixed_8_4,mixed_6_4,sensitivity"


def variant_options(name: str, bit_budget: float) -> dict:
    """Options of a variant name; DFlash2 drafters take suffixes: ``+cbN`` codebooks at N bits,
    ``+cbf`` codebooks in float, ``+kf`` kernel projections in float (e.g. ``6+cbf+kf``)."""
    name, *extras = name.split("+")
    opts = _base_options(name, bit_budget)
    for extra in extras:
        if extra == "kf":
            opts["float_kernels"] = True
        elif extra == "cbf":
            opts["codebook_bits"] = None
        elif extra.startswith("cb") and extra[2:].isdigit():
            opts["codebook_bits"] = int(extra[2:])
        else:
            raise SystemExit(f"variant suffix +{extra}: use +cbN, +cbf or +kf")
    return opts


def _base_options(name: str, bit_budget: float) -> dict:
    if name == "src":
        return {}
    if name in DTYPE_VARIANTS:
        return {"dtype": DTYPE_VARIANTS[name]}
    if name.isdigit():
        return {"quantize": True, "q_bits": int(name)}
    if name == "sensitivity":
        return {"quant_recipe": "sensitivity", "bit_budget": bit_budget}
    return {"quant_recipe": name}


DTYPE_VARIANTS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def load_native(path: Path):
    """The drafter exactly as stored (quantized layers, bf16), without the CPU backend's casts."""
    raw = json.loads((path / "config.json").read_text())
    cfg = DFlashConfig.from_dict(raw)
    model = build_draft(cfg, read_weights(path), str(path), raw.get("quantization"))
    mx.eval(model.parameters())
    return model


def step_time(draft, embed, context: int, block: int, reps: int = 10) -> float:
    """Milliseconds of one drafter pass over a block with ``context`` cached rows."""
    cfg = draft.config
    taps = mx.random.normal((1, context, cfg.num_taps * cfg.hidden_size), key=mx.random.key(0))
    tokens = mx.array([1] + [cfg.mask_token_id] * (block - 1))[None]
    embeds = embed(tokens)
    dtype = next(v.dtype for k, v in _params(draft) if k.endswith("norm.weight"))
    taps, embeds = taps.astype(dtype), embeds.astype(dtype)
    cache = draft.make_cache()
    draft.append_context(taps, cache)
    mx.eval([c.state for c in cache])
    times = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        mx.eval(draft(embeds, cache))
        if i >= 2:
            times.append(time.perf_counter() - t0)
    times.sort()
    return 1000 * times[len(times) // 2]


def path_agreement(calib, reference, draft, parts) -> float | None:
    """DFlash2: the share of greedy selector proposals (the walk, codebooks included) equal to
    the unquantized drafter's on the calibration blocks; None for v1. The unary KL above does not
    see the codebooks; this does."""
    if not draft.config.is_dflash2:
        return None
    same = total = 0
    for taps, embeds in calib.samples:
        paths = []
        for model in (reference, draft):
            cache = model.make_cache()
            model.append_context(taps, cache)
            hidden = model(embeds, cache)[0, 1:]
            selector = model.candidate_selector
            unary = selector.unary(model.head_logits(parts, hidden))
            anchor = model.config.mask_token_id  # any fixed predecessor: both walks share it
            paths.append(walk(*selector.lattice(hidden, unary, anchor),
                              lambda _, scores: int(np.argmax(scores))))
        same += sum(a == b for a, b in zip(*paths))
        total += len(paths[0])
    return same / max(total, 1)


def _params(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=None, help="source drafter (HF folder or repo id)")
    ap.add_argument("--target", default=None, help="target model (mlx-lm folder or repo id)")
    ap.add_argument("--prompts", default=None, help="JSONL prompt file (default: built-in 8)")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help=f"comma-separated (default {DEFAULT_VARIANTS}); also bf16, fp16, 5, 3, "
                         "mixed_8_6 ...")
    ap.add_argument("--bit-budget", type=float, default=5.0, help="for the sensitivity variant")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--context", type=int, default=256, help="cached rows for the step microbench")
    ap.add_argument("--native", action="store_true",
                    help="time the drafter as stored (no CPU dequantization to float32)")
    ap.add_argument("--workdir", default=None, help="keep the converted variants here")
    ap.add_argument("--json", default=None, help="write the results as JSON")
    args = ap.parse_args(argv)

    from dflash.model_mlx import load
    from dflash.target import target_parts

    if args.draft is None or args.target is None:
        from dflash.default_pair import default_draft_path, default_target_path

        args.draft = args.draft or str(default_draft_path())
        args.target = args.target or str(default_target_path())
    if args.prompts:
        from dflash.prompts import read_prompts

        prompts = tuple(i.get("prompt") or i["messages"][-1]["content"]
                        for i in read_prompts(args.prompts))
    else:
        prompts = FIXED_PROMPTS
    prompts = prompts[: args.n_prompts]

    print(f"target {args.target}\ndrafter {args.draft}\nbackend: "
          f"{'cpu' if backend.on_cpu() else 'gpu'}, BLAS {backend.blas_status}; "
          f"{len(prompts)} prompts x {args.max_tokens} tokens, greedy", flush=True)
    model, tokenizer = load(args.target)
    parts = target_parts(model)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-quant-"))
    work.mkdir(parents=True, exist_ok=True)

    reference = load_draft(args.draft, dtype=mx.float32)
    calib = build_calibration(reference.config, (parts, tokenizer), prompts=prompts)
    calib.set_reference(reference)

    rows = []
    for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
        opts = variant_options(name, args.bit_budget)
        dst = work / name
        t0 = time.perf_counter()
        report = convert(args.draft, dst, q_group_size=args.group_size, force=True,
                         target=(model, tokenizer) if name == "sensitivity" else None,
                         calib_prompts=prompts, tau_prompts=(), verify=False, **opts)
        convert_s = time.perf_counter() - t0
        draft = load_native(dst) if args.native else load_draft(dst)
        kl, agree = calib.score(draft)
        t0 = time.perf_counter()
        tau = measure_tau(model, tokenizer, draft,
                          prompt_token_ids(tokenizer, prompts, draft.config.vocab_size, seed=0),
                          block_size=args.block_size, max_tokens=args.max_tokens)
        gen_s = time.perf_counter() - t0
        block = args.block_size or draft.block_size
        row = {
            "variant": name, "bits_per_weight": report["bits_per_weight"],
            "size_mb": report["size_after"] / 1e6, "kl": kl, "top1": agree,
            "tau": tau["tau"], "draft_ms_per_cycle": tau["draft_ms_per_cycle"],
            "step_ms": step_time(draft, parts.embed, args.context, block),
            "tok_per_s": sum(len(o) for o in tau["outputs"]) / gen_s,
            "convert_s": convert_s, "path_agree": path_agreement(calib, reference, draft, parts),
        }
        rows.append(row)
        print(f"  {name:<12} bpw {row['bits_per_weight']:5.2f}  {row['size_mb']:8.2f} MB  "
              f"KL {kl:8.4g}  top-1 {100 * agree:5.1f} %  τ {row['tau']:.3f}  "
              f"step {row['step_ms']:7.2f} ms  draft/cycle {row['draft_ms_per_cycle']:7.2f} ms  "
              f"{row['tok_per_s']:6.1f} tok/s"
              + ("" if row["path_agree"] is None else f"  path {100 * row['path_agree']:5.1f} %"),
              flush=True)

    base = next((r for r in rows if r["variant"] in ("fp32", "src")), rows[0] if rows else None)
    paths = any(r["path_agree"] is not None for r in rows)
    print("\n| variant | bits/weight | size MB | KL vs unquantized | top-1 agree | "
          + ("selector path agree | " if paths else "")
          + "τ | Δτ | drafter step ms | drafter ms/cycle | tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if paths else ""))
    for r in rows:
        print(f"| {r['variant']} | {r['bits_per_weight']:.2f} | {r['size_mb']:.2f} | {r['kl']:.4g} | "
              f"{100 * r['top1']:.1f} % | "
              + (f"{100 * r['path_agree']:.1f} % | " if paths else "")
              + f"{r['tau']:.3f} | {r['tau'] - base['tau']:+.3f} | "
              f"{r['step_ms']:.2f} | {r['draft_ms_per_cycle']:.2f} | {r['tok_per_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"target": args.target, "draft": args.draft,
                                               "prompts": len(prompts),
                                               "max_tokens": args.max_tokens,
                                               "native": args.native, "rows": rows}, indent=2))
    if not args.workdir:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
