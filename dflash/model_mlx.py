"""The public facade: ``from dflash.model_mlx import load, load_draft, stream_generate``.

The loaders set up MLX's CPU backend (:func:`dflash.backend.configure`: OpenBLAS on Linux) before
they load anything; importing this module does not.
"""

from __future__ import annotations

from .backend import configure


def load(path_or_hf_repo: str, tokenizer_config: dict | None = None, **kwargs):
    """Load a target model and its tokenizer through mlx-lm, ready for this machine's backend."""
    from .target import load_target

    configure()
    return load_target(path_or_hf_repo, tokenizer_config, **kwargs)


def load_draft(path_or_hf_repo: str, sliding_window_size: int | None = None):
    """Load a DFlash drafter (Hugging Face bf16 or MLX-quantized checkpoint)."""
    from .drafter import load_draft as _load_draft

    configure()
    return _load_draft(path_or_hf_repo, sliding_window_size=sliding_window_size)


def load_default():
    """The built-in pair: ``(model, tokenizer, draft)`` for SmolLM2-135M-Instruct."""
    from .default_pair import default_draft_path, default_target_path

    configure()
    model, tokenizer = load(str(default_target_path()))
    return model, tokenizer, load_draft(str(default_draft_path()))


from .batch import BatchEvent, BatchGenerator, batch_generate  # noqa: E402
from .prompt_cache import PromptCache  # noqa: E402
from .settings import GenerationSettings  # noqa: E402
from .speculative import DFlashResponse, GenerationResult, generate, stream_generate  # noqa: E402

__all__ = ["configure", "load", "load_draft", "load_default", "stream_generate", "generate",
           "DFlashResponse", "GenerationResult", "PromptCache", "batch_generate",
           "BatchGenerator", "BatchEvent", "GenerationSettings"]
