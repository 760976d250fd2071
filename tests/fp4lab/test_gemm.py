"""The quantized GEMM's arithmetic (docs/numerics.md, "The GEMM"): inner values multiplied (as
BF16 where they are BF16 numbers), float32 accumulation, the per-tensor factors after the
product; against the NumPy oracle's codes and scales in float64, and against the rewrites."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from oracles import numpy_ref as ref

import fp4lab
from fp4lab.gemm.qdot import qdot_general
from fp4lab.gemm.recipe import OperandQuant
from fp4lab.numerics.formats import get_format
from fp4lab.numerics.gemm_operands import gemm_operand

DN = (((1,), (0,)), ((), ()))
HI = jax.lax.Precision.HIGHEST
F32 = np.float32


def recipe(fmt, w_tile=None):
    """Every operand in ``fmt``, round to nearest (the forward is what these tests read)."""
    op = OperandQuant(format=fmt)
    return fp4lab.Recipe(name=f"test_{fmt}", fprop_x=op, dgrad_dy=op, dgrad_w=op, wgrad_x=op,
                         wgrad_dy=op, fprop_w=OperandQuant(format=fmt, tile=w_tile))


def operands(m=64, k=256, n=48, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k)) * jnp.exp(jax.random.normal(kx, (m, 1)))  # row ranges
    return x, jax.random.normal(kw, (k, n)) * 0.05


def nvfp4_inner(t, block_shape):
    """``(q * s_b, amax)`` of ``t`` (M, K) blocked along K, from the NumPy oracle, float64."""
    codes, sb, amax = ref.nvfp4_quantize(np.asarray(t, F32), block_shape)
    s = np.kron(ref.e4m3_value(sb).astype(np.float64), np.ones(block_shape))
    return ref.e2m1_value(codes).astype(np.float64) * s, F32(amax)


def accumulation_bound(a, b, k):
    """The float32 summation's error bound ``(k + 2) 2^-24 sum |a_k b_k|``, plus one rounding."""
    return (k + 2) * 2.0**-24 * (np.abs(a) @ np.abs(b))


@pytest.mark.parametrize("tile", [None, (16, 16)])
def test_nvfp4_gemm_is_the_exact_product_scaled_by_tes_alpha(tile):
    """Y = fl(sum q_x s_x q_w s_w) * fl(fl(amax_x * amax_w) * fl(1 / (6 * 448)^2)): the float64
    product of the oracle's inner values times TE's float32 alpha, within the accumulation's
    bound, while the old rule (each value rounded as `q * fl(fl(s * amax) / 2688)`) is not the
    definition (it differs from the exact product by the per-value roundings)."""
    x, w = operands()
    y = np.asarray(qdot_general(x, w, DN, recipe("nvfp4", tile)), np.float64)
    ix, ax = nvfp4_inner(x, (1, 16))
    iw, aw = nvfp4_inner(w.T, tile or (1, 16))
    alpha = (ax * aw) * (F32(1) / F32(6 * 448 * 6 * 448))  # TE's order, float32
    exact = (ix @ iw.T) * np.float64(alpha)
    bound = accumulation_bound(ix, iw.T, x.shape[1]) * np.float64(alpha) + 2.0**-24 * np.abs(exact)
    assert np.all(np.abs(y - exact) <= bound)
    # alpha is TE's: scaling by fl(ax / 2688) * fl(aw / 2688) instead moves outputs
    other = (ix @ iw.T) * (np.float64(ax * (F32(1) / F32(2688))) *
                           np.float64(aw * (F32(1) / F32(2688))))
    assert np.abs(other - exact).max() > 0


