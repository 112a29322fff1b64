"""Serving a target sharded over ranks: rank 0 serves HTTP, the other ranks follow its engine.

Every pass of a sharded target is a sequence of collectives that all ranks must enter in the
same order with the same shapes, so every rank must run exactly the generations rank 0 runs. Rank
0's worker (:class:`~.worker.Worker` given the ranks) hands the other ranks each engine call
before it makes it. A job run alone (the single-sequence engine): the prompt's token ids, the
engine settings with the seed rank 0 chose, the scope whose index and prefix cache it uses; after
each cycle, whether to go on (a client that left stops the generation on every rank at the same
cycle); its ``auto`` or ``tree`` plans cross inside the engine, from rank 0's policy
(:mod:`dflash.policy.agreed`). With ``max_concurrency`` above 1 the batched engine's calls are
handed over the same way: its construction, each ``insert`` (with the seed rank 0 chose) and each
``step`` with the cancellations decided before it; the batch's ``auto`` decisions (priced with
rank 0's timings) cross inside the engine too (:func:`dflash.policy.agreed.agreed_batch`). The
followers here replay those calls on their own copy of the scopes, which therefore hold the same
text on every rank, and so prefill and draft alike. A failed step is not retried: the ranks may
be out of step, so the server stops generating (``RankLost``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

from .. import distributed
from ..batch import BatchGenerator
from ..grammar import BoundGrammar, Grammar
from ..policy.memory import PairMemory
from ..ranks import Ranks
from ..speculative import stream_generate
from .scopes import Scopes


def to_wire(kwargs: dict) -> dict:
    """Engine keyword arguments as JSON can carry them (``logit_bias`` keys are integers; a
    grammar goes as its tokenizer-free :class:`~dflash.grammar.Grammar`, which each rank binds
    to its own tokenizer: the same masks everywhere, as the same tokens reach every matcher)."""
    out = dict(kwargs)
    if isinstance(out.get("logit_bias"), dict):
        out["logit_bias"] = [[int(k), float(v)] for k, v in out["logit_bias"].items()]
    grammar = out.get("grammar")
    if isinstance(grammar, BoundGrammar):
        grammar = grammar.grammar
    if isinstance(grammar, Grammar):
        out["grammar"] = dataclasses.asdict(grammar)
    return out


def from_wire(kwargs: dict) -> dict:
    """The engine keyword arguments :func:`to_wire` wrote."""
    out = dict(kwargs)
    if isinstance(out.get("logit_bias"), list):
        out["logit_bias"] = {int(k): v for k, v in out["logit_bias"]}
    if isinstance(out.get("grammar"), dict):
        out["grammar"] = Grammar(**out["grammar"])
    return out


def follow(ranks: Ranks, load: Callable[[], Any], scopes: Scopes) -> None:
    """A follower rank's loop: load the pair (with rank 0, which loads it in its worker), then
    make every engine call rank 0 hands over, until rank 0 says there are no more."""
    pair = load()
    memory = PairMemory(pair.draft.block_size - 1)
    batch = None
    while True:
        call = distributed.call_from_main(ranks)
        if call is None:
            return
        op = call.get("op", "generate")
        if op == "batch":
            batch = BatchGenerator(pair.model, pair.draft, pair.tokenizer,
                                   max_batch=call["max_batch"], block_size=call["block_size"],
                                   memory=memory, policy=call["policy"])
        elif op == "insert":
            scope = scopes.get(call["scope"])
            with contextlib.suppress(ValueError):  # refused on rank 0 alike (told its client)
                batch.insert(call["prompt_ids"], index=scope.index,
                             prompt_cache=scope.prompt_cache, **from_wire(call["kwargs"]))
        elif op == "step":
            for uid in call["cancel"]:
                batch.cancel(uid)
            batch.step()
        else:
            _generate(ranks, pair, memory, scopes.get(call["scope"]), call)


def _generate(ranks: Ranks, pair, memory: PairMemory, scope, call: dict) -> None:
    """One single-sequence generation as rank 0 runs it, stopping at the cycle rank 0 stops."""
    try:
        gen = stream_generate(pair.model, pair.draft, pair.tokenizer, call["prompt_ids"],
                              memory=memory, index=scope.index, prompt_cache=scope.prompt_cache,
                              prompt_progress_callback=_progress, **from_wire(call["kwargs"]))
        for _ in gen:
            if not ranks.from_main(0):  # rank 0's client left: stop at the same cycle
                gen.close()
                break
    except ValueError:  # a setting the engine refused, on rank 0 alike (told to its client)
        pass


def _progress(*_done) -> None:
    """Rank 0 watches its prefill's progress; the followers prefill the same way, unwatched."""
