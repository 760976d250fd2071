"""Self-checks of the NumPy test oracles (tests/oracles/) against docs/numerics.md.

These tests check the *references*, not fp4lab: the shared float32 arithmetic (oracles.f32)
against NumPy's and by hand, element conversions exhaustively against ml_dtypes / np.float16
(used here only, never inside the oracles), the codecs the paper ports share with the
specification's, and the block formats with the test vectors and hand-computed examples of
docs/numerics.md.
"""

import ml_dtypes
import numpy as np
import pytest

from oracles import numpy_ref as ref
from oracles import papers
from oracles.f32 import Arith, ftz32

F32 = np.float32
NAN, INF = np.float32(np.nan), np.float32(np.inf)


def f32(*vals):
    return np.array(vals, dtype=F32)


def bf16(bits):
    """float32 value of a BF16 bit pattern."""
    return np.array([bits << 16], dtype=np.uint32).view(F32)[0]


# ----------------------------------------------------------------------------------------------
# oracles.f32: the arithmetic every oracle shares
# ----------------------------------------------------------------------------------------------

def test_arith_rounds_once_per_operation_and_flushes_under_ftz():
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(4096) * np.exp2(rng.integers(-140, 120, 4096))).astype(F32)
    b = (rng.standard_normal(4096) * np.exp2(rng.integers(-140, 120, 4096))).astype(F32)
    plain, ftz = Arith(False), Arith(True)
    with np.errstate(all="ignore"):
        for op, want in (("mul", a * b), ("div", a / b), ("add", a + b), ("sub", a - b)):
            got = getattr(plain, op)(a, b)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), op)
            flushed = getattr(ftz, op)(a, b)  # results flushed (the inputs are the caller's)
            np.testing.assert_array_equal(flushed.view(np.uint32),
                                          ftz32(want).view(np.uint32), op)
    sub = f32(2.0**-130, -(2.0**-130), 2.0**-126)
    assert ftz.f(sub).view(np.uint32).tolist() == f32(0.0, -0.0, 2.0**-126).view(
        np.uint32).tolist()
    assert plain.f(sub).tolist() == sub.tolist()


def test_seqsum_adds_in_element_order():
    x = f32(1.0, 2.0**24, -(2.0**24), 1.0)  # left to right: 1 is lost against 2**24, then 0 + 1
    assert Arith(False).seqsum(x).tolist() == [1.0]
    # from the other end: 1 - 2**24 is exact, so both ones survive
    assert Arith(False).seqsum(f32(1.0, -(2.0**24), 2.0**24, 1.0)).tolist() == [2.0]
    y = f32(2.0**24, 1.0, 1.0, -(2.0**24))  # each 1 is lost: 0
    assert Arith(False).seqsum(y).tolist() == [0.0]


def test_the_paper_ports_e4m3_codec_is_the_specifications():
    codes = np.arange(0x80)
    np.testing.assert_array_equal(papers.e4m3_value(codes),
                                  ref.e4m3_value(codes.astype(np.uint8)))
    values = papers.e4m3_value(np.arange(0x7F))
    np.testing.assert_array_equal(papers.e4m3_code(values), ref.e4m3_byte(values))
    # where they differ on purpose: the authors' kernels keep NaN in E2M1 and turn an
    # infinite input into NaN in E4M3; the specification has no E2M1 NaN and saturates
    special = f32(np.nan, np.inf)
    assert np.isnan(papers.e2m1_rne(special[:1])).all()
    assert np.isnan(papers.e4m3_rne_sat(special[1:])).all()
    assert ref.e4m3_value(ref.e4m3_byte(special[1:])).tolist() == [448.0]


# ----------------------------------------------------------------------------------------------
# Environment: the oracle relies on NumPy doing IEEE float32 arithmetic without FTZ/DAZ.
# ----------------------------------------------------------------------------------------------

def test_process_has_no_ftz():
    tiny = F32(2.0**-140)
    assert tiny * F32(1.0) != 0                      # no DAZ/FTZ in this process
    assert ref.ftz32(f32(2.0**-140, -(2.0**-140), 2.0**-126, -0.0, NAN)).tolist()[:4] == [
        0.0, -0.0, 2.0**-126, -0.0]
    assert np.signbit(ref.ftz32(f32(-(2.0**-140))))[0]


# ----------------------------------------------------------------------------------------------
# Element conversions: exhaustive agreement with ml_dtypes / np.float16
# ----------------------------------------------------------------------------------------------

_RNG = np.random.default_rng(0)
# Random float32 bit patterns (all exponents, incl. subnormals), NaNs removed.
_RANDOM_F32 = _RNG.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32).view(F32)
_RANDOM_F32 = _RANDOM_F32[~np.isnan(_RANDOM_F32)]


