"""dflash: DFlash block-diffusion speculative decoding on MLX.

Importing it changes nothing: the loaders set up MLX's CPU backend (:func:`dflash.backend.configure`).
"""

__version__ = "0.1.0"
