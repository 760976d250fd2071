"""E5M6 (DeepSeek-V3's 12-bit attention-output format): round to nearest even on its grid
against a float64 NumPy oracle (ties, subnormals, saturation, specials), the 1x128 block
formats (abs-max and power-of-two scales) against their arithmetic, and their use as
saved-activation storage."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import adversarial as adv
import fp4lab
from fp4lab.numerics import rounding as rnd
from fp4lab.numerics.formats import E5M6

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
    from fp4lab.gemm.qdot import qdot_general, saved_bytes
    from fp4lab.gemm.recipe import SavedX, get_recipe

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
    from fp4lab.numerics.formats import ELEMENTS

    assert ELEMENTS[fmt].is_storage_dtype and not E5M6.is_storage_dtype


# ------------------------------------------------------------ e5m6_block128_pow2 (DeepSeek-V3)

F32 = np.float32


def pow2_exponent(amax: float) -> int:
    """The least integer e with amax <= MAX * 2**e (float64, exact: MAX * 2**e is a float64),
    clamped to E8M0's [-127, 127]; amax 0 gives -127."""
    if amax == 0:
        return -127
    e = int(np.floor(np.log2(amax / MAX)))
    while amax > MAX * 2.0 ** e:
        e += 1
    while amax <= MAX * 2.0 ** (e - 1):
        e -= 1
    return int(np.clip(e, -127, 127))


