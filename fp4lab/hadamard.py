"""Random Hadamard transform (RHT) along an axis, in groups of ``n`` (16 by default).

``T = diag(s) . H_n / sqrt(n)`` with ``H_n`` the Sylvester Hadamard matrix and a sign vector
``s``; each group of ``n`` consecutive elements along ``axis`` is multiplied by ``T`` (as
``x_group @ T``). ``T T^T = I``, so applying it to both operands of a GEMM along the GEMM's
reduction axis leaves the product unchanged while spreading outliers across each group before
quantization (NUMERICS.md; applied to the wgrad operands in the NVFP4 recipe).

The output keeps the input's dtype (BF16 inputs give BF16-rounded transforms, as in TE).
A length that is not a multiple of ``n`` is zero-padded to one, and the output keeps the
padded length: the transform spreads real values into the padded positions of the last group,
so slicing them off would break ``T T^T = I``; a GEMM over the padded axis is exact.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["TE_SIGNS", "hadamard_matrix", "rht_matrix", "rht"]

# Transformer Engine's fixed sign vector for 16-point RHT (NUMERICS.md).
TE_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester Hadamard matrix of order ``n`` (a power of two), entries ±1."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size n={n} must be a power of two")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@functools.cache
def rht_matrix(n: int = 16, signs: str | int = "te") -> np.ndarray:
    """The float32 matrix ``T = diag(s) H_n / sqrt(n)``.

    ``signs="te"`` uses TE's vector (n = 16 only); an int seeds a fixed random ±1 vector."""
    if signs == "te":
        if n != 16:
            raise ValueError(f"TE's sign vector has 16 entries; use an int seed for n={n}")
        s = np.array(TE_SIGNS, np.float64)
    elif isinstance(signs, int) and not isinstance(signs, bool):
        s = np.random.default_rng(signs).choice([-1.0, 1.0], n)
    else:
        raise ValueError(f"signs={signs!r} must be 'te' or an int seed")
    return (s[:, None] * hadamard_matrix(n) / np.sqrt(n)).astype(np.float32)


def rht(x: jax.Array, axis: int, n: int = 16, signs: str | int = "te") -> jax.Array:
    """Apply the RHT to groups of ``n`` along ``axis``; the output's ``axis`` has length
    ``ceil(len / n) * n`` (see module docstring)."""
    axis = axis % x.ndim
    t = jnp.asarray(rht_matrix(n, signs))
    pad = -x.shape[axis] % n
    xm = jnp.moveaxis(x, axis, -1)
    if pad:
        xm = jnp.pad(xm, [(0, 0)] * (xm.ndim - 1) + [(0, pad)])
    g = xm.reshape(xm.shape[:-1] + (-1, n)).astype(jnp.float32)
    y = jnp.einsum("...gi,ij->...gj", g, t, precision=jax.lax.Precision.HIGHEST)
    y = y.reshape(xm.shape).astype(x.dtype)
    return jnp.moveaxis(y, -1, axis)
