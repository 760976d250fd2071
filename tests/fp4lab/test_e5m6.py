"""E5M6 (DeepSeek-V3's 12-bit attention-output format): round to nearest even on its grid
against a float64 NumPy oracle (ties, subnormals, saturation, specials), the 1x128 block
format against the abs-max arithmetic, and its use as saved-activation storage."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4lab
from fp4lab import rounding as rnd
from fp4lab.formats import E5M6

MAX = (2 - 2.0 ** -6) * 2.0 ** 15


def oracle(v):
    """Round float64 values onto E5M6 (5 exponent bits, bias 15, 6 mantissa bits), ties to
    even, saturating at the max; NaN stays NaN."""
    v = np.asarray(v, np.float64)
    a = np.minimum(np.abs(v), MAX)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), -14)
    ulp = 2.0 ** (e - 6)
    q = np.round(a / ulp) * ulp  # np.round: half to even
    return np.where(np.isnan(v), np.nan, np.copysign(np.minimum(q, MAX), v))


def _cases():
    rng = np.random.default_rng(0)
    grid = oracle(np.concatenate([2.0 ** rng.uniform(-22, 16, 2000), [1.0, 2.0 ** -14]]))
    grid = grid[grid > 0]
    ulp = 2.0 ** (np.maximum(np.floor(np.log2(grid)), -14) - 6)
    ties = grid + ulp / 2  # exactly halfway: to even
    near = grid + ulp * rng.uniform(0.01, 0.99, grid.size)
    special = np.array([0.0, -0.0, MAX, MAX + 2.0 ** 8, 1e30, 2.0 ** -20, 2.0 ** -21,
                        1.5 * 2.0 ** -21, np.nan])
    x = np.concatenate([grid, ties, -near, near, special]).astype(np.float32)
    return x[np.asarray(x, np.float64) == np.concatenate([grid, ties, -near, near, special])]


def test_round_nearest_onto_e5m6_equals_the_oracle():
    x = _cases()
    got = np.asarray(jax.jit(lambda v: rnd.round_nearest(v, E5M6))(x), np.float64)
    want = oracle(x)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok], want[ok])
    assert np.all(np.asarray(got[ok], np.float16).astype(np.float64) == got[ok])  # FP16 holds it
    assert np.signbit(got[1]) == np.signbit(x[1])


def test_the_block_format_is_abs_max_scaled_e5m6():
    x = jax.random.normal(jax.random.key(1), (8, 256)) * jnp.logspace(-3, 3, 8)[:, None]
    q = fp4lab.quantize(x, "e5m6_block128", axis=-1)
    assert q.data.dtype == jnp.float16 and q.scale.shape == (8, 2)
    xs = np.asarray(x, np.float32).reshape(8, 2, 128)
    amax = np.abs(xs).max(-1, keepdims=True)
    scale = np.minimum(np.float32(MAX) / amax, np.finfo(np.float32).max).astype(np.float32)
    codes = oracle((xs * scale).astype(np.float32))
    inv = (np.float32(1) / scale).astype(np.float32)
    want = (codes.astype(np.float32) * inv).astype(np.float32).reshape(8, 256)
    np.testing.assert_array_equal(np.asarray(fp4lab.dequantize(q)), want)


def test_e5m6_as_the_saved_attention_output():
    from fp4lab.qdot import qdot_general, saved_bytes
    from fp4lab.recipe import SavedX, get_recipe

    recipe = dataclasses.replace(get_recipe("bf16"), name="bf16_saved_e5m6",
                                 saved_x=SavedX("e5m6_block128"))
    x = jax.random.normal(jax.random.key(2), (32, 128)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(3), (128, 16)).astype(jnp.bfloat16)
    dn = (((1,), (0,)), ((), ()))
    dw = jax.grad(lambda b: qdot_general(x, b, dn, recipe).astype(jnp.float32).sum())(w)
    stored = fp4lab.dequantize(fp4lab.quantize(x.astype(jnp.float32), "e5m6_block128"))
    want = jax.lax.dot_general(stored.astype(jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16),
                               (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(want.astype(jnp.bfloat16)))
    assert saved_bytes(x, w, dn, recipe)["x"] == 32 * 128 * 2 + 32 * 4  # FP16 codes + scales


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp32"])
def test_the_storage_dtype_formats_still_convert(fmt):
    from fp4lab.formats import ELEMENTS

    assert ELEMENTS[fmt].is_storage_dtype and not E5M6.is_storage_dtype
