"""How well a drafter predicts its target: τ (tokens committed per cycle) on greedy generation.

One measurement serves convert (original vs quantized drafter), training (held-out evaluation) and
the scripts. Every proposal of a block is verified (``policy="fixed"``) so that τ measures the
drafter, not the machine's verify-length policy.
"""

from __future__ import annotations

import time

import numpy as np

# Imported with this module, not when τ is first measured: a long training run evaluates hours
# after it started, and a decode module edited meanwhile must not meet the in-memory others.
from .speculative import generate


def measure_tau(model, tokenizer, draft, prompts: list[list[int]], block_size: int | None = None,
                max_tokens: int = 128) -> dict:
    """Greedy speculative generation on ``prompts`` (token ids); τ = emitted tokens / cycles.

    Returns ``tau``, ``cycles``, ``tokens`` (generated), ``tok_s``, ``acceptance_by_position``,
    ``draft_time``, ``verify_time``, ``draft_ms_per_cycle`` and the generated ``outputs``.
    """
    emitted = cycles = n_gen = 0
    accepted = None
    draft_time = verify_time = 0.0
    outputs = []
    t0 = time.perf_counter()
    for ids in prompts:
        res = generate(model, draft, tokenizer, ids, block_size=block_size,
                       max_tokens=max_tokens, temperature=0.0, policy="fixed")
        st = res.stats
        outputs.append(res.tokens)
        emitted += round(st.mean_tau * st.cycles)
        cycles += st.cycles
        n_gen += st.generation_tokens
        draft_time += st.draft_time
        verify_time += st.verify_time
        acc = np.array(st.acceptance_by_position) * max(st.cycles, 1)
        accepted = acc if accepted is None else accepted + acc
    dt = time.perf_counter() - t0
    return {
        "block_size": block_size or draft.block_size,
        "tau": emitted / cycles if cycles else 0.0,
        "cycles": cycles,
        "tokens": n_gen,
        "tok_s": n_gen / dt if dt else 0.0,
        "acceptance_by_position": [round(float(a), 3) for a in
                                   (accepted / max(cycles, 1) if accepted is not None else [])],
        "draft_time": draft_time,
        "verify_time": verify_time,
        "draft_ms_per_cycle": 1000 * draft_time / cycles if cycles else 0.0,
        "outputs": outputs,
    }
