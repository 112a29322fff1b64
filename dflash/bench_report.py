"""The prompt bench's reports: ``bench.md``, ``bench.json``, the plots and the terminal lines.

:func:`dflash.bench.run_bench` measures; this module only turns its result dict into text and
pictures, so that a report can be rewritten from a stored ``bench.json`` without a model. The
small formatters (:func:`shown_path`, ``_f``, ``_same``) serve the trace bench's report too
(:mod:`dflash.bench_trace`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from .errors import install_hint


def _f(x, digits=2, suffix="") -> str:
    return "n/a" if x is None else f"{x:.{digits}f}{suffix}"


def _same(x) -> str:
    return "n/a" if x is None else ("yes" if x else "**no**")


def _policy_text(cfg: dict) -> str:
    from .policy import policy_class

    return policy_class(cfg.get("policy", "confidence")).describe(cfg)


def shown_path(path: str) -> str:
    """``path`` as a report shows it: inside the package as ``dflash/...``, inside the cache as
    ``$DFLASH_HOME/...`` (reports are committed and read on other machines), else as given."""
    from .default_pair import cache_dir

    resolved = Path(path).expanduser().resolve()
    for base, name in ((Path(__file__).parent, "dflash"), (cache_dir(), "$DFLASH_HOME")):
        base = base.expanduser().resolve()
        if resolved == base or base in resolved.parents:
            return str(Path(name) / resolved.relative_to(base))
    return str(path)


def markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        "# dflash bench",
        "",
        f"- target: `{shown_path(cfg['model'])}`",
        f"- drafter: `{shown_path(cfg['draft'])}`",
        f"- prompts: {cfg['prompts']} ({cfg['n_prompts']}), max tokens {cfg['max_tokens']}, "
        f"temperature {cfg['temperature']}, repeats {cfg['repeats']}"
        f"{', after a warm-up' if cfg['warmup'] else ''}",
        f"- verify policy: {_policy_text(cfg)}",
        f"- device: {cfg['device']} · {cfg['platform']} · mlx {cfg['mlx']} · "
        f"mlx-lm {cfg['mlx_lm']} · dflash {cfg['dflash']}",
        "- tokens/s are decode speeds (after the first token), same prompt token ids for both",
        "",
    ]
    if len(result["runs"]) > 1:
        lines += ["## Block size sweep", "",
                  "| block size | τ | mlx-lm tok/s | dflash tok/s | speed-up | identical |",
                  "|---:|---:|---:|---:|---:|:---:|"]
        for r in result["runs"]:
            o = r["overall"]
            lines.append(f"| {_arm(r)[len('block '):]} | {_f(o['tau'])} | "
                         f"{_f(o['baseline_tokens_per_s'], 1)} | {_f(o['dflash_tokens_per_s'], 1)} | "
                         f"{_f(o['speedup'], 2, '×')} | {_same(o['identical'])} |")
        lines.append("")
    for r in result["runs"]:
        o = r["overall"]
        lines += [f"## Block size {_arm(r)[len('block '):]}", "",
                  "| prompt | prompt tokens | tokens | mlx-lm tok/s | dflash tok/s | speed-up | τ "
                  "| prompt time mlx-lm / dflash (s) | identical |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|:---:|"]
        for p in r["prompts"]:
            lines.append(
                f"| {p['id']} | {p['prompt_tokens']} | {p['generated_tokens']} | "
                f"{_f(p['baseline']['tokens_per_s'], 1)} | {_f(p['dflash']['tokens_per_s'], 1)} | "
                f"{_f(p['speedup'], 2, '×')} | {_f(p['dflash']['tau'])} | "
                f"{_f(p['baseline']['prompt_time'], 3)} / {_f(p['dflash']['prompt_time'], 3)} | "
                f"{_same(p['identical'])} |")
        lines.append(
            f"| **all** | | | **{_f(o['baseline_tokens_per_s'], 1)}** | "
            f"**{_f(o['dflash_tokens_per_s'], 1)}** | **{_f(o['speedup'], 2, '×')}** | "
            f"**{_f(o['tau'])}** | {_f(o['baseline_prompt_time'], 3)} / "
            f"{_f(o['dflash_prompt_time'], 3)} | {_same(o['identical'])} |")
        busy = o["draft_time"] + o["verify_time"]
        share = f" ({100 * o['draft_time'] / busy:.0f}% drafting)" if busy > 0 else ""
        acc = " · ".join(f"{j + 1}: {a:.2f}" for j, a in enumerate(o["acceptance_by_position"]))
        if o.get("priced_speedup"):
            lines += ["", f"Priced speed-up {o['priced_speedup']:.2f}× (the passes each side "
                      "took, at this machine's calibrated costs: does not depend on what else "
                      "ran)."]
        lines += ["", f"Draft {o['draft_time']:.2f} s / verify {o['verify_time']:.2f} s{share}; "
                      f"{o.get('verified_per_cycle', 0.0):.1f} drafted tokens verified per cycle; "
                      f"{o.get('rows_per_pass', 0.0):.1f} target rows per pass; "
                      f"{100 * o.get('plain_share', 0.0):.0f}% plain steps (no drafting), "
                      f"{100 * o.get('tree_share', 0.0):.0f}% draft trees, "
                      f"{100 * o.get('lookup_share', 0.0):.0f}% context continuations (no "
                      "drafting).",
                  "", f"Acceptance by block position: {acc}", ""]
    return "\n".join(lines) + "\n"


def _arm(run: dict) -> str:
    """A run's name: ``block 16``, or ``block 16, continuations off``."""
    return f"block {run['block_size']}" + ("" if run.get("lookup", True) else
                                            ", continuations off")


