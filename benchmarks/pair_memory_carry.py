"""What a generation should inherit from the pair memory: the held-out mix run math -> chat -> code
in one process under each carry variant, priced at the calibrated pass costs (run ``dflash
calibrate`` first: the prices are then the same for every variant, whatever else runs).

    python benchmarks/pair_memory_carry.py [--max-tokens 96]

Prints, per variant and domain, the priced decode time and how many cycles verified a context
continuation; greedy outputs are the target's in every variant (the memory steers cost only).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from dflash.model_mlx import generate, load_default
from dflash.policy.memory import PairMemory
from dflash.prompts import read_prompts

VARIANTS = {
    "fresh memory each generation": lambda: None,
    "everything, decayed to 4 per bin": lambda: PairMemory(carry_continuations=True,
                                                           inherit_streak=True),
    "everything, decayed to 1 per bin": lambda: PairMemory(carry=1.0, carry_continuations=True,
                                                           inherit_streak=True),
    "all but the streak": lambda: PairMemory(carry_continuations=True),
    "all but the continuations": lambda: PairMemory(inherit_streak=True),
    "drafter's calibration and depths (default)": lambda: PairMemory(),
}


def domain(prompt_id: str) -> str:
    return prompt_id.split("-")[0].split("/")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    model, tokenizer, draft = load_default()
    prompts = read_prompts("heldout-mix")
    for name, make in VARIANTS.items():
        memory = make()
        totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0])
        for p in prompts:
            text = tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}],
                                                 tokenize=False, add_generation_prompt=True)
            stats = generate(model, draft, tokenizer, text, max_tokens=args.max_tokens,
                             memory=memory).stats
            row = totals[domain(p["id"])]
            row[0] += stats.priced_ms
            row[1] += stats.lookup_cycles
            row[2] += stats.cycles
        print(f"{name}: " + "; ".join(f"{d} {ms:,.0f} ms ({lk}/{cy} continuations/cycles)"
                                       for d, (ms, lk, cy) in totals.items()), flush=True)


if __name__ == "__main__":
    main()
