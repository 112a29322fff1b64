"""API keys, and who may benefit from whose text: the scopes of the state requests leave behind.

Why: two pieces of server state carry text from one request to the next, the continuation index
(:class:`~dflash.lookup.ContinuationIndex`: earlier prompts and answers, verified as proposals)
and the prefix cache (:class:`~dflash.prompt_cache.PromptCache`: the caches of recent conversations, prompt and reply).
Both make a request faster when its text was seen before, so the speed of an answer (cycles, time
to first token) would tell a client whether a guessed text was sent or generated for someone else.
Each API key therefore gets its own index and prefix cache unless the operator says otherwise
(``--share``): ``key`` (the default) one per key, ``all`` one for everyone (a single-user
machine), ``none`` no index and no prefix cache reuse across requests. Without API keys the server
has one tenant: everyone is the same scope.

Keys are compared in constant time against every configured key (``hmac.compare_digest``), so the
time a rejection takes does not say how much of a guessed key was right.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from dataclasses import dataclass
from pathlib import Path

from ..cache_files import check_writable
from ..console import log
from ..errors import ServerConfigError
from ..lookup import DEFAULT_BUDGET, ContinuationIndex
from ..prompt_cache import DEFAULT_DISK_BYTES, DEFAULT_ENTRIES, PromptCache

SHARE_MODES = ("key", "all", "none")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
ANONYMOUS = "-"  # the scope of a server without keys


def read_keys_file(path: str | Path) -> list[str]:
    """The keys in ``path``: one per line; blank lines and ``#`` comments are skipped.

    A missing, unreadable or keyless file is a :class:`ServerConfigError` naming it (a server
    that was meant to require keys must not start open)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ServerConfigError(f"--api-keys-file {p}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ServerConfigError(f"--api-keys-file {p}: cannot be read ({e})") from None
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ServerConfigError(f"--api-keys-file {p}: holds no key (one per line; blank lines "
                                "and # comments are skipped)")
    return keys


class APIKeys:
    """The keys a server accepts; :meth:`check` names the scope of a request's credentials."""

    def __init__(self, keys: list[str] | None = None):
        unique: list[str] = []
        for k in keys or ():
            if not isinstance(k, str) or not k.strip() or any(c.isspace() for c in k.strip()):
                raise ServerConfigError(f"--api-key {k!r}: a non-empty key without spaces")
            if k.strip() not in unique:
                unique.append(k.strip())
        self._keys = [k.encode() for k in unique]
        # a scope is named by a digest of its key, not its place in the list: reordering the
        # keys file never hands one key's cached conversations (on disk too) to another
        self._names = [scope_name(k) for k in unique]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def check(self, authorization: str | None, x_api_key: str | None) -> str | None:
        """The scope name of the key sent as ``Authorization: Bearer KEY`` or ``x-api-key: KEY``
        (:data:`ANONYMOUS` on a server without keys); ``None``: no key or a wrong one."""
        if not self._keys:
            return ANONYMOUS
        sent = []
        if authorization:
            scheme, _, value = authorization.strip().partition(" ")
            if scheme.lower() == "bearer" and value.strip():
                sent.append(value.strip())
        if x_api_key and x_api_key.strip():
            sent.append(x_api_key.strip())
        found = None
        for candidate in sent:
            given = candidate.encode()
            for i, key in enumerate(self._keys):  # every key, whatever matched before
                if hmac.compare_digest(given, key) and found is None:
                    found = self._names[i]
        return found


def scope_name(key: str) -> str:
    """A key's scope: ``key-`` and 12 hex digits of its SHA-256 (shown in logs and used as a
    folder name; the key itself is never written anywhere)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass
class Scope:
    """The cross-request state one scope's requests share (``None``: not kept)."""

    name: str
    index: ContinuationIndex | None
    prompt_cache: PromptCache | None


class Scopes:
    """The scopes of a server, made on first use: ``share`` says whose requests share one."""

    def __init__(self, share: str = "key", index_budget: int = DEFAULT_BUDGET,
                 prompt_cache_size: int = DEFAULT_ENTRIES, prompt_cache_bytes: int | None = None,
                 prompt_cache_dir: str | Path | None = None,
                 prompt_cache_dir_bytes: int = DEFAULT_DISK_BYTES, defer_writes: bool = False):
        if share not in SHARE_MODES:
            raise ServerConfigError(f"--share {share!r}: one of {', '.join(SHARE_MODES)}")
        if isinstance(index_budget, bool) or not isinstance(index_budget, int) \
                or index_budget <= 0:
            raise ServerConfigError(
                f"--index-budget {index_budget!r}: must be a positive number of tokens")
        for flag, value in (("--prompt-cache-size", prompt_cache_size),
                            ("--prompt-cache-bytes", prompt_cache_bytes),
                            ("--prompt-cache-dir-bytes", prompt_cache_dir_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ServerConfigError(f"{flag} {value!r}: must be a positive integer")
        self.share, self.index_budget = share, index_budget
        # each scope's bound: a server with keys holds up to (keys x size) conversations
        self.prompt_cache_size, self.prompt_cache_bytes = prompt_cache_size, prompt_cache_bytes
        # each scope's conversations on disk, in a folder of its own (``None``: memory only)
        self.prompt_cache_dir = None if prompt_cache_dir is None else Path(prompt_cache_dir)
        self.prompt_cache_dir_bytes = prompt_cache_dir_bytes
        # replies written to the folder only when the worker is idle (:meth:`write_deferred`)
        self.defer_writes = defer_writes
        if self.prompt_cache_dir is not None and share != "none":
            check_writable(self.prompt_cache_dir)  # at start, not at the first reply
        self._scopes: dict[str, Scope] = {}
        self._lock = threading.Lock()

    def get(self, key: str | None) -> Scope:
        """The scope of a request made with the key named ``key`` (see :meth:`APIKeys.check`)."""
        if self.share == "none":
            return Scope("none", None, None)
        name = "all" if self.share == "all" else (key or ANONYMOUS)
        with self._lock:
            scope = self._scopes.get(name)
            if scope is None:
                folder = None if self.prompt_cache_dir is None else self.prompt_cache_dir / (
                    "shared" if name in ("all", ANONYMOUS) else name)
                scope = self._scopes[name] = Scope(
                    name, ContinuationIndex(self.index_budget),
                    PromptCache(self.prompt_cache_size, self.prompt_cache_bytes, folder,
                                self.prompt_cache_dir_bytes, defer_writes=self.defer_writes))
            return scope

    def scopes(self) -> list[Scope]:
        with self._lock:
            return list(self._scopes.values())

    def on_rank(self, rank: int) -> None:
        """A sharded target's rank keeps its own stage's caches: in a folder of its own, so
        that no rank's byte budget counts (or evicts) another's files."""
        if self.prompt_cache_dir is not None:
            self.prompt_cache_dir = self.prompt_cache_dir / f"rank-{rank}"

    def flush(self) -> None:
        """Write the deferred conversations and wait for those being written (at shutdown)."""
        if self.prompt_cache_dir is None:
            return
        written = sum(scope.prompt_cache.flush() for scope in self.scopes()
                      if scope.prompt_cache is not None)
        log(f"prompt cache: {written} conversation{'' if written == 1 else 's'} written to "
            f"{self.prompt_cache_dir} at shutdown")

    def write_deferred(self) -> None:
        """Start writing every scope's queued replies to disk (the worker, when idle)."""
        for scope in self.scopes():
            if scope.prompt_cache is not None:
                scope.prompt_cache.write_deferred()

    def clear_prompt_caches(self) -> None:
        """Forget every scope's prefix cache (after a failed batch: its caches may be
        mid-update). Called from the worker thread, the only one that uses them."""
        for scope in self.scopes():
            if scope.prompt_cache is not None:
                scope.prompt_cache.clear()

    @property
    def index_tokens(self) -> int:
        """Tokens held by all the scopes' continuation indexes."""
        return sum(s.index.tokens for s in self.scopes() if s.index is not None)

    @property
    def index_bytes(self) -> int:
        return sum(s.index.nbytes for s in self.scopes() if s.index is not None)
