"""fp4lab.numerics.hadamard.rht against NumPy: the butterfly order bit for bit, the matrix within
rounding, and the propagation of infinities and NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4lab.numerics.hadamard import (TE_SIGNS, hadamard_matrix, random_signs, rht, rht_matrix,
                             rht_transpose, rotate)


def numpy_rht_groups(g, signs, n):
    """NumPy float32: ``fl(W(s * g) * fl(1/sqrt(n)))`` over the last axis of ``g`` (groups of
    ``n``), W as butterflies h = 1, 2, 4, ... (the order fp4lab.numerics.hadamard documents)."""
    u = [np.float32(signs[i]) * g[..., i] for i in range(n)]
    h = 1
    while h < n:
        for i in range(n):
            if i & h == 0:
                a, b = u[i], u[i + h]
                u[i], u[i + h] = np.float32(a + b), np.float32(a - b)
        h *= 2
    c = np.float32(1 / np.sqrt(n))
    return np.stack([v * c for v in u], axis=-1).astype(np.float32)


def numpy_rht(x, axis, signs=TE_SIGNS, n=16):
    xm = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    pad = -xm.shape[-1] % n
    xm = np.pad(xm, [(0, 0)] * (xm.ndim - 1) + [(0, pad)])
    g = xm.reshape(xm.shape[:-1] + (-1, n))
    return np.moveaxis(numpy_rht_groups(g, signs, n).reshape(xm.shape), -1, axis)


@pytest.mark.parametrize("shape,axis", [((64, 24), 0), ((3, 40), 1), ((2, 5, 16), 1)])
def test_rht_equals_the_numpy_butterflies_bit_for_bit(shape, axis):
    # magnitudes that vary along the transformed axis make every summation order visible
    scale = 10.0 ** (np.arange(shape[axis]) % 7).astype(np.float32)
    x = np.asarray(jax.random.normal(jax.random.key(0), shape)) * np.expand_dims(
        scale, tuple(d for d in range(len(shape)) if d != axis))
    x = x.astype(np.float32)
    got = np.asarray(rht(jnp.asarray(x), axis))
    np.testing.assert_array_equal(got.view(np.uint32), numpy_rht(x, axis).view(np.uint32))
    # BF16 inputs: the same float32 arithmetic, then rounded to BF16
    xb = jnp.asarray(x, jnp.bfloat16)
    want = jnp.asarray(numpy_rht(np.asarray(xb.astype(jnp.float32)), axis), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(rht(xb, axis)).view(np.uint16),
                                  np.asarray(want).view(np.uint16))


def test_rht_is_the_matrix_product_within_rounding():
    x = np.asarray(jax.random.normal(jax.random.key(1), (512, 32)), np.float32)
    for n, signs in ((16, "te"), (32, 7), (4, 3)):
        t = rht_matrix(n, signs).astype(np.float64)
        exact = (x.astype(np.float64).reshape(512, -1, n) @ t).reshape(512, 32)
        got = np.asarray(rht(jnp.asarray(x), 1, n, signs), np.float64)
        np.testing.assert_allclose(got, exact, rtol=0, atol=4 * np.finfo(np.float32).eps * 8)
        s = np.sign(rht_matrix(n, signs)[:, 0])
        np.testing.assert_array_equal(np.asarray(rht(jnp.asarray(x), 1, n, signs)),
                                      numpy_rht(x, 1, s, n))
    np.testing.assert_array_equal(rht_matrix(16) * 4, np.diag(TE_SIGNS) @ hadamard_matrix(16))


def test_infinities_and_nan_propagate_as_in_the_product():
    x = np.zeros((16,), np.float32)
    x[0] = np.inf
    y = np.asarray(rht(jnp.asarray(x), 0))
    np.testing.assert_array_equal(y, np.where(rht_matrix(16)[0] > 0, np.inf, -np.inf))
    x[1] = -np.inf  # TE's s0 = s1 = 1: outputs adding both are NaN, subtracting them inf
    y = np.asarray(rht(jnp.asarray(x), 0))
    h = hadamard_matrix(16)
    np.testing.assert_array_equal(np.isnan(y), h[1] > 0)
    np.testing.assert_array_equal(y[h[1] < 0], np.inf)
    x[5] = np.nan
    assert np.all(np.isnan(np.asarray(rht(jnp.asarray(x), 0))))
    nan_group = np.asarray(rht(jnp.asarray(np.r_[x, np.ones(16, np.float32)]), 0))
    assert np.all(np.isfinite(nan_group[16:]))  # a non-finite value stays in its group


def test_rht_rejects_integer_input_and_bad_signs():
    with pytest.raises(TypeError, match="floating-point input, got int32"):
        rht(jnp.ones((16,), jnp.int32), 0)
    with pytest.raises(ValueError, match="signs='x' must be 'te', 'none' or an int seed"):
        rht(jnp.ones((16,)), 0, signs="x")
    with pytest.raises(ValueError, match=r"must have shape \(16,\), got \(8,\)"):
        rht(jnp.ones((16,)), 0, signs=jnp.ones((8,)))


@pytest.mark.parametrize("signs", ["te", "none", 5, "array"])
def test_rht_transpose_is_the_transpose_of_the_dense_matrix(signs):
    """rht_transpose(y) = y @ Tb^T (Tb block-diagonal diag(s) H c) along either axis, cut to
    the input's length; for a drawn sign vector too."""
    from fp4lab.numerics.hadamard import random_signs, rht_transpose
    s = random_signs(jax.random.key(1), 16) if signs == "array" else signs
    t = (np.asarray(s, np.float64)[:, None] * hadamard_matrix(16) / 4 if signs == "array"
         else rht_matrix(16, signs).astype(np.float64))
    y = jax.random.normal(jax.random.key(0), (3, 32))
    want = np.asarray(y, np.float64) @ np.kron(np.eye(2), t).T
    got = rht_transpose(y, 1, 27, 16, s)
    np.testing.assert_allclose(np.asarray(got), want[:, :27], rtol=1e-6, atol=1e-6)
    got0 = rht_transpose(y.T, 0, 27, 16, s)
    np.testing.assert_allclose(np.asarray(got0), want[:, :27].T, rtol=1e-6, atol=1e-6)
    x = jax.random.normal(jax.random.key(2), (2, 27))
    back = rht_transpose(rht(x, 1, 16, s), 1, 27, 16, s)
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("signs", ["te", "random"])
def test_rotate_is_rht_widened_and_its_gradient_is_the_float32_transpose(dtype, signs):
    """``rotate`` (a forward transform wrapped around a GEMM): the values ``rht`` gives in
    the input's dtype, in float32; the gradient ``rht_transpose`` of the float32 cotangent,
    cast once to the input's dtype (not rounded to it before the transpose), bit for bit,
    with K cut back from its padding (20 -> 32)."""
    if signs == "random":
        signs = random_signs(jax.random.key(3), 16)
    x = jax.random.normal(jax.random.key(0), (5, 20)).astype(dtype)
    g = jax.random.normal(jax.random.key(1), (5, 32), jnp.float32) * 1e3
    y, vjp = jax.vjp(lambda t: rotate(t, 1, 16, signs), x)
    assert y.dtype == jnp.float32 and y.shape == (5, 32)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(rht(x, 1, 16, signs), np.float32))
    (dx,) = vjp(g)
    assert dx.dtype == dtype
    want = rht_transpose(g, 1, 20, 16, signs).astype(dtype)
    np.testing.assert_array_equal(np.asarray(dx).view(np.uint8), np.asarray(want).view(np.uint8))
