"""Reuse of target and drafter caches across calls (multi-turn chat, shared system prompts).

Attention caches trim to any common prefix. GatedDeltaNet states cannot be trimmed, so we keep
snapshots of them at the ends of recent prompts (MLX arrays are immutable: a snapshot is a list of
references, no copy) and restore the longest one inside the common prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from .target import TargetParts, make_cache

MAX_SNAPSHOTS = 4


@dataclass
class PromptCache:
    """Pass one to ``stream_generate(..., prompt_cache=...)`` per conversation; never share it
    between threads."""

    tokens: list[int] = field(default_factory=list)
    target: list | None = None
    draft: list | None = None
    owner: tuple[int, int] | None = None
    snapshots: dict[int, list] = field(default_factory=dict)
    reused_tokens: int = 0  # of the last call, for statistics

    def clear(self) -> None:
        self.tokens, self.target, self.draft, self.owner = [], None, None, None
        self.snapshots = {}

    def take(self, parts: TargetParts, draft, prompt: list[int]) -> tuple[list, list, int]:
        """Caches for ``prompt`` and how many of its tokens they already hold."""
        owner = (id(parts.model), id(draft))
        if self.target is None or self.owner != owner:
            return self._fresh(parts, draft, owner)
        common = 0
        limit = min(len(self.tokens), len(prompt) - 1)  # the last prompt token is always fed
        while common < limit and self.tokens[common] == prompt[common]:
            common += 1
        keep = common
        if any(isinstance(c, RotatingKVCache) and c.offset > keep and not c.is_trimmable()
               for c in self.target):
            # A wrapped sliding-window cache no longer holds the rows before its window.
            return self._fresh(parts, draft, owner)
        recurrent = [i for i, c in enumerate(self.target) if isinstance(c, ArraysCache)]
        if recurrent and keep < len(self.tokens):
            keep = max((n for n in self.snapshots if n <= common), default=0)
            if keep == 0:
                return self._fresh(parts, draft, owner)
            for i, state in zip(recurrent, self.snapshots[keep]):
                self.target[i].cache = list(state)
        for c in self.target:
            if not isinstance(c, ArraysCache):
                c.trim(c.offset - keep)
        for c in self.draft:
            c.trim(c.offset - keep)
        self.snapshots = {n: s for n, s in self.snapshots.items() if n <= keep}
        self.reused_tokens = keep
        return self.target, self.draft, keep

    def _fresh(self, parts: TargetParts, draft, owner) -> tuple[list, list, int]:
        self.clear()
        self.target, self.draft, self.owner = make_cache(parts), draft.make_cache(), owner
        self.reused_tokens = 0
        return self.target, self.draft, 0

    def snapshot(self, n_tokens: int) -> None:
        """Remember recurrent states after ``n_tokens`` fed tokens (cheap: references)."""
        states = [list(c.cache) for c in self.target if isinstance(c, ArraysCache)]
        if states:
            self.snapshots[n_tokens] = states
            for n in sorted(self.snapshots)[:-MAX_SNAPSHOTS]:
                del self.snapshots[n]

    def store(self, parts: TargetParts, draft, target: list, dcache: list,
              tokens: list[int]) -> None:
        """Keep the caches after a generation; ``tokens`` are exactly those fed to the target and
        ``dcache`` has seen the features of all of them."""
        self.owner = (id(parts.model), id(draft))
        self.target, self.draft, self.tokens = target, dcache, list(tokens)
