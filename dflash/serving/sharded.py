"""Serving a target sharded over ranks: rank 0 serves HTTP, the other ranks follow its engine.

Every pass of a sharded target is a sequence of collectives that all ranks must enter in the
same order with the same shapes, so every rank must run exactly the generations rank 0 runs. Rank
0's worker (:class:`~.worker.Worker` given the ranks) runs one generation at a time and, before
each, hands the other ranks the call it is about to make (the prompt's token ids, the engine
settings with the seed rank 0 chose, the scope whose index and prefix cache it uses); after each
cycle it tells them whether to go on (a client that left stops the generation on every rank at
the same cycle). The followers here replay those calls on their own copy of the scopes, which
therefore hold the same text on every rank, and so prefill and draft alike.

One generation at a time: the batched engine's steps would have to be replayed too (its
admissions, cancellations and failures); that is not built, and a sharded server refuses a
``max_concurrency`` above 1. Requests beyond the first wait in the queue, as with
``max_concurrency`` 1 on one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import distributed
from ..errors import ServerConfigError
from ..policy.memory import PairMemory
from ..ranks import Ranks
from ..speculative import stream_generate
from .scopes import Scopes


def check_sharded_concurrency(max_concurrency: int | None, ranks: Ranks) -> None:
    """``ServerConfigError`` naming ``max_concurrency`` when a sharded server is asked to batch."""
    if max_concurrency is not None and max_concurrency > 1:
        raise ServerConfigError(
            f"--max-concurrency {max_concurrency}: a target sharded over {ranks.size} ranks is "
            "served one sequence at a time (batched serving over ranks is not built); give "
            "--max-concurrency 1 or leave it out")


def to_wire(kwargs: dict) -> dict:
    """Engine keyword arguments as JSON can carry them (``logit_bias`` keys are integers)."""
    out = dict(kwargs)
    if isinstance(out.get("logit_bias"), dict):
        out["logit_bias"] = [[int(k), float(v)] for k, v in out["logit_bias"].items()]
    return out


def from_wire(kwargs: dict) -> dict:
    """The engine keyword arguments :func:`to_wire` wrote."""
    out = dict(kwargs)
    if isinstance(out.get("logit_bias"), list):
        out["logit_bias"] = {int(k): v for k, v in out["logit_bias"]}
    return out


def follow(ranks: Ranks, load: Callable[[], Any], scopes: Scopes) -> None:
    """A follower rank's loop: load the pair (with rank 0, which loads it in its worker), then
    run every generation rank 0 hands over, until rank 0 says there are no more."""
    pair = load()
    memory = PairMemory(pair.draft.block_size - 1)
    while True:
        call = distributed.call_from_main(ranks)
        if call is None:
            return
        scope = scopes.get(call["scope"])
        try:
            gen = stream_generate(pair.model, pair.draft, pair.tokenizer, call["prompt_ids"],
                                  memory=memory, index=scope.index,
                                  prompt_cache=scope.prompt_cache,
                                  prompt_progress_callback=_progress, **from_wire(call["kwargs"]))
            for _ in gen:
                if not ranks.from_main(0):  # rank 0's client left: stop at the same cycle
                    gen.close()
                    break
        except ValueError:  # a setting the engine refused, on rank 0 alike (told to its client)
            continue


def _progress(*_done) -> None:
    """Rank 0 watches its prefill's progress; the followers prefill the same way, unwatched."""
