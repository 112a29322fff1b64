"""Typed errors: each is a ``ValueError`` whose message names the field or file at fault."""


class DFlashError(ValueError):
    """Base class of dflash's input errors."""


class DraftCheckpointError(DFlashError):
    """A drafter folder that cannot be read: missing/malformed config, corrupt or mismatched weights."""


class IncompatibleDraftError(DFlashError):
    """A drafter that does not fit the target (hidden size, vocabulary, taps, layer count)."""


class GenerationConfigError(DFlashError):
    """A generation or sampling setting outside its valid range."""


class UnsupportedTargetError(DFlashError):
    """A target whose decoder layers cannot be tapped or whose caches cannot be rolled back."""
