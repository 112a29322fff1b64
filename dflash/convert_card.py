"""What ``dflash convert`` says about its output: the ``README.md`` model card written beside the
weights and the summary printed at the end of the command, both from the conversion's report.
"""

from __future__ import annotations

import re
from pathlib import Path

from . import __version__
from .convert_plan import parse_recipe
from .drafter import DFlashConfig


def _compatible_targets(raw: dict, src: Path, source_name: str) -> list[str]:
    found: list[str] = []

    def add(value):
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and v and v not in found:
                found.append(v)

    dcfg = raw.get("dflash_config") or {}
    for key in ("target_model", "target_model_name_or_path", "target_model_path", "base_model",
                "target"):
        add(raw.get(key))
        add(dcfg.get(key) if isinstance(dcfg, dict) else None)
    readme = src / "README.md"
    if readme.is_file():
        text = readme.read_text(errors="replace")
        m = re.match(r"---\n(.*?)\n---", text, re.DOTALL)
        if m:
            lines = m.group(1).splitlines()
            for i, line in enumerate(lines):
                if line.startswith("base_model:"):
                    rest = line.split(":", 1)[1].strip()
                    if rest:
                        add(rest.strip("'\""))
                    for nxt in lines[i + 1:]:
                        if not nxt.strip().startswith("- "):
                            break
                        add(nxt.strip()[2:].strip("'\""))
    if not found:
        m = re.match(r"(.+?)-DFlash", source_name.split("/")[-1], re.IGNORECASE)
        if m:
            add(m.group(1) + " (inferred from the drafter's name)")
    return found


def _fmt_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def _quantization_summary(report: dict) -> tuple[str, str]:
    """The card's ``Quantization`` row and the short phrase of its first line, by recipe."""
    q = report["quantization"]
    recipe = report["recipe"]
    if q is None:
        return f"none ({report['dtype']} weights)", f"{report['dtype']}"
    if recipe == "uniform":
        return f"Uniform {q['bits']}-bit", f"{q['bits']}-bit quantized"
    if recipe == "sensitivity":
        return (f"Sensitivity-aware mixed precision (average {report['average_bits']:.2f} bits "
                f"per quantized weight, budget {report['sensitivity']['bit_budget']})",
                f"sensitivity-aware mixed-precision ({report['average_bits']:.2f}-bit average)")
    hi, lo = parse_recipe(recipe)[1]
    return (f"Mixed {hi}/{lo}-bit (`{recipe}`: `fc` and the first and last layer at {hi} "
            f"bits, the rest at {lo})", f"mixed {hi}/{lo}-bit quantized")


def _intro_lines(name: str, short: str, source: str, cfg: DFlashConfig,
                 targets: list[str]) -> list[str]:
    """Title, what a drafter is, and the targets it runs with."""
    lines = [
        f"# {name}", "",
        f"MLX {short} version of the DFlash drafter `{source}`, for Apple Silicon and any other "
        "MLX backend.", "",
        "This is the **drafter** of a DFlash speculative decoding pair: a block diffusion model "
        f"that fills a block of {cfg.block_size} tokens in one pass; the target verifies them all "
        "in one forward pass and keeps the longest agreeing prefix, so the output is exactly "
        "the target's. It is **not a standalone chat model**: it has no embedding table and no "
        "LM head of its own and borrows the target's.", "",
        "## Compatible targets", "",
    ]
    lines += [f"- {t}" for t in targets]
    lines += [
        f"- any target with hidden size {cfg.hidden_size}, a vocabulary of {cfg.vocab_size} "
        + (f"and {cfg.num_target_layers} decoder layers " if cfg.num_target_layers else "")
        + f"whose layers {cfg.target_layer_ids} (0-based outputs) this drafter was trained on "
          "(fine-tunes of the original target work; unrelated models of the same shape do not)",
        "",
    ]
    return lines


