"""``dflash bench --context 512,2k,4k,8k``: the same tasks at growing context lengths.

Why: users of every DFlash engine report that the speed-up collapses as the context grows (the
verify pass's attention grows with the context, the drafter's too, unless its context is windowed)
and that memory grows with it. This bench puts unrelated real text before each prompt of a prompt
set so that every prompt holds ``length - max_tokens`` tokens ("8k": 7,936 prompt tokens + 256
generated for SmolLM2's 8,192 positions), then runs the ordinary bench (mlx-lm and dflash
alternating on the same token ids, greedy outputs compared) at each length, with the context's
continuations and without, and reports per length: decode speed-up (and the range of the
repeats' own), priced speed-up, τ, the drafter's share of the cycle time, prefill time of each
side and peak memory of each side.

Each side prefills a prompt once and every repeat decodes from a copy of its caches
(``run_bench(reuse_prefill=True)``): an 8k prefill takes minutes here, and decodes that far apart
measured the machine's drift more than the two sides (the same 8k decode, interleaved in one
process, ran 0.87-1.28x mlx-lm's from one repeat to the next; the bench's repeats are seconds
apart and their median is reported).

The text put first is the plain-text documentation of a few standard-library modules (pydoc, as
every Python installation can render it): real English prose with code words, which the answers
to math, chat and coding prompts do not quote. It depends on the Python version; the bench
records which.
"""

from __future__ import annotations

import platform
import re
from collections.abc import Callable, Sequence

from .errors import GenerationConfigError

FILLER_MODULES = ("email.message", "http.cookiejar", "calendar", "tarfile", "smtplib", "zipfile",
                  "logging.handlers", "ftplib", "mailbox", "imaplib")
PREAMBLE = "Here is some documentation, for reference only (the question below does not need it):"


def parse_contexts(text: str | int | Sequence[int]) -> list[int]:
    """``"512,2k,4k,8k"`` -> ``[512, 2048, 4096, 8192]`` (``k``: 1,024 tokens); typed error
    naming ``--context`` otherwise."""
    if isinstance(text, int):
        items: list[str | int] = [text]
    elif isinstance(text, str):
        items = [t.strip() for t in text.split(",") if t.strip()]
    else:
        items = list(text)
    out = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            value = item
        else:
            m = re.fullmatch(r"(\d+)(k?)", str(item).lower())
            if m is None:
                raise GenerationConfigError(
                    f"--context {text!r}: {item!r} is not a token count (e.g. 512, 2k, 8k)")
            value = int(m.group(1)) * (1024 if m.group(2) else 1)
        if value < 2:
            raise GenerationConfigError(f"--context {text!r}: {value} must be at least 2 tokens")
        out.append(value)
    if not out:
        raise GenerationConfigError("--context: give at least one length, e.g. 512,2k,4k,8k")
    return sorted(dict.fromkeys(out))


def filler_text() -> str:
    """The unrelated text put before each prompt (see the module docstring)."""
    import importlib
    import pydoc

    parts = []
    for name in FILLER_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a Python built without it
            continue
        parts.append(pydoc.render_doc(module, renderer=pydoc.plaintext))
    return re.sub(r"\n{3,}", "\n\n", "\n\n".join(parts))


def _with_document(item: dict, document: str) -> dict:
    """``item`` with ``document`` put before its first user message."""
    messages = [dict(m) for m in (item.get("messages")
                                  or [{"role": "user", "content": item["prompt"]}])]
    for m in messages:
        if m.get("role") == "user":
            m["content"] = f"{PREAMBLE}\n\n{document}\n\n---\n\n{m['content']}"
            break
    return {k: v for k, v in item.items() if k != "prompt"} | {"messages": messages}


def at_context(items: Sequence[dict], length: int, max_tokens: int, encode: Callable[[dict], list],
               tokenizer, filler: str | None = None) -> list[dict]:
    """Each item with as much of the filler text before it as makes its prompt
    ``length - max_tokens`` tokens (within a few: a cut re-tokenises); an item already longer
    is kept as it is. ``encode``: an item's prompt token ids (the bench's own encoding)."""
    filler_ids = list(tokenizer.encode(filler if filler is not None else filler_text()))
    want = length - max_tokens
    out = []
    for item in items:
        bare = len(encode(item))
        if bare >= want:
            out.append(dict(item, id=f"{item['id']}@{length}"))
            continue
        n = max(0, want - bare - 40)  # the preamble and separators take some tokens
        padded = item
        for _ in range(6):  # re-tokenising a cut text moves its length a little: converge
            if n > len(filler_ids):
                raise GenerationConfigError(
                    f"--context {length}: the filler text holds {len(filler_ids)} tokens, "
                    f"fewer than the {want - bare} needed")
            padded = _with_document(item, tokenizer.decode(filler_ids[:n]))
            got = len(encode(padded))
            if got == want:
                break
            n = max(0, n + want - got)
        out.append(dict(padded, id=f"{item['id']}@{length}"))
    return out