def _probe_values(finite_values, max_finite):
    """Every representable value, every midpoint between neighbours (ties), the float32
    neighbours of both, zeros, max, above max, infinities, float32 subnormals and random
    float32 bit patterns -- both signs."""
    pos = np.unique(np.abs(finite_values.astype(np.float64)))            # sorted, has 0
    mids = (pos[:-1] + pos[1:]) / 2                                      # exact in float32
    above_max = [max_finite * (1 + 2.0**-20), max_finite * 1.01, 2 * max_finite,
                 float(ref.FLT_MAX), np.inf]
    base = np.concatenate([pos, mids, above_max]).astype(F32)
    assert np.all(base.astype(np.float64)[: len(pos) + len(mids)]
                  == np.concatenate([pos, mids]))                        # no rounding in setup
    with np.errstate(over="ignore"):
        near = np.concatenate([np.nextafter(base, F32(np.inf)), np.nextafter(base, F32(0))])
    subnormals = f32(2.0**-149, 2.0**-140, 2.0**-127, 1e-39)
    allv = np.concatenate([base, near, subnormals, _RANDOM_F32])
    return np.concatenate([allv, -allv])


def _assert_codes_equal(got, want, v):
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(float(v[i]), int(got[i]), int(want[i])) for i in bad[:10]]


@pytest.mark.parametrize(
    "name, enc, dec, mdt, maxf",
    [("e4m3", ref.e4m3_byte, ref.e4m3_value, ml_dtypes.float8_e4m3fn, 448.0),
     ("e5m2", ref.e5m2_byte, ref.e5m2_value, ml_dtypes.float8_e5m2, 57344.0)],
)
def test_fp8_exhaustive(name, enc, dec, mdt, maxf):
    allbytes = np.arange(256, dtype=np.uint8)
    want_vals = allbytes.view(mdt).astype(F32)
    got_vals = dec(allbytes)
    np.testing.assert_array_equal(got_vals, want_vals)                   # NaN == NaN here
    assert np.array_equal(np.signbit(got_vals), np.signbit(want_vals))

    finite = want_vals[np.isfinite(want_vals)]
    assert float(np.max(finite)) == maxf
    v = _probe_values(finite, maxf)
    want = np.clip(v, -maxf, maxf).astype(mdt).view(np.uint8)            # satfinite = clip first
    _assert_codes_equal(enc(v), want, v)

    # Round trip of every finite byte; specials.
    fin = np.isfinite(want_vals)
    np.testing.assert_array_equal(enc(want_vals[fin]), allbytes[fin])
    assert enc(f32(0.0, -0.0, NAN, -NAN, INF, -INF)).tolist() == [
        0x00, 0x80, 0x7F, 0x7F, enc(f32(maxf))[0], enc(f32(-maxf))[0]]


def test_e4m3_specific_points():
    assert ref.e4m3_byte(f32(448, 464, 465, 480, 1e30)).tolist() == [0x7E] * 5
    assert ref.e4m3_byte(f32(2.0**-9, 2.0**-10, np.nextafter(F32(2.0**-10), F32(1)))).tolist() \
        == [0x01, 0x00, 0x01]
    assert ref.e4m3_byte(f32(400.0)).tolist() == [0x7C]                  # tie 384|416 -> even
    assert np.isnan(ref.e4m3_value([0x7F, 0xFF])).all()


def test_e5m2_specials():
    assert ref.e5m2_value([0x7C, 0xFC]).tolist() == [np.inf, -np.inf]
    assert np.isnan(ref.e5m2_value([0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF])).all()
    assert ref.e5m2_byte(f32(61440, INF, -INF)).tolist() == [0x7B, 0x7B, 0xFB]