def _quantization_lines(report: dict, source: str, q_line: str) -> list[str]:
    """The ``Quantization`` table and, when quantized, which tensors got how many bits."""
    q = report["quantization"]
    lines = [
        "## Quantization", "",
        "| | |", "|---|---|",
        f"| Source | `{source}` ({report['source_dtype']}) |",
        "| Format | MLX (safetensors, mlx-lm `quantization` config block) |",
        f"| Quantization | {q_line} |",
    ]
    if q is not None:
        lines += [f"| Group size | {q['group_size']} |", "| Mode | affine |"]
    lines += [
        f"| Floating-point dtype | {report['dtype']} |",
        f"| Size on disk | {_fmt_size(report['size_before'])} -> {_fmt_size(report['size_after'])} |",
        f"| Bits per weight | {report['bits_per_weight']:.2f} |",
        "| Target platform | Apple Silicon (Metal); also runs on MLX's CPU and CUDA backends |",
        "",
    ]
    if q is None:
        return lines
    by_bits: dict[int, list[str]] = {}
    for p, b in report["quantized"].items():
        by_bits.setdefault(b, []).append(p)
    lines += ["Quantized tensors (packed `weight` + `scales` + `biases`):", ""]
    for b in sorted(by_bits, reverse=True):
        lines.append(f"- **{b}-bit** ({len(by_bits[b])}): " + ", ".join(f"`{p}`" for p in by_bits[b]))
    lines += ["", "Kept in floating point:", "",
              "- every norm (`hidden_norm`, `norm`, `input_layernorm`, "
              "`post_attention_layernorm`, `q_norm`, `k_norm`)"]
    for p, why in report["kept"].items():
        lines.append(f"- `{p}`: {why}")
    if report["recipe"] == "uniform":
        lines += ["", f"This release does **not** use sensitivity-aware mixed precision: every "
                      f"quantizable projection is quantized to {q['bits']} bits."]
    lines.append("")
    return lines


def _measured_lines(report: dict, cfg: DFlashConfig) -> list[str]:
    """What the conversion measured (KL, top-1 agreement, τ), and its notes; empty when none."""
    lines: list[str] = []
    if report.get("calibration"):
        c = report["calibration"]
        lines += ["## Measured on this conversion", "",
                  f"- Calibration: {c['description']}",
                  f"- Block-prediction KL divergence from the unquantized drafter: {c['kl']:.4g} nats; "
                  f"top-1 agreement {100 * c['top1_agreement']:.1f} %"]
        if report.get("sensitivity") and "uniform_comparison" in report["sensitivity"]:
            u = report["sensitivity"]["uniform_comparison"]
            lines.append(f"- Uniform {u['bits']}-bit for comparison: KL {u['kl']:.4g} nats, "
                         f"top-1 agreement {100 * u['top1_agreement']:.1f} %")
    if report.get("tau"):
        t = report["tau"]
        if not report.get("calibration"):
            lines += ["## Measured on this conversion", ""]
        lines.append(f"- Mean acceptance τ (greedy, block {cfg.block_size}, {t['prompts']} fixed "
                     f"prompts, target `{t['target']}`): original {t['original']:.3f}, "
                     f"converted {t['converted']:.3f}")
    if report.get("calibration") or report.get("tau"):
        lines.append("")
    if report.get("notes"):
        lines += ["Notes:", ""] + [f"- {n}" for n in report["notes"]] + [""]
    return lines


def _usage_lines(name: str, target_example: str, cfg: DFlashConfig) -> list[str]:
    """How to run the pair (the snippet a test runs verbatim), and the credits."""
    return [
        "## Usage", "",
        "```python",
        "from dflash.model_mlx import load, load_draft, stream_generate",
        "",
        f'model, tokenizer = load("{target_example}")',
        f'draft = load_draft("{name}")',
        "",
        'messages = [{"role": "user", "content": "Explain speculative decoding."}]',
        "prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)",
        "",
        f"for r in stream_generate(model, draft, tokenizer, prompt, block_size={cfg.block_size}, "
        "max_tokens=2048, temperature=0.6):",
        '    print(r.text, end="", flush=True)',
        "```", "",
        "Weight-only quantization of the drafter barely moves acceptance; float16 *activations* "
        "do (keep the drafter in bfloat16 or float32), and the output is always exactly the "
        "target's.", "",
        "## Credits", "",
        "- z-lab DFlash team (method and original drafter), the Qwen team, Apple MLX", "",
        "```bibtex",
        "@article{chen2026dflash,",
        "  title={DFlash: Block Diffusion for Flash Speculative Decoding},",
        "  author={Chen, Jian and Liang, Yesheng and Liu, Zhijian},",
        "  year={2026},",
        "  eprint={2602.06036},",
        "  archivePrefix={arXiv},",
        "  primaryClass={cs.LG}",
        "}",
        "```", "",
        f"Converted with `dflash convert` (dflash {__version__}).", "",
    ]


