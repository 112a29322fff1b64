"""The statistics of a finished generation, in one shape for the CLI, the server and the bench.

Every tool reports the same acceptance and timing fields of the last ``DFlashResponse`` of a
generation; each adds only what is its own (the CLI its speed-up estimate, the server its queue
time, the bench its wall-clock timing). Rounded for people and JSON; ``rounded=False`` keeps full
precision for tools that aggregate over many generations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type only: importing the engine would load MLX for `dflash --help`
    from .speculative import DFlashResponse


def generation_stats(r: DFlashResponse, rounded: bool = True) -> dict:
    """Acceptance (τ, cycles, per-position rates), speed and time split of a finished generation."""

    def rnd(x: float, digits: int) -> float:
        return round(x, digits) if rounded else x

    return {
        "mean_tau": rnd(r.mean_tau, 4),
        "cycles": r.cycles,
        "verified_tokens": r.verified_tokens,
        "plain_steps": r.plain_steps,
        "tree_cycles": r.tree_cycles,
        "lookup_cycles": r.lookup_cycles,
        "index_cycles": r.index_cycles,
        "rows_per_pass": rnd(r.rows_per_pass, 3),
        "priced_ms": None if r.priced_ms is None else rnd(r.priced_ms, 1),
        "reused_prompt_tokens": r.reused_prompt_tokens,
        "acceptance_by_position": [rnd(a, 4) for a in r.acceptance_by_position],
        "prompt_tps": rnd(r.prompt_tps, 2),
        "generation_tps": rnd(r.generation_tps, 2),
        "draft_time": rnd(r.draft_time, 4),
        "verify_time": rnd(r.verify_time, 4),
        "peak_memory_gb": rnd(r.peak_memory, 4),
        "forced_tokens": r.forced_tokens,  # proposed by the grammar, not the drafter
        # finish_reason "grammar": why the grammar allowed no next token
        **({} if r.grammar_message is None else {"grammar_message": r.grammar_message}),
    }