def run_context_bench(lengths: Sequence[int], *, pair, prompts, max_tokens: int,
                      limit: int | None = None, say: Callable[[str], None] = lambda _m: None,
                      lookups: Sequence[bool] = (True, False),
                      on_row: Callable[[dict], None] | None = None, **bench_kwargs) -> dict:
    """:func:`dflash.bench.run_bench` at each context length, with the context's continuations
    and without (``lookups``: which of the two), both decoding from the same prefills and timed
    against the same mlx-lm decodes; one row per length. ``on_row``: called with the result so
    far after each length (an 8k row takes many minutes: a run stopped later keeps the rows it
    finished)."""
    from .bench import load_prompts, run_bench
    from .prompts import encode_prompt

    _, items = load_prompts(prompts, limit)
    template = {k: bench_kwargs[k] for k in ("chat_template", "system") if k in bench_kwargs}

    def encode(item: dict) -> list[int]:
        return encode_prompt(pair.tokenizer, item, **template)

    lookups = list(dict.fromkeys(lookups))
    if pair.max_context is not None and max(lengths) > pair.max_context:  # before any work
        raise GenerationConfigError(
            f"--context {max(lengths)}: the target reads {pair.max_context} positions")
    filler = filler_text()
    # Warm both engines up on the first prompt as it is (a warm-up at the first length would
    # prefill it there: minutes at 8k, more over a quantized cache).
    run_bench(pair=pair, prompts=items[:1], max_tokens=min(16, max_tokens), log=lambda _m: None,
              lookup=lookups, **(bench_kwargs | {"repeats": 1}))
    rows: list[dict] = []

    def summary(rows: list[dict]) -> dict:
        return {"config": {"contexts": list(lengths), "max_tokens": max_tokens,
                           "filler": f"pydoc of {', '.join(FILLER_MODULES)} "
                                     f"(Python {platform.python_version()})",
                           "n_prompts": len(items), "kv": bench_kwargs.get("kv") or None,
                           "lookups": list(lookups)},
                "rows": list(rows)}

    for length in lengths:
        padded = at_context(items, length, max_tokens, encode, pair.tokenizer, filler)
        row: dict = {"context": length,
                     "prompt_tokens": [len(encode(p)) for p in padded]}
        say(f"context {length}: {len(padded)} prompts of ~{length - max_tokens} tokens, "
            f"continuations {'/'.join('on' if lk else 'off' for lk in lookups)}")
        result = run_bench(pair=pair, prompts=padded, max_tokens=max_tokens, lookup=lookups,
                           warmup=False, log=say, reuse_prefill=True, **bench_kwargs)
        for run in result["runs"]:
            row["lookup" if run["lookup"] else "no_lookup"] = _arm_row(run, result)
        rows.append(row)
        if on_row is not None:
            on_row(summary(rows))
    return summary(rows)


def _arm_row(run: dict, result: dict) -> dict:
    """One arm (continuations on or off) of one length's bench run."""
    overall, prompts = run["overall"], run["prompts"]
    cycle = overall["draft_time"] + overall["verify_time"]
    spread = [x for p in prompts for x in p["repeat_speedups"] if x is not None]
    return {
        "speedup": overall["speedup"], "priced_speedup": overall["priced_speedup"],
        "speedup_range": [min(spread), max(spread)] if spread else None,
        "reused_prefill": result["config"]["reuse_prefill"],
        "tau": overall["tau"], "lookup_share": overall["lookup_share"],
        "plain_share": overall["plain_share"],
        "drafter_share": overall["draft_time"] / cycle if cycle > 0 else None,
        # Each prompt's median prefill, averaged over the prompts.
        "baseline_prefill_s": sum(p["baseline"]["prompt_time"] for p in prompts) / len(prompts),
        "dflash_prefill_s": sum(p["dflash"]["prompt_time"] for p in prompts) / len(prompts),
        "baseline_peak_gb": max(p["baseline"].get("peak_memory_gb") or 0.0 for p in prompts),
        "dflash_peak_gb": max(p["dflash"]["peak_memory_gb"] for p in prompts),
        "identical": run["overall"]["identical"],
    }


def format_context_summary(result: dict) -> str:
    """One line per context length (speed-ups: over all repeats, and the repeats' range)."""
    lines = ["context  speed-up [repeats] (priced)     no-lookup [repeats] (priced)     τ      "
             "drafter  prefill s mlx-lm/dflash  peak GB mlx-lm/dflash  identical"]

    def x(v):
        return "   -  " if v is None else f"{v:5.2f}×"

    def span(arm):
        r = arm.get("speedup_range") if arm else None
        return "[     -     ]" if not r else f"[{r[0]:4.2f}-{r[1]:4.2f}]"

    for row in result["rows"]:
        on, off = row.get("lookup"), row.get("no_lookup")
        first = on or off  # the shared columns (prefill, peaks) from the first arm run
        identical = all(arm["identical"] for arm in (on, off) if arm)
        lines.append(
            f"{row['context']:>7}  {x(on and on['speedup'])} {span(on)} "
            f"({x(on and on['priced_speedup'])})   {x(off and off['speedup'])} {span(off)} "
            f"({x(off and off['priced_speedup'])})  "
            f"{first['tau']:5.2f}  {(first['drafter_share'] or 0) * 100:5.1f} %  "
            f"{first['baseline_prefill_s']:6.2f} / {first['dflash_prefill_s']:6.2f}     "
            f"{first['baseline_peak_gb']:5.2f} / {first['dflash_peak_gb']:5.2f}        "
            f"{identical}")
    return "\n".join(lines)


def plot_contexts(result: dict, path) -> None:
    """Speed-up against context length, with and without continuations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["context"] for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, marker, label in (("lookup", "o", "auto (continuations on)"),
                               ("no_lookup", "s", "continuations off")):
        if all(arm in r for r in result["rows"]):
            ax.plot(xs, [r[arm]["speedup"] or 0 for r in result["rows"]], marker=marker,
                    label=label)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (prompt + generated tokens)")
    ax.set_ylabel("decode speed-up over mlx-lm")
    ax.set_title("speed-up by context length")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
