"""Random Hadamard transform (RHT) along an axis, in groups of ``n`` (16 by default).

``T = diag(s) . H_n / sqrt(n)`` with ``H_n`` the Sylvester Hadamard matrix and a sign vector
``s``; each group of ``n`` consecutive elements along ``axis`` is multiplied by ``T`` (as
``x_group @ T``). ``T T^T = I``, so applying it to both operands of a GEMM along the GEMM's
reduction axis leaves the product unchanged while spreading outliers across each group before
quantization (docs/numerics.md; applied to the wgrad operands in the NVFP4 recipe).

Arithmetic (the same in the fused Pallas kernel, so the two agree bit for bit). With
``T = diag(s) H_n c``, ``c = fl32(1/sqrt(n))`` (1/4 for n = 16, exact), each group is computed
as ``y = fl(W(s * x) * c)``: the signs are applied (exact), then the unnormalized Sylvester
Walsh-Hadamard transform ``W`` runs as log2(n) float32 butterfly stages ``h = 1, 2, 4, ...``,
each replacing the pair ``(u_i, u_{i+h})`` (bit ``h`` of ``i`` clear) by ``(u_i + u_{i+h},
u_i - u_{i+h})``, and the sums are scaled by ``c`` once. This is ``x @ T`` with one fixed
summation order: a matrix product leaves the order to the backend (Eigen on CPU and cuBLAS
on GPU differ in the last bit), the butterfly does not; and its only products before the
additions are by +-1 (exact), so a compiler contracting them into FMAs changes no bit. Each
output is a sum of ``n`` terms before scaling, so an input above ``FLT_MAX / n`` can overflow
to infinity where the exact transform would not. Infinities and NaN propagate as in the
matrix product: ``+-inf`` stays infinite in its group's outputs, NaN (or ``inf - inf``)
gives NaN.

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
from jax import lax

__all__ = ["TE_SIGNS", "rotate", "hadamard_matrix", "rht_matrix", "rht_signs_and_scale",
           "walsh_hadamard", "rht", "rht_transpose", "random_signs"]

# Transformer Engine's fixed sign vector for 16-point RHT (docs/numerics.md).
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

    ``signs="te"`` uses TE's vector (n = 16 only); an int seeds a fixed random ±1 vector;
    ``"none"`` is the plain normalized Hadamard transform (all signs +1: Quartet's forward)."""
    if signs == "none":
        s = np.ones(n)
    elif signs == "te":
        if n != 16:
            raise ValueError(f"TE's sign vector has 16 entries; use an int seed for n={n}")
        s = np.array(TE_SIGNS, np.float64)
    elif isinstance(signs, int) and not isinstance(signs, bool):
        s = np.random.default_rng(signs).choice([-1.0, 1.0], n)
    else:
        raise ValueError(f"signs={signs!r} must be 'te', 'none' or an int seed")
    return (s[:, None] * hadamard_matrix(n) / np.sqrt(n)).astype(np.float32)


def rht_signs_and_scale(n: int = 16, signs: str | int = "te") -> tuple[np.ndarray, np.float32]:
    """The factors of ``T = diag(s) H_n c``: the float32 sign vector ``s`` and ``c``."""
    t = rht_matrix(n, signs)
    return np.sign(t[:, 0]), np.abs(t[0, 0])


def _factors(n: int, signs):
    """``(s, c)`` of :func:`rht_signs_and_scale`, or a traced sign vector (``jax.Array``,
    shape (n,), entries +-1: a transform drawn per call) with the same ``c``."""
    if isinstance(signs, jax.Array):
        if signs.shape != (n,):
            raise ValueError(f"a sign vector for n={n} must have shape ({n},), got "
                             f"{signs.shape}")
        return signs.astype(jnp.float32), rht_signs_and_scale(n, "none")[1]
    return rht_signs_and_scale(n, signs)


def random_signs(key: jax.Array, n: int) -> jax.Array:
    """A uniformly random +-1 float32 vector of length ``n`` drawn from ``key`` (the sign
    vector of a transform redrawn at every call, as Quartet, Quartet II and TetraJet-v2 do)."""
    return jax.random.rademacher(key, (n,), jnp.float32)


