"""Constrained decoding: a grammar (JSON schema, regex, Lark) masks the target's logits.

The grammar machinery is llguidance's (the matcher vLLM, SGLang and llama.cpp use): this module
only binds it to a tokenizer and to the speculative loop. What the loop needs from a grammar, per
sequence (:class:`GrammarState`):

* the mask of the state after the emitted tokens (a bitmask, one bit per token id), applied to a
  verify row as ``where(allowed, logits, -inf)`` after the sampler's processors -- the same
  expression the reference logits processor applies in mlx-lm's ``generate``
  (:func:`logits_processor`), so the masked logits are bit-identical;
* proposals cut where the grammar rejects them (before any target row is spent on them), the
  drafter's next best allowed candidate taken in place of a rejected top choice where the
  candidates are on the host, and tokens the grammar forces proposed for free (jump-forward): all
  of them decided by the verify pass like any proposal, so the output stays the target's;
* the masks of row ``i`` = the state after ``proposals[:i]``: the proposals are consumed
  tentatively, one mask computed per row, and rolled back to the accepted ones after the pass.

A state whose mask allows no token at all (a grammar that cannot continue: a matcher error, a
resource limit) ends the generation with ``finish_reason="grammar"``; the message says why.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from .errors import GrammarError, missing_extra

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")
FINISH_REASON = "grammar"  # a grammar with no valid continuation ended the answer
# llguidance's JSON options per whitespace mode (Grammar.json_schema).
WHITESPACE: dict[str, dict | None] = {
    "compact": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    "flexible": None,
}


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - installed with the serve and dev extras
        raise missing_extra("serve", "structured outputs need llguidance (or pip install "
                            "llguidance)") from e
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What an answer must match, independent of any tokenizer: build one with
    :meth:`json_schema`, :meth:`json_object`, :meth:`regex` or :meth:`lark`, and give it to
    ``stream_generate(..., grammar=...)``. ``field`` names the request field it came from, in
    error messages (``response_format.json_schema.schema``, ``--regex``...)."""

    kind: str
    source: str  # the schema as JSON text, the regex or the Lark text
    field: str
    spec: str  # llguidance's grammar

    @classmethod
    def json_schema(cls, schema: dict | str, field: str = "json_schema",
                    whitespace: str = "compact") -> Grammar:
        """Answers that are JSON documents valid under ``schema`` (a dict, or its JSON text).

        ``whitespace="compact"`` (default): one line, ``", "`` between items and ``": "`` after
        keys (Python's ``json.dumps`` layout), so that the grammar forces every separator and
        the quotes around each key -- free proposals -- and the answer cannot wander in
        whitespace; ``"flexible"``: any JSON whitespace between tokens (llguidance's default).
        A schema's own ``"x-guidance"`` options override these."""
        if whitespace not in WHITESPACE:
            raise GrammarError(f"{field}: whitespace={whitespace!r}: one of "
                               f"{', '.join(WHITESPACE)}")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"{field}: not JSON ({e})") from e
        if not isinstance(schema, dict):
            raise GrammarError(f"{field}: a JSON schema must be an object, not "
                               f"{type(schema).__name__}")
        llg = _llguidance()
        text = json.dumps(schema)
        try:
            spec = llg.LLMatcher.grammar_from_json_schema(text, defaults=WHITESPACE[whitespace])
        except ValueError as e:
            raise GrammarError(f"{field}: {e}") from e
        return cls("json_schema", text, field, spec)

    @classmethod
    def json_object(cls, field: str = "response_format", whitespace: str = "compact") -> Grammar:
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        grammar = cls.json_schema({"type": "object"}, field, whitespace)
        return cls("json_object", grammar.source, field, grammar.spec)

    @classmethod
    def regex(cls, pattern: str, field: str = "regex") -> Grammar:
        """Answers that match ``pattern`` whole (Rust ``regex`` syntax, no look-around)."""
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError(f"{field}: a regex must be a non-empty string")
        return cls("regex", pattern, field, _llguidance().LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def lark(cls, text: str, field: str = "grammar") -> Grammar:
        """Answers that the Lark grammar ``text`` derives from ``start`` (llguidance's Lark
        dialect: https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md)."""
        if not isinstance(text, str) or not text.strip():
            raise GrammarError(f"{field}: a Lark grammar must be a non-empty string")
        return cls("lark", text, field, _llguidance().LLMatcher.grammar_from_lark(text))

    def bind(self, tokenizer, vocab_size: int) -> BoundGrammar:
        """This grammar over ``tokenizer``'s tokens and a ``vocab_size``-wide logits row, checked
        now: :class:`~dflash.errors.GrammarError` names the field and what is wrong."""
        llg_tok = grammar_tokenizer(tokenizer, vocab_size)
        llg = _llguidance()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(self.spec, llg_tok)
        if is_error:
            raise GrammarError(f"{self.field}: {messages[0].strip()}")
        if messages:
            # A warning is something llguidance would silently not enforce (an unknown
            # "format", say): refused, never an answer less constrained than asked.
            raise GrammarError(f"{self.field}: {'; '.join(m.strip() for m in messages)}")
        return BoundGrammar(self, llg_tok, vocab_size)


# llguidance tokenizers, built once per tokenizer object (building one walks the vocabulary).
_TOKENIZERS: dict[tuple[int, int], tuple[Any, Any]] = {}


def grammar_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of ``tokenizer`` (an mlx-lm ``TokenizerWrapper``, a Hugging Face fast
    tokenizer, or an ``llguidance.LLTokenizer`` already), ``vocab_size`` ids wide; the end of an
    answer is the tokenizer's EOS ids (mlx-lm's ``eos_token_ids``: chat models end on theirs)."""
    llg = _llguidance()
    if isinstance(tokenizer, llg.LLTokenizer):
        return tokenizer
    if tokenizer is None:
        raise GrammarError("grammar: needs the tokenizer of the target (none was given)")
    key = (id(tokenizer), vocab_size)
    hit = _TOKENIZERS.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [])
    if not eos and getattr(hf, "eos_token_id", None) is not None:
        eos = [int(hf.eos_token_id)]
    from llguidance.hf import from_tokenizer

    try:
        built = from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos or None)
    except ValueError as e:
        raise GrammarError(f"grammar: the tokenizer cannot be used for constrained decoding ({e})"
                           ) from e
    _TOKENIZERS[key] = (tokenizer, built)
    return built


@dataclass(frozen=True)
class BoundGrammar:
    """A checked grammar over one tokenizer; :meth:`start` gives each sequence its own state."""

    grammar: Grammar
    tokenizer: Any
    vocab_size: int

    def start(self) -> GrammarState:
        return GrammarState(self, self.matcher(), self.vocab_size)

    def matcher(self):
        matcher = _llguidance().LLMatcher(self.tokenizer, self.grammar.spec, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{self.grammar.field}: {_first_line(matcher.get_error())}")
        return matcher


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else message


@dataclass
class Constrained:
    """Proposals after the grammar: ``tokens`` (cut, replaced, extended with forced tokens),
    their ``q`` rows (``None`` where the proposals were not sampled) and ``bits``, the mask of
    each verify row (``len(tokens) + 1``; all zeros: no token can follow there)."""

    tokens: list[int]
    q: list | None
    bits: list[np.ndarray]
    forced: int = 0  # tokens the grammar forced (proposed without the drafter)
    # The last token is an end of text the matcher has not consumed: llguidance's roll-back
    # over a consumed end of text does not restore the state before it (measured, 1.9.1).
    pending_end: bool = False


@dataclass
class GrammarState:
    """One sequence's matcher, in step with its emitted tokens between cycles."""

    bound: BoundGrammar
    matcher: Any
    vocab_size: int
    committed: list[int] = field(default_factory=list)  # the emitted tokens it consumed
    dead: str | None = None  # why no token can follow (the generation ends)
    drop_last: bool = False  # the last token produced came from a row with no allowed token
    forced_total: int = 0  # forced tokens proposed so far (statistics)
    words: int = field(init=False)

    def __post_init__(self) -> None:
        self.words = (self.vocab_size + 31) // 32
        self.ends = {int(t) for t in self.bound.tokenizer.eos_tokens}
        # After an end of text only an end of text may follow (llguidance's stopped state).
        self.end_bits = np.zeros(self.words, dtype=np.int32)
        for t in self.ends:
            if t < self.vocab_size:
                self.end_bits[t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))

    # -- masks --------------------------------------------------------------------------------

    def bits(self) -> np.ndarray:
        """The mask of the current state: ``(words,)`` int32, bit ``t`` set where token ``t``
        may come next; all zeros where nothing can (llguidance's error state, whose own mask
        allows only the end of text: that end would not be the grammar's)."""
        out = np.empty(self.words, dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self.matcher.is_error():
            out[:] = 0
        return out

    @staticmethod
    def allows(bits: np.ndarray, token: int) -> bool:
        return 0 <= token < bits.size * 32 and bool((int(bits[token >> 5]) >> (token & 31)) & 1)

    def allowed(self, rows: Sequence[np.ndarray]) -> mx.array:
        """``(R, V)`` booleans from masks; a row allowing nothing allows everything instead (its
        token is dropped: :meth:`mark_dead`), so that no row turns into NaNs."""
        stacked = np.stack(rows)
        dense = np.unpackbits(stacked.view(np.uint8), axis=1, bitorder="little")
        dense = dense[:, :self.vocab_size].astype(bool)
        empty = ~dense.any(axis=1)
        if empty.any():
            dense[empty] = True
        return mx.array(dense)

    @staticmethod
    def empty(bits: np.ndarray) -> bool:
        return not bits.any()

    def mark_dead(self) -> None:
        """The state allows no token: the token its row produced is not the grammar's."""
        reason = _first_line(self.matcher.get_error()) if self.matcher.is_error() else ""
        self.dead = "the grammar allows no next token" + (f" ({reason})" if reason else "")
        self.drop_last = True

    def _restart(self, tokens: Sequence[int]) -> None:
        """A fresh matcher after the committed tokens and ``tokens``: llguidance's error state
        is sticky (no roll-back leaves it), and a proposal the target may still reject must not
        end the answer."""
        self.matcher = self.bound.matcher()
        self.matcher.consume_tokens(self.committed + list(tokens))

    # -- the cycle ----------------------------------------------------------------------------

    def forces(self) -> bool:
        """The grammar forces the next token(s): a chain the target can verify for free."""
        return bool(self.matcher.compute_ff_tokens())

    def consume(self, token: int) -> None:
        """An emitted token (one its row's mask allowed)."""
        if not self.matcher.consume_token(int(token)):
            self.dead = f"token {token} rejected: {_first_line(self.matcher.get_error())}"
        self.committed.append(int(token))

    def constrain(self, proposals: Sequence[int], cap: int, q: list | None = None,
                  alternatives: np.ndarray | None = None, draw=None) -> Constrained:
        """The proposals a verify pass may spend rows on, and each row's mask.

        Row ``i``'s token is: the token the grammar forces there (jump-forward, free: no drafter
        row needed), else ``proposals[i]`` if the grammar allows it, else the first allowed of
        ``alternatives[i]`` (the drafter's candidates, best first), else the chain ends. Up to
        ``cap`` tokens (forced tokens may run past the proposals). The matcher keeps the tokens
        consumed (:meth:`settle` rolls back to what the target accepts).

        Exactness: a deterministic proposal (argmax, a candidate, a forced token, a
        continuation) may be anything, so cutting or replacing one is exact. A proposal drawn
        from the drafter's ``q`` (rejection sampling) is kept only with ``q`` restricted to the
        allowed tokens: a drawn token the grammar allows is a draw from that restriction, one it
        rejects is drawn again from it (``draw``: the sampler's generator); with no allowed mass
        in ``q`` the chain ends there (the target's row is then drawn from ``p``, which is what
        the rejection of a token ``p`` gives no mass would draw). A forced token gets a one-hot
        ``q`` row.
        """
        from .sampling import RowDist

        tokens: list[int] = []
        qs: list | None = None if q is None else []
        bits = [self.bits()]
        forced = 0
        while len(tokens) < cap and not self.empty(bits[-1]):
            i = len(tokens)
            row_q = None
            ff = self.matcher.compute_ff_tokens()
            token = None
            if ff:
                token = int(ff[0])
            elif q is not None and i < len(q):
                row_q = _restricted(q[i], bits[-1])
                if row_q is None:
                    break
                token = int(proposals[i])
                if not self.allows(bits[-1], token):
                    token = draw(row_q)
            elif i < len(proposals) and self.allows(bits[-1], int(proposals[i])):
                token = int(proposals[i])
            elif alternatives is not None and i < len(alternatives):
                token = next((int(t) for t in alternatives[i] if self.allows(bits[-1], int(t))),
                             None)
            if token is None:
                break
            if token in self.ends:  # proposed, not consumed (see Constrained.pending_end)
                forced += bool(ff)
                tokens.append(token)
                if qs is not None:
                    qs.append(row_q if row_q is not None else
                              RowDist(np.array([token], dtype=np.int64), np.array([1.0])))
                bits.append(self.end_bits)
                self.forced_total += forced
                return Constrained(tokens, qs, bits, forced, pending_end=True)
            self.matcher.consume_token(token)
            after = self.bits()
            if self.matcher.is_error():
                # Nothing can follow this token: it is not proposed (the target may still
                # choose it, and the answer then ends there).
                self._restart(tokens)
                break
            forced += bool(ff)
            tokens.append(token)
            if qs is not None:
                qs.append(row_q if row_q is not None else
                          RowDist(np.array([token], dtype=np.int64), np.array([1.0])))
            bits.append(after)
        self.forced_total += forced
        return Constrained(tokens, qs, bits, forced)

    def tree(self, tree) -> tuple[list[int], list[np.ndarray]]:
        """The nodes of a draft tree (:class:`~dflash.tree.DraftTree`) a verify pass may spend
        rows on, and each kept node's mask (the state after its own path; the root's: the
        current state). A node is cut, with its subtree, where its parent's state rejects its
        token, where nothing can follow it, or below an end of text. Returns the kept nodes'
        indices in ``tree`` (the root first, parents before children) and their masks; the
        matcher is left as it was. Cutting a node is exact: the walk could never accept it (its
        parent's row is drawn from the masked distribution)."""
        kept, bits, where = [0], [self.bits()], {0: 0}
        for i in range(1, len(tree)):
            parent = where.get(tree.parents[i])
            token = int(tree.tokens[i])
            if parent is None or bits[parent] is self.end_bits \
                    or not self.allows(bits[parent], token):
                continue
            if token in self.ends:  # not consumed (see Constrained.pending_end)
                node_bits = self.end_bits
            else:
                path = [int(tree.tokens[j]) for j in tree.path_to(i)]
                self.matcher.consume_tokens(path)
                if self.matcher.is_error():  # nothing can follow it: not verified
                    self._restart([])
                    continue
                node_bits = self.bits()
                self.matcher.rollback(len(path))
            where[i] = len(kept)
            kept.append(i)
            bits.append(node_bits)
        return kept, bits

    def settle_path(self, tokens: Sequence[int], bonus: int) -> None:
        """After a tree's verify pass: the accepted path's ``tokens`` and the target's token
        after them, consumed (:meth:`tree` left the matcher at the emitted tokens)."""
        for t in tokens:
            self.consume(t)
        if not (tokens and int(tokens[-1]) in self.ends):  # nothing follows an end of text
            self.consume(bonus)

    def settle(self, c: Constrained, accepted: int, bonus: int) -> None:
        """After the verify pass: keep the accepted proposals and the target's token after them
        (the matcher then holds exactly the emitted tokens)."""
        consumed = len(c.tokens) - c.pending_end
        kept = min(accepted, consumed)
        if consumed > kept:
            self.matcher.rollback(consumed - kept)
        self.committed += c.tokens[:kept]
        if accepted > consumed:  # the end of text was accepted: consumed for good now
            self.consume(c.tokens[-1])
        if self.empty(c.bits[accepted]):
            self.mark_dead()
        else:
            self.consume(bonus)

    def step_mask(self) -> mx.array | None:
        """The ``(1, V)`` mask of a one-token step, or ``None`` where no token is allowed (the
        state is then marked dead)."""
        bits = self.bits()
        if self.empty(bits):
            self.mark_dead()
            return None
        return self.allowed([bits])


def _restricted(q, bits: np.ndarray):
    """``q`` (a :class:`~dflash.sampling.RowDist`) restricted to the tokens ``bits`` allows and
    renormalised; ``None`` where it puts no mass there."""
    from .sampling import RowDist

    ids = np.arange(q.probs.size) if q.ids is None else np.asarray(q.ids)
    ok = ((bits[ids >> 5].astype(np.int64) >> (ids & 31)) & 1).astype(bool)
    mass = float(q.probs[ok].sum())
    if mass <= 0:
        return None
    return RowDist(ids[ok], q.probs[ok] / mass)


def apply_mask(logits: mx.array, allowed: mx.array | None) -> mx.array:
    """``logits`` where the grammar allows, ``-inf`` elsewhere (the reference processor's op)."""
    if allowed is None:
        return logits
    return mx.where(allowed, logits, -math.inf)


def logits_processor(bound: BoundGrammar, prompt_tokens: int):
    """An mlx-lm logits processor ``(tokens, logits) -> logits`` applying ``bound``'s mask, for
    ``mlx_lm.generate(..., logits_processors=[...])``: the reference constrained decoding that
    dflash's output equals (greedy) or is distributed as (sampled). ``prompt_tokens``: how many
    of the tokens it is given are the prompt (the matcher consumes what follows)."""
    state = bound.start()
    seen = [prompt_tokens]

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        new = tokens[seen[0]:].tolist() if tokens.size > seen[0] else []
        for t in new:
            state.consume(int(t))
        seen[0] += len(new)
        return apply_mask(logits, state.allowed([state.bits()]))

    return process
