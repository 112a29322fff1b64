"""Draw the plots of docs/benchmarks.md from the numbers in benchmarks/plot_data.json.

Why: a reader would rather look than read for two of the page's tables — the speed-up per
domain of the one-sequence table and the first-token time per turn of the agent sessions over
HTTP. The numbers are not measured here: they are copied from the page into plot_data.json
(with the machine, date and command each came from), so the plots and the tables stay one set
of numbers. Measure again, update the JSON, rerun this.

    python benchmarks/plots.py                      # writes docs/img/*.png
    python benchmarks/plots.py --data FILE --out DIR

(a) ``speedup-per-domain.png``: the `auto` median with its range of runs, and the priced
    speed-up, per domain, against mlx-lm (1.0 = as fast).
(b) ``first-token-per-turn.png``: dflash serve's and mlx_lm.server's first-token time per turn
    (log scale), one panel per session that has per-turn times; a session without them (an
    empty ``turns``) is named and skipped.

Needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DPI = 100
DFLASH, MLX_LM, PRICED = "#1f77b4", "#ff7f0e", "#9ecae1"


def source_line(block: dict) -> str:
    return f"{block['date']} · {block['command']}"


def speedup_per_domain(block: dict, out: Path) -> None:
    domains = block["domains"]
    x = range(len(domains))
    med = [d["speedup"] for d in domains]
    err = [[d["speedup"] - d["low"] for d in domains], [d["high"] - d["speedup"] for d in domains]]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    w = 0.38
    ax.bar([i - w / 2 for i in x], med, w, yerr=err, capsize=3, color=DFLASH,
           label="wall clock (median, range of 3)")
    ax.bar([i + w / 2 for i in x], [d["priced"] for d in domains], w, color=PRICED,
           label="priced at the calibrated pass costs")
    for i, d in enumerate(domains):
        ax.text(i - w / 2, d["high"] + 0.02, f"{d['speedup']:.2f}×", ha="center", fontsize=8)
        ax.text(i + w / 2, d["priced"] + 0.02, f"{d['priced']:.2f}×", ha="center", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(list(x), [f"{d['name']}\nτ {d['tau']:.2f}" for d in domains])
    ax.set_ylabel("speed-up against mlx-lm")
    ax.set_ylim(0, max(d["high"] for d in domains) * 1.35)
    ax.set_title(block["title"], fontsize=10)
    ax.legend(fontsize=8, loc="upper center", ncol=2, frameon=False)
    fig.text(0.01, 0.01, source_line(block), fontsize=6, color="grey")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out, dpi=DPI)
    plt.close(fig)


def first_token_per_turn(block: dict, out: Path) -> None:
    sessions = [s for s in block["sessions"] if s["turns"]]
    for s in block["sessions"]:
        if not s["turns"]:
            print(f"plots: session {s['session']!r} has no per-turn times, skipped"
                  + (f" ({s['note']})" if s.get("note") else ""))
    if not sessions:
        print(f"plots: no session with per-turn times, {out.name} not written")
        return
    fig, axes = plt.subplots(len(sessions), 1, figsize=(6.4, 3.6 * len(sessions)), squeeze=False)
    for ax, s in zip(axes[:, 0], sessions):
        turns = s["turns"]
        x = range(len(turns))
        w = 0.38
        ax.bar([i - w / 2 for i in x], [t["dflash_s"] for t in turns], w, color=DFLASH,
               label="dflash serve")
        ax.bar([i + w / 2 for i in x], [t["mlx_lm_s"] for t in turns], w, color=MLX_LM,
               label="mlx_lm.server")
        for i, t in enumerate(turns):
            ax.text(i - w / 2, t["dflash_s"] * 1.1, f"{t['dflash_s']:.2f}", ha="center", fontsize=7)
            ax.text(i + w / 2, t["mlx_lm_s"] * 1.1, f"{t['mlx_lm_s']:.2f}", ha="center", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylim(min(t["dflash_s"] for t in turns) / 2, max(t["mlx_lm_s"] for t in turns) * 3)
        ax.set_xticks(list(x), [t["request"].replace(" after ", "\nafter ") for t in turns],
                      fontsize=8)
        ax.set_ylabel("first token (s, log scale)")
        title = f"{s['session']} session" + (f" ({s['caveat']})" if s.get("caveat") else "")
        ax.set_title(block["title"] + "\n" + "\n".join(textwrap.wrap(title, 80)), fontsize=9)
        ax.legend(fontsize=8, loc="upper right", ncol=2, frameon=False)
        ax.text(0.0, -0.3, source_line(s), transform=ax.transAxes, fontsize=6, color="grey")
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=ROOT / "benchmarks/plot_data.json")
    p.add_argument("--out", type=Path, default=ROOT / "docs/img")
    args = p.parse_args()
    data = json.loads(args.data.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    speedup_per_domain(data["speedup_per_domain"], args.out / "speedup-per-domain.png")
    first_token_per_turn(data["first_token_per_turn"], args.out / "first-token-per-turn.png")
    for f in sorted(args.out.glob("*.png")):
        print(f"{f.relative_to(ROOT) if f.is_relative_to(ROOT) else f}: {f.stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
