"""fp4lab.quantize against the independent NumPy oracle (tests/oracles/numpy_ref.py), bit for bit."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from oracles import numpy_ref as ref
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fp4lab
from fp4lab.numerics import rounding
from fp4lab.numerics.formats import E4M3
from fp4lab.numerics.quantize import straight_through
from fp4lab.gemm.recipe import OPERANDS
from fp4lab.numerics.scaling import FourOverSixScale

F32 = np.float32
NAN, INF = F32(np.nan), F32(np.inf)


# ------------------------------------------------------------------ data


def bf16_values(x):
    """float32 array holding exactly the BF16 rounding of x."""
    return np.asarray(x, F32).astype(ml_dtypes.bfloat16).astype(F32)


def wide_range(seed, shape, lo=-40, hi=40, dtype="bf16"):
    """Random signs, exponents uniform in [lo, hi), BF16 or FP32 mantissas."""
    rng = np.random.default_rng(seed)
    mbits = 7 if dtype == "bf16" else 23
    mant = rng.integers(0, 2**mbits, shape) / 2**mbits
    x = rng.choice([-1.0, 1.0], shape) * (1 + mant) * np.exp2(rng.integers(lo, hi, shape))
    return x.astype(F32)


def heavy_tailed(seed, shape, dtype="bf16"):
    rng = np.random.default_rng(seed)
    x = rng.standard_t(1.5, shape).astype(F32) * F32(0.02)
    return bf16_values(x) if dtype == "bf16" else x


def as_input(x, dtype):
    return jnp.asarray(x.astype(ml_dtypes.bfloat16) if dtype == "bf16" else x)


CASES = [
    ("bf16-wide", lambda: wide_range(0, (24, 64))),
    ("bf16-narrow", lambda: wide_range(1, (24, 64), -3, 3)),
    ("bf16-heavy", lambda: heavy_tailed(2, (24, 64))),
    ("fp32-wide", lambda: wide_range(3, (24, 64), dtype="fp32")),
    ("fp32-heavy", lambda: heavy_tailed(4, (24, 64), dtype="fp32")),
]


@functools.cache
def case(name):
    return dict(CASES)[name]()


def input_dtype(name):
    return "bf16" if name.startswith("bf16") else "fp32"


def codes_of(q):
    """Unpacked element codes of a QArray as a uint8 NumPy array (padded layout)."""
    data = q.data
    if q.format.element.packed:
        data = rounding.unpack_nibbles(data, q.axis)
    data = np.asarray(data)
    return data.view(np.uint8) if data.dtype.itemsize == 1 else data


def scale_bytes(q):
    """The stored scales' bit patterns (uint8 for E4M3/E8M0, uint32 for float32 scales)."""
    s = np.asarray(q.scale)
    return s.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[s.dtype.itemsize])


def same_bits(a, b):
    """Bitwise equality of float arrays, treating all NaNs as equal."""
    a, b = np.asarray(a, F32), np.asarray(b, F32)
    assert a.shape == b.shape, (a.shape, b.shape)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    np.testing.assert_array_equal(nan_a, nan_b)
    ai, bi = a.view(np.uint32), b.view(np.uint32)
    bad = (ai != bi) & ~nan_a
    assert not bad.any(), f"{bad.sum()} mismatches, first at {np.argwhere(bad)[:3].tolist()}: " \
        f"{a[bad][:3]} vs {b[bad][:3]}"


def with_amax(f, amax, **kw):
    """``f(x, **kw, global_amax=amax)`` as a function of ``x``, under jit: a given amax below
    ``max|x|`` (delayed scaling's lagging amax, which saturates) is refused eagerly and taken
    as given under jit; the oracle checks what it does."""
    return lambda x: jax.jit(lambda x, a: f(x, **kw, global_amax=a))(x, amax)


def check_fake_quant_matches(x, fmt, global_amax=None, **kw):
    """fake_quant == dequantize(quantize(x)) in x's dtype, bit for bit."""
    y1 = with_amax(fp4lab.fake_quant, global_amax, fmt=fmt, **kw)(x)
    y2 = fp4lab.dequantize(with_amax(fp4lab.quantize, global_amax, fmt=fmt, **kw)(x), x.dtype)
    same_bits(np.asarray(y1, F32), np.asarray(y2, F32))


# ------------------------------------------------------------------ NVFP4


def check_nvfp4(x, *, tile=None, ftz=False, dtype="fp32", global_amax=None):
    xin = as_input(x, dtype)
    q = with_amax(fp4lab.quantize, global_amax, fmt="nvfp4", tile=tile)(xin)
    block = tile or (1, 16)
    codes, sb, amax = ref.nvfp4_quantize(x, block_shape=block, amax=global_amax, ftz=ftz)
    np.testing.assert_array_equal(codes_of(q), codes)
    np.testing.assert_array_equal(scale_bytes(q), sb)
    same_bits(q.global_scale, amax)
    same_bits(fp4lab.dequantize(q), ref.nvfp4_dequantize(codes, sb, amax, block, ftz=ftz))
    check_fake_quant_matches(xin, "nvfp4", tile=tile, global_amax=global_amax)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
@pytest.mark.parametrize("tile", [None, (16, 16)])
def test_nvfp4_random(name, tile):
    x = case(name)
    check_nvfp4(x[:16] if tile else x, tile=tile, dtype=input_dtype(name))