def format_summary(result: dict) -> str:
    """A few lines for the terminal."""
    out = []
    if result["config"].get("ranks", 1) > 1:
        split = result["config"].get("split") or "tensor-parallel"
        out.append(f"target sharded {split} over {result['config']['ranks']} ranks; "
                   "mlx-lm: its own sharded generation in the same launch")
    for r in result["runs"]:
        o = r["overall"]
        priced = f" (priced {o['priced_speedup']:.2f}×)" if o.get("priced_speedup") else ""
        out.append(f"{_arm(r)}: τ {_f(o['tau'])}, mlx-lm "
                   f"{_f(o['baseline_tokens_per_s'], 1)} tok/s, dflash "
                   f"{_f(o['dflash_tokens_per_s'], 1)} tok/s, speed-up {_f(o['speedup'], 2, '×')}"
                   f"{priced}, {o.get('rows_per_pass', 0.0):.1f} rows/pass, "
                   f"{100 * o.get('plain_share', 0.0):.0f}% plain steps, "
                   f"{100 * o.get('tree_share', 0.0):.0f}% trees, "
                   f"{100 * o.get('lookup_share', 0.0):.0f}% lookups"
                   f", identical at T=0: {_same(o['identical']).strip('*')}")
        if o.get("baseline_prompt_time") and o.get("dflash_prompt_time"):
            out.append(f"  first token (models loaded): mlx-lm {o['baseline_prompt_time']:.3f} s, "
                       f"dflash {o['dflash_prompt_time']:.3f} s "
                       f"({o['dflash_prompt_time'] / o['baseline_prompt_time']:.2f}x), "
                       "summed over prompts and repeats")
    if result.get("pass_costs"):
        out.append(result["pass_costs"]["describe"])
    return "\n".join(out)


def write_outputs(result: dict, out: str | Path, log: Callable[[str], None] | None = None) -> dict:
    """Write ``bench.json``, ``bench.md`` and the PNG plots into ``out``; return their paths."""
    say = log or (lambda _msg: None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "bench.json", "markdown": out / "bench.md"}
    files["json"].write_text(json.dumps(result, indent=2, ensure_ascii=False))
    files["markdown"].write_text(markdown(result))
    try:
        files.update(plot(result, out))
    except ImportError:
        say(f"matplotlib is not installed: no plots ({install_hint('bench')})")
    say("wrote " + ", ".join(str(p) for p in files.values()))
    return files


def plot(result: dict, out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    runs = result["runs"]
    ids = [p["id"] for p in runs[0]["prompts"]]
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(ids) + 2), 4))
    for k, r in enumerate(runs):
        xs = [i + (k - (len(runs) - 1) / 2) * width for i in range(len(ids))]
        ax.bar(xs, [p["speedup"] or 0.0 for p in r["prompts"]], width,
               label=f"{_arm(r)} (all: {_f(r['overall']['speedup'], 2, '×')})")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(ids)))
    ax.set_xticklabels(ids, rotation=30, ha="right")
    ax.set_ylabel("speed-up over mlx-lm (decode tok/s)")
    ax.set_title("dflash speed-up per prompt")
    ax.legend()
    fig.tight_layout()
    paths["speedup_png"] = out / "speedup.png"
    fig.savefig(paths["speedup_png"], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        acc = r["overall"]["acceptance_by_position"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o",
                label=f"{_arm(r)} (τ {_f(r['overall']['tau'])})")
    ax.set_xlabel("draft position in the block")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance by block position")
    ax.legend()
    fig.tight_layout()
    paths["acceptance_png"] = out / "acceptance.png"
    fig.savefig(paths["acceptance_png"], dpi=120)
    plt.close(fig)
    return paths

