"""The public facade: ``from dflash.model_mlx import load, load_draft, stream_generate``."""

from __future__ import annotations

from . import backend


def load(path_or_hf_repo: str, tokenizer_config: dict | None = None, **kwargs):
    """Load a target model and its tokenizer through mlx-lm, ready for this machine's backend."""
    from mlx_lm import load as mlx_lm_load

    model, tokenizer = mlx_lm_load(str(path_or_hf_repo), tokenizer_config=tokenizer_config or {},
                                   **kwargs)
    backend.prepare_for_backend(model)
    return model, tokenizer
