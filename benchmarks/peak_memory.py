"""Peak memory of one long-context generation, mlx-lm alone against the dflash pair, each side in a
process of its own (a process's peak holds whatever it loaded: the drafter, its bounded context
cache and the continuation index count against dflash, nothing of dflash against mlx-lm).

    python benchmarks/peak_memory.py [--context 8k] [--max-tokens 256] [--prompts FILE] [--limit N]

The prompts are the bench's (`dflash bench --context` pads each with the same unrelated text,
:func:`dflash.contexts.at_context`); each runs greedy to ``--max-tokens`` in a fresh process per
side. Prints MLX's peak (``mx.get_peak_memory``) and the process's peak resident set per side,
their ratio, and whether the two outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def one_side(side: str, prompt_ids: list[int], max_tokens: int) -> dict:
    """Generate in this process and report its peaks since it started (run as ``--side``)."""
    import mlx.core as mx

    from dflash.default_pair import default_target_path
    from dflash.model_mlx import generate, load, load_default

    if side == "mlx-lm":  # the target alone, as mlx-lm decodes it
        from mlx_lm import stream_generate

        model, tokenizer = load(str(default_target_path()))
        tokens = [r.token for r in stream_generate(model, tokenizer, prompt_ids,
                                                   max_tokens=max_tokens)
                  if r.finish_reason != "stop"]
    else:
        model, tokenizer, draft = load_default()
        tokens = generate(model, draft, tokenizer, prompt_ids, max_tokens=max_tokens).tokens
    return {"side": side, "tokens": tokens, "mlx_peak_gb": mx.get_peak_memory() / 1e9,
            "rss_peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}


def prompts_at(context: int, max_tokens: int, prompts: str, limit: int | None) -> list[list[int]]:
    from dflash.bench_runs import load_prompts
    from dflash.contexts import at_context
    from dflash.model_mlx import load_default
    from dflash.prompts import encode_prompt

    _, tokenizer, _ = load_default()
    _, items = load_prompts(prompts, limit)
    padded = at_context(items, context, max_tokens, lambda it: encode_prompt(tokenizer, it),
                        tokenizer)
    return [encode_prompt(tokenizer, p) for p in padded]


def parse_length(text: str) -> int:
    return int(float(text[:-1]) * 1024) if text.lower().endswith("k") else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", default="8k")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompts", default="heldout-mix")
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--side", choices=["mlx-lm", "dflash"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:  # a child: the prompt ids come on stdin
        print(json.dumps(one_side(args.side, json.load(sys.stdin), args.max_tokens)))
        return
    context = parse_length(args.context)
    for i, ids in enumerate(prompts_at(context, args.max_tokens, args.prompts, args.limit)):
        out = {}
        for side in ("mlx-lm", "dflash"):
            child = subprocess.run([sys.executable, __file__, "--side", side, "--max-tokens",
                                    str(args.max_tokens)], input=json.dumps(ids),
                                   capture_output=True, text=True, check=True)
            out[side] = json.loads(child.stdout.strip().splitlines()[-1])
        base, ours = out["mlx-lm"], out["dflash"]
        print(f"prompt {i}: {len(ids)} tokens + {args.max_tokens}; MLX peak GB mlx-lm "
              f"{base['mlx_peak_gb']:.3f} dflash {ours['mlx_peak_gb']:.3f} "
              f"({ours['mlx_peak_gb'] / base['mlx_peak_gb']:.3f}×); RSS peak GB "
              f"{base['rss_peak_gb']:.3f} / {ours['rss_peak_gb']:.3f} "
              f"({ours['rss_peak_gb'] / base['rss_peak_gb']:.3f}×); identical "
              f"{base['tokens'] == ours['tokens']}", flush=True)


if __name__ == "__main__":
    main()
