"""CPU cost of the training features of real records: the target's head on every row or on the
response rows only (what ``dflash train`` does: its anchors lie in the response).

Reads the records as ``dflash train`` reads them (``--data``, long-context records at their full
length here: the features of a cut record are computed over the whole document anyway), takes
``--short`` random records under 1,500 tokens and the first ``--long`` records with at least
4,000 prompt tokens, and times :meth:`FeatureStore.compute` over each group with the head on
every row and with ``head_from`` at the prompt's end, ``--repeats`` times in turn. CPU seconds
are the process's own (``time.process_time``), so other work on the machine changes them less
than wall time; the table shows each repeat.

    OPENBLAS_NUM_THREADS=1 python benchmarks/feature_costs.py --data datasets/smollm2/shards
"""

from __future__ import annotations

import argparse
import random
import time

from dflash.default_pair import default_target_path
from dflash.target import load_target, target_parts
from dflash.training.data import read_samples
from dflash.training.features import FeatureStore


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="datasets/smollm2/shards")
    p.add_argument("--target", default=None, help="target folder (default: the built-in pair's)")
    p.add_argument("--short", type=int, default=6, help="short records timed together")
    p.add_argument("--long", type=int, default=1, help="long-context records timed together")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--taps", default="1,8,14,20,27")
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    model, _ = load_target(str(args.target or default_target_path()))
    store = FeatureStore(target_parts(model), [int(t) for t in args.taps.split(",")], args.topk,
                         None)
    samples = read_samples(args.data, max_len=1 << 20)
    short = [s for s in samples if len(s.ids) < 1500]
    groups = {"short": random.Random(args.seed).sample(short, min(args.short, len(short))),
              "long": [s for s in samples if s.prompt_len >= 4000][:args.long]}
    print("| records | tokens | prompt share | repeat | head on every row (CPU-s) "
          "| response rows only (CPU-s) | saved |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, group in groups.items():
        if not group:
            continue
        tokens = sum(len(s.ids) for s in group)
        prompt = sum(s.prompt_len for s in group)
        for rep in range(args.repeats):
            cost = {}
            for label, response_only in (("all", False), ("response", True)):
                t0 = time.process_time()
                for s in group:
                    store.compute(s.ids, s.prefix, s.prompt_len if response_only else 0)
                cost[label] = time.process_time() - t0
            print(f"| {len(group)} {name} | {tokens:,} | {prompt / tokens:.0%} | {rep} "
                  f"| {cost['all']:.1f} | {cost['response']:.1f} "
                  f"| {1 - cost['response'] / cost['all']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