def test_nvfp4_te_discriminating_vectors():
    bf = lambda bits: np.array([bits << 16], np.uint32).view(F32)[0]  # noqa: E731
    x = np.zeros((3, 16), F32)
    x[0, 0], x[1, 0] = bf(0x402F), bf(0x4044)  # tensor amax 3.0625, block amax 2.734375
    q = fp4lab.quantize(jnp.asarray(x, jnp.bfloat16), "nvfp4")
    assert scale_bytes(q)[0, 0] == 0x7D  # TE stores 416 (a pure-JAX order stores 384)
    check_nvfp4(x, dtype="bf16")

    x = np.zeros((1, 16), F32)
    x[0, :2] = bf(0x4027), bf(0x3EA7)  # tensor amax 2.609375, block scale 448
    q = fp4lab.quantize(jnp.asarray(x, jnp.bfloat16), "nvfp4")
    assert scale_bytes(q)[0, 0] == 0x7E and codes_of(q)[0, 1] == 1  # TE: 0.5 (jax.nn: 1.0)
    check_nvfp4(x, dtype="bf16")

    x = np.zeros((2, 16), F32)
    x[0, :2] = bf(0x3FA7), bf(0xBEC6)
    x[1, 0] = bf(0xC046)  # tensor amax 3.09375 (negative)
    q = fp4lab.quantize(jnp.asarray(x, jnp.bfloat16), "nvfp4")
    assert fp4lab.dequantize(q)[0, 1] < 0 and codes_of(q)[0, 1] == 0xC  # TE: -2.0
    check_nvfp4(x, dtype="bf16")


def test_nvfp4_zero_blocks_and_all_zero_tensor():
    x = np.zeros((2, 32), F32)
    x[0, :16] = np.linspace(-3, 3, 16, dtype=F32)
    check_nvfp4(x)
    q = fp4lab.quantize(jnp.asarray(x), "nvfp4")
    assert scale_bytes(q)[0, 1] == 0 and not codes_of(q)[0, 16:].any()
    z = np.zeros((4, 32), F32)
    check_nvfp4(z)
    q = fp4lab.quantize(jnp.asarray(z), "nvfp4")
    assert not np.asarray(q.data).any() and not scale_bytes(q).any()
    assert not np.asarray(fp4lab.dequantize(q)).any()


def test_nvfp4_extremes_max_and_subnormal_scales():
    x = wide_range(5, (8, 32), -10, 10)
    x[0, 0] = np.finfo(F32).max  # the largest float32: S_enc is tiny but normal
    x[1, 0] = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    check_nvfp4(x)
    # Blocks far below the tensor amax get subnormal E4M3 scales (byte exponent field 0).
    y = wide_range(6, (8, 32), -30, -20)
    y[0, 0] = 1e4
    check_nvfp4(y)
    sb = scale_bytes(fp4lab.quantize(jnp.asarray(y), "nvfp4"))
    assert ((sb & 0x78) == 0).sum() > 4


def test_nvfp4_nan_and_inf():
    x = wide_range(7, (4, 32), -3, 3)
    xi = x.copy()
    xi[1, 3] = INF
    check_nvfp4(xi)
    xn = x.copy()
    xn[2, 5] = NAN
    check_nvfp4(xn)
    y = np.asarray(fp4lab.fake_quant(jnp.asarray(xn), "nvfp4"))
    assert np.isnan(y).all()  # a NaN poisons the tensor: it never vanishes silently


def test_nvfp4_global_amax_argument():
    x = wide_range(8, (4, 32), -3, 3)
    check_nvfp4(x, global_amax=F32(100.0))
    check_nvfp4(x, global_amax=F32(1.0))  # smaller than max|x|: saturates (under jit)


def test_a_given_amax_that_cannot_be_an_amax_is_refused():
    """The issue's inputs: a negative amax acted as its magnitude and one below max|x| clipped
    the tensor to it (relative error 0.999), silently. Eagerly both are refused; a NaN or
    infinite one too."""
    x = jnp.asarray(wide_range(8, (4, 32), -3, 3))
    amax = float(jnp.max(jnp.abs(x)))
    calls = (lambda a: fp4lab.quantize(x, "nvfp4", global_amax=a),
             lambda a: fp4lab.fake_quant(x, "nvfp4", global_amax=a),
             lambda a: fp4lab.fake_quant(x, "fp8_e4m3", global_amax=a),
             lambda a: fp4lab.quant_metrics(x, "nvfp4", global_amax=a))
    for call in calls:
        for bad in (-amax, F32(-2.0), float("nan"), float("inf"), -0.0 - 1e-30):
            with pytest.raises(ValueError, match=r"global_amax=.* must be a finite amax >= 0"):
                call(bad)
        for low in (amax / 2, F32(1e-3), 0.0):
            with pytest.raises(ValueError, match=r"global_amax=.* is below max\|x\|=.*under "
                                                 r"jax.jit"):
                call(low)
        with pytest.raises(ValueError, match=r"global_amax must be a scalar, got shape \(2,\)"):
            call(jnp.ones(2))
        call(amax)  # the tensor's own amax, and any larger one, are amaxes
        call(2 * amax)
    zeros = jnp.zeros((2, 16))
    fp4lab.quantize(zeros, "nvfp4", global_amax=0.0)  # all zero: amax 0 covers it