def test_e2m1_exhaustive():
    codes = np.arange(16, dtype=np.uint8)
    want_vals = codes.view(ml_dtypes.float4_e2m1fn).astype(F32)
    got_vals = ref.e2m1_value(codes)
    np.testing.assert_array_equal(got_vals, want_vals)
    assert np.array_equal(np.signbit(got_vals), np.signbit(want_vals))
    assert got_vals[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]

    v = _probe_values(want_vals, 6.0)
    want = np.clip(v, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    _assert_codes_equal(ref.e2m1_code(v), want, v)

    # docs/numerics.md's tie table, saturation, sign of zero, NaN -> +0 (ml_dtypes gives -0).
    ties = f32(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
    assert ref.e2m1_value(ref.e2m1_code(ties)).tolist() == [0, 1, 1, 2, 2, 4, 4]
    assert ref.e2m1_code(f32(5.0001, 7, 1e30, INF, -INF)).tolist() == [7, 7, 7, 7, 15]
    assert ref.e2m1_code(f32(-0.0, -0.1, 0.0, NAN, -NAN)).tolist() == [8, 8, 0, 0, 0]


def test_fp16_exhaustive():
    allbits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    want_vals = allbits.view(np.float16).astype(F32)
    got_vals = ref.fp16_value(allbits)
    np.testing.assert_array_equal(got_vals, want_vals)
    assert np.array_equal(np.signbit(got_vals), np.signbit(want_vals))

    finite = want_vals[np.isfinite(want_vals)]
    v = _probe_values(finite, 65504.0)
    v = np.concatenate([v, f32(65519.99, 65520.0, 65536.0)])
    with np.errstate(over="ignore"):
        want = v.astype(np.float16).view(np.uint16)
    _assert_codes_equal(ref.fp16_bits(v), want, v)
    assert ref.fp16_bits(f32(NAN, -NAN, 65520.0, -INF)).tolist() == [0x7E00, 0x7E00, 0x7C00,
                                                                     0xFC00]


# ----------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------

def _tensor(rows):
    """(len(rows), 16) float32 tensor, each row's leading values given, rest zeros."""
    x = np.zeros((len(rows), 16), F32)
    for i, r in enumerate(rows):
        x[i, : len(r)] = r
    return x


def test_nvfp4_vector_scale_tie_416():
    amax, bamax = bf16(0x4044), bf16(0x402F)
    assert (amax, bamax) == (3.0625, 2.734375)
    x = _tensor([[bamax], [amax]])
    codes, sb, am = ref.nvfp4_quantize(x)
    assert am == amax and sb.shape == (2, 1)
    assert sb[0, 0] == 0x7D and ref.e4m3_value(sb[0, 0]) == 416          # TE's order
    # The vector discriminates: fl(fl(bamax/6) * S_enc) stores 384 (0x7C).
    s_enc = F32(2688) / amax
    assert ref.e4m3_byte((bamax / F32(6)) * s_enc)[()] == 0x7C


def test_nvfp4_vector_half():
    amax, xv = bf16(0x4027), bf16(0x3EA7)
    x = _tensor([[amax, xv]])
    codes, sb, _ = ref.nvfp4_quantize(x)
    assert sb[0, 0] == 0x7E                                              # block scale 448
    assert ref.e2m1_value(codes[0, 1]) == 0.5                            # TE gives 0.5
    # Dividing by gs = amax/2688 (jax.nn) gives 1.0 instead.
    assert ref.e2m1_value(ref.e2m1_code(xv / (F32(448) * (amax / F32(2688)))))[()] == 1.0
    # Dequantize: q * fl(fl(s_b * amax) * fl(1/2688)).
    y = ref.nvfp4_dequantize(codes, sb, amax)
    assert y[0, 1] == F32(0.5) * ((F32(448) * amax) * (F32(1) / F32(2688)))


def test_nvfp4_vector_minus_two():
    amax, bamax, xv = bf16(0xC046), bf16(0x3FA7), bf16(0xBEC6)
    assert amax == -3.09375 and xv == -0.38671875
    x = _tensor([[bamax, xv], [amax]])
    codes, sb, am = ref.nvfp4_quantize(x)
    assert am == 3.09375
    assert ref.e4m3_value(sb[0, 0]) == 192 and sb[0, 0] == 0x74
    assert codes[0, 1] == 0xC and ref.e2m1_value(codes[0, 1]) == -2.0    # TE gives -2.0


def test_nvfp4_zero_block_and_zero_tensor():
    x = np.zeros((2, 32), F32)
    x[0, :16] = np.linspace(-3, 3, 16, dtype=F32)
    codes, sb, am = ref.nvfp4_quantize(x)
    assert am == 3
    assert sb[0, 1] == 0 and sb[1].tolist() == [0, 0]                    # zero blocks: scale 0
    assert not codes[0, 16:].any() and not codes[1].any()                # codes +0
    assert not ref.nvfp4_dequantize(codes, sb, am)[:, 16:].any()

    z = np.zeros((4, 32), F32)
    codes, sb, am = ref.nvfp4_quantize(z)
    assert am == 0 and not sb.any() and not codes.any()
    y = ref.nvfp4_dequantize(codes, sb, am)
    assert y.dtype == F32 and not y.any()


def test_nvfp4_dequantize_amax_zero_uses_scale_directly():
    codes = np.full((1, 16), 7, np.uint8)                                # 6.0
    sb = ref.e4m3_byte(f32(2.0)).reshape(1, 1)
    assert ref.nvfp4_dequantize(codes, sb, 0.0).tolist() == [[12.0] * 16]


def test_nvfp4_special_values():
    # NaN in the tensor: tensor amax NaN -> S_enc NaN -> all scales 0x7F, all codes 0.
    x = _tensor([[1.0, NAN], [2.0]])
    codes, sb, am = ref.nvfp4_quantize(x)
    assert np.isnan(am) and (sb == 0x7F).all() and not codes.any()
    # inf: amax inf -> S_enc = 1; the inf block gets scale min(inf, FLT_MAX) -> 448 (0x7E);
    # a finite block is quantized with S_enc = 1.
    x = _tensor([[INF, 1.0], [3.0]])
    codes, sb, am = ref.nvfp4_quantize(x)
    assert am == np.inf and sb[0, 0] == 0x7E and sb[1, 0] == ref.e4m3_byte(f32(0.5))[0]
    assert codes[0, 0] == 7 and codes[1, 0] == 7                         # 3 / 0.5 = 6


def test_nvfp4_explicit_amax_and_2d_tiles():
    x = _RNG.standard_normal((32, 48)).astype(F32)
    c1, s1, a1 = ref.nvfp4_quantize(x)
    c2, s2, a2 = ref.nvfp4_quantize(x, amax=a1)
    assert a1 == np.max(np.abs(x)) and np.array_equal(c1, c2) and np.array_equal(s1, s2)
    # A smaller supplied amax changes the encoding scale.
    _, s3, a3 = ref.nvfp4_quantize(x, amax=a1 / 2)
    assert a3 == a1 / 2 and not np.array_equal(s1, s3)

    # 2D 16x16 tiles: one scale per tile; the transpose is exact.
    c, s, a = ref.nvfp4_quantize(x, block_shape=(16, 16))
    ct, st, at = ref.nvfp4_quantize(x.T.copy(), block_shape=(16, 16))
    assert s.shape == (2, 3) and a == at
    assert np.array_equal(ct, c.T) and np.array_equal(st, s.T)
    # A tile's scale equals the 1D scale of a block holding the tile amax.
    tile_amax = np.max(np.abs(x[16:32, 16:32]))
    probe = np.zeros((1, 16), F32)
    probe[0, 0] = tile_amax
    assert ref.nvfp4_quantize(probe, amax=a)[1][0, 0] == s[1, 1]
    y = ref.nvfp4_dequantize(c, s, a, block_shape=(16, 16))
    assert y.shape == x.shape and np.mean((y - x) ** 2) / np.mean(x**2) < 0.02


def test_nvfp4_ftz_tiny_amax():
    # Tensor amax 1e-37 (normal). S_enc = min(2688/1e-37 = inf, FLT_MAX) = FLT_MAX both ways.
    # S_dec = fl(1/FLT_MAX) = 2**-128 is a float32 subnormal: flushed to 0 under FTZ, so there
    # enc_b = min(1/0, FLT_MAX) = FLT_MAX and every non-tiny element saturates.
    x = _tensor([[1e-37, 5e-38, 5e-39, -5e-38]])                         # 5e-39 is subnormal
    c0, s0, a0 = ref.nvfp4_quantize(x, ftz=False)
    c1, s1, a1 = ref.nvfp4_quantize(x, ftz=True)
    assert a0 == a1 == F32(1e-37)
    assert ref.e4m3_value(s0[0, 0]) == ref.e4m3_value(s1[0, 0]) == 5.5  # e4m3(5.67)
    # Without FTZ: enc = 2**128 / 5.5 ~ 6.19e37: 6.19 -> 6, 3.09 -> 3, 0.309 -> 0.5, -3.09 -> -3
    assert ref.e2m1_value(c0[0, :4]).tolist() == [6.0, 3.0, 0.5, -3.0]
    # With FTZ: enc = FLT_MAX: 34 -> 6, 17 -> 6, flushed input -> 0, -17 -> -6
    assert ref.e2m1_value(c1[0, :4]).tolist() == [6.0, 6.0, 0.0, -6.0]
    # Dequantize: fl(fl(5.5 * 1e-37) * fl(1/2688)) ~ 2e-40 is subnormal: flushed under FTZ.
    y0 = ref.nvfp4_dequantize(c0, s0, a0, ftz=False)
    y1 = ref.nvfp4_dequantize(c1, s1, a1, ftz=True)
    assert y0[0, 0] != 0 and not y1.any()


# ----------------------------------------------------------------------------------------------
# MX
# ----------------------------------------------------------------------------------------------

def _mx_block(*vals):
    x = np.zeros((1, 32), F32)
    x[0, : len(vals)] = vals
    return x


def test_mx_e4m3_rceil_vs_floor():
    x = _mx_block(500.0, 1.0)
    # rceil: d = 500/448 = 1.116 -> e = 0 + 1 = 1; 500/2 = 250 -> 256 (0x78); 0.5 -> 0x30
    c, s = ref.mx_quantize(x, "e4m3", "rceil")
    assert s.tolist() == [[128]] and c[0, :3].tolist() == [0x78, 0x30, 0]
    assert ref.mx_dequantize(c, s, "e4m3")[0, :2].tolist() == [512.0, 1.0]
    # floor: floor(log2 500) - 8 = 0; 500 saturates to 448 (0x7E); 1.0 -> 0x38
    c, s = ref.mx_quantize(x, "e4m3", "floor")
    assert s.tolist() == [[127]] and c[0, :3].tolist() == [0x7E, 0x38, 0]
    assert ref.mx_dequantize(c, s, "e4m3")[0, :2].tolist() == [448.0, 1.0]


def test_mx_e2m1_rceil_vs_floor():
    x = _mx_block(7.0, -1.0)
    c, s = ref.mx_quantize(x, "e2m1", "rceil")       # d = 7/6 -> e = 1; 3.5 ties to 4 (code 6)
    assert s.tolist() == [[128]] and c[0, :2].tolist() == [6, 0x8 | 1]
    c, s = ref.mx_quantize(x, "e2m1", "floor")       # floor(log2 7) - 2 = 0; 7 saturates to 6
    assert s.tolist() == [[127]] and c[0, :2].tolist() == [7, 0x8 | 2]
    assert ref.mx_dequantize(c, s, "e2m1")[0, :2].tolist() == [6.0, -1.0]


def test_mx_e5m2_modes():
    x = _mx_block(57344.0, 3.0)
    # floor: floor(log2 57344) - 15 = 0: elements unscaled, 57344 -> 0x7B
    c, s = ref.mx_quantize(x, "e5m2", "floor")
    assert s.tolist() == [[127]] and c[0, :2].tolist() == [0x7B, ref.e5m2_byte(f32(3.0))[0]]
    # rceil: d = fl(57344 * fl(1/57344)); ceil(log2 d) checked with an independent float64
    # computation of the rule (frexp mantissa 0.5 <=> d is a power of two).
    d = F32(57344.0) * (F32(1) / F32(57344.0))
    m, ex = np.frexp(np.float64(d))
    e_expected = int(ex - 1 + (m != 0.5))
    assert ref.mx_quantize(x, "e5m2", "rceil")[1].tolist() == [[e_expected + 127]]
    # rceil and floor differ on a non-power-of-two amax: 60000 -> rceil e = 1, floor e = 0
    x = _mx_block(60000.0)
    assert ref.mx_quantize(x, "e5m2", "rceil")[1].tolist() == [[128]]
    c, s = ref.mx_quantize(x, "e5m2", "floor")
    assert s.tolist() == [[127]] and c[0, 0] == 0x7B                      # saturates


def test_mx_special_blocks_and_shapes():
    x = np.zeros((2, 96), F32)
    x[0, :32] = _RNG.standard_normal(32)
    x[0, 40] = np.nan
    x[0, 70] = -np.inf
    x[1, :32] = -0.0                                   # amax 0 block with negative zeros
    x[1, 32:64] = 2.0**-130                            # subnormal block
    for elem in ("e4m3", "e5m2", "e2m1"):
        for mode in ("rceil", "floor"):
            c, s = ref.mx_quantize(x, elem, mode)
            assert c.shape == x.shape and s.shape == (2, 3)
            assert s[0, 1] == 0xFF and s[0, 2] == 0xFF and not c[0, 32:].any()
            assert s[1, 0] == 0 and not c[1, :32].any()   # e = -127, all codes 0
            y = ref.mx_dequantize(c, s, elem)
            assert np.isnan(y[0, 32:]).all() and not np.isnan(y[0, :32]).any()
            assert not y[1, :32].any()
            # FTZ: the subnormal block becomes an all-zero block.
            cz, sz = ref.mx_quantize(x, elem, mode, ftz=True)
            assert sz[1, 1] == 0 and not cz[1, 32:64].any()


def test_mx_rceil_subnormal_descale():
    # bamax = 2**-118: d = bamax * fl(1/448) ~ 2**-126.8 is a float32 subnormal > 2**-127
    # -> e = -126; x * 2**126 = 256 (0x78). Under FTZ d flushes to 0 -> e = -127 and
    # x * 2**127 = 512 saturates to 448 (0x7E).
    x = _mx_block(2.0**-118)
    c, s = ref.mx_quantize(x, "e4m3", "rceil")
    assert s[0, 0] == 1 and c[0, 0] == 0x78
    c, s = ref.mx_quantize(x, "e4m3", "rceil", ftz=True)
    assert s[0, 0] == 0 and c[0, 0] == 0x7E
    # The subnormal-descale rule on its boundary (e2m1, fl(1/6) = 0.16666667):
    # bamax = 6 * 2**-127 gives d == 2**-127 exactly -> -127; bamax = 6.5 * 2**-127 gives
    # 2**-127 < d < 2**-126 -> -126; FTZ flushes that d to 0 -> -127.
    b_tie, b_up = F32(6 * 2.0**-127), F32(6.5 * 2.0**-127)
    assert b_tie * (F32(1) / F32(6)) == F32(2.0**-127)
    assert ref.mx_scale_exponent(f32(b_tie, b_up), "e2m1", "rceil").tolist() == [-127, -126]
    assert ref.mx_scale_exponent(f32(b_tie, b_up), "e2m1", "rceil", ftz=True).tolist() == [
        -127, -127]
    # floor on a subnormal / zero amax clamps to -127.
    assert ref.mx_scale_exponent(f32(2.0**-140, 0.0), "e4m3", "floor").tolist() == [-127, -127]


def test_mx_dequantize_exact_and_ftz():
    # e = -127 with the smallest e5m2 subnormal: 2**-16 * 2**-127 = 2**-143 (float32 subnormal)
    c = np.zeros((1, 32), np.uint8)
    c[0, 0] = 1
    s = np.array([[0]], np.uint8)
    assert ref.mx_dequantize(c, s, "e5m2")[0, 0] == F32(2.0**-143)
    assert ref.mx_dequantize(c, s, "e5m2", ftz=True)[0, 0] == 0
    # e = 127 with 448 overflows float32 -> inf
    c[0, 0] = 0x7E
    assert ref.mx_dequantize(c, np.array([[254]], np.uint8), "e4m3")[0, 0] == np.inf


def test_mx_roundtrip_random_matches_ml_dtypes():
    x = (_RNG.standard_normal((8, 128)) * 10.0 ** _RNG.integers(-3, 4, (8, 1))).astype(F32)
    for elem, mdt, maxf in (("e4m3", ml_dtypes.float8_e4m3fn, 448),
                            ("e5m2", ml_dtypes.float8_e5m2, 57344)):
        for mode in ("rceil", "floor"):
            c, s = ref.mx_quantize(x, elem, mode)
            e = np.repeat(s.astype(np.int64) - 127, 32, axis=1)
            scaled = (x.astype(np.float64) * np.ldexp(1.0, -e)).astype(F32)  # exact
            want = np.clip(scaled, -maxf, maxf).astype(mdt).view(np.uint8)
            np.testing.assert_array_equal(c, want)
    for mode in ("rceil", "floor"):
        c, s = ref.mx_quantize(x, "e2m1", mode)
        e = np.repeat(s.astype(np.int64) - 127, 32, axis=1)
        scaled = (x.astype(np.float64) * np.ldexp(1.0, -e)).astype(F32)
        want = np.clip(scaled, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
        np.testing.assert_array_equal(c, want)


def test_ftz_is_a_no_op_on_normal_data():
    # Data far from the subnormal range: every quantizer must give identical results.
    x = _RNG.standard_normal((32, 128)).astype(F32)
    x[x == 0] = 1.0
    x[np.abs(x) < 1e-3] = 1e-3
    pairs = [
        lambda f: ref.nvfp4_quantize(x, ftz=f),
        lambda f: ref.nvfp4_quantize(x, block_shape=(16, 16), ftz=f),
        lambda f: ref.mx_quantize(x, "e4m3", "rceil", ftz=f),
        lambda f: ref.mx_quantize(x, "e2m1", "floor", ftz=f),
        lambda f: ref.fp8_tensor_quantize(x, "e5m2", ftz=f),
        lambda f: ref.fp8_block_quantize(x, (1, 128), ftz=f),
        lambda f: ref.int_quantize(x, 4, ftz=f),
        lambda f: ref.q4_0_quantize(x, ftz=f),
        lambda f: ref.q8_0_quantize(x, ftz=f),
    ]
    for fn in pairs:
        for a, b in zip(fn(False), fn(True), strict=True):
            np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------------------------
# FP8 current scaling
# ----------------------------------------------------------------------------------------------

def test_fp8_tensor_quantize():
    x = _RNG.standard_normal((16, 64)).astype(F32)
    for elem, mdt, maxf in (("e4m3", ml_dtypes.float8_e4m3fn, 448),
                            ("e5m2", ml_dtypes.float8_e5m2, 57344)):
        b, scale, scale_inv = ref.fp8_tensor_quantize(x, elem)
        amax = np.max(np.abs(x))
        assert scale == F32(maxf) / amax and scale_inv == F32(1) / scale
        want = np.clip(x * scale, -maxf, maxf).astype(mdt).view(np.uint8)
        np.testing.assert_array_equal(b, want)
        y = ref.fp8_tensor_dequantize(b, scale_inv, elem)
        np.testing.assert_array_equal(y, b.view(mdt).astype(F32) * scale_inv)
    # amax 0, inf or NaN -> scale 1 (TE's compute_scale_from_amax): inf saturates, NaN stays
    assert ref.fp8_tensor_quantize(np.zeros((2, 2), F32), "e4m3")[1] == 1
    b, s, si = ref.fp8_tensor_quantize(f32(INF, 1.0, -2.0).reshape(1, 3), "e4m3")
    assert s == 1 and b.tolist() == [[0x7E, 0x38, 0xC0]]
    b, s, si = ref.fp8_tensor_quantize(f32(NAN, 1.0).reshape(1, 2), "e4m3")
    assert s == 1 and si == 1 and b.tolist() == [[0x7F, 0x38]]
    # integers have no NaN: a NaN amax gives a NaN scale (the channel dequantizes to NaN)
    q, si = ref.int_quantize(f32(NAN, 1.0).reshape(1, 2), 8)
    assert np.isnan(si).all() and q.tolist() == [[0, 0]]
    # Explicit amax.
    assert ref.fp8_tensor_quantize(x, "e4m3", amax=2.0)[1] == 224


def test_fp8_block_quantize_matches_per_tensor_on_each_block():
    x = _RNG.standard_normal((128, 256)).astype(F32)
    x[3, 5:133] = 0.0                                      # half of a 1x128 block ...
    x[3, 0:5] = 0.0
    x[3, 133:256] = 0.0                                    # ... row 3 entirely zero
    for bshape in ((1, 128), (128, 128)):
        b, s, si = ref.fp8_block_quantize(x, bshape)
        assert s.shape == (128 // bshape[0], 2) and si.shape == s.shape
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                blk = x[i * bshape[0]:(i + 1) * bshape[0], j * 128:(j + 1) * 128]
                bt, st, sit = ref.fp8_tensor_quantize(blk, "e4m3")
                assert s[i, j] == st and si[i, j] == sit
                assert np.array_equal(
                    b[i * bshape[0]:(i + 1) * bshape[0], j * 128:(j + 1) * 128], bt)
        # E4M3 round-off: half an ulp, 2**-4 relative for normals, 2**-10 * scale_inv below.
        y = ref.fp8_block_dequantize(b, si, bshape)
        bound = 2.0**-4 * np.abs(x) + 2.0**-10 * np.repeat(np.repeat(si, bshape[0], 0), 128, 1)
        assert np.all(np.abs(y - x) <= bound)
    assert ref.fp8_block_quantize(x, (1, 128))[1][3].tolist() == [1.0, 1.0]


# ----------------------------------------------------------------------------------------------
# Integer formats
# ----------------------------------------------------------------------------------------------

def test_int_quantize_hand_computed():
    x = np.array([[1.0, -2.0, 4.0, 0.5],
                  [0.0, 0.0, 0.0, 0.0],
                  [1.0, NAN, 2.0, 3.0],
                  [INF, 1.0, -1.0, 0.0]], F32)
    q, si = ref.int_quantize(x, 4)
    # row 0: scale = 7/4 = 1.75: 1.75 -> 2, -3.5 -> -4 (RNE), 7 -> 7, 0.875 -> 1
    assert q[0].tolist() == [2, -4, 7, 1] and si[0, 0] == F32(1) / F32(1.75)
    assert q[1].tolist() == [0, 0, 0, 0] and si[1, 0] == 1                # amax 0 -> scale 1
    assert q[2].tolist() == [0, 0, 0, 0] and np.isnan(si[2, 0])           # NaN amax
    assert q[3].tolist() == [7, 1, -1, 0] and si[3, 0] == 1               # inf amax -> 1
    q8, si8 = ref.int_quantize(x[:1], 8)
    # scale = 127/4 = 31.75: 31.75 -> 32, -63.5 -> -64, 127, 15.875 -> 16
    assert q8[0].tolist() == [32, -64, 127, 16]
    y = ref.int_dequantize(q8, si8)
    assert y[0, 2] == F32(127) * (F32(1) / F32(31.75))
    # per-group variant
    qg, sig = ref.int_quantize(np.array([[1, 2, 8, 4]], F32), 8, axis_block=2)
    assert sig.shape == (1, 2) and qg.tolist() == [[64, 127, 127, 64]]


def test_q4_0_hand_computed():
    # Block 0: m = -4 (first of the tie |-4| == |4|): d = -4/-8 = 0.5, id = 2,
    #   xi = floor(2x + 8.5) clipped to 15, q = xi - 8.
    # Block 1: m = 4: d = -0.5, id = -2 (the sign flips the codes).
    b0 = np.zeros(32, F32)
    b0[:8] = [-4.0, 1.0, 0.25, -0.25, 0.3, -1.3, 4.0, 3.9]
    b1 = np.zeros(32, F32)
    b1[:4] = [4.0, -4.0, 1.0, 2.2]
    x = np.concatenate([b0, b1]).reshape(1, 64)
    q, d_bits = ref.q4_0_quantize(x)
    assert d_bits.tolist() == [[0x3800, 0xB800]]                          # fp16 0.5, -0.5
    #              -4  1   .25 -.25 .3  -1.3  4  3.9(7.8+8.5=16.3->15)
    assert q[0, :8].tolist() == [-8, 2, 1, 0, 1, -3, 7, 7]
    assert q[0, 8:32].tolist() == [0] * 24                                # 8.5 -> 8 -> 0
    #              4: -8+8.5   -4: 16.5->15  1: 6.5->6  2.2: -4.4+8.5=4.1->4
    assert q[0, 32:36].tolist() == [-8, 7, -2, -4]
    y = ref.q4_0_dequantize(q, d_bits)
    assert y[0, :3].tolist() == [-4.0, 1.0, 0.5] and y[0, 32] == 4.0

    # NaN: counts as the largest |x| (first NaN wins): d = NaN, every q = 0, d stored 0x7E00.
    xn = np.zeros((1, 32), F32)
    xn[0, :3] = [100.0, NAN, 1.0]
    q, d_bits = ref.q4_0_quantize(xn)
    assert not q.any() and d_bits.tolist() == [[0x7E00]]
    # All-zero block: d = fl(0 / -8) = -0.0 (fp16 0x8000, as in GGML), id = 0, q = 0.
    q, d_bits = ref.q4_0_quantize(np.zeros((1, 32), F32))
    assert not q.any() and d_bits.tolist() == [[0x8000]]


def test_q8_0_hand_computed():
    x = np.zeros((1, 64), F32)
    x[0, :5] = [127.0, 2.5, -2.5, 0.49, -126.6]          # amax 127 -> d = 1, id = 1
    x[0, 32:34] = [NAN, 1.0]
    q, d_bits = ref.q8_0_quantize(x)
    assert q[0, :5].tolist() == [127, 3, -3, 0, -127]     # half away from zero
    assert d_bits.tolist() == [[0x3C00, 0x7E00]]          # fp16 1.0, NaN
    assert not q[0, 32:].any()
    assert ref.q8_0_dequantize(q, d_bits)[0, :3].tolist() == [127.0, 3.0, -3.0]


# ----------------------------------------------------------------------------------------------
# Stochastic rounding probabilities
# ----------------------------------------------------------------------------------------------

def test_stochastic_round_grid_probs():
    lo, hi, p = ref.stochastic_round_grid_probs(f32(2.5, -5.0, 3.0, 0.1, 7.0, 0.0), "e2m1")
    assert lo.tolist() == [2, 4, 3, 0, 6, 0] and hi.tolist() == [3, 6, 3, 0.5, 6, 0]
    np.testing.assert_allclose(p, [0.5, 0.5, 0.0, 0.2, 0.0, 0.0])
    for elem, maxf in (("e2m1", 6), ("e4m3", 448), ("e5m2", 57344)):
        v = (_RNG.uniform(-1, 1, 1000) * maxf).astype(F32)
        lo, hi, p = ref.stochastic_round_grid_probs(v, elem)
        assert np.all((lo <= np.abs(v)) & (np.abs(v) <= hi)) and np.all((0 <= p) & (p < 1))
        np.testing.assert_allclose(lo + p * (hi - lo), np.abs(v), rtol=1e-12)   # unbiased
        # lo and hi are representable neighbours: RNE picks one of them.
        rne = ref.elem_decode(ref.elem_encode(np.abs(v), elem), elem)
        assert np.all((rne == lo) | (rne == hi))
    lo, hi, p = ref.stochastic_round_grid_probs(f32(NAN), "e4m3")
    assert np.isnan([lo, hi, p]).all()
