"""How fast speculation could be with this drafter on this machine: bounds from measured numbers.

Why: the verify-policy and batching issues set speed-up targets (math ≥ 1.4×, 4 clients ≥ 1.5×
mlx-lm). Whether a target is an engineering gap or a drafter gap follows from two measurements
this script combines: the drafter's acceptance by block position under whole-block verification
(a ``dflash bench --policy fixed --min-confidence 0`` JSON: ``a_i`` = share of cycles whose first
``i`` drafted tokens were all accepted) and this machine's calibrated pass costs
(``dflash calibrate``: ``verify(rows)``, ``draft(rows)``, the pipelined plain ``step`` in ms).

For one sequence, in plain steps (what greedy decoding pays per token, pipelined), with
``c(r) = verify(r) / step`` and ``d(r) = draft(r) / step`` for ``r ≥ 2`` and ``c(1) = 1``:

* **fixed chain of r rows**: ``τ_r = 1 + Σ_{i<r} a_i`` tokens for ``c(r) + d(r)``; the best ``r``
  bounds every policy that verifies the same number of rows each cycle;
* **oracle**: a policy that knew each cycle's accepted length ``L`` verifies exactly ``L + 1``
  rows (a plain step when ``L = 0``): ``E[L + 1] / E[c(L + 1) + d(L + 1)]`` with
  ``P(L ≥ i) = a_i`` — no chain policy over the same drafts can beat it.

For ``N`` sequences batched (mlx-lm's batching runs ``N`` rows per pipelined step, cost
``p(N) = c(N) - (c(1) - 1)``, the lone pass minus what pipelining hides):
``τ_r · p(N) / (c(N·r) + d(N·r))`` at the best common ``r`` (a batched drafter pass is charged
as one pass of ``N·r`` rows, an approximation). Drafter costs can be left out (``--free-drafter``).

    python scripts/speedup_bound.py --bench docs/bench/heldout-full-verify/bench.json \\
        --domains gsm8k=gsm8k,chat=chat,code=HumanEval --clients 1,4,8

Prints a table per domain (and all prompts together); needs the pair loaded once for its cached
calibration (``--model``/``--draft`` as in ``dflash calibrate``; defaults: the built-in pair).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import dflash  # noqa: F401  (OpenBLAS before mlx)


def acceptance(prompts: list[dict]) -> np.ndarray:
    """Cycle-weighted acceptance by position over ``prompts`` (bench JSON entries)."""
    total, cycles = None, 0.0
    for p in prompts:
        run = p["dflash"]
        acc = np.asarray(run["acceptance_by_position"], dtype=np.float64) * run["cycles"]
        total = acc if total is None else total + acc
        cycles += run["cycles"]
    return total / max(cycles, 1.0)


def chain_bound(a: np.ndarray, cost) -> tuple[int, float]:
    """Best fixed chain: (rows, tokens per one-token-step of time)."""
    best = (1, 1.0)
    for r in range(1, len(a) + 2):
        tau = 1.0 + a[: r - 1].sum()
        ratio = tau / cost(r)
        if ratio > best[1]:
            best = (r, ratio)
    return best


def oracle_bound(a: np.ndarray, cost) -> float:
    """Rows chosen knowing each cycle's accepted length: E[L+1] / E[cost(L+1)]."""
    reach = np.concatenate([[1.0], a, [0.0]])  # P(L >= i), i = 0..len(a)+1
    p_len = np.clip(reach[:-1] - reach[1:], 0.0, None)  # P(L = i)
    lengths = np.arange(len(p_len))
    return float((p_len * (lengths + 1)).sum() / (p_len * [cost(n + 1) for n in lengths]).sum())


def batch_bound(a: np.ndarray, verify, plain, draft, clients: int) -> tuple[int, float]:
    """Best common chain of r rows per sequence for ``clients`` sequences against plain batching."""
    best = (1, 1.0)
    for r in range(2, len(a) + 2):
        tau = 1.0 + a[: r - 1].sum()
        ratio = tau * plain(clients) / (verify(clients * r) + draft(clients * r))
        if ratio > best[1]:
            best = (r, ratio)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", required=True, help="dflash bench JSON run with whole-block verify")
    p.add_argument("--domains", default="gsm8k=gsm8k,chat=chat,code=HumanEval",
                   help="NAME=ID_PREFIX,... (prompts grouped by id prefix)")
    p.add_argument("--clients", default="1,4,8")
    p.add_argument("--context", type=int, default=256, help="cached tokens for the pass costs")
    p.add_argument("--free-drafter", action="store_true", help="charge nothing for drafting")
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default=None)
    args = p.parse_args()

    from dflash.console import log
    from dflash.cost_model import cost_model
    from dflash.pair import load_pair
    from dflash.target import target_parts

    bench = json.load(open(args.bench))
    run = bench["runs"][0]
    if bench["config"].get("min_confidence", 0.0) != 0.0 or bench["config"].get("policy") not in (
            None, "fixed"):
        raise SystemExit(f"{args.bench}: not a whole-block run (policy fixed, min confidence 0)")
    pair = load_pair(args.model, args.draft, log=log)
    costs = cost_model(target_parts(pair.model), pair.draft)
    step = costs.step(args.context)
    hidden = costs.verify(1, args.context) / step - 1.0  # what pipelining hides, in steps

    def verify(rows: int) -> float:
        return costs.verify(rows, args.context) / step

    def plain(rows: int) -> float:
        return verify(rows) - hidden

    def draft(rows: int) -> float:
        return 0.0 if args.free_drafter else costs.draft(rows) / step

    def cost(rows: int) -> float:
        return 1.0 if rows == 1 else verify(rows) + draft(rows)

    clients = [int(c) for c in args.clients.split(",")]
    groups = {name: [q for q in run["prompts"] if q["id"].startswith(prefix)]
              for name, prefix in (d.split("=", 1) for d in args.domains.split(","))}
    groups["all"] = run["prompts"]
    print(f"bench {args.bench} (block {run['block_size']}); pass costs in pipelined plain steps "
          f"({step:.1f} ms) at context {args.context}: "
          + ", ".join(f"{r} rows {verify(r):.2f}" for r in (1, 2, 4, 8, 16, 32))
          + ("" if args.free_drafter else
             "; draft " + ", ".join(f"{r} rows {draft(r):.2f}" for r in (4, 16))))
    head = ["domain", "prompts", "τ (whole block)", "a1 a2 a3 a4", "best chain", "oracle"]
    head += [f"{n} clients (r)" for n in clients if n > 1]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, prompts in groups.items():
        if not prompts:
            continue
        a = acceptance(prompts)
        rows, chain = chain_bound(a, cost)
        cells = [name, str(len(prompts)), f"{1 + a.sum():.2f}", " ".join(f"{x:.2f}" for x in a[:4]),
                 f"{chain:.2f}× ({rows} rows)", f"{oracle_bound(a, cost):.2f}×"]
        for n in clients:
            if n > 1:
                r, ratio = batch_bound(a, verify, plain, draft, n)
                cells.append(f"{ratio:.2f}× ({r})")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