def test_nvfp4_flush_to_zero_regime():
    """Tensors whose amax is below ~1e-35 follow XLA:CPU's flushed arithmetic (documented)."""
    x = wide_range(9, (4, 32), -130, -120)  # includes float32 subnormals
    x[0, 0] = F32(1e-37)
    if jax.default_backend() == "cpu":
        check_nvfp4(x, ftz=True)
    else:
        check_nvfp4(x, ftz=False)


# ------------------------------------------------------------------ MX


MX = [("mxfp8", "e4m3", "rceil"), ("mxfp8_e5m2", "e5m2", "rceil"), ("mxfp4", "e2m1", "rceil"),
      ("mxfp8_floor", "e4m3", "floor"), ("mxfp8_e5m2_floor", "e5m2", "floor"),
      ("mxfp4_floor", "e2m1", "floor")]


def check_mx(x, fmt, elem, mode, dtype="fp32", ftz=False):
    xin = as_input(x, dtype)
    q = fp4lab.quantize(xin, fmt)
    codes, sb = ref.mx_quantize(x, elem, mode, ftz=ftz)
    np.testing.assert_array_equal(codes_of(q), codes)
    np.testing.assert_array_equal(scale_bytes(q), sb)
    same_bits(fp4lab.dequantize(q), ref.mx_dequantize(codes, sb, elem, ftz=ftz))
    check_fake_quant_matches(xin, fmt)


@pytest.mark.parametrize("fmt,elem,mode", MX)
@pytest.mark.parametrize("name", ["bf16-wide", "bf16-heavy", "fp32-wide"])
def test_mx_random(fmt, elem, mode, name):
    check_mx(case(name), fmt, elem, mode, input_dtype(name))


@pytest.mark.parametrize("fmt,elem,mode", MX)
def test_mx_special_blocks(fmt, elem, mode):
    x = wide_range(10, (6, 64), -5, 5)
    x[0, :32] = 0  # zero block
    x[1, 3] = NAN  # NaN block
    x[2, 40] = -INF  # Inf block
    x[3, :32] *= F32(2.0**-120)  # tiny block: exponent clamps at -127
    x[4, 33] = np.finfo(F32).max  # largest amax
    check_mx(x, fmt, elem, mode)
    q = fp4lab.quantize(jnp.asarray(x), fmt)
    assert scale_bytes(q)[1, 0] == 0xFF and scale_bytes(q)[2, 1] == 0xFF
    assert scale_bytes(q)[0, 0] == 0 and not codes_of(q)[0, :32].any()
    y = np.asarray(fp4lab.dequantize(q))
    assert np.isnan(y[1, :32]).all() and np.isnan(y[2, 32:]).all()


def test_mx_rceil_and_floor_differ():
    x = wide_range(11, (16, 64), -3, 3)
    a = scale_bytes(fp4lab.quantize(jnp.asarray(x), "mxfp8"))
    b = scale_bytes(fp4lab.quantize(jnp.asarray(x), "mxfp8_floor"))
    assert (a != b).mean() > 0.2


# ------------------------------------------------------------------ FP8, INT, GGML


@pytest.mark.parametrize("fmt,elem", [("fp8_e4m3", "e4m3"), ("fp8_e5m2", "e5m2")])
@pytest.mark.parametrize("name", ["bf16-wide", "bf16-heavy", "fp32-wide"])
def test_fp8_per_tensor(fmt, elem, name):
    x = case(name)
    xin = as_input(x, input_dtype(name))
    q = fp4lab.quantize(xin, fmt)
    codes, _, scale_inv = ref.fp8_tensor_quantize(x, elem)
    np.testing.assert_array_equal(codes_of(q), codes)
    same_bits(q.scale, scale_inv)
    same_bits(fp4lab.dequantize(q), ref.fp8_tensor_dequantize(codes, scale_inv, elem))
    check_fake_quant_matches(xin, fmt)
    # a given amax (e.g. from a history) replaces max|x|
    q = with_amax(fp4lab.quantize, F32(3.0), fmt=fmt)(xin)  # below max|x|: under jit
    codes, _, scale_inv = ref.fp8_tensor_quantize(x, elem, amax=F32(3.0))
    np.testing.assert_array_equal(codes_of(q), codes)


@pytest.mark.parametrize("fmt,elem", [("fp8_e4m3", "e4m3"), ("fp8_e5m2", "e5m2"),
                                      ("fp8_block128", "e4m3")])
def test_fp8_inf_and_nan_follow_te_current_scaling(fmt, elem):
    """TE's compute_scale_from_amax: an Inf or NaN amax gives scale 1; Inf saturates to the
    element max (satfinite), NaN stays NaN, every other value quantizes at scale 1."""
    x = wide_range(12, (4, 128), -3, 3)
    for v in (INF, -INF, NAN):
        xs = x.copy()
        xs[1, 1] = v
        q = fp4lab.quantize(jnp.asarray(xs), fmt)
        if fmt == "fp8_block128":
            codes, _, scale_inv = ref.fp8_block_quantize(xs, (1, 128), elem)
            deq = ref.fp8_block_dequantize(codes, scale_inv, (1, 128), elem)
            assert np.asarray(q.scale)[1, 0] == 1  # the block holding the special value
        else:
            codes, _, scale_inv = ref.fp8_tensor_quantize(xs, elem)
            deq = ref.fp8_tensor_dequantize(codes, scale_inv, elem)
            assert float(q.scale) == 1
        np.testing.assert_array_equal(codes_of(q), codes)
        y = np.asarray(fp4lab.dequantize(q))
        same_bits(y, deq)
        if np.isnan(v):
            assert np.isnan(y[1, 1]) and np.isnan(y).sum() == 1  # the NaN stays, alone
        else:
            assert y[1, 1] == np.sign(v) * fp4lab.numerics.formats.ELEMENTS[elem].max


