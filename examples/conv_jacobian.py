"""The convolution Jacobian story: the whole per-sample Jacobian of a blur, and one pixel's gradient.

A 'same' Gaussian blur with an 11x11 kernel maps a 64x64 image to a 64x64 image. Its Jacobian is
a 4096 x 4096 matrix, but every output pixel depends on at most 121 input pixels. divjac finds this
on the traced program (no values involved), colors the columns (about 121 colors instead of 4096
columns) and computes the whole Jacobian with one batched JVP per color, stored as a sparse BCOO
matrix: no 4096 x 4096 dense array is ever formed.

One row of that Jacobian is the gradient of one output pixel, which ``jax.grad`` gives directly:
its nonzeros are the kernel flipped on both axes (a convolution flips its kernel), in the
11x11 window around the pixel.

Run: ``python examples/conv_jacobian.py``
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from divjac.jax import sparse_jacobian, sparsity
from divjac.models import jax as models


def main(small: bool = False) -> dict[str, Any]:
    """Compute the sparse Jacobian and one pixel's gradient; returns them with the kernel."""
    size = 32 if small else 64
    kernel = models.gaussian_kernel(11, 2.0, dtype=jnp.zeros(()).dtype)

    def blur(images: jax.Array) -> jax.Array:  # [B, H, W] -> [B, H, W], jax.scipy convolve2d
        return models.blur(images, kernel)

    images = jax.random.uniform(jax.random.key(0), (2, size, size))
    n = size * size

    pattern = sparsity(blur)(images)
    print(f"per-sample Jacobian: {n} x {n}, {pattern.nnz:,} structural nonzeros")
    print(f"  column colors: {pattern.n_colors} (passes of sparse_jacobian) instead of {n} columns")
    print(f"  diagonal colors: {pattern.n_diagonal_colors} (passes of the exact divergence)")

    J = jax.jit(sparse_jacobian(blur))(images)  # BCOO, shape (2, n, n)
    print(f"sparse_jacobian: {type(J).__name__} of shape {J.shape}, {J.nse:,} values per sample")

    i, j = size // 2, size // 3

    def pixel(image: jax.Array) -> jax.Array:
        return blur(image[None])[0, i, j]

    gradient = jax.grad(pixel)(images[0])  # (size, size): d out[i, j] / d image
    window = gradient[i - 5 : i + 6, j - 5 : j + 6]
    row = J[0][i * size + j].todense().reshape(size, size)  # the same row of the Jacobian
    print(f"gradient of output pixel ({i}, {j}): {int(jnp.sum(gradient != 0))} nonzeros")
    print(
        "  equals the flipped kernel in its 11x11 window:",
        bool(np.allclose(window, np.flip(np.asarray(kernel)))),
    )
    print("  equals row", i * size + j, "of the sparse Jacobian:", bool(np.allclose(row, gradient)))
    return {
        "pattern": pattern,
        "jacobian": J,
        "gradient": gradient,
        "row": row,
        "window": window,
        "kernel": kernel,
        "pixel": (i, j),
    }


if __name__ == "__main__":
    main()
