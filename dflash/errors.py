"""Every exception dflash raises on purpose, in one place.

Input errors are ``DFlashError`` (a ``ValueError``) subclasses whose message names the field or
file at fault; the CLI prints them as one line (exit 1), the server maps them to HTTP 400.
"""


class DFlashError(ValueError):
    """Base class of dflash's input errors."""


class DraftCheckpointError(DFlashError):
    """A drafter folder that cannot be read: missing/malformed config, corrupt or mismatched weights."""


class ExportError(DFlashError):
    """A drafter that cannot be written in the published Hugging Face layout (``dflash export``):
    a destination that exists, a tensor off the layout, a file that does not read back."""


class IncompatibleDraftError(DFlashError):
    """A drafter that does not fit the target (hidden size, vocabulary, taps, layer count)."""


class GenerationConfigError(DFlashError):
    """A generation or sampling setting outside its valid range."""


class GrammarError(DFlashError):
    """A JSON schema, regex or Lark grammar that cannot constrain decoding: not valid, a keyword
    the grammar engine does not enforce, or a tokenizer it cannot read (the message names the
    field)."""


class UnsupportedTargetError(DFlashError):
    """A target whose decoder layers cannot be tapped or whose caches cannot be rolled back."""


class ModelLoadError(DFlashError):
    """A ``--model``/``--draft`` that is not a model folder, or that cannot be loaded as one."""


class PromptFileError(DFlashError):
    """A prompt file that is missing, not JSONL, or has a line without a prompt field."""


class TraceFileError(PromptFileError):
    """A trace file (``dflash bench --trace``) that is missing, not JSONL, or has a conversation or
    turn without its fields (or with a field it does not know)."""


class DataSetError(DFlashError):
    """A generated data set that is missing, empty or holds malformed records."""


class TrainingDataError(DataSetError):
    """A data set that cannot be trained on: missing, empty, or records without the needed fields."""


class TrainConfigError(DFlashError):
    """A training setting outside its valid range (block size, taps, output folder, ...)."""


class CostModelError(DFlashError):
    """Pass costs that cannot be used: a timing of an unknown pass kind, or a stored calibration
    or learnt-costs file of another pair or another format (read as missing, said once)."""


class GGUFImportError(ModelLoadError):
    """A GGUF file the importer cannot convert: an architecture, tokenizer or tensor type it does
    not support."""


class RankMessageError(ValueError):
    """More than fits the fixed-size message the ranks of a sharded target exchange: a plan with
    more continuation tokens or tree nodes than it holds, or more values than its width."""


class CacheLayoutError(ValueError):
    """A batched cache asked for what its layout does not hold: one row of a batch of several, a
    sliding-window mask of a target's cache, a target's mask of a drafter's cache, a window wider
    than the cache keeps."""


class WorkerFailedError(RuntimeError):
    """A per-core worker process (:func:`dflash.workers.run_per_core`) exited with an error."""


class PairMemoryFileError(DFlashError):
    """A pair-memory file (``--pair-memory``, ``PairMemory.open``) that this dflash did not write:
    not a JSON object, another format, or a stored value out of its range."""


class MissingDependencyError(DFlashError):
    """An optional extra (``serve``, ``bench``) that is not installed; made by :func:`missing_extra`."""


def install_hint(extra: str) -> str:
    """The command that installs ``extra``: under this distribution's name, since
    ``pip install 'dflash[serve]'`` would install z-lab's package of that name instead."""
    from . import DISTRIBUTION

    return f"pip install '{DISTRIBUTION}[{extra}]'"


def missing_extra(extra: str, needs: str) -> MissingDependencyError:
    """The error for a missing optional extra: ``needs`` says what is missing and what for, the
    message ends with the command that installs it."""
    return MissingDependencyError(f"{needs}: {install_hint(extra)}")


class PromptCacheDirError(DFlashError):
    """A ``--prompt-cache-dir``, or ``PromptCache(directory=...)``, that cannot be made or written."""


class BackendSetupError(DFlashError):
    """MLX's CPU backend cannot be set up as asked (``DFLASH_BLAS``): OpenBLAS missing, or
    ``mlx.core`` loaded first by a build whose BLAS calls cannot be routed to it."""


class QueueFull(Exception):
    """The serving worker's queue is full; the HTTP layer answers 429."""


class RankLost(Exception):
    """A rank of a sharded target stopped or stopped answering; the HTTP layer answers 503."""


class GenerationCancelled(Exception):
    """A queued or running generation stopped because its client left or the server stops."""


class ServerStartError(DFlashError):
    """``dflash serve`` could not listen on the address and port it was given."""


class ServerConfigError(DFlashError):
    """A ``dflash serve`` setting that cannot be used: an API keys file that is missing or holds
    no key, an unknown ``--share`` mode, an index budget that is not a positive number."""


class APIError(Exception):
    """An OpenAI-style HTTP error: the status and the ``{"error": {...}}`` body a client gets."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type_, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class CLIError(Exception):
    """A problem with a command line the user can fix; ``dflash`` prints it as one line and exits
    with ``code`` (1, or 2 for usage errors)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class BenchConfigError(DFlashError):
    """A ``dflash bench`` setting that cannot be used: a block-size sweep that does not parse or
    holds a size below 2, a repeat count, prompt limit, concurrency or batch size below 1, a
    ``lookup`` that is not True, False or a sequence of them."""