def test_int_nan_poisons_its_channel_inf_saturates():
    x = wide_range(12, (3, 16), -3, 3)
    x[0, 2], x[1, 3] = NAN, INF
    y = np.asarray(fp4lab.fake_quant(jnp.asarray(x), "int8"))
    assert np.isnan(y[0]).all() and not np.isnan(y[1:]).any()  # no NaN code: the scale is NaN
    assert y[1, 3] == 127  # scale 1, saturated


def test_fp8_per_tensor_special_values():
    tiny = np.full((2, 4), F32(1e-30))  # max/amax overflows: the scale clamps to FLT_MAX
    tiny[0, 0] = 0
    q = fp4lab.quantize(jnp.asarray(tiny), "fp8_e4m3")
    assert not np.isnan(np.asarray(fp4lab.dequantize(q))).any()


@pytest.mark.parametrize("tile", [None, (128, 128)])
def test_fp8_block128(tile):
    x = wide_range(13, (256, 256), -8, 8)
    x[:128, :128] *= F32(1e-3)
    q = fp4lab.quantize(jnp.asarray(x), "fp8_block128", tile=tile)
    codes, _, scale_inv = ref.fp8_block_quantize(x, tile or (1, 128), "e4m3")
    np.testing.assert_array_equal(codes_of(q), codes)
    same_bits(q.scale, scale_inv)
    same_bits(fp4lab.dequantize(q), ref.fp8_block_dequantize(codes, scale_inv, tile or (1, 128)))


@pytest.mark.parametrize("fmt,bits", [("int8", 8), ("int4", 4)])
def test_int_per_channel(fmt, bits):
    x = wide_range(14, (8, 64), -6, 6)
    x[3] = 0
    q = fp4lab.quantize(jnp.asarray(x), fmt)
    qi, scale_inv = ref.int_quantize(x, bits)
    codes = codes_of(q)
    if bits == 4:
        codes = ((codes.astype(np.int16) ^ 8) - 8).astype(np.int8)  # nibble -> signed
    np.testing.assert_array_equal(codes.view(np.int8), qi)
    same_bits(q.scale, scale_inv)
    same_bits(fp4lab.dequantize(q), ref.int_dequantize(qi, scale_inv))
    check_fake_quant_matches(jnp.asarray(x), fmt)


@pytest.mark.parametrize("fmt", ["int4_q4_0", "int8_q8_0"])
def test_ggml(fmt):
    x = wide_range(15, (8, 64), -6, 6)
    x[0, :32] = 0
    x[1, 0], x[1, 5] = 3.0, -3.0  # tie on |max|: the first wins
    x[2, 7] = NAN
    quant, dequant = {"int4_q4_0": (ref.q4_0_quantize, ref.q4_0_dequantize),
                      "int8_q8_0": (ref.q8_0_quantize, ref.q8_0_dequantize)}[fmt]
    q = fp4lab.quantize(jnp.asarray(x), fmt)
    qi, d_bits = quant(x)
    codes = codes_of(q)
    if fmt == "int4_q4_0":
        codes = ((codes.astype(np.int16) ^ 8) - 8).astype(np.int8)
    np.testing.assert_array_equal(codes.view(np.int8), qi)
    np.testing.assert_array_equal(np.asarray(q.scale).view(np.uint16), d_bits)
    same_bits(fp4lab.dequantize(q), dequant(qi, d_bits))
    check_fake_quant_matches(jnp.asarray(x), fmt)


@pytest.mark.parametrize("fmt", ["int4_q4_0", "int8_q8_0"])
def test_ggml_formats_in_2d_tiles(fmt):
    """``tile=(32, 32)``: one scale per tile (Q4_0: the first largest value in row-major
    order), against the oracle's tiled variant; padding included."""
    x = wide_range(22, (64, 96), -6, 6)
    x[0, 5], x[7, 3] = 5e3, -5e3  # a tie on |max| in the first tile: row-major first wins
    quant, dequant = {"int4_q4_0": (ref.q4_0_quantize, ref.q4_0_dequantize),
                      "int8_q8_0": (ref.q8_0_quantize, ref.q8_0_dequantize)}[fmt]
    q = fp4lab.quantize(jnp.asarray(x), fmt, tile=(32, 32))
    qi, d_bits = quant(x, block_shape=(32, 32))
    codes = codes_of(q)
    if fmt == "int4_q4_0":
        codes = ((codes.astype(np.int16) ^ 8) - 8).astype(np.int8)
        assert float(q.scale[0, 0]) == np.float16(5e3 / -8)
    np.testing.assert_array_equal(codes.view(np.int8), qi)
    np.testing.assert_array_equal(np.asarray(q.scale).view(np.uint16), d_bits)
    same_bits(fp4lab.dequantize(q), dequant(qi, d_bits, block_shape=(32, 32)))
    check_fake_quant_matches(jnp.asarray(x), fmt, tile=(32, 32))
    y = fp4lab.fake_quant(jnp.asarray(x[:50, :70]), fmt, tile=(32, 32))  # padded tiles
    assert y.shape == (50, 70) and np.isfinite(np.asarray(y)).all()


