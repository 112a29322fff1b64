"""``dflash bench --trace FILE``: agent conversations replayed turn by turn (:mod:`dflash.traces`).

Each turn sends the whole history and runs through mlx-lm and dflash from scratch (the end-to-end
speed-ups) and through dflash with a prefix cache carried across the conversation (time to first
token); the report says which proposal source won each pass. Its own module: it shares only one
timed run of each side (:mod:`dflash.bench_runs`) and the report formatters
(:mod:`dflash.bench_report`) with the prompt bench.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .bench_report import _f, _policy_text, _same, shown_path
from .bench_runs import (
    _environment,
    _first_difference,
    _ratio,
    _run_baseline,
    _run_dflash,
    parse_block_sizes,
)
from .errors import BenchConfigError
from .files import write_atomic

SOURCES = ("chain", "tree", "context", "index", "plain")  # what a pass verified
SIDE_NAMES = {"mlx_lm": "mlx-lm", "dflash": "dflash",
              "dflash_prompt_cache": "dflash with the prefix cache"}
SIDES = tuple(SIDE_NAMES)  # mlx-lm first: the others are timed against it
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}  # histories hold the answers


def _passes(r: dict) -> dict[str, int | None]:
    """One dflash generation's passes by what they verified: the drafter's chain or tree, the
    sequence's own continuation, the cross-request index's, or a plain step (``index`` is
    ``None`` where the engine does not count it apart)."""
    lookups, index = r.get("lookup_cycles", 0), r.get("index_cycles")
    return {"chain": r["cycles"] - r["tree_cycles"] - lookups, "tree": r["tree_cycles"],
            "context": lookups - (index or 0), "index": index, "plain": r["plain_steps"]}


def _shares(passes: dict[str, int | None]) -> dict[str, float | None]:
    total = sum(v for v in passes.values() if v is not None)
    return {k: None if v is None else (v / total if total else 0.0) for k, v in passes.items()}


def _add_passes(a: dict, b: dict) -> dict:
    return {k: None if a[k] is None or b[k] is None else a[k] + b[k] for k in SOURCES}


def _side(runs: list[dict]) -> dict:
    """One side of a turn, per run (the mean over the repeats): time to first token, decode,
    end to end."""
    n = len(runs)
    ttft = sum(r["prompt_time"] for r in runs) / n
    decode = sum(r["decode_time"] for r in runs) / n
    tokens = sum(r["decode_tokens"] for r in runs) / n
    return {"ttft_s": ttft, "decode_s": decode, "total_s": ttft + decode,
            "decode_tokens": tokens, "decode_tokens_per_s": tokens / decode if decode > 0 else 0.0}


def _trace_row(conversation: str, k: int, turn, n_prompt: int, base: list[dict],
               scratch: list[dict], cached: list[dict], text: str) -> dict:
    passes = {k_: 0 for k_ in SOURCES}
    for r in scratch:
        passes = _add_passes(passes, _passes(r))
    cycles = sum(r["cycles"] for r in scratch)
    differ = {}
    for name, runs in (("dflash", scratch), ("dflash_prompt_cache", cached)):
        diffs = [_first_difference(b["tokens"], d["tokens"]) for b, d in zip(base, runs)
                 if b["tokens"] != d["tokens"]]
        differ[name] = diffs[0] if diffs else None
    b, d, c = _side(base), _side(scratch), _side(cached)
    d.update(tau=sum(r["cycle_tokens"] for r in scratch) / cycles if cycles else 0.0,
             passes=passes, shares=_shares(passes))
    c["reused_prompt_tokens"] = cached[-1]["reused_prompt_tokens"]
    return {"conversation": conversation, "turn": k + 1, "retry": turn.retry,
            "prompt_tokens": n_prompt, "max_tokens": turn.max_tokens,
            "generated_tokens": len(base[-1]["tokens"]),
            "mlx_lm": b, "dflash": d, "dflash_prompt_cache": c,
            "speedup": _ratio(b["total_s"], d["total_s"]),
            "decode_speedup": _ratio(d["decode_tokens_per_s"], b["decode_tokens_per_s"]),
            "prompt_cache_speedup": _ratio(b["total_s"], c["total_s"]),
            "identical": all(v is None for v in differ.values()),
            "first_difference": differ, "text": text}


def _trace_totals(rows: list[dict]) -> dict | None:
    """Sums over ``rows`` (per run): end-to-end and decode speed-ups, first-token times both
    ways, and the share of passes each source won."""
    if not rows:
        return None
    sums = {side: {k: sum(r[side][k] for r in rows) for k in ("ttft_s", "decode_s", "total_s",
                                                               "decode_tokens")}
            for side in ("mlx_lm", "dflash", "dflash_prompt_cache")}
    for s in sums.values():
        s["decode_tokens_per_s"] = s["decode_tokens"] / s["decode_s"] if s["decode_s"] else 0.0
    passes = {k: 0 for k in SOURCES}
    for r in rows:
        passes = _add_passes(passes, r["dflash"]["passes"])
    b, d, c = sums["mlx_lm"], sums["dflash"], sums["dflash_prompt_cache"]
    return {"turns": len(rows), "generated_tokens": sum(r["generated_tokens"] for r in rows),
            **sums, "speedup": _ratio(b["total_s"], d["total_s"]),
            "decode_speedup": _ratio(d["decode_tokens_per_s"], b["decode_tokens_per_s"]),
            "prompt_cache_speedup": _ratio(b["total_s"], c["total_s"]),
            "ttft_prompt_cache_speedup": _ratio(d["ttft_s"], c["ttft_s"]),
            "passes": passes, "shares": _shares(passes),
            "identical": all(r["identical"] for r in rows)}


def run_trace_bench(trace, model: str | None = None, draft: str | None = None, *,
                    repeats: int = 1, warmup: bool = True, index: bool = True,
                    lookup: bool = True, block_size: int | None = None,
                    policy: str | None = None, tree_budget: int | None = None,
                    min_confidence: float | None = None, limit: int | None = None,
                    chat_template: bool = True, template_kwargs: dict | None = None,
                    out: str | Path | None = None, log: Callable[[str], None] | None = None,
                    pair=None) -> dict:
    """Replay the conversations of ``trace`` (a file, a shipped trace's name such as ``agent``,
    or conversation dicts: :mod:`dflash.traces`) as an agent sends them, greedy, and time each
    turn through mlx-lm and dflash.

    Every turn sends the whole history (the assistant turns: the target's own earlier answers);
    a retry turn sends the previous request again. Each turn runs three times: mlx-lm's
    ``stream_generate`` and dflash, both from scratch (the end-to-end figures), and dflash with a
    :class:`~dflash.prompt_cache.PromptCache` carried across the turns of the conversation (time
    to first token with the prefix cache). Each repeat is a run: both dflash sides start from an
    empty :class:`~dflash.lookup.ContinuationIndex` (``index=False``: none) and an empty pair
    memory, their own, shared by all turns of all conversations of the run in order, so a turn
    uses only earlier turns of the same run. Outputs must be identical token for token; the
    result says where they were not.
    """
    say = log or (lambda _msg: None)
    from .policy.memory import PairMemory
    from .traces import Replay, load_trace

    source, conversations = load_trace(trace, limit)  # bad input fails before a model loads
    if not isinstance(repeats, int) or repeats < 1:
        raise BenchConfigError(f"repeats={repeats!r}: must be an integer >= 1")
    if block_size is not None:
        parse_block_sizes(block_size)
    if pair is None:
        from .pair import load_pair

        pair = load_pair(model, draft, log=log)
    sides = _Sides(pair, block_size, min_confidence, policy, tree_budget, lookup, chat_template,
                   template_kwargs)
    if warmup:  # its own memory and no index: the runs start from nothing
        say("warming up ...")
        first = conversations[0]
        ids = sides.encode(Replay(first).request(first.turns[0]))
        sides.mlx_lm(ids, 16)
        sides.dflash(ids, 16, PairMemory(pair.draft.block_size - 1))
    tic = time.perf_counter()
    runs = _replay(sides, conversations, repeats, index, say)
    elapsed = time.perf_counter() - tic
    summary = _trace_summary(conversations, runs)
    from .cost_model import cost_model
    from .cost_model import report as cost_report
    from .policy import policy_class
    from .target import target_parts

    policy_used = policy or ("auto" if min_confidence is None else "confidence")
    result = {
        "mode": "trace",
        "config": _environment(pair) | {
            "trace": source, "conversations": [c.id for c in conversations],
            "turns": len(summary["turns"]), "repeats": repeats, "warmup": warmup,
            "temperature": 0.0, "chat_template": chat_template,
            "block_size": block_size or pair.draft.block_size, "policy": policy_used,
            "min_confidence": min_confidence, "tree_budget": tree_budget, "lookup": lookup,
            "index": index, "pair_memory": "fresh", "elapsed_s": elapsed},
        **summary,
    }
    if policy_class(policy_used).needs_cost:
        result["pass_costs"] = cost_report(cost_model(target_parts(pair.model), pair.draft))
    if result["differing"]:
        say("WARNING: greedy outputs differ from mlx-lm's on " + ", ".join(result["differing"]))
    if out is not None:
        write_trace_outputs(result, out, log=say)
    return result


@dataclass
class _Sides:
    """How the trace bench runs one request on each side: greedy, seed 0, dflash with the run's
    block size, policy and proposal settings; ``encode`` makes a request's prompt token ids."""

    pair: object
    block_size: int | None
    min_confidence: float | None
    policy: str | None
    tree_budget: int | None
    lookup: bool
    chat_template: bool
    template_kwargs: dict | None

    def encode(self, messages: list[dict]) -> list[int]:
        from .prompts import encode_prompt

        return encode_prompt(self.pair.tokenizer, {"messages": messages},
                             chat_template=self.chat_template, **(self.template_kwargs or {}))

    def mlx_lm(self, ids: list[int], max_tokens: int) -> dict:
        return _run_baseline(self.pair, ids, max_tokens, GREEDY, 0)

    def dflash(self, ids: list[int], max_tokens: int, memory, index=None, cache=None) -> dict:
        return _run_dflash(self.pair, ids, max_tokens, self.block_size, GREEDY, 0,
                           self.min_confidence, self.policy, self.tree_budget, self.lookup,
                           memory, index=index, prompt_cache=cache)


def _replay(sides: _Sides, conversations: list, repeats: int, index: bool,
            say: Callable[[str], None]) -> dict[tuple[int, int], dict]:
    """Every turn of every conversation through each side, once a run (``repeats`` runs), the
    sides' order reversed from one turn to the next. Returns, by (conversation, turn) position:
    the prompt's length, the target's answer (mlx-lm's last) and each side's results."""
    from .lookup import ContinuationIndex
    from .policy.memory import PairMemory
    from .prompt_cache import PromptCache
    from .traces import Replay

    rows_per_block = sides.pair.draft.block_size - 1
    positions = sides.pair.max_context  # RoPE scaling counted
    runs: dict[tuple[int, int], dict] = {}
    total = repeats * sum(len(c.turns) for c in conversations) * len(SIDES)
    done, step = 0, 0
    for rep in range(repeats):
        indexes = {s: ContinuationIndex() if index else None for s in SIDES[1:]}
        memories = {s: PairMemory(rows_per_block) for s in SIDES[1:]}
        for ci, conv in enumerate(conversations):
            replay, cache = Replay(conv), PromptCache()
            for k, turn in enumerate(conv.turns):
                ids = sides.encode(replay.request(turn))
                if positions and len(ids) + turn.max_tokens > positions:
                    say(f"WARNING: {conv.id} turn {k + 1}: {len(ids)} prompt tokens + "
                        f"{turn.max_tokens} exceed the target's {positions} positions")
                got = runs.setdefault((ci, k), {"n_prompt": len(ids), **{s: [] for s in SIDES}})
                order = list(SIDES) if step % 2 == 0 else list(reversed(SIDES))
                step += 1
                for side in order:
                    done += 1
                    if side == "mlx_lm":
                        r = sides.mlx_lm(ids, turn.max_tokens)
                    else:
                        r = sides.dflash(ids, turn.max_tokens, memories[side], indexes[side],
                                         cache if side == "dflash_prompt_cache" else None)
                    got[side].append(r)
                    say(f"[{done}/{total}] {conv.id} turn {k + 1}"
                        f"{' (retry)' if turn.retry else ''} (repeat {rep + 1}/{repeats}) "
                        f"{_side_line(side, r)}")
                got["text"] = sides.pair.tokenizer.decode(got["mlx_lm"][-1]["tokens"])
                replay.answered(turn, got["text"])  # the target's own answer
    return runs


def _side_line(side: str, r: dict) -> str:
    """What one side's generation of a turn did, for the progress log."""
    more = "" if side == "mlx_lm" else (
        f", τ {r['mean_tau']:.2f}, {r['lookup_cycles']} continuations"
        + (f", {r['reused_prompt_tokens']} prompt tokens cached"
           if side == "dflash_prompt_cache" else ""))
    return (f"{SIDE_NAMES[side]}: {len(r['tokens'])} tokens, first token "
            f"{r['prompt_time']:.3f} s, {r['decode_tps']:.1f} tok/s{more}")


def _trace_summary(conversations: list, runs: dict[tuple[int, int], dict]) -> dict:
    """The per-turn rows of :func:`_replay`'s ``runs`` and their totals: per conversation, over
    first sends, over retries and overall; whether every output matched mlx-lm's, and where not."""
    rows = [_trace_row(conv.id, k, turn, runs[ci, k]["n_prompt"], runs[ci, k]["mlx_lm"],
                       runs[ci, k]["dflash"], runs[ci, k]["dflash_prompt_cache"],
                       runs[ci, k]["text"])
            for ci, conv in enumerate(conversations) for k, turn in enumerate(conv.turns)]
    overall = _trace_totals(rows)
    return {
        "turns": rows,
        "conversations": [{"id": c.id, **_trace_totals([r for r in rows
                                                        if r["conversation"] == c.id])}
                          for c in conversations],
        "first_sends": _trace_totals([r for r in rows if not r["retry"]]),
        "retries": _trace_totals([r for r in rows if r["retry"]]),
        "overall": overall,
        "identical": overall["identical"],
        "differing": [f"{r['conversation']} turn {r['turn']} ({name}, token {i})"
                      for r in rows for name, i in r["first_difference"].items()
                      if i is not None],
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _shares_text(shares: dict) -> str:
    names = {"chain": "drafter chains", "tree": "drafter trees", "context": "own continuation",
             "index": "cross-request index", "plain": "plain steps"}
    return ", ".join(f"{names[k]} {_pct(shares[k])}" for k in SOURCES)


def format_trace_summary(result: dict) -> str:
    """The per-turn table and the totals, for the terminal."""
    cfg = result["config"]
    lines = [f"{len(cfg['conversations'])} conversations, {cfg['turns']} turns ({cfg['trace']}), "
             f"greedy, block {cfg['block_size']}, policy {cfg['policy']}, cross-request index "
             f"{'on' if cfg['index'] else 'off'}, {cfg['repeats']} repeat(s)",
             f"{'turn':<18}{'prompt':>7}{'tokens':>7}{'speed-up':>9}{'decode':>8}"
             f"{'TTFT mlx-lm':>12}{'dflash':>8}{'cached':>8}{'τ':>6}  identical"]
    for r in result["turns"]:
        name = f"{r['conversation']} {r['turn']}{' retry' if r['retry'] else ''}"
        lines.append(f"{name:<18}{r['prompt_tokens']:>7}{r['generated_tokens']:>7}"
                     f"{_f(r['speedup'], 2, '×'):>9}{_f(r['decode_speedup'], 2, '×'):>8}"
                     f"{r['mlx_lm']['ttft_s']:>11.3f}s{r['dflash']['ttft_s']:>7.3f}s"
                     f"{r['dflash_prompt_cache']['ttft_s']:>7.3f}s{r['dflash']['tau']:>6.2f}"
                     f"  {'yes' if r['identical'] else 'NO'}")
    for label, key in (("all turns", "overall"), ("first sends", "first_sends"),
                       ("retries", "retries")):
        t = result.get(key)
        if t is None:
            continue
        lines.append(f"{label}: end to end {_f(t['speedup'], 2, '×')} mlx-lm (prompt "
                     f"processing counted on both sides), decode {_f(t['decode_speedup'], 2, '×')}"
                     f"; first token {t['mlx_lm']['ttft_s']:.2f} s mlx-lm, "
                     f"{t['dflash']['ttft_s']:.2f} s dflash, "
                     f"{t['dflash_prompt_cache']['ttft_s']:.2f} s with the prefix cache")
    lines.append("passes won: " + _shares_text(result["overall"]["shares"]))
    lines.append("identical greedy outputs: " + ("yes" if result["identical"] else
                                                 "NO: " + ", ".join(result["differing"])))
    return "\n".join(lines)


def trace_markdown(result: dict) -> str:
    cfg = result["config"]
    lines = ["# dflash bench --trace", "",
             f"- target: `{shown_path(cfg['model'])}`",
             f"- drafter: `{shown_path(cfg['draft'])}`",
             f"- trace: {cfg['trace']} ({', '.join(cfg['conversations'])}), {cfg['turns']} turns, "
             f"greedy, repeats {cfg['repeats']}{', after a warm-up' if cfg['warmup'] else ''}",
             f"- verify policy: {_policy_text(cfg)}; cross-request index "
             f"{'on' if cfg['index'] else 'off'}; context continuations "
             f"{'on' if cfg['lookup'] else 'off'}",
             f"- device: {cfg['device']} · {cfg['platform']} · mlx {cfg['mlx']} · "
             f"mlx-lm {cfg['mlx_lm']} · dflash {cfg['dflash']}",
             "- speed-up: end to end (first token + decode, prompts processed from scratch on "
             "both sides); decode: tokens/s after the first token; TTFT: time to first token",
             "",
             "| turn | prompt tokens | tokens | speed-up | decode | TTFT mlx-lm | TTFT dflash "
             "| TTFT prefix cache | τ | chain / tree / own / index / plain | identical |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|:---:|"]

    def passes(shares):
        return " / ".join(_pct(shares[k]) for k in SOURCES)

    for r in result["turns"]:
        lines.append(f"| {r['conversation']} {r['turn']}{' (retry)' if r['retry'] else ''} | "
                     f"{r['prompt_tokens']} | {r['generated_tokens']} | "
                     f"{_f(r['speedup'], 2, '×')} | {_f(r['decode_speedup'], 2, '×')} | "
                     f"{r['mlx_lm']['ttft_s']:.3f} s | {r['dflash']['ttft_s']:.3f} s | "
                     f"{r['dflash_prompt_cache']['ttft_s']:.3f} s | {r['dflash']['tau']:.2f} | "
                     f"{passes(r['dflash']['shares'])} | {_same(r['identical'])} |")
    for label, t in [(f"**{c['id']}**", c) for c in result["conversations"]] + [
            ("**first sends**", result["first_sends"]), ("**retries**", result["retries"]),
            ("**all**", result["overall"])]:
        if t is None:
            continue
        lines.append(f"| {label} | | {t['generated_tokens']} | **{_f(t['speedup'], 2, '×')}** | "
                     f"{_f(t['decode_speedup'], 2, '×')} | {t['mlx_lm']['ttft_s']:.3f} s | "
                     f"{t['dflash']['ttft_s']:.3f} s | {t['dflash_prompt_cache']['ttft_s']:.3f} s "
                     f"| | {passes(t['shares'])} | {_same(t['identical'])} |")
    lines += ["", "TTFT columns of the totals are sums over the turns."]
    if result["differing"]:
        lines += ["", "**Outputs differ from mlx-lm's** on " + ", ".join(result["differing"])]
    return "\n".join(lines) + "\n"


def write_trace_outputs(result: dict, out: str | Path,
                        log: Callable[[str], None] | None = None) -> dict[str, Path]:
    """``bench.json`` (every per-turn row) and ``bench.md`` (the table) in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "bench.json", "markdown": out / "bench.md"}
    write_atomic(files["json"], json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    write_atomic(files["markdown"], trace_markdown(result))
    (log or (lambda _msg: None))("wrote " + ", ".join(str(p) for p in files.values()))
    return files
