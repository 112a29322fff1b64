"""Chat prompts without a data set: the target writes user turns itself (the Magpie method).

An aligned model given only its chat template's user header (``...<|im_start|>user\\n``) continues
with something a user would plausibly ask. Sampled at temperature ~1 and filtered, those turns are
chat prompts in the target's own domain; ``dflash datagen`` then regenerates the answers as usual.
The built-in drafter never saw chat data and measured τ 1.2 on held-out chat questions.

* **Filters**: length (characters and words), language (mostly letters of the Latin alphabet, no
  template markup), near-duplicates (MinHash over word 3-grams with LSH bands; a turn whose
  estimated Jaccard similarity with a kept one reaches ``0.7`` is dropped).
* **Two turns**: ``--followups-of DATA`` writes a second user turn after a first turn and the
  target's own answer to it (records of a ``dflash datagen`` folder), giving conversations
  ``[user, assistant, user]`` whose last answer datagen generates.
* **Held out, stably**: an id's side of the split is a hash of the id, so the split does not move
  as data grows; held-out prompts go to a separate file that no training run reads.
* **Resumable**: the output is appended; a rerun continues numbering (and the random stream)
  after the last kept turn.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from ..console import log
from ..errors import DataSetError, DFlashError

SPLIT = "\u2063dflash-split\u2063"
WORD = re.compile(r"[a-z0-9]+")


def user_header(tokenizer, history: list[dict] | None = None) -> list[int]:
    """Token ids of the chat template up to where a user turn's text starts."""
    messages = list(history or []) + [{"role": "user", "content": SPLIT}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if SPLIT not in text:
        raise DFlashError("the target's chat template does not place the user's text verbatim; "
                          "cannot write user turns with it")
    prefix = text[: text.index(SPLIT)]
    return list(tokenizer.encode(prefix, add_special_tokens=False))


def held_out(item_id: str, percent: float) -> bool:
    """Stable split: the same id is on the same side however many prompts exist."""
    h = int(hashlib.sha1(item_id.encode()).hexdigest()[:8], 16)
    return (h % 10000) < percent * 100


def clean_turn(text: str, min_chars: int = 12, max_chars: int = 600) -> str | None:
    """The turn, stripped, or ``None`` when it fails the length or language filter."""
    text = text.strip()
    if not min_chars <= len(text) <= max_chars or len(text.split()) < 3:
        return None
    if "<|" in text or "|>" in text or "im_start" in text:
        return None  # template markup leaked into the turn
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) / len(letters) < 0.95:
        return None  # mostly another script: keep the chat domain the drafter will serve
    return text


class NearDuplicates:
    """MinHash + LSH over word 3-grams: ``seen(text)`` is True for a near-copy of a kept text."""

    def __init__(self, num_perm: int = 64, bands: int = 16, threshold: float = 0.7, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, (1 << 61) - 1, size=num_perm, dtype=np.uint64)
        self.b = rng.integers(0, (1 << 61) - 1, size=num_perm, dtype=np.uint64)
        self.rows = num_perm // bands
        self.bands = bands
        self.threshold = threshold
        self.buckets: dict[tuple, list[np.ndarray]] = {}

    def signature(self, text: str) -> np.ndarray:
        words = WORD.findall(text.lower())
        grams = {" ".join(words[i:i + 3]) for i in range(max(1, len(words) - 2))}
        h = np.array([int(hashlib.blake2b(g.encode(), digest_size=8).hexdigest(), 16) >> 3
                      for g in grams], dtype=np.uint64)
        return (np.outer(h, self.a) + self.b).min(axis=0)  # wraps mod 2**64: a fine hash family

    def seen(self, text: str, add: bool = True) -> bool:
        sig = self.signature(text)
        keys = [(band, sig[band * self.rows:(band + 1) * self.rows].tobytes())
                for band in range(self.bands)]
        for key in keys:
            for other in self.buckets.get(key, ()):
                if np.mean(other == sig) >= self.threshold:
                    return True
        if add:
            for key in keys:
                self.buckets.setdefault(key, []).append(sig)
        return False


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by an interrupted run
    return rows