def pow2_oracle(x, ftz: bool):
    """Codes, E8M0 bytes and float32 values of ``e5m6_block128_pow2`` for a float32
    [rows, 128k] array, in float64: blocks of 128 along the last axis scaled by 2**-e, rounded with
    :func:`oracle`; a block holding NaN or Inf: byte 255, codes 0, values NaN. ``ftz``: XLA:CPU
    flushes float32 subnormals (inputs and results) to zero."""
    x = np.asarray(x, np.float64)
    tiny = np.finfo(F32).tiny
    if ftz:
        x = np.where(np.abs(x) < tiny, np.copysign(0.0, x), x)
    rows, n = x.shape
    xb = x.reshape(rows, n // 128, 128)
    finite = np.isfinite(xb).all(-1)
    amax = np.where(finite, np.abs(np.where(np.isfinite(xb), xb, 0)).max(-1), 0)
    e = np.vectorize(pow2_exponent)(amax).astype(np.int64)
    codes = oracle(xb * 2.0 ** -e[..., None])
    codes = np.where(finite[..., None], codes, 0.0)
    values = codes * 2.0 ** e[..., None]
    if ftz:
        values = np.where(np.abs(values) < tiny, np.copysign(0.0, values), values)
    values = np.where(finite[..., None], values, np.nan)
    with np.errstate(over="ignore"):  # within half an E5M6 ulp of 2**128: float32's inf
        values = values.astype(F32).astype(np.float64)
    byte = np.where(finite, e + 127, 255).astype(np.uint8)
    return codes.reshape(rows, n), byte, values.reshape(rows, n)


def _e5m6_targets():
    """E5M6 grid values and the midpoints between them (ties), normal and subnormal, both
    signs: the boundaries of the element rounding."""
    grid = np.unique(np.concatenate([(1 + np.arange(64) / 64) * 2.0 ** k for k in range(-14, 16)]
                                    + [np.arange(64) * 2.0 ** -20]))
    grid = grid[grid <= MAX]
    mids = (grid[:-1] + grid[1:]) / 2
    return np.concatenate([grid, mids, -grid, -mids])


def _pow2_cases():
    """Rows of 128 (one block each): block amaxes on and one or two float32 ulps beside
    MAX * 2**k (where the exponent steps) and 2**k; elements on and beside every E5M6 grid
    value and tie after the block's scale (tests/adversarial.py's preimages); E8M0's clamped
    bottom (the two-factor decode); zeros, subnormals, MAX, FLT_MAX, Inf, NaN."""
    rng = np.random.default_rng(7)
    ks = [-140, -127, -126, -30, -3, -1, 0, 1, 5, 17, 100, 112]
    amaxes = adv.neighbours(np.concatenate([[MAX * 2.0 ** k for k in ks],
                                            [2.0 ** k for k in ks]]).astype(F32))
    amaxes = amaxes[np.isfinite(amaxes) & (amaxes > 0)]
    targets = _e5m6_targets()
    blocks = []
    for a in amaxes:
        pool = adv.preimages(targets, F32(2.0 ** -pow2_exponent(float(a))), k=1)
        pool = pool[np.abs(pool) <= a]
        blocks.append(adv.rows(a, pool, 128, 2, rng) if pool.size else np.full((1, 128), a, F32))
    sub = np.finfo(F32).smallest_subnormal
    special = [np.zeros(128), np.full(128, -0.0), np.full(128, sub * 3), np.full(128, MAX),
               np.r_[MAX, -MAX, np.zeros(126)], np.r_[np.finfo(F32).max, np.ones(127)],
               np.r_[np.inf, np.ones(127)], np.r_[-np.inf, np.ones(127)],
               np.r_[np.nan, np.ones(127)], np.r_[np.finfo(F32).tiny, sub, -sub, np.zeros(125)]]
    return np.concatenate(blocks + [np.asarray(special, F32)]).astype(F32)


def test_pow2_block_format_equals_the_oracle_bit_for_bit():
    """The user's input: DeepSeek-V3's E5M6 with power-of-two scales, on ties, scale
    boundaries, zeros, subnormals, the max, Inf and NaN."""
    x = _pow2_cases()
    q = jax.jit(lambda v: fp4lab.quantize(v, "e5m6_block128_pow2", axis=-1))(x)
    got = np.asarray(jax.jit(fp4lab.dequantize)(q), np.float64)
    codes, byte, values = pow2_oracle(x, ftz=jax.default_backend() == "cpu")
    assert q.data.dtype == jnp.float16 and q.scale.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(q.scale).ravel(), byte.ravel())
    np.testing.assert_array_equal(np.asarray(q.data, np.float64), codes)
    np.testing.assert_array_equal(np.signbit(np.asarray(q.data)), np.signbit(codes))
    np.testing.assert_array_equal(got, values)  # NaN where the oracle has NaN
    np.testing.assert_array_equal(np.signbit(got), np.signbit(values))
    finite = np.isfinite(x).all(-1)
    assert np.all(np.abs(codes[finite]) <= MAX)
    # nothing saturates: no element exceeds MAX after its block's scale
    scaled = np.asarray(x[finite], np.float64) * 2.0 ** -(byte[finite] - 127.0)
    assert np.all(np.abs(scaled) <= MAX)


def test_pow2_scales_step_exactly_where_the_max_would_overflow():
    """amax = MAX * 2**k keeps e = k (the max code, exact); one float32 ulp above needs
    e = k + 1, where the MX RCEIL rule (a product with fl(1/max)) may stay at k and clip."""
    for k in (-3, 0, 7):
        at = F32(MAX * 2.0 ** k)
        above = np.nextafter(at, F32(np.inf))
        x = np.zeros((2, 128), F32)
        x[0, 0], x[1, 0] = at, above
        q = fp4lab.quantize(x, "e5m6_block128_pow2", axis=-1)
        np.testing.assert_array_equal(np.asarray(q.scale).ravel(), [k + 127, k + 128])
        assert float(q.data[0, 0]) == MAX


def test_pow2_is_saved_attention_storage_of_the_same_size():
    from fp4lab.gemm.qdot import saved_bytes

    x = jax.ShapeDtypeStruct((32, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((128, 16), jnp.bfloat16)
    dn = (((1,), (0,)), ((), ()))
    assert saved_bytes(x, w, dn, "bf16_saved_e5m6_pow2")["x"] == 32 * 128 * 2 + 32  # + E8M0
    assert fp4lab.FORMATS["e5m6_block128_pow2"].bits_per_element() == 12 + 8 / 128