def model_card(report: dict, raw: dict, cfg: DFlashConfig, name: str, src: Path) -> str:
    """A README.md in the spirit of the public DFlash MLX cards."""
    source = report["source"]
    if Path(source).expanduser().exists():
        # a local folder: its name, not this machine's path (the card travels with the weights)
        source = src.name
    targets = _compatible_targets(raw, src, source)
    q_line, short = _quantization_summary(report)
    target_example = targets[0].split(" (")[0] if targets else "PATH_OR_REPO_OF_THE_TARGET"
    lines = (_intro_lines(name, short, source, cfg, targets)
             + _quantization_lines(report, source, q_line)
             + _measured_lines(report, cfg)
             + _usage_lines(name, target_example, cfg))
    return "\n".join(lines)


def format_report(r: dict) -> str:
    """The human summary printed at the end of ``dflash convert``."""
    lines = [f"[convert] {r['source']} -> {r['destination']}"]
    if r["quantization"] is None:
        lines.append(f"  weights: {r['dtype']} (not quantized)")
    else:
        by_bits: dict[int, int] = {}
        for b in r["quantized"].values():
            by_bits[b] = by_bits.get(b, 0) + 1
        mix = ", ".join(f"{n} tensors at {b} bits" for b, n in sorted(by_bits.items(), reverse=True))
        lines.append(f"  quantization: {r['recipe']}, group size {r['quantization']['group_size']}, "
                     f"{mix or 'nothing quantized'}; floats in {r['dtype']}")
        if r["kept"]:
            lines.append("  kept in float: " + "; ".join(f"{p} ({why})"
                                                          for p, why in r["kept"].items()))
    before = r["bits_per_weight_before"]
    lines.append(f"  size on disk: {_fmt_size(r['size_before'])} -> {_fmt_size(r['size_after'])}"
                 f" ({len(r['files'])} file{'s' if len(r['files']) > 1 else ''})")
    lines.append("  bits per weight: "
                 + (f"{before:.2f} -> " if before is not None else "")
                 + f"{r['bits_per_weight']:.2f}")
    if r.get("sensitivity"):
        s = r["sensitivity"]
        lines.append(f"  sensitivity: budget {s['bit_budget']} bits, spent "
                     f"{s['average_bits']:.2f} bits per quantized weight ({s['seconds']} s)")
        if "uniform_comparison" in s:
            u = s["uniform_comparison"]
            lines.append(f"    uniform {u['bits']}-bit for comparison: KL {u['kl']:.4g}, "
                         f"top-1 {100 * u['top1_agreement']:.1f} %")
    if r.get("calibration"):
        c = r["calibration"]
        lines.append(f"  block-prediction KL vs unquantized: {c['kl']:.4g} nats, top-1 agreement "
                     f"{100 * c['top1_agreement']:.1f} %")
        lines.append(f"    calibration: {c['description']}")
    if r.get("tau"):
        t = r["tau"]
        lines.append(f"  mean τ (greedy, {t['prompts']} prompts, {t['max_tokens']} tokens): "
                     f"original {t['original']:.3f} -> converted {t['converted']:.3f}"
                     + ("" if t["outputs_identical"] else
                        "  [outputs differ: float rounding of the verify pass]"))
    for note in r.get("notes", []):
        lines.append(f"  note: {note}")
    return "\n".join(lines)
