"""Log-probabilities on the OpenAI endpoints: the request fields in, OpenAI's shapes out.

The values are the engine's (:mod:`dflash.logprobs`: the target's own log-softmax of its raw
logits, before any sampling setting, for every generated token and, with ``echo``, every prompt
token). Here they are read from the request and written the way each API shows them:

* ``/v1/chat/completions``: ``logprobs: true`` and ``top_logprobs`` (0..20); each choice's
  ``logprobs.content`` is a list of ``{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}``, one per generated token (streamed: each chunk carries its tokens' entries).
  ``echo`` is a 400 naming it (chat has no echo).
* ``/v1/completions`` (the legacy shape): ``logprobs: N`` (0..20; OpenAI's own limit is 5) and
  ``echo``; ``logprobs`` is ``{tokens, token_logprobs, top_logprobs, text_offset}``, where
  ``top_logprobs`` holds a ``{token text: logprob}`` object per token (the N most likely and, as
  OpenAI documents, the chosen token, so up to N + 1 entries). With ``echo`` the prompt comes
  first, its first token's log-probability ``null`` (nothing predicts it), and the text starts with
  the prompt. ``text_offset``: where each token's text starts in the choice's ``text``.
* ``/v1/responses``: ``include: ["message.output_text.logprobs"]`` (or ``top_logprobs`` > 0) and
  ``top_logprobs`` (0..20); the message's ``output_text`` part (and each streamed
  ``output_text.delta``) carries the chat-shaped entries.

Every generated token has an entry, the tokens of a reasoning block, of tool calls and of a stop
string included (what ``usage.completion_tokens`` counts); a stop token is not generated text and
has none.
"""

from __future__ import annotations

from ..errors import APIError
from ..logprobs import MAX_TOP_LOGPROBS, TokenLogprob, TokenText, text_offsets

INCLUDE_LOGPROBS = "message.output_text.logprobs"  # the Responses API's ``include`` entry


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise _bad(f"{name}={value!r}: must be an integer from 0 to {MAX_TOP_LOGPROBS}", name)
    return value


def parse_logprobs(endpoint: str, body: dict) -> tuple[int | None, bool]:
    """``(alternatives per token or None: no log-probabilities, echo)`` of a request body of
    ``endpoint`` ("chat", "completions" or "responses"); a 400 naming the field at fault."""
    echo = body.get("echo")
    if endpoint != "completions":
        if echo not in (None, False):
            raise _bad("echo: only /v1/completions echoes the prompt", "echo",
                       "unsupported_parameter")
    elif echo is not None and not isinstance(echo, bool):
        raise _bad(f"echo={echo!r}: must be true or false", "echo", "invalid_type")
    if endpoint == "completions":
        logprobs = body.get("logprobs")
        return (None if logprobs is None else _count(logprobs, "logprobs")), bool(echo)
    top = body.get("top_logprobs")
    top = None if top is None else _count(top, "top_logprobs")
    if endpoint == "responses":
        include = body.get("include")
        if include is not None and (not isinstance(include, list)
                                    or not all(isinstance(x, str) for x in include)):
            raise _bad("include: must be a list of strings", "include", "invalid_type")
        wanted = INCLUDE_LOGPROBS in (include or ()) or bool(top)
        return (top or 0) if wanted else None, False
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad(f"logprobs={logprobs!r}: must be true or false", "logprobs", "invalid_type")
    if top and not logprobs:
        raise _bad("top_logprobs: needs logprobs set to true", "top_logprobs")
    return (top or 0) if logprobs else None, False


class LogprobFormat:
    """Writes one answer's log-probabilities in its endpoint's shape (``top``: alternatives per
    token); keeps the text offset across streamed chunks."""

    def __init__(self, tokenizer, top: int):
        self.texts = TokenText(tokenizer)
        self.top = top
        self.offset = 0  # characters of the completion's text already covered (legacy shape)
        self.answered = False  # the answer's first token has been written (legacy shape)
        self.lead = 0  # its dropped leading space (see :meth:`legacy`)

    # -- chat and responses ---------------------------------------------------------------------

    def _entry(self, token: int, logprob: float) -> dict:
        raw = self.texts.bytes(token)
        return {"token": self.texts.text(token), "logprob": logprob, "bytes": list(raw)}

    def content(self, entries: list[TokenLogprob]) -> list[dict]:
        """Chat's ``logprobs.content`` (and the Responses API's ``logprobs``) for ``entries``."""
        return [{**self._entry(e.token, e.logprob),
                 "top_logprobs": [self._entry(t, v) for t, v in e.top]} for e in entries]

    def chat(self, entries: list[TokenLogprob]) -> dict:
        return {"content": self.content(entries), "refusal": None}

    # -- completions (legacy) -------------------------------------------------------------------

    def legacy(self, entries: list[TokenLogprob], text: str | None = None) -> dict:
        """The legacy ``logprobs`` object for ``entries``, offsets continuing from the last call.
        ``text``: the answer's text with the first of them (the detokenizer drops the space a
        first token starts with, mlx-lm's way: the offsets after it move back by one)."""
        pieces = [self.texts.bytes(e.token) for e in entries]
        raw = text_offsets(pieces, self.offset)  # as if every token's text were kept
        if entries:
            self.offset = raw[-1] + len(pieces[-1].decode("utf-8", errors="replace"))
        if entries and not self.answered:
            self.answered = True
            first = pieces[0].decode("utf-8", errors="replace")
            if text is not None and first.startswith(" ") and not text.startswith(" "):
                self.lead = 1
            offsets = raw[:1] + [o - self.lead for o in raw[1:]]
        else:
            offsets = [o - self.lead for o in raw]
        return {"tokens": [self.texts.text(e.token) for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [self._top_dict(e) for e in entries],
                "text_offset": offsets}

    def legacy_prompt(self, prompt_ids: list[int], entries: list[TokenLogprob | None],
                      prompt_text: str) -> dict:
        """The echoed prompt's legacy object: its first token ``null`` (nothing predicts it);
        the answer's offsets continue after ``prompt_text`` (the echoed text)."""
        pieces = [self.texts.bytes(t) for t in prompt_ids]
        offsets = text_offsets(pieces, self.offset)
        self.offset += len(prompt_text)
        return {"tokens": [self.texts.text(t) for t in prompt_ids],
                "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else self._top_dict(e) for e in entries],
                "text_offset": offsets}

    def _top_dict(self, e: TokenLogprob) -> dict[str, float]:
        """The N most likely tokens and the chosen one (OpenAI's legacy "up to N + 1")."""
        out = {self.texts.text(t): v for t, v in e.top}
        out.setdefault(self.texts.text(e.token), e.logprob)
        return out


def join_legacy(*parts: dict) -> dict:
    """One legacy ``logprobs`` object of several (the echoed prompt's, then the answer's)."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [x for p in parts for x in p[k]] for k in keys}