def walsh_hadamard(u: jax.Array, axis: int = -1) -> jax.Array:
    """The unnormalized Sylvester Walsh-Hadamard transform ``H_n u`` along ``axis``, as
    butterflies ``h = 1, 2, 4, ...`` in ``u``'s dtype (``rht`` passes float32; the summation
    order of the module docstring).
    The axes after ``axis`` stay innermost, so each butterfly adds contiguous rows."""
    axis = axis % u.ndim
    n, pre, post = u.shape[axis], u.shape[:axis], u.shape[axis + 1:]
    h = 1
    while h < n:
        v = u.reshape(pre + (n // (2 * h), 2, h) + post)
        a, b = (lax.index_in_dim(v, i, axis + 1, keepdims=False) for i in (0, 1))
        u = jnp.stack([a + b, a - b], axis=axis + 1).reshape(u.shape)
        h *= 2
    return u


def _in_groups(x, axis: int, n: int):
    """``x`` (whole groups along ``axis``) as float32 groups ``(..., len / n, n, ...)``, the
    trailing axes innermost (no transpose); an empty tensor too."""
    return x.reshape(x.shape[:axis] + (x.shape[axis] // n, n) + x.shape[axis + 1:]).astype(
        jnp.float32)


def rht(x: jax.Array, axis: int, n: int = 16, signs: str | int | jax.Array = "te"
        ) -> jax.Array:
    """Apply the RHT to groups of ``n`` along ``axis``; the output's ``axis`` has length
    ``ceil(len / n) * n`` (see module docstring). ``signs``: as :func:`rht_matrix`, or a
    +-1 vector (:func:`random_signs`)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"rht needs a floating-point input, got {x.dtype}")
    axis = axis % x.ndim
    s, c = _factors(n, signs)
    pad = -x.shape[axis] % n
    if pad:
        x = jnp.pad(x, [(0, pad if d == axis else 0) for d in range(x.ndim)])
    g = _in_groups(x, axis, n)
    y = walsh_hadamard(g * s.reshape((n,) + (1,) * (x.ndim - 1 - axis)), axis + 1) * c
    return y.reshape(x.shape).astype(x.dtype)


def rht_transpose(y: jax.Array, axis: int, length: int, n: int = 16,
                  signs: str | int = "te") -> jax.Array:
    """The transpose of :func:`rht`: groups of ``n`` along ``axis`` (a multiple of ``n``)
    multiplied by ``T^T = c H_n diag(s)``, computed as ``fl(W(y) * c) * s`` (the same
    butterflies), then cut to the first ``length`` entries. It maps a gradient with respect to
    a transformed operand back to the untransformed one (``rht_transpose(rht(x)) = x`` up to
    rounding)."""
    axis = axis % y.ndim
    if y.shape[axis] % n:
        raise ValueError(f"rht_transpose needs axis {axis} (length {y.shape[axis]}) in whole "
                         f"groups of {n=}")
    s, c = _factors(n, signs)
    g = _in_groups(y, axis, n)
    x = walsh_hadamard(g, axis + 1) * c * s.reshape((n,) + (1,) * (y.ndim - 1 - axis))
    return lax.slice_in_dim(x.reshape(y.shape), 0, length, axis=axis).astype(y.dtype)


def rotate(x: jax.Array, axis: int, n: int = 16, signs: str | int | jax.Array = "te"
           ) -> jax.Array:
    """:func:`rht` as a change of basis around a GEMM: the rotated ``x`` in float32 (``rht``
    in ``x``'s dtype, then widened: the values a quantizer would see), whose gradient autodiff
    maps back through :func:`rht_transpose` in float32 before casting to ``x``'s dtype once.
    A forward transform that cancels in its GEMM (Quartet's) wraps the quantized GEMM this
    way, so the GEMM itself never tracks a rotated domain."""
    axis = axis % x.ndim
    if isinstance(signs, jax.Array):
        return _rotate(axis, n, None, x.shape[axis], x, signs)
    return _rotate(axis, n, signs, x.shape[axis], x, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _rotate(axis, n, fixed, length, x, drawn):
    return rht(x, axis, n, drawn if fixed is None else fixed).astype(jnp.float32)


def _rotate_fwd(axis, n, fixed, length, x, drawn):
    return _rotate(axis, n, fixed, length, x, drawn), (jnp.zeros((0,), x.dtype), drawn)


def _rotate_bwd(axis, n, fixed, length, res, g):
    stand_in, drawn = res
    dx = rht_transpose(g, axis, length, n, drawn if fixed is None else fixed)
    return dx.astype(stand_in.dtype), None if drawn is None else jnp.zeros_like(drawn)


_rotate.defvjp(_rotate_fwd, _rotate_bwd)