def test_row_scaled_x_gets_one_alpha_per_row():
    x, w = operands(k=64)
    r = recipe("nvfp4")
    r = fp4lab.Recipe(name="row", fprop_x=OperandQuant(format="nvfp4_row"),
                      fprop_w=r.fprop_w, dgrad_dy=r.dgrad_dy, dgrad_w=r.dgrad_w,
                      wgrad_x=OperandQuant(format="nvfp4_row"), wgrad_dy=r.wgrad_dy)
    y = np.asarray(qdot_general(x, w, DN, r), np.float64)
    iw, aw = nvfp4_inner(w.T, (1, 16))
    for i in range(0, x.shape[0], 7):
        ix, ax = nvfp4_inner(x[i:i + 1], (1, 16))
        alpha = np.float64((ax * aw) * (F32(1) / F32(6 * 448 * 6 * 448)))
        exact = (ix @ iw.T)[0] * alpha
        bound = accumulation_bound(ix, iw.T, 64)[0] * alpha + 2.0**-24 * np.abs(exact)
        assert np.all(np.abs(y[i] - exact) <= bound), i


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8", "mxfp8", "mxfp4", "fp8_block128"])
def test_other_formats_are_the_exact_product_of_their_dequantized_values(fmt):
    """Per-tensor and per-channel scales after the product, MX values in BF16, FP8 1x128 over
    two blocks as float32 values: all the exact product of the dequantized operands."""
    x, w = operands()
    y = np.asarray(qdot_general(x, w, DN, recipe(fmt)), np.float64)
    dx = np.asarray(fp4lab.fake_quant(x, fmt, axis=1), np.float64)
    dw = np.asarray(fp4lab.fake_quant(w, fmt, axis=0), np.float64)
    exact = dx @ dw
    # per-tensor/per-channel: the scale's rounding enters once more than the product's
    bound = accumulation_bound(dx, dw, x.shape[1]) + 3 * 2.0**-24 * np.abs(exact)
    assert np.all(np.abs(y - exact) <= bound)


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def test_mx_multiplies_bf16_and_tiny_blocks_count_as_zero_in_either_dtype():
    """MXFP8 operands are multiplied as BF16 (the BF16 dot's own order of accumulation, told
    apart from the float32 one on this data). A block at 2^-120 times the data holds values
    below 2^-126 that BF16 rounds: XLA:CPU flushes them in a float32 dot as well, so the GEMM is
    the float64 product with every value below 2^-126 taken as zero."""
    x, w = operands()
    dot = {dt: jax.jit(lambda a, b, dt=dt: jax.lax.dot(
        a.astype(dt), b.astype(dt), precision=HI, preferred_element_type=jnp.float32))
        for dt in (jnp.bfloat16, jnp.float32)}
    xq, wq = (fp4lab.fake_quant(t, "mxfp8", axis=a) for t, a in ((x, 1), (w, 0)))
    y = qdot_general(x, w, DN, recipe("mxfp8"))
    b, f = bits(dot[jnp.bfloat16](xq, wq)), bits(dot[jnp.float32](xq, wq))
    assert not np.array_equal(b, f)  # the two orders differ here, so the test tells them apart
    np.testing.assert_array_equal(bits(y), b)

    w = w * 2.0**100  # products of the tiny block stay normal
    tiny = x.at[3, :32].set(x[3, :32] * 2.0**-120)  # block exponent about -120 - 8
    y = np.asarray(qdot_general(tiny, w, DN, recipe("mxfp8")), np.float64)
    xq, wq = (np.asarray(fp4lab.fake_quant(t, "mxfp8", axis=a), np.float64)
              for t, a in ((tiny, 1), (w, 0)))
    below = np.abs(xq) < 2.0**-126
    assert below[3, :32].any() and (~below[3, :32] & (xq[3, :32] != 0)).any()
    exact = np.where(below, 0, xq) @ wq
    assert np.all(np.abs(y - exact) <= accumulation_bound(xq, wq, x.shape[1]))


def element_grid(elem) -> np.ndarray:
    """Every non-negative value of a float element format, from its fields."""
    mb, emin = elem.mantissa_bits, elem.emin
    sub = np.arange(2**mb) * 2.0 ** (emin - mb)
    normal = [(2**mb + np.arange(2**mb)) * 2.0 ** (e - mb) for e in range(emin, elem.emax + 1)]
    v = np.concatenate([sub, *normal])
    return v[v <= elem.max]


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp8_e5m2", "mxfp4", "e5m6_block128_pow2"])
def test_mx_values_are_bf16_numbers_at_or_above_2_to_the_minus_126(fmt):
    """For every block exponent, every element value times ``2^e`` that float32 holds and that
    lies at or above 2^-126 is a BF16 number (ml_dtypes); below, BF16's subnormals hold them
    down to the exponent docs/numerics.md names (E4M3 -124, E5M2 -117, E2M1 always)."""
    f = get_format(fmt)
    grid = element_grid(f.element)
    assert grid.max() == f.element.max and grid[1] == f.element.min_subnormal
    assert f.scaling.bf16_values(f.element)
    lowest = {"e4m3": -124, "e5m2": -117, "e2m1": -127, "e5m6": -113}[f.element.name]
    with np.errstate(over="ignore"):
        for e in range(-127, 128):
            v = (grid * 2.0**e).astype(np.float32)
            same = v.astype(ml_dtypes.bfloat16).astype(np.float32) == v
            assert same[v >= 2.0**-126].all(), (fmt, e)
            assert same.all() == (e >= lowest), (fmt, e)


