"""The training vocabulary: the token ids the training loss runs its softmax over.

With ``--vocab data`` the loss runs over the ids seen in the data only (a few thousand rows instead
of the whole head: several times faster). The engine, though, takes the argmax of the full head, so
ids outside the vocabulary must still lose: each step adds random negatives from the rest of the
head to the softmax, and mining adds ids that win the full head on training rows.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..errors import TrainConfigError


def initial_vocab(mode: str, seen: set[int], vocab_size: int) -> np.ndarray:
    """``--vocab data``: the ids seen in the data, sorted; ``--vocab full``: every id."""
    if mode == "full":
        return np.arange(vocab_size)
    if mode != "data":
        raise TrainConfigError(f"--vocab {mode!r}: `data` or `full`")
    return np.array(sorted(seen), dtype=np.int64)


class TrainingVocab:
    """Vocabulary ids, their frozen head rows (``head_w``) and the map from full to vocabulary ids.

    ``to_sub[i]`` is the row of id ``i`` in ``head_w`` (``-1``: outside the vocabulary); labels of a
    batch are such rows. The vocabulary only grows, so rows keep their meaning.
    """

    def __init__(self, head_full: mx.array, vocab_size: int, ids: np.ndarray):
        self.head_full = head_full  # (V, H) float32, the target's whole head
        self.vocab_size = vocab_size
        self.set(ids)

    def set(self, ids: np.ndarray) -> None:
        self.ids = np.asarray(ids, dtype=np.int64)
        self.to_sub = np.full(self.vocab_size, -1, dtype=np.int64)
        self.to_sub[self.ids] = np.arange(len(self.ids))
        self.head_w = self.head_full[mx.array(self.ids)]
        mx.eval(self.head_w)

    def add(self, new: np.ndarray | list[int]) -> None:
        """Append ids not yet in the vocabulary (the caller passes only new ones)."""
        self.set(np.concatenate([self.ids, np.asarray(new, dtype=np.int64)]))

    def add_seen(self, seen: set[int]) -> None:
        """Grow to the ids of a data set that grew (``--refresh-data``)."""
        extra = sorted(seen - set(self.ids.tolist()))
        if extra:
            self.add(extra)

    def negatives(self, rng: np.random.Generator, n: int) -> mx.array | None:
        """Head rows of ``n`` random ids outside the vocabulary (none when it is the full head)."""
        if n <= 0:
            return None
        rest = np.flatnonzero(self.to_sub < 0)
        if not len(rest):
            return None
        ids = rng.choice(rest, size=min(n, len(rest)), replace=False)
        return self.head_full[mx.array(ids)]

    def mine(self, hidden: mx.array, valid: np.ndarray, rng: np.random.Generator,
             max_rows: int = 512, k: int = 4) -> int:
        """Add ids that win the *full* head on some rows but lie outside the vocabulary.

        The restricted-vocabulary loss never pushes those down, and at inference the engine takes
        the argmax of the full head: without this, a few "hub" tokens win most rows there.
        Returns how many ids joined.
        """
        new = self.mine_candidates(hidden, valid, rng, max_rows, k)
        if len(new):
            self.add(new)
        return len(new)

    def mine_candidates(self, hidden: mx.array, valid: np.ndarray, rng: np.random.Generator,
                        max_rows: int = 512, k: int = 4) -> np.ndarray:
        """The sorted ids :meth:`mine` would add (data-parallel ranks add the union of theirs)."""
        rows = np.flatnonzero(valid.reshape(-1))
        if not len(rows):
            return np.zeros(0, dtype=np.int64)
        rows = rng.choice(rows, size=min(max_rows, len(rows)), replace=False)
        h = hidden.reshape(-1, hidden.shape[-1])[mx.array(rows)]
        logits = h @ self.head_full.T
        top = mx.argpartition(-logits, k - 1, axis=-1)[:, :k]
        ids = np.unique(np.array(top))
        return ids[self.to_sub[ids] < 0]
