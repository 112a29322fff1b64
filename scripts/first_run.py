"""The first run (scripts/run_default.sh): the built-in pair answers one prompt, then the same
prompt is decoded by mlx-lm alone in the same process, and the speed-up of this run is printed
with the measured reason a CPU gains least.

    python scripts/first_run.py ["another prompt"]

The default prompt is one the 135M target answers correctly (docs/benchmarks.md names it); the
speed-up printed is whatever this run measured on it, and differs from machine to machine.
"""

from __future__ import annotations

import sys
import time

# An edit of code in the prompt: the answer repeats most of it, which the default `auto` policy
# verifies as a continuation of text already seen, and the drafter fills in the rest.
PROMPT = "Add type hints to this function:\n\ndef is_even(n):\n    return n % 2 == 0"
MAX_TOKENS = 160
REPEATS = 3


def timed(stream, show: bool) -> tuple[list[int], float, object]:
    """Run a generation stream to its end: its tokens, its wall time and its last response."""
    tokens, last = [], None
    tic = time.perf_counter()
    for r in stream:
        tokens.extend(r.tokens if hasattr(r, "tokens") else [r.token])
        last = r
        if show and r.text:
            sys.stdout.write(r.text)
            sys.stdout.flush()
    return tokens, time.perf_counter() - tic, last


def main(prompt: str) -> None:
    from mlx_lm.generate import stream_generate as mlx_lm_stream_generate

    from dflash.cost_model import measure
    from dflash.model_mlx import load_default, stream_generate
    from dflash.prompts import encode_prompt
    from dflash.target import target_parts

    model, tokenizer, draft = load_default()
    ids = encode_prompt(tokenizer, {"prompt": prompt})

    def ours(n: int):
        return stream_generate(model, draft, tokenizer, ids, max_tokens=n)

    def theirs(n: int):
        return mlx_lm_stream_generate(model, tokenizer, ids, max_tokens=n)

    # A short warm-up of each first, so neither side pays for first-call allocations.
    timed(ours(8), show=False)
    timed(theirs(8), show=False)

    print(f"\nprompt:\n{prompt}\n\nanswer:")
    # Each side REPEATS times, alternating, the fastest of each kept: on a machine shared with
    # other work one timing of a few seconds says more about the load than about decoding.
    ours_runs, theirs_runs = [], []
    for i in range(REPEATS):
        tokens, seconds, last = timed(ours(MAX_TOKENS), show=i == 0)
        if i == 0:
            print()
        ours_runs.append((seconds, tokens, last))
        # The target alone, asked for exactly as many tokens: the same work, one step at a time.
        plain, seconds, _ = timed(theirs(len(tokens)), show=False)
        theirs_runs.append((seconds, plain))
    ours_s, tokens, last = min(ours_runs, key=lambda r: r[0])
    theirs_s, plain = min(theirs_runs, key=lambda r: r[0])
    same = "identical" if all(p == t for (_, p), (_, t, _) in zip(theirs_runs, ours_runs)) \
        else "DIFFERENT (see docs/how-it-works.md)"
    drafted = last.cycles - last.lookup_cycles
    print(f"\ndflash  {len(tokens)} tokens in {ours_s:.1f} s ({len(tokens) / ours_s:.1f} tok/s); "
          f"{last.cycles} verify passes at τ {last.mean_tau:.2f} tokens each "
          f"({last.lookup_cycles} checked the prompt's own text as the continuation, {drafted} a "
          f"drafted block) and {last.plain_steps} plain steps where the policy expected "
          "speculation to lose")
    print(f"mlx-lm  {len(plain)} tokens in {theirs_s:.1f} s ({len(plain) / theirs_s:.1f} tok/s), "
          f"the target alone; output {same}")
    print(f"speed-up {theirs_s / ours_s:.2f}× on this prompt, in this run (prompt and decode, "
          f"wall time, the fastest of {REPEATS} alternating runs of each)")

    # What a verify pass costs against a plain step, timed now on this machine.
    costs = measure(target_parts(model), draft, rows=(1, 16), contexts=(256,), draft_rows=(16,),
                    rounds=5, quiet=True)
    ratio = costs.verify(16) / costs.step()
    print(f"why a CPU gains least: here a 16-row verify pass costs {ratio:.1f} one-token steps "
          f"({costs.verify(16):.0f} ms against {costs.step():.0f} ms, measured just now), "
          "against about one on Metal or CUDA, so each accepted draft token saves less; "
          "more prompts and machines: docs/benchmarks.md")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 and sys.argv[1].strip() else PROMPT)