def test_nvfp4_inner_values_are_all_bf16_numbers():
    e2m1 = np.unique(np.abs(ref.e2m1_value(np.arange(16, dtype=np.uint8)).astype(np.float64)))
    e4m3 = ref.e4m3_value(np.arange(256, dtype=np.uint8)).astype(np.float64)
    v = np.outer(e2m1, e4m3[np.isfinite(e4m3)]).ravel()
    assert np.array_equal(v.astype(ml_dtypes.bfloat16).astype(np.float64), v)
    assert get_format("nvfp4").scaling.bf16_values(get_format("nvfp4").element) is True


def test_the_scaled_output_survives_a_callers_constants_and_additions():
    """Under a caller's jit that holds W as a constant (its amax foldable into alpha's
    constant divisor), multiplies the output by a constant (foldable into alpha) or adds to it
    (contractible into an FMA with `Y * alpha`), the GEMM's bits are its own call's."""
    x, w = operands(k=64)
    b = jax.random.normal(jax.random.key(3), (48,))
    r = recipe("nvfp4")
    y = np.asarray(jax.jit(lambda x, w: qdot_general(x, w, DN, r))(x, w))
    for caller, expected in [(lambda y: y, y), (lambda y: y * 3.0, y * F32(3)),
                             (lambda y: y + b, y + np.asarray(b))]:
        got = jax.jit(lambda x: caller(qdot_general(x, w, DN, r)))(x)  # w: a constant
        np.testing.assert_array_equal(bits(got), bits(expected))
        got = jax.jit(lambda w: caller(qdot_general(jnp.asarray(x), w, DN, r)))(w)
        np.testing.assert_array_equal(bits(got), bits(expected))


def test_special_values_in_an_nvfp4_gemm():
    x, w = operands(k=64)
    r = recipe("nvfp4")
    y = np.asarray(qdot_general(x.at[5, 7].set(jnp.nan), w, DN, r))
    assert np.isnan(y).all()  # NaN amax: alpha NaN, as every value was before
    y = np.asarray(qdot_general(jnp.zeros_like(x), w, DN, r))
    assert (bits(y) == 0).all()  # amax 0: outer factor 1, +0 everywhere
    y = np.asarray(qdot_general(x, w.at[0, 0].set(jnp.inf), DN, r))
    assert not np.isfinite(y).any()  # alpha = inf: inf, or NaN where the sum is 0


def test_an_amax_of_zero_leaves_the_block_scales_alone():
    """Delayed scaling's first step: a traced amax of 0 decodes ``q * s_b``, no outer factor."""
    x, _ = operands(k=64)
    op = jax.jit(lambda x, a: gemm_operand(x, "nvfp4", global_amax=a))(x, jnp.float32(0))
    q = jax.jit(lambda x, a: fp4lab.dequantize(fp4lab.quantize(x, "nvfp4", global_amax=a)))(
        x, jnp.float32(0))
    assert float(op.outer.factor) == 1 and float(op.outer.divisor) == 1
    np.testing.assert_array_equal(np.asarray(op.values, np.float32), np.asarray(q))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's flush of subnormals")
def test_an_alpha_below_float32s_normal_range_is_flushed_on_the_cpu():
    """docs/numerics.md: ``amax_x * amax_w`` under ~8.5e-32 makes TE's alpha subnormal, which
    XLA:CPU flushes (the outputs are 0); a hundred times larger, the product is exact to the
    accumulation's bound."""
    x, w = operands(k=64)
    for s, flushed in ((1e-15, False), (1e-16, True)):
        y = np.asarray(qdot_general(x * s, w * s, DN, recipe("nvfp4")), np.float64)
        ix, ax = nvfp4_inner(x * s, (1, 16))
        iw, aw = nvfp4_inner((w * s).T, (1, 16))
        alpha = np.float64((ax * aw) * (F32(1) / F32(6 * 448 * 6 * 448)))
        assert (alpha < 2.0**-126) == flushed
        if flushed:
            assert (y == 0).all()
        else:
            exact = (ix @ iw.T) * alpha
            assert np.all(np.abs(y - exact) <= accumulation_bound(ix, iw.T, 64) * alpha
                          + 2.0**-24 * np.abs(exact))
