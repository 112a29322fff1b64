"""dflash: DFlash block-diffusion speculative decoding on MLX."""

from .backend import preload_openblas

preload_openblas()

__version__ = "0.1.0"
