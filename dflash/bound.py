"""How fast speculation could be with this drafter on this machine: bounds from two measurements
(``dflash bench --bound BENCH.json``).

Why: when a speed-up falls short, this says whether the gap is the engine's or the drafter's. It
combines the drafter's acceptance by block position under whole-block verification (a
``dflash bench --policy fixed --min-confidence 0`` JSON: ``a_i`` = share of cycles whose first ``i``
drafted tokens were all accepted) with this machine's calibrated pass costs (``dflash
calibrate``: ``verify(rows)``, ``draft(rows)`` and the pipelined plain ``step``).

For one sequence, in plain steps, with ``c(r) = (verify(r) + draft(r)) / step`` for ``r ≥ 2`` and
``c(1) = 1``:

* **best fixed chain** of ``r`` rows: ``τ_r = 1 + Σ_{i<r} a_i`` tokens for ``c(r)``; it bounds
  every policy that verifies the same number of rows each cycle;
* **oracle**: a policy that knew each cycle's accepted length ``L`` verifies ``L + 1`` rows:
  ``E[L + 1] / E[c(L + 1)]`` with ``P(L ≥ i) = a_i``; no chain policy over the same drafts beats it.

For ``N`` sequences batched (plain batching runs ``N`` rows per pipelined step, costing the lone
pass minus what pipelining hides): ``τ_r · plain(N) / (verify(N·r) + draft(N·r))`` at the best
common ``r`` (a batched drafter pass is charged as one pass of ``N·r`` rows, an approximation).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from .errors import DataSetError

Cost = Callable[[int], float]
DOMAINS = "gsm8k=gsm8k,chat=chat,code=HumanEval"


def acceptance(prompts: Sequence[dict]) -> np.ndarray:
    """Cycle-weighted acceptance by position over ``prompts`` (bench JSON entries)."""
    total, cycles = None, 0.0
    for p in prompts:
        run = p["dflash"]
        acc = np.asarray(run["acceptance_by_position"], dtype=np.float64) * run["cycles"]
        total = acc if total is None else total + acc
        cycles += run["cycles"]
    return total / max(cycles, 1.0)


def chain_bound(a: np.ndarray, cost: Cost) -> tuple[int, float]:
    """Best fixed chain: ``(rows, tokens per one-token step of time)``."""
    best = (1, 1.0)
    for r in range(1, len(a) + 2):
        ratio = (1.0 + a[: r - 1].sum()) / cost(r)
        if ratio > best[1]:
            best = (r, ratio)
    return best


def oracle_bound(a: np.ndarray, cost: Cost) -> float:
    """Rows chosen knowing each cycle's accepted length: ``E[L+1] / E[cost(L+1)]``."""
    reach = np.concatenate([[1.0], a, [0.0]])  # P(L >= i), i = 0..len(a)+1
    p_len = np.clip(reach[:-1] - reach[1:], 0.0, None)  # P(L = i)
    lengths = np.arange(len(p_len))
    return float((p_len * (lengths + 1)).sum() / (p_len * [cost(n + 1) for n in lengths]).sum())


def batch_bound(a: np.ndarray, verify: Cost, plain: Cost, draft: Cost,
                clients: int) -> tuple[int, float]:
    """Best common chain of ``r`` rows per sequence for ``clients`` sequences, against plain
    batching: ``(rows, speed-up)``."""
    best = (1, 1.0)
    for r in range(2, len(a) + 2):
        ratio = (1.0 + a[: r - 1].sum()) * plain(clients) / (verify(clients * r)
                                                              + draft(clients * r))
        if ratio > best[1]:
            best = (r, ratio)
    return best


def read_whole_block_run(path: str | Path) -> dict:
    """A bench JSON with whole-block verification; anything else is refused, naming the file."""
    bench = json.loads(Path(path).read_text())
    config = bench["config"]
    if config.get("min_confidence", 0.0) != 0.0 or config.get("policy") not in (None, "fixed"):
        raise DataSetError(f"{path}: config.policy {config.get('policy')!r} / "
                           f"config.min_confidence {config.get('min_confidence')!r}: not a "
                           "whole-block run (bench --policy fixed --min-confidence 0)")
    return bench


def format_bound(bench: dict, name: str, verify: Cost, draft: Cost, step_ms: float,
                 clients: Sequence[int] = (1, 4, 8), domains: str = DOMAINS) -> str:
    """The bound table: per domain (prompt id prefix), and all prompts together.

    ``verify(rows)`` and ``draft(rows)`` are pass costs in pipelined plain steps;
    ``verify(1) - 1`` is what pipelining hides.
    """
    run = bench["runs"][0]
    hidden = verify(1) - 1.0

    def plain(rows: int) -> float:
        return verify(rows) - hidden

    def cost(rows: int) -> float:
        return 1.0 if rows == 1 else verify(rows) + draft(rows)

    groups = {label: [q for q in run["prompts"] if q["id"].startswith(prefix)]
              for label, prefix in (d.split("=", 1) for d in domains.split(","))}
    groups["all"] = run["prompts"]
    lines = [f"bound of {name} (block {run['block_size']}); pass costs in pipelined plain steps "
             f"({step_ms:.1f} ms): "
             + ", ".join(f"{r} rows {verify(r):.2f}" for r in (1, 2, 4, 8, 16, 32))
             + "; draft " + ", ".join(f"{r} rows {draft(r):.2f}" for r in (4, 16)), ""]
    head = ["domain", "prompts", "τ (whole block)", "a1 a2 a3 a4", "best chain", "oracle"]
    head += [f"{n} clients (r)" for n in clients if n > 1]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, prompts in groups.items():
        if not prompts:
            continue
        a = acceptance(prompts)
        rows, chain = chain_bound(a, cost)
        cells = [label, str(len(prompts)), f"{1 + a.sum():.2f}",
                 " ".join(f"{x:.2f}" for x in a[:4]), f"{chain:.2f}× ({rows} rows)",
                 f"{oracle_bound(a, cost):.2f}×"]
        cells += [f"{ratio:.2f}× ({r})" for n in clients if n > 1
                  for r, ratio in [batch_bound(a, verify, plain, draft, n)]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace, log: Callable[[str], None],
                  context: int = 256) -> int:
    """``dflash bench --bound FILE``: the bound table from a whole-block bench JSON and the
    pair's calibrated pass costs (measured once per machine, then cached)."""
    from .cost_model import calibrate
    from .pair import load_pair
    from .target import target_parts

    bench = read_whole_block_run(args.bound)
    pair = load_pair(args.model, args.draft, log=log)
    costs = calibrate(target_parts(pair.model), pair.draft)  # measured, not learnt: a bound
    step = costs.step(context)
    print(format_bound(bench, str(args.bound), lambda r: costs.verify(r, context) / step,
                       lambda r: costs.draft(r) / step, step), flush=True)
    return 0
