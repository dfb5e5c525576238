"""Built-in example models used by ``divjac demo``, the benchmarks, the examples and the tests.

:mod:`divjac.models.jax` and :mod:`divjac.models.torch` define the same architectures, so the
same weights give the same functions in both frameworks.
"""

from __future__ import annotations


def unet_layers(channels: int, in_channels: int) -> dict[str, tuple[int, int]]:
    """The convolutions of the U-Net (``unet`` in both frameworks): name -> (in, out) channels."""
    c = channels
    return {
        "enc1": (in_channels, c),
        "enc2": (c, 2 * c),
        "mid": (2 * c, 2 * c),
        "dec2": (4 * c, c),
        "dec1": (2 * c, in_channels),
    }
