"""dflash: DFlash block-diffusion speculative decoding on MLX.

Importing it changes nothing: the loaders set up MLX's CPU backend (:func:`dflash.backend.configure`).
"""

__version__ = "0.2.0"  # the only place the version is written (pyproject.toml reads it)

# The name pip knows this package by. It is not `dflash`: that name on PyPI is z-lab's reference
# implementation, which installs an import package of the same name.
DISTRIBUTION = "mlx-dflash-spec"