@pytest.mark.parametrize("shape", [(0, 64), (4, 0), (0,)])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "mxfp4", "fp8_e4m3", "fp8_block128", "int8",
                                 "int4", "int4_q4_0", "int8_q8_0", "bf16"])
def test_empty_arrays_give_empty_results(fmt, shape):
    x = jnp.zeros(shape, jnp.bfloat16)
    q = fp4lab.quantize(x, fmt)
    assert q.shape == shape and fp4lab.dequantize(q).shape == shape
    assert fp4lab.fake_quant(x, fmt).shape == shape
    m = fp4lab.quant_metrics(x, fmt)
    assert float(m["underflow"]) == float(m["saturation"]) == 0.0


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32"])
def test_passthrough(fmt):
    x = jnp.asarray(wide_range(16, (4, 8), -20, 20, dtype="fp32"))
    q = fp4lab.quantize(x, fmt)
    assert q.scale is None and q.data.dtype == jnp.dtype(fmt.replace("fp", "float")
                                                          .replace("bf16", "bfloat16"))
    with np.errstate(over="ignore"):  # fp16 overflows to inf, as the cast should
        same_bits(fp4lab.dequantize(q), np.asarray(x).astype(q.data.dtype).astype(F32))


# ------------------------------------------------------------------ elements, exhaustively


def _probe_values(elem):
    """Every grid value, every midpoint (tie), their float32 neighbours, specials."""
    grid = np.array(fp4lab.numerics.formats.ELEMENTS[elem].grid(), np.float64)
    mids = (grid[:-1] + grid[1:]) / 2
    pts = np.concatenate([grid, mids, [grid[-1] * 1.01, grid[-1] * 4, 1e30]]).astype(F32)
    pts = np.concatenate([pts, np.nextafter(pts, F32(np.inf)), np.nextafter(pts, F32(0))])
    pts = np.concatenate([pts, -pts, [0.0, -0.0, np.inf, -np.inf]]).astype(F32)
    return pts


@pytest.mark.parametrize("elem", ["e2m1", "e4m3", "e5m2"])
def test_every_code_and_every_tie(elem):
    fmt = fp4lab.numerics.formats.ELEMENTS[elem]
    v = _probe_values(elem)
    q = rounding.round_nearest(jnp.asarray(v), fmt)
    codes = np.asarray(rounding.encode(q, fmt))
    codes = codes.view(np.uint8) if codes.dtype.itemsize == 1 else codes
    np.testing.assert_array_equal(codes, ref.elem_encode(v, elem))
    same_bits(q, ref.elem_decode(ref.elem_encode(v, elem), elem))
    # decode is the inverse for every code
    all_codes = np.arange(16 if fmt.packed else 256, dtype=np.uint8)
    stored = all_codes if fmt.packed else all_codes.view(fmt.storage)
    same_bits(rounding.decode(jnp.asarray(stored), fmt), ref.elem_decode(all_codes, elem))


def test_e2m1_ties_from_numerics():
    v = jnp.asarray([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 7.0, -0.1], F32)
    got = np.asarray(rounding.round_nearest(v, fp4lab.numerics.formats.ELEMENTS["e2m1"]))
    np.testing.assert_array_equal(got, [0, 1, 1, 2, 2, 4, 4, 6, 6, -0.0])
    assert np.signbit(got[-1])


# ------------------------------------------------------------------ stochastic rounding


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8", "int4"])
def test_stochastic_rounding_is_unbiased(fmt):
    """The mean of n draws is within 6 standard errors of the input, for every element."""
    x = jnp.asarray(wide_range(17, (2, 32), -2, 2))
    n = 2000
    keys = jax.random.split(jax.random.key(0), n)
    draws = jax.vmap(lambda k: fp4lab.fake_quant(x, fmt, rounding="stochastic", key=k,
                                                 global_amax=F32(4.0) if fmt == "nvfp4"
                                                 else None))(keys)
    draws = np.asarray(draws, np.float64)
    mean, sd = draws.mean(0), draws.std(0)
    # For a fixed scale E[SR(v)] = v, so the mean converges to x up to the rounding of the
    # scale product (a few ulps) and sd/sqrt(n); elements on the grid have sd = 0. Block
    # maxima are left out: a block scale that rounds down can push |v| past the element max,
    # where the value saturates (unbiasedness holds for |v| <= max, docs/numerics.md).
    xa = np.abs(np.asarray(x, np.float64))
    inside = xa < 0.9 * xa.reshape(2, 2, 16).max(-1, keepdims=True).repeat(16, -1).reshape(2, 32)
    err = np.abs(mean - np.asarray(x, np.float64))
    ok = err <= 6 * sd / np.sqrt(n) + 1e-6 * xa
    assert ok[inside].all(), err[inside & ~ok]
    assert (sd > 0).mean() > 0.5  # most elements really are rounded randomly


