"""Structured outputs on the built-in pair: what a grammar costs per token, and the speed of
schema-constrained answers against mlx-lm with the same mask (docs/structured-outputs.md).

    python benchmarks/structured_outputs.py [--max-tokens 128] [--repeats 2]

Part 1 replays each schema's answer through llguidance's matcher and times, per token, the mask
(``compute mask``), its conversion into the ``(1, V)`` boolean row the verify pass applies, one
``consume`` and one forced-token query. Part 2 decodes the same prompts four ways in one process,
alternating after a warm-up: mlx-lm's ``generate_step`` with the grammar's mask as a logits
processor, dflash with the grammar, and both unconstrained; decode tokens/s after the first token
(as ``dflash bench``), and every dflash answer checked identical to mlx-lm's (greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

from dflash.grammar import Grammar, logits_processor
from dflash.model_mlx import load_default
from dflash.speculative import stream_generate
from dflash.target import target_parts

SCHEMAS = {
    "person": ({
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.com$"},
                       "colour": {"enum": ["red", "green", "blue"]}},
        "required": ["name", "age", "email", "colour"], "additionalProperties": False,
    }, "Describe a person called Ann Lee, 31, who likes green, as JSON."),
    "order": ({
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "customer": {"type": "object",
                         "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
                         "required": ["name", "vip"], "additionalProperties": False},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"},
                               "price": {"type": "number"}},
                "required": ["sku", "qty", "price"], "additionalProperties": False}},
            "status": {"enum": ["new", "paid", "shipped"]},
        },
        "required": ["id", "customer", "items", "status"], "additionalProperties": False,
    }, "Write an example online shop order as JSON."),
    "recipe": ({
        "type": "object",
        "properties": {"title": {"type": "string"},
                       "minutes": {"type": "integer", "minimum": 1},
                       "ingredients": {"type": "array", "items": {"type": "string"},
                                       "minItems": 2, "maxItems": 6},
                       "vegetarian": {"type": "boolean"}},
        "required": ["title", "minutes", "ingredients", "vegetarian"],
        "additionalProperties": False,
    }, "Give a simple pancake recipe as JSON."),
    "answer": ({
        "type": "object",
        "properties": {"reasoning": {"type": "string"}, "answer": {"type": "number"}},
        "required": ["reasoning", "answer"], "additionalProperties": False,
    }, "A baker makes 24 muffins and sells 3 boxes of 4 muffins. How many are left? "
       "Answer as JSON with your reasoning."),
}


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True)


def mlx_lm_decode(model, prompt, n, procs, eos: set[int]) -> tuple[list[int], float]:
    """Tokens up to EOS (as mlx-lm's stream_generate stops) and decode seconds after the
    first token."""
    tokens, t1 = [], None
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, logits_processors=procs):
        if t1 is None:
            t1 = time.perf_counter()
        if int(t) in eos:
            break
        tokens.append(int(t))
    return tokens, time.perf_counter() - t1


def dflash_decode(model, draft, tokenizer, prompt, n, grammar) -> tuple[list[int], float, dict]:
    tokens, t1, last = [], None, None
    for r in stream_generate(model, draft, tokenizer, prompt, max_tokens=n, grammar=grammar):
        if t1 is None:
            t1 = time.perf_counter()
        tokens += r.tokens
        last = r
    return tokens, time.perf_counter() - t1, {"tau": last.mean_tau, "forced": last.forced_tokens,
                                              "plain": last.plain_steps, "cycles": last.cycles}


def mask_costs(bound, tokens: list[int]) -> dict[str, float]:
    """Median microseconds per token of each grammar operation, along ``tokens``."""
    state = bound.start()
    times: dict[str, list[float]] = {"mask": [], "to_row": [], "consume": [], "forced": []}
    for t in tokens:
        s = time.perf_counter()
        bits = state.bits()
        times["mask"].append(time.perf_counter() - s)
        s = time.perf_counter()
        mx.eval(state.allowed([bits]))
        times["to_row"].append(time.perf_counter() - s)
        s = time.perf_counter()
        state.matcher.compute_ff_tokens()
        times["forced"].append(time.perf_counter() - s)
        s = time.perf_counter()
        state.consume(t)
        times["consume"].append(time.perf_counter() - s)
    return {k: 1e6 * statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    model, tokenizer, draft = load_default()
    vocab = target_parts(model).vocab_size
    eos = set(tokenizer.eos_token_ids)
    print(f"load average {os.getloadavg()[0]:.2f}; max_tokens {args.max_tokens}; "
          f"repeats {args.repeats}")
    # Warm-up: both engines, compiled kernels and the grammar tokenizer built.
    warm = Grammar.json_schema(SCHEMAS["person"][0])
    mlx_lm_decode(model, chat(tokenizer, "hi"), 8, None, eos)
    dflash_decode(model, draft, tokenizer, chat(tokenizer, "hi"), 8, warm)

    rows = []
    for name, (schema, question) in SCHEMAS.items():
        grammar = Grammar.json_schema(schema)
        bound = grammar.bind(tokenizer, vocab)
        prompt = chat(tokenizer, question)
        sums = {"ref_g": 0.0, "dfl_g": 0.0, "ref_u": 0.0, "dfl_u": 0.0}
        identical, info = True, {}
        for _ in range(args.repeats):
            ref, t = mlx_lm_decode(model, prompt, args.max_tokens,
                                   [logits_processor(bound, len(prompt))], eos)
            sums["ref_g"] += t
            out, t, info = dflash_decode(model, draft, tokenizer, prompt, args.max_tokens,
                                         grammar)
            sums["dfl_g"] += t
            identical &= out == ref
            uref, t = mlx_lm_decode(model, prompt, args.max_tokens, None, eos)
            sums["ref_u"] += t
            uout, t, _ = dflash_decode(model, draft, tokenizer, prompt, args.max_tokens, None)
            sums["dfl_u"] += t
            identical &= uout == uref
        answer = tokenizer.decode(out)
        try:
            json.loads(answer)
            valid = "valid"
        except json.JSONDecodeError:
            valid = "cut (length)" if len(out) >= args.max_tokens else "INVALID"
        costs = mask_costs(bound, out)
        # The same tokens on both sides (greedy, checked identical): the speed-up is the ratio
        # of the decode times.
        g_ratio = sums["ref_g"] / sums["dfl_g"]
        u_ratio = sums["ref_u"] / sums["dfl_u"]
        rows.append((name, len(out), valid, identical, g_ratio, u_ratio, info, costs))
        print(f"{name}: {len(out)} tokens ({valid}), identical={identical}, "
              f"speed-up with grammar {g_ratio:.2f}x (unconstrained on the same prompt "
              f"{u_ratio:.2f}x, {len(uout)} tokens), tau {info['tau']:.2f}, "
              f"forced {info['forced']}, plain steps {info['plain']}, mask "
              f"{costs['mask']:.1f} us, to row {costs['to_row']:.1f} us, consume "
              f"{costs['consume']:.1f} us, forced query {costs['forced']:.1f} us (medians)",
              flush=True)
    print("\n| schema | tokens | answer | identical | dflash + grammar vs mlx-lm + mask | "
          "unconstrained, same prompt | τ | forced | mask µs | row µs | consume µs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, n, valid, same, g, u, info, c in rows:
        print(f"| {name} | {n} | {valid} | {'yes' if same else 'NO'} | {g:.2f}× | {u:.2f}× | "
              f"{info['tau']:.2f} | {info['forced']} | {c['mask']:.1f} | {c['to_row']:.1f} | "
              f"{c['consume']:.1f} |")
    print(f"\nload average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