def _append(path: Path, rows: list[dict]) -> None:
    with path.open("a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_user_turns(target: str, out: str | Path, n: int, *, seed: int = 0,
                     temperature: float = 1.0, max_tokens: int = 128, batch_size: int = 32,
                     heldout_percent: float = 5.0, followups_of: str | Path | None = None,
                     prefix: str = "chat", max_attempts: int | None = None,
                     steer: list[str] | None = None) -> tuple[Path, Path]:
    """Append up to ``n`` new filtered user turns: training prompts to ``out``, held-out ones to
    ``out`` with ``-heldout`` before the suffix. Returns both paths.

    ``steer``: system texts (e.g. a language, a length, a topic) placed before the user header
    in turn to vary what the target writes; they shape the turn only and are not kept in it.

    Gives up after ``max_attempts`` sampled turns (default ``20 * n + 64``): a target that does not
    write usable user turns raises :class:`DataSetError` instead of looping forever."""
    from ..target import load_target as load
    from ..target import target_parts
    from .capture import RolloutEngine

    if n < 1:
        raise DFlashError(f"--n {n}: must be >= 1")
    out = Path(out)
    heldout = out.with_name(out.stem + "-heldout" + out.suffix)
    out.parent.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load(str(target))
    parts = target_parts(model)
    existing = _read_jsonl(out) + _read_jsonl(heldout)
    dedup = NearDuplicates(seed=seed)
    for row in existing:
        dedup.seen(row["messages"][-1]["content"])
    histories: list[list[dict]] = [[]]
    if followups_of is not None:
        from .data import load_samples

        histories = []
        for rec in load_samples(followups_of):
            if rec.get("finish_reason") != "stop" or not rec.get("messages"):
                continue  # a follow-up needs a finished first answer and its conversation
            answer = tokenizer.decode(rec["response_ids"][:-1]).strip()
            histories.append(rec["messages"] + [{"role": "assistant", "content": answer}])
        if not histories:
            raise DataSetError(f"--followups-of {followups_of}: no finished records with "
                               "`messages` (generate first turns with `dflash magpie` first)")
    # Continue numbering after the highest id written so far: ids never repeat across runs.
    attempt = 1 + max((int(row["id"].rsplit("-", 1)[1]) for row in existing), default=-1)
    done = attempt
    kept = 0
    max_attempts = 20 * n + 64 if max_attempts is None else max_attempts
    while kept < n:
        if attempt - done >= max_attempts:
            raise DataSetError(f"--target {target}: only {kept} of {n} user turns passed the "
                               f"filters in {attempt - done} tries; is it a chat model?")
        want = min(batch_size * 2, 2 * (n - kept) + 4)
        batch = []
        for k in range(attempt, attempt + want):
            history = histories[k % len(histories)]
            if steer:
                history = [{"role": "system", "content": steer[k % len(steer)]}] + history
            batch.append((str(k), user_header(tokenizer, history)))
        engine = RolloutEngine(parts, taps=[], max_tokens=max_tokens, batch_size=batch_size,
                               stop_ids=tokenizer.eos_token_ids, temperature=temperature,
                               seed=seed * 1_000_003 + attempt, capture=False)
        train_rows, heldout_rows = [], []
        for r in sorted(engine.run(batch), key=lambda r: int(r.id)):
            if r.finish_reason != "stop" or kept >= n:
                continue  # a turn that never ended is a rambling continuation, not a question
            text = clean_turn(tokenizer.decode(r.response_ids[:-1]))
            if text is None or dedup.seen(text):
                continue
            history = histories[int(r.id) % len(histories)]
            item_id = f"{prefix}-{'2t-' if history else ''}{int(r.id):06d}"
            row = {"id": item_id, "messages": history + [{"role": "user", "content": text}]}
            (heldout_rows if held_out(item_id, heldout_percent) else train_rows).append(row)
            kept += 1
        _append(out, train_rows)
        _append(heldout, heldout_rows)
        attempt += want
        log(f"magpie: {kept}/{n} user turns kept of {attempt - done} written")
    return out, heldout


def add_magpie_args(p) -> None:
    p.add_argument("--target", help="mlx-lm target folder (default: the built-in SmolLM2 target)")
    p.add_argument("--out", required=True,
                   help="prompt file to append to (JSONL with `messages`); held-out turns go to "
                        "the same name with -heldout")
    p.add_argument("--n", type=int, required=True, help="new user turns to keep")
    p.add_argument("--followups-of", default=None,
                   help="a datagen folder of first turns: write second user turns after them")
    p.add_argument("--temperature", type=float, default=1.0, help="(default 1.0)")
    p.add_argument("--max-tokens", type=int, default=128, help="longest user turn (default 128)")
    p.add_argument("--batch-size", type=int, default=32, help="(default 32)")
    p.add_argument("--heldout-percent", type=float, default=5.0,
                   help="share of turns held out from training, by a hash of the id (default 5)")
    p.add_argument("--seed", type=int, default=0)


def run_magpie(args) -> Path:
    target = args.target
    if target is None:
        from ..default_pair import default_target_path

        target = str(default_target_path())
    out, _ = write_user_turns(target, args.out, args.n, seed=args.seed,
                              temperature=args.temperature, max_tokens=args.max_tokens,
                              batch_size=args.batch_size, heldout_percent=args.heldout_percent,
                              followups_of=args.followups_of,
                              prefix="chat2" if args.followups_of else "chat")
    return out