def test_stochastic_rounding_matches_neighbour_probabilities():
    v = np.array([0.3, 1.1, 2.6, 4.9, 5.999], F32)
    lo, hi, p = ref.stochastic_round_grid_probs(v, "e2m1")
    n = 20000
    u = jax.random.uniform(jax.random.key(1), (n, v.size))
    r = np.asarray(rounding.round_stochastic(jnp.asarray(v)[None],
                                             fp4lab.numerics.formats.ELEMENTS["e2m1"], u))
    assert set(np.unique(r)) <= set(np.concatenate([lo, hi]).tolist())
    frac_up = (r == hi[None]).mean(0)
    assert np.all(np.abs(frac_up - p) < 5 * np.sqrt(p * (1 - p) / n) + 1e-9)


def test_stochastic_rounding_deterministic_per_key():
    x = jnp.asarray(wide_range(18, (4, 64), -3, 3))
    a = fp4lab.quantize(x, "nvfp4", rounding="stochastic", key=jax.random.key(3))
    b = fp4lab.quantize(x, "nvfp4", rounding="stochastic", key=jax.random.key(3))
    c = fp4lab.quantize(x, "nvfp4", rounding="stochastic", key=jax.random.key(4))
    np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    assert (np.asarray(a.data) != np.asarray(c.data)).any()
    check_fake_quant_matches(x, "nvfp4", rounding="stochastic", key=jax.random.key(3))


# ------------------------------------------------------------------ geometry


@pytest.mark.parametrize("fmt,tile", [("nvfp4", (16, 16)), ("fp8_block128", (128, 128)),
                                      ("mxfp8", (32, 32))])
def test_tile_transpose_consistency(fmt, tile):
    w = jnp.asarray(wide_range(19, (2 * tile[0], 3 * tile[1] - 5), -4, 4))
    a = fp4lab.quantize(w, fmt, tile=tile)
    b = fp4lab.quantize(w.T, fmt, tile=tile[::-1])
    np.testing.assert_array_equal(scale_bytes(a).T, scale_bytes(b))
    same_bits(fp4lab.dequantize(a).T, fp4lab.dequantize(b))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8", "int4", "int4_q4_0", "fp8_e4m3"])
@pytest.mark.parametrize("shape,axis", [((5, 37), -1), ((37, 3), 0), ((2, 21, 3), 1), ((7,), 0)])
def test_padding_round_trips_along_any_axis(fmt, shape, axis):
    x = wide_range(20, shape, -3, 3)
    q = fp4lab.quantize(jnp.asarray(x), fmt, axis=axis)
    y = np.asarray(fp4lab.dequantize(q))
    assert y.shape == shape and q.shape == shape
    # equals quantizing the zero-padded array along the last axis, then slicing back
    f = fp4lab.get_format(fmt)
    moved = np.moveaxis(x, axis, -1)
    if f.granularity == "block":
        pad = -moved.shape[-1] % f.block
        moved = np.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, pad)])
    z = np.asarray(fp4lab.fake_quant(jnp.asarray(moved), fmt))[..., : shape[axis]]
    same_bits(y, np.moveaxis(z, -1, axis))


def test_vmap_jit_grad():
    x = jnp.asarray(wide_range(21, (3, 4, 32), -3, 3))
    per_example = jnp.stack([fp4lab.fake_quant(x[i], "nvfp4") for i in range(3)])
    same_bits(jax.vmap(lambda t: fp4lab.fake_quant(t, "nvfp4"))(x), per_example)
    same_bits(jax.jit(lambda t: fp4lab.fake_quant(t, "nvfp4"))(x), fp4lab.fake_quant(x, "nvfp4"))
    qs = jax.vmap(lambda t: fp4lab.quantize(t, "mxfp4"))(x)
    assert qs.data.shape == (3, 4, 16) and qs.scale.shape == (3, 4, 1)
    # straight-through gradient, optionally masked where the input saturated
    g = jax.grad(lambda t: fp4lab.fake_quant(t, "mxfp8").sum())(x)
    np.testing.assert_array_equal(np.asarray(g), 1.0)
    big = x.at[0, 0, 0].set(1e3)
    g = jax.grad(lambda t: fp4lab.fake_quant(t, "fp8_e4m3", global_amax=F32(10.0),
                                             mask_saturated=True).sum())(big)
    assert float(g[0, 0, 0]) == 0.0 and float(g.sum()) == big.size - (np.abs(big) > 10).sum()


# the inputs a straight-through form must survive: infinities, NaN, the largest float32,
# saturating values, float32 and E4M3 subnormals, signed zeros
SPECIAL = F32([np.inf, -np.inf, np.nan, np.finfo(F32).max, -np.finfo(F32).max, 1e30, 1e10,
               464.0, -448.0, 1e-40, -1e-40, 2.0 ** -9, -(2.0 ** -10) * 3, -5e-4, -0.0, 0.3])


def test_straight_through_gives_y_bit_for_bit_and_the_identity_gradient():
    x = jnp.asarray(SPECIAL)
    y = rounding.round_nearest(x, E4M3)
    same_bits(straight_through(x, y), y)
    assert np.signbit(np.asarray(y)[-2]) and np.isnan(np.asarray(y)[2])
    g = jax.grad(lambda t: jnp.sum(straight_through(t, y) * 3.0))(x)
    np.testing.assert_array_equal(np.asarray(g), np.full(x.shape, 3.0))
    usual = np.asarray(x + jax.lax.stop_gradient(y - x))  # what the usual form computes
    assert np.isnan(usual[0]) and usual[5] == 0.0 and not np.signbit(usual[-2])
    with pytest.raises(ValueError, match=r"y like x; got x float32\[16\] and y bfloat16"):
        straight_through(x, y.astype(jnp.bfloat16))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e4m3_row", "fp8_block128", "mxfp8", "nvfp4"])
