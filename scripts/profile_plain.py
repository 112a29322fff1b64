"""Our plain target step against mlx-lm's ``generate_step``, in one process, interleaved.

The ``auto`` policy takes plain one-token target steps while speculation loses (a drafter that
never agrees: ~92 % of its steps). What such a step costs next to mlx-lm's own decoding is the
floor of that case, so this script times, per generated token after the prefill (wall and
process CPU time; median over interleaved rounds, each variant from its own prefill of the same
prompt ids, greedy):

* ``mlx-lm``: ``mlx_lm.generate.generate_step`` (what ``mlx_lm.stream_generate`` runs);
* ``plain``: one forced stretch of ``_plain_steps`` (taps kept for the drafter, as decoding does);
* ``plain-grown``: the same stretch keeping its taps the way dflash did before (one growing
  array, a concatenation per step: what the pieces kept instead save);
* ``plain-notaps``: the same stretch through a forward without taps (what the taps cost);
* ``dflash``: the whole loop (``stream_generate``, policy ``auto``) with the given drafter.

    python scripts/make_random_drafter.py $DFLASH_HOME/bench/random-drafter   # once
    python scripts/profile_plain.py --draft $DFLASH_HOME/bench/random-drafter --tokens 96 --rounds 6

Every variant's tokens must equal mlx-lm's (checked; a mismatch is printed). On a loaded machine
whole runs vary by more than the few per cent looked for; ``--steps N`` instead times N single
synchronous steps per variant at a fixed context (each step's cache rows trimmed after it), the
variants interleaved: ``mlx-lm`` (``generate_step``'s own ops: the model call, log-softmax, argmax),
``plain`` and ``plain-notaps`` (``_plain_steps(..., 1)``); the minimum is the step's own cost.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

# isort: off
import dflash  # noqa: F401  (OpenBLAS before mlx)
# isort: on
import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream

from dflash import speculative as sp
from dflash.bench import load_prompts
from dflash.pair import load_pair
from dflash.prompts import encode_prompt
from dflash.target import make_cache, target_parts


class Clock:
    """Wall and process CPU time (all threads) since ``start``, per decoded token: the CPU time
    is the work itself, less sensitive than the wall time to the other jobs on a shared machine."""

    def start(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def per_token(self, n: int) -> tuple[float, float]:
        return (time.perf_counter() - self.wall) / n, (time.process_time() - self.cpu) / n


def run_mlx_lm(pair, ids: list[int], n: int) -> tuple[list[int], tuple[float, float]]:
    tokens, clock = [], Clock()
    for token, _ in generate_step(mx.array(ids), pair.model, max_tokens=n + 1,
                                  sampler=lambda x: mx.argmax(x, axis=-1)):
        tokens.append(int(token))
        if len(tokens) == 1:
            clock.start()  # the prefill and first token are not counted
    per_token = clock.per_token(n)
    mx.synchronize(generation_stream)  # its last queued step must not run into the next variant
    return tokens, per_token


class GrownTaps(sp.DecodeState):
    """The taps in one array grown by a concatenation per step (dflash before pieces)."""

    def commit_taps(self, taps: mx.array) -> None:
        self.pending = [mx.concatenate(self.pending + [taps], axis=1)]


class NoTaps(sp.DecodeState):
    """A forward without taps (a stand-in drafter that asks for none) leaves nothing to keep."""

    def commit_taps(self, taps: None) -> None:
        pass


def run_plain(pair, ids: list[int], n: int, taps: bool,
              state_type: type = sp.DecodeState) -> tuple[list[int], tuple[float, float]]:
    parts = target_parts(pair.model)
    draft = pair.draft
    request = sp.build_request(parts, draft, pair.tokenizer, ids, max_tokens=n + 1)
    state = state_type(make_cache(parts), draft.make_cache(), history=list(ids), fed=list(ids),
                       policy=sp.VerifyPolicy("fixed", request.block_size))
    last = sp._prefill(parts, draft, request, state, 0)
    state.history.append(sp.first_token(request, state, last))
    clock = Clock()
    clock.start()
    # Without taps: a stand-in drafter that asks for no layer outputs.
    step = sp._plain_steps(parts, draft if taps else SimpleNamespace(target_layer_ids=[]),
                           request, state, n)
    mx.eval(state.take_taps(), [c.state for c in state.cache])
    return state.history[len(ids):] + step.tokens, clock.per_token(n)


def run_dflash(pair, ids: list[int], n: int) -> tuple[list[int], tuple[float, float]]:
    tokens, clock = [], Clock()
    for r in sp.stream_generate(pair.model, pair.draft, pair.tokenizer, ids, max_tokens=n + 1):
        tokens += r.tokens
        if len(tokens) == len(r.tokens):
            clock.start()
    return tokens, clock.per_token(n)


def one_step_times(pair, ids: list[int], reps: int) -> dict[str, list[float]]:
    """Seconds of ``reps`` synchronous one-token steps per variant, interleaved, at the context
    right after the prompt (each step's rows are trimmed off its caches again)."""
    parts, draft = target_parts(pair.model), pair.draft
    request = sp.build_request(parts, draft, pair.tokenizer, ids, max_tokens=2)

    def prefilled(state_type: type) -> sp.DecodeState:
        state = state_type(make_cache(parts), draft.make_cache(), history=list(ids),
                           fed=list(ids), policy=sp.VerifyPolicy("fixed", request.block_size))
        state.history.append(sp.first_token(request, state, sp._prefill(parts, draft, request,
                                                                         state, 0)))
        return state

    def mlx_lm(state: sp.DecodeState) -> None:  # generate_step's _step, then its token read
        with mx.stream(generation_stream):
            logits = pair.model(mx.array([[state.history[-1]]]), cache=state.cache)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            y = mx.argmax(logprobs, axis=-1)
        mx.async_eval(y, logprobs)
        y.item()

    def plain(tapped) -> Callable[[sp.DecodeState], None]:
        def run(state: sp.DecodeState) -> None:
            sp._plain_steps(parts, tapped, request, state, 1)
            mx.eval(state.take_taps(), [c.state for c in state.cache])
            state.fed.pop()
        return run

    steps = {"mlx-lm": (mlx_lm, prefilled(sp.DecodeState)),
             "plain": (plain(draft), prefilled(sp.DecodeState)),
             "plain-notaps": (plain(SimpleNamespace(target_layer_ids=[])), prefilled(NoTaps))}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(reps + 2):  # two warm-up rounds
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            run, state = steps[name]
            tic = time.perf_counter()
            run(state)
            if r >= 2:
                times[name].append(time.perf_counter() - tic)
            for c in state.cache:
                c.trim(1)
    return times


VARIANTS = {
    "mlx-lm": run_mlx_lm,
    "plain": lambda p, i, n: run_plain(p, i, n, True),
    "plain-grown": lambda p, i, n: run_plain(p, i, n, True, GrownTaps),
    "plain-notaps": lambda p, i, n: run_plain(p, i, n, False, NoTaps),
    "dflash": run_dflash,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--prompts", default="docs/bench/heldout-mix.jsonl")
    ap.add_argument("--prompt-index", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=0,
                    help="time this many single synchronous steps per variant instead")
    args = ap.parse_args()
    pair = load_pair(args.model, args.draft)
    _, items = load_prompts(args.prompts, None)
    ids = encode_prompt(pair.tokenizer, items[args.prompt_index])
    if args.steps:
        times = one_step_times(pair, ids, args.steps)
        print(f"{len(ids)} prompt tokens, {args.steps} single steps per variant; ms: min, "
              "median, 90th percentile; ratio of the minima to mlx-lm's")
        for name, ts in times.items():
            ts = sorted(ts)
            print(f"{name:>13}: {1e3 * ts[0]:7.2f}  {1e3 * statistics.median(ts):7.2f}  "
                  f"{1e3 * ts[int(0.9 * (len(ts) - 1))]:7.2f}  ratio "
                  f"{times['mlx-lm'] and min(times['mlx-lm']) / ts[0]:.3f}")
        return
    names = args.variants.split(",")
    for name in names:  # warm-up
        VARIANTS[name](pair, ids, 8)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    reference = None
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            tokens, per_token = VARIANTS[name](pair, ids, args.tokens)
            reference = reference or tokens
            if tokens[:args.tokens + 1] != reference[:args.tokens + 1]:
                print(f"MISMATCH: {name} differs from {names[0]}")
            times[name].append(per_token)
    print(f"{len(ids)} prompt tokens, {args.tokens} decoded, {args.rounds} rounds; ms/token "
          f"median (min-max); ratio = {names[0]} / variant, per round, median (min-max)")
    for kind, k in (("wall", 0), ("cpu", 1)):
        base = [t[k] for t in times[names[0]]]
        for name in names:
            ts = [t[k] for t in times[name]]
            ratios = [b / t for b, t in zip(base, ts)]
            print(f"{kind:>4} {name:>13}: {1e3 * statistics.median(ts):7.2f} ms "
                  f"({1e3 * min(ts):.2f}-{1e3 * max(ts):.2f})  ratio "
                  f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