def test_fake_quant_is_straight_through_at_special_values(fmt):
    """Forward: dequantize(quantize(x)) bit for bit (docs/numerics.md says what each format
    makes of inf and NaN); gradient: the identity, or zero exactly where the input was
    clipped (a NaN is not clipped)."""
    x = jnp.asarray(np.tile(SPECIAL, (4, 8)))  # (4, 128): every value in every block size
    same_bits(fp4lab.fake_quant(x, fmt), fp4lab.dequantize(fp4lab.quantize(x, fmt)))
    g = jax.grad(lambda t: jnp.sum(fp4lab.fake_quant(t, fmt) * 3.0))(x)
    np.testing.assert_array_equal(np.asarray(g), np.full(x.shape, 3.0))
    if fmt == "fp8_e4m3":  # an infinite amax gives scale 1: clipped where |x| > 448
        g = jax.grad(lambda t: jnp.sum(fp4lab.fake_quant(t, fmt, mask_saturated=True)))(x)
        np.testing.assert_array_equal(np.asarray(g), np.where(np.abs(x) > 448, 0.0, 1.0))


# ------------------------------------------------------------------ properties


finite_f32 = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@given(st.lists(finite_f32, min_size=1, max_size=96),
       st.sampled_from(["mxfp8", "mxfp4", "mxfp8_e5m2", "mxfp4_floor"]))
def test_mx_fake_quant_is_idempotent(vals, fmt):
    x = jnp.asarray(np.array(vals, F32))
    y = fp4lab.fake_quant(x, fmt)
    same_bits(fp4lab.fake_quant(y, fmt), y)


@given(st.lists(finite_f32, min_size=1, max_size=96),
       st.sampled_from(["nvfp4", "mxfp8", "mxfp4", "fp8_e4m3", "fp8_e5m2", "int8", "int4",
                        "int8_q8_0", "fp8_block128"]))
def test_sign_symmetry(vals, fmt):
    """fq(-x) == -fq(x) (integer formats have a single, unsigned zero)."""
    x = jnp.asarray(np.array(vals, F32))
    a, b = np.asarray(fp4lab.fake_quant(-x, fmt)), -np.asarray(fp4lab.fake_quant(x, fmt))
    if fmt.startswith("int"):
        a, b = a + F32(0), b + F32(0)
    same_bits(a, b)


# ------------------------------------------------------------------ errors


def test_bad_inputs_raise_clear_errors():
    x = jnp.ones((4, 32))
    with pytest.raises(ValueError, match="unknown format 'nvfp3'.*nvfp4.*mxfp8"):
        fp4lab.quantize(x, "nvfp3")
    with pytest.raises(TypeError, match="floating-point.*int32"):
        fp4lab.quantize(jnp.ones((4, 32), jnp.int32), "nvfp4")
    with pytest.raises(TypeError, match="complex64"):
        fp4lab.quantize(jnp.ones((4, 32), jnp.complex64), "mxfp8")
    with pytest.raises(ValueError, match=r"axis=2 out of range for shape \(4, 32\)"):
        fp4lab.quantize(x, "nvfp4", axis=2)
    with pytest.raises(ValueError, match="stochastic.*key"):
        fp4lab.fake_quant(x, "nvfp4", rounding="stochastic")
    with pytest.raises(ValueError, match="rounding='up'"):
        fp4lab.quantize(x, "nvfp4", rounding="up")
    with pytest.raises(ValueError, match=r"tile=\(16, 16\) does not fit format fp8_e4m3"):
        fp4lab.quantize(x, "fp8_e4m3", tile=(16, 16))
    with pytest.raises(ValueError, match=r"tile=\(16, 15\) does not fit format nvfp4"):
        fp4lab.quantize(x, "nvfp4", tile=(16, 15))
    with pytest.raises(ValueError, match="pair of positive ints"):
        fp4lab.quantize(x, "nvfp4", tile=(16,))
    with pytest.raises(ValueError, match="global_amax.*mxfp8"):
        fp4lab.quantize(x, "mxfp8", global_amax=1.0)
    with pytest.raises(ValueError, match="stochastic.*fp32.*only bf16 and fp16"):
        fp4lab.quantize(x, "fp32", rounding="stochastic", key=jax.random.key(0))
    with pytest.raises(TypeError, match="QArray"):
        fp4lab.dequantize(x)
    with pytest.raises(TypeError, match="dtype must be floating point; got int8"):
        fp4lab.dequantize(fp4lab.quantize(x, "nvfp4"), jnp.int8)
    with pytest.raises(TypeError, match=r"key=1 is not a PRNG key: pass jax.random.key"):
        fp4lab.quantize(x, "nvfp4", rounding="stochastic", key=1)
    with pytest.raises(TypeError, match=r"key=.* is not a PRNG key"):
        fp4lab.fake_quant(x, "mxfp4", rounding="stochastic", key=jnp.ones(3))
    fp4lab.quantize(x, "nvfp4", rounding="stochastic", key=jax.random.PRNGKey(0))  # legacy


# ------------------------------------------------------------------ Four Over Six (4/6)


def _four_over_six(x, fmt="nvfp4_4over6"):
    q = fp4lab.quantize(jnp.asarray(np.asarray(x, F32)), fmt)
    return np.asarray(fp4lab.dequantize(q)), np.asarray(q.scale.astype(jnp.float32))


def test_four_over_six_worked_examples():
    """Blocks worked out by hand from Transformer Engine's 4over6 arithmetic (E = 256; the
    adversarial comparison with the ported oracle is in test_rewrites.py): map-to-6 kept on a
    smaller error, MAE and MSE choosing differently, map-to-4 winning where 6's grid puts 5 on
    the 4 / 6 tie, the same block with E = 448 (map-to-4 clamped to 448: no choice left), and
    the division ``fl(bamax / 6)`` that the reciprocal product would round to another scale."""
    x = np.zeros((1, 16), F32)
    x[0, :4] = 5, 4.2, 3.3, 1
    y, s = _four_over_six(x)
    assert s.tolist() == [[256.0]] and y[0, :4].tolist() == [5, 5, F32(3.3333335), F32(0.8333334)]
    x = np.array([[6, 5, 4.5, -4, 3, 2, 1, 0.5] + [0.25] * 8], F32)
    y, s = _four_over_six(x)
    assert s.tolist() == [[256.0]] and y[0, :8].tolist() == [6, 4, 4, -4, 3, 2, 1, 0.5]
    y, s = _four_over_six(x, "nvfp4_4over6_mse")
    assert s.tolist() == [[384.0]] and y[0, :8].tolist() == [6, 4.5, 4.5, -4.5, 3, 2.25, 0.75,
                                                              0.75]
    x = np.array([[6] + [5] * 15], F32)
    y, s = _four_over_six(x)
    assert s.tolist() == [[384.0]] and y[0].tolist() == [6] + [4.5] * 15
    e448 = dataclasses.replace(fp4lab.get_format("nvfp4_4over6"), name="nvfp4_4over6_448",
                               scaling=FourOverSixScale(e4m3_max=448))
    y, s = _four_over_six(x, e448)
    assert s.tolist() == [[448.0]] and y[0].tolist() == [6] + [4.0] * 15
    x = np.zeros((2, 16), F32)
    x[0, 0], x[1, 0] = 1234.5, np.array([0x445DD2FF], np.uint32).view(F32)[0]
    y, s = _four_over_six(x)
    assert s[1, 0] == 176 and y[1, 0] == F32(848.71875)  # fl(fl(b*fl(S/6))) would give 192


def test_four_over_six_refuses_stochastic_rounding_and_its_recipe_quantizes_x_and_w():
    x = jnp.ones((2, 16))
    with pytest.raises(ValueError, match="not supported for format nvfp4_4over6"):
        fp4lab.quantize(x, "nvfp4_4over6", rounding="stochastic", key=jax.random.key(0))
    r = fp4lab.get_recipe("nvfp4_4over6")
    assert [str(r.operands[o].format) for o in OPERANDS] == [
        "nvfp4_4over6", "nvfp4_4over6", "nvfp4", "nvfp4_4over6", "nvfp4_4over6", "nvfp4"]
    assert r.fprop_w.tile == r.dgrad_w.tile == (16, 16) and r.dgrad_dy.rounding == "stochastic"
    assert not any(r.operands[o].hadamard for o in OPERANDS)  # TE: 4/6 refuses RHT


# ------------------------------------------------------------------ row-scaled NVFP4


@pytest.mark.parametrize("name", ["bf16-wide", "fp32-heavy"])
@pytest.mark.parametrize("axis", [1, 0])
def test_row_scaled_nvfp4_is_te_nvfp4_with_each_slices_own_amax(name, axis):
    """Transformer Engine's row-scaled NVFP4: its NVFP4 arithmetic (the oracle) run on each
    slice along the block axis with that slice's amax: a row of X blocked along K (fprop),
    a column blocked along the tokens (its wgrad copy, axis 0)."""
    x = case(name)[:16, :48]
    q = fp4lab.quantize(as_input(x, input_dtype(name)), "nvfp4_row", axis=axis)
    slices = x if axis == 1 else x.T
    got_values = np.asarray(fp4lab.dequantize(q))
    got_values = got_values if axis == 1 else got_values.T
    amax = np.asarray(q.global_scale).reshape(-1)
    assert amax.shape == (slices.shape[0],)
    for r, row in enumerate(slices):
        codes, sb, a = ref.nvfp4_quantize(row[None], block_shape=(1, 16))
        same_bits(amax[r], a)
        same_bits(got_values[r][None], ref.nvfp4_dequantize(codes, sb, a))
    assert len(set(amax.tolist())) > 1  # the slices' amaxes differ: not one tensor amax


def test_row_scaled_nvfp4_refuses_what_te_refuses():
    x = jnp.ones((16, 32))
    for kw, match in (({"tile": (16, 16)}, "no 2D tile"), ({"global_amax": 1.0}, "no global_amax"),
                      ({"rounding": "stochastic", "key": jax.random.key(0)},
                       "not supported for format nvfp4_row")):
        with pytest.raises(ValueError, match=match):
            fp4lab.quantize(x, "nvfp4_row", **kw)
    r = fp4lab.get_recipe("nvfp4_row_scaled")
    assert [str(r.operands[o].format) for o in OPERANDS] == [
        "nvfp4_row", "nvfp4", "nvfp4", "nvfp4", "nvfp4_row", "nvfp4"]
