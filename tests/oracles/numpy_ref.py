"""NumPy reference implementation of fp4lab's quantization numerics (the test oracle).

This module is the *oracle* used by fp4lab's tests. It was written directly from the numerics
specification (now ``docs/numerics.md``) and independently of the ``fp4lab`` package (none of
whose code was read or imported while writing it), so that agreement between the two is
evidence that both follow the spec rather than a shared bug.

Conventions
-----------
* ``fl(e)`` in docs/numerics.md -- evaluate ``e`` in float32 with round-to-nearest-even -- is
  written here as one float32 NumPy operation per ``fl`` (:func:`_mul`, :func:`_div`, ...), in
  exactly the order the spec gives. NumPy's float32 ``*`` and ``/`` are IEEE-754 correctly
  rounded (RNE), and NumPy does not flush subnormals.
* Every public function takes ``ftz: bool = False``. With ``ftz=True`` the module emulates
  DAZ+FTZ hardware (what XLA:CPU does): every float32 *input* whose magnitude is below
  ``2**-126`` (a float32 subnormal) is replaced by a zero of the same sign before use, and the
  float32 result of every arithmetic op / float32-producing conversion is flushed the same way
  (:func:`ftz32`). Integer and bit manipulations are not flushed. Max-reductions operate on
  the already-flushed inputs.
* Element conversions (E2M1, E4M3, E5M2, FP16) are implemented with explicit arithmetic on
  exact float64 values (``frexp``/``ldexp``/``rint``), never with ``ml_dtypes``; the tests
  cross-check them against ``ml_dtypes`` / ``np.float16``.
* Block quantizers return codes *unpacked* (one code per element, same shape as ``x``) and
  scale arrays shaped ``(rows // b0, cols // b1)`` for a block shape ``(b0, b1)``. The caller
  guarantees divisibility.
* NaN and infinity handling follows docs/numerics.md plus the explicit choices documented on each
  function. Overflow/invalid warnings are suppressed locally (``np.errstate``).

Only ``numpy`` is imported (no jax, no ml_dtypes), and the float32 arithmetic of
:mod:`oracles.f32`.
"""

from __future__ import annotations

import numpy as np

from oracles.f32 import F32, FLT_MAX, Arith, ftz32

__all__ = [
    "FLT_MAX", "ELEM_MAX", "MX_EMAX",
    "ftz32",
    "e2m1_code", "e2m1_value",
    "e4m3_byte", "e4m3_value",
    "e5m2_byte", "e5m2_value",
    "fp16_bits", "fp16_value",
    "elem_encode", "elem_decode",
    "nvfp4_quantize", "nvfp4_dequantize",
    "nvfp4_4over6_quantize", "nvfp4_4over6_dequantize",
    "mx_scale_exponent", "mx_quantize", "mx_dequantize",
    "fp8_tensor_quantize", "fp8_tensor_dequantize",
    "fp8_block_quantize", "fp8_block_dequantize",
    "int_quantize", "int_dequantize",
    "q4_0_quantize", "q4_0_dequantize",
    "q8_0_quantize", "q8_0_dequantize",
    "stochastic_round_grid_probs",
]

# Largest finite value and OCP "emax" of each element format.
ELEM_MAX = {"e2m1": F32(6.0), "e4m3": F32(448.0), "e5m2": F32(57344.0)}
MX_EMAX = {"e2m1": 2, "e4m3": 8, "e5m2": 15}


# ----------------------------------------------------------------------------------------------
# float32 arithmetic helpers (oracles.f32): one helper call == one fl(...) of docs/numerics.md
# ----------------------------------------------------------------------------------------------

def _f32_in(a, ftz):
    """Convert an input to float32 and, under DAZ, flush its subnormals."""
    return Arith(ftz).f(a)


def _out(r, ftz):
    """Result of a float32 op: flushed under FTZ."""
    return Arith(ftz).f(r)


def _mul(a, b, ftz):
    """fl(a * b) in float32 (RNE), operands assumed already float32/flushed."""
    return Arith(ftz).mul(a, b)


def _div(a, b, ftz):
    """fl(a / b) in float32 (RNE)."""
    return Arith(ftz).div(a, b)


def _add(a, b, ftz):
    """fl(a + b) in float32 (RNE)."""
    return Arith(ftz).add(a, b)


def _min_flt_max(a):
    """min(a, FLT_MAX) with NaN propagation (np.minimum propagates NaN)."""
    return np.minimum(np.asarray(a, F32), FLT_MAX).astype(F32)


def _f64_to_f32(a, ftz):
    """Round an (exact) float64 to float32 with RNE; overflow gives inf; flushed under FTZ."""
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        r = np.asarray(a, dtype=np.float64).astype(F32)
    return _out(r, ftz)


# ----------------------------------------------------------------------------------------------
# Generic binary minifloat rounding / encoding (exact, in float64)
# ----------------------------------------------------------------------------------------------

def _round_to_grid(a64, mbits, emin):
    """Round non-negative finite float64 ``a64`` to the nearest value (RNE) of a binary format
    with ``mbits`` explicit mantissa bits and minimum normal exponent ``emin`` (no upper limit:
    the caller clips or detects overflow). The result is an exact float64 grid value.

    The spacing of the grid around ``a`` is ``2**(max(floor(log2 a), emin) - mbits)``; scaling by
    a power of two is exact in float64 and ``np.rint`` is round-half-to-even, so this performs a
    single correct rounding. A carry into the next binade (e.g. 0.96875 -> 1.0) is handled
    naturally because the result is a value, not a bit field.
    """
    _, ex = np.frexp(a64)                  # a = m * 2**ex, m in [0.5, 1)  ->  floor(log2 a) = ex-1
    e = np.maximum(ex - 1, emin)           # zeros get emin (frexp(0) = (0, 0))
    return np.ldexp(np.rint(np.ldexp(a64, mbits - e)), e - mbits)


def _grid_to_field(q64, mbits, emin, bias):
    """Encode an exact non-negative grid value as (exponent field << mbits) | mantissa field."""
    _, ex = np.frexp(q64)
    e = ex - 1
    normal = q64 >= np.ldexp(1.0, emin)
    # normal: q = (1 + m/2**mbits) * 2**e  ->  m = q * 2**(mbits-e) - 2**mbits
    mant_n = np.ldexp(q64, np.where(normal, mbits - e, 0)) - (1 << mbits)
    field_n = ((e + bias).astype(np.int64) << mbits) + mant_n.astype(np.int64)
    # subnormal (and zero): q = m * 2**(emin - mbits), exponent field 0
    field_s = np.ldexp(q64, mbits - emin).astype(np.int64)
    return np.where(normal, field_n, field_s)


def _decode_table(ebits, mbits, bias, kind):
    """Decode every bit pattern of a 1-ebits-mbits format into float64 values (explicitly).

    ``kind``: "fn" (E4M3: only all-ones exponent+mantissa is NaN, no inf), "ieee" (E5M2/FP16:
    all-ones exponent is inf when mantissa == 0, else NaN), "e2m1" (no specials).
    """
    n = 1 << (1 + ebits + mbits)
    bits = np.arange(n, dtype=np.int64)
    sign = np.where((bits >> (ebits + mbits)) & 1, -1.0, 1.0)
    efield = (bits >> mbits) & ((1 << ebits) - 1)
    mfield = bits & ((1 << mbits) - 1)
    emin = 1 - bias
    normal = np.ldexp(1.0 + mfield / float(1 << mbits), efield - bias)
    subnormal = np.ldexp(mfield.astype(np.float64), emin - mbits)
    val = sign * np.where(efield == 0, subnormal, normal)
    eall = (1 << ebits) - 1
    nan = np.copysign(np.nan, sign)                            # NaNs keep their sign bit
    if kind == "fn":
        val = np.where((efield == eall) & (mfield == (1 << mbits) - 1), nan, val)
    elif kind == "ieee":
        val = np.where((efield == eall) & (mfield == 0), sign * np.inf, val)
        val = np.where((efield == eall) & (mfield != 0), nan, val)
    return val


_E2M1_TABLE = _decode_table(2, 1, 1, "e2m1").astype(F32)    # 16 entries
_E4M3_TABLE = _decode_table(4, 3, 7, "fn").astype(F32)      # 256 entries
_E5M2_TABLE = _decode_table(5, 2, 15, "ieee").astype(F32)   # 256 entries
_FP16_TABLE = _decode_table(5, 10, 15, "ieee").astype(F32)  # 65536 entries


def _encode_fp8(v, ftz, *, mbits, bias, max_finite):
    """Shared satfinite RNE encoder for E4M3 / E5M2 (clip to +-max first, NaN -> 0x7F)."""
    v = _f32_in(v, ftz)
    nan = np.isnan(v)
    sign = np.signbit(v)
    a = np.clip(np.abs(np.where(nan, F32(0), v)), 0, max_finite).astype(np.float64)  # exact
    q = _round_to_grid(a, mbits, 1 - bias)
    field = _grid_to_field(q, mbits, 1 - bias, bias)
    byte = (sign.astype(np.int64) << 7) | field
    return np.where(nan, 0x7F, byte).astype(np.uint8)


# ----------------------------------------------------------------------------------------------
# Element conversions
# ----------------------------------------------------------------------------------------------

def e2m1_code(v, ftz: bool = False):
    """float32 -> 4-bit E2M1 code (0..15, sign in bit 3), RNE, saturating.

    Magnitude code from docs/numerics.md's branch-free formula with ``a = |v|``:
    ``(a>0.25)+(a>=0.75)+(a>1.25)+(a>=1.75)+(a>2.5)+(a>=3.5)+(a>5)``; everything above 5
    (including inf) -> 6.0 (code 7). Sign bit = ``np.signbit(v)`` (so -0.0 and -0.1 give 0x8).
    NaN -> code 0 (+0).
    """
    v = _f32_in(v, ftz)
    a = np.abs(v)
    with np.errstate(invalid="ignore"):
        mag = ((a > 0.25).astype(np.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
               + (a > 2.5) + (a >= 3.5) + (a > 5.0)).astype(np.uint8)
    nan = np.isnan(v)
    sign = (np.signbit(v) & ~nan).astype(np.uint8)
    return np.where(nan, 0, (sign << 3) | mag).astype(np.uint8)


def e2m1_value(code, ftz: bool = False):
    """4-bit E2M1 code (0..15) -> float32 value (grid 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign)."""
    code = np.asarray(code).astype(np.int64) & 0xF
    return _out(_E2M1_TABLE[code], ftz)


def e4m3_byte(v, ftz: bool = False):
    """float32 -> float8_e4m3fn byte: satfinite RNE (clip to +-448 first), subnormals kept
    (min 2**-9), sign kept (-0.0 -> 0x80), NaN -> 0x7F."""
    return _encode_fp8(v, ftz, mbits=3, bias=7, max_finite=ELEM_MAX["e4m3"])


def e4m3_value(byte, ftz: bool = False):
    """float8_e4m3fn byte -> float32 (0x7F / 0xFF -> NaN)."""
    byte = np.asarray(byte).astype(np.int64) & 0xFF
    return _out(_E4M3_TABLE[byte], ftz)


def e5m2_byte(v, ftz: bool = False):
    """float32 -> float8_e5m2 byte: satfinite RNE (clip to +-57344, so +-inf -> +-max),
    subnormals kept (min 2**-16), sign kept, NaN -> 0x7F."""
    return _encode_fp8(v, ftz, mbits=2, bias=15, max_finite=ELEM_MAX["e5m2"])


def e5m2_value(byte, ftz: bool = False):
    """float8_e5m2 byte -> float32 (0x7C = inf, 0x7D..0x7F = NaN, and their negatives)."""
    byte = np.asarray(byte).astype(np.int64) & 0xFF
    return _out(_E5M2_TABLE[byte], ftz)


def fp16_bits(v, ftz: bool = False):
    """float32 -> IEEE binary16 bits with RNE. Overflow goes to +-inf exactly as an ordinary
    cast does (|v| >= 65520 -> inf), +-inf -> +-inf, any NaN -> 0x7E00."""
    v = _f32_in(v, ftz)
    nan = np.isnan(v)
    sign = np.signbit(v)
    a = np.abs(np.where(nan, F32(0), v)).astype(np.float64)
    finite = np.isfinite(a)
    q = _round_to_grid(np.where(finite, a, 0.0), 10, -14)
    overflow = ~finite | (q > 65504.0)
    field = np.where(overflow, 0x7C00, _grid_to_field(np.where(overflow, 0.0, q), 10, -14, 15))
    bits = (sign.astype(np.int64) << 15) | field
    return np.where(nan, 0x7E00, bits).astype(np.uint16)


def fp16_value(bits, ftz: bool = False):
    """IEEE binary16 bits -> float32 (exact; fp16 subnormals are float32 normals)."""
    bits = np.asarray(bits).astype(np.int64) & 0xFFFF
    return _out(_FP16_TABLE[bits], ftz)


_ENCODERS = {"e2m1": e2m1_code, "e4m3": e4m3_byte, "e5m2": e5m2_byte}
_DECODERS = {"e2m1": e2m1_value, "e4m3": e4m3_value, "e5m2": e5m2_value}


def elem_encode(v, elem: str, ftz: bool = False):
    """Satfinite RNE element code of ``v`` for elem in {"e2m1", "e4m3", "e5m2"} (uint8)."""
    return _ENCODERS[elem](v, ftz=ftz)


def elem_decode(code, elem: str, ftz: bool = False):
    """Value (float32) of an element code for elem in {"e2m1", "e4m3", "e5m2"}."""
    return _DECODERS[elem](code, ftz=ftz)


# ----------------------------------------------------------------------------------------------
# Block helpers
# ----------------------------------------------------------------------------------------------

def _as_2d_block_shape(block_shape):
    b0, b1 = (int(b) for b in block_shape)
    return b0, b1


def _blocked(x, block_shape):
    """View a (M, N) array as (M//b0, b0, N//b1, b1)."""
    b0, b1 = _as_2d_block_shape(block_shape)
    m, n = x.shape
    assert m % b0 == 0 and n % b1 == 0, f"shape {x.shape} not divisible by block {block_shape}"
    return x.reshape(m // b0, b0, n // b1, b1)


def _block_reduce_absmax(x, block_shape):
    """Per-block max|x| (NaN-propagating, as np.max), shape (M//b0, N//b1)."""
    return np.max(np.abs(_blocked(x, block_shape)), axis=(1, 3)).astype(F32)


def _block_any(mask, block_shape):
    return np.any(_blocked(mask, block_shape), axis=(1, 3))


def _expand(per_block, block_shape):
    """Broadcast a (M//b0, N//b1) per-block array back to (M, N)."""
    b0, b1 = _as_2d_block_shape(block_shape)
    return np.repeat(np.repeat(per_block, b0, axis=0), b1, axis=1)


def _check_2d(x):
    x = np.asarray(x)
    assert x.ndim == 2, f"expected a 2D array, got shape {x.shape}"
    return x


# ----------------------------------------------------------------------------------------------
# NVFP4 (TE-exact)
# ----------------------------------------------------------------------------------------------

_F32_2688 = F32(2688.0)


def nvfp4_quantize(x, block_shape=(1, 16), amax=None, ftz: bool = False):
    """NVFP4 quantization, docs/numerics.md "NVFP4 (bit-exact with Transformer Engine)".

    Args:
      x: float32 (M, N). block_shape: (1, 16) for 1D blocks along the last axis or (16, 16)
        for 2D tiles (block amax over all 256 elements).
      amax: optional tensor amax to use instead of max|x| (e.g. a per-direction amax).
    Returns:
      (codes uint8 (M, N) unpacked 4-bit E2M1 codes,
       scale_bytes uint8 (M//b0, N//b1) E4M3 block scales,
       amax float32 scalar: the tensor amax used).
    """
    x = _f32_in(_check_2d(x), ftz)
    one = F32(1.0)
    # amax = max|x| over the whole tensor (np.max propagates NaN), or the one supplied.
    if amax is None:
        amax = np.max(np.abs(x)).astype(F32) if x.size else F32(0.0)
    amax = _f32_in(amax, ftz)

    # S_enc = min(fl(2688 / amax), FLT_MAX); 1 if amax == 0 or S_enc == 0 (covers amax = inf).
    s_enc = _min_flt_max(_div(_F32_2688, amax, ftz))
    s_enc = np.where((amax == 0) | (s_enc == 0), one, s_enc).astype(F32)
    s_dec = _div(one, s_enc, ftz)                              # S_dec = fl(1 / S_enc)

    # Per block: s_b = e4m3_satfinite(min(fl(bamax * fl(S_enc * fl(1/6))), FLT_MAX)).
    bamax = _block_reduce_absmax(x, block_shape)
    inv6 = _div(one, F32(6.0), ftz)                            # fl(1/6)
    s_enc_over6 = _mul(s_enc, inv6, ftz)                       # fl(S_enc * fl(1/6))
    scale_bytes = e4m3_byte(_min_flt_max(_mul(bamax, s_enc_over6, ftz)), ftz)

    # enc_b = min(fl(1 / fl(float(s_b) * S_dec)), FLT_MAX); zero scale -> 1/0 = inf -> FLT_MAX.
    s_b = e4m3_value(scale_bytes, ftz)
    enc_b = _min_flt_max(_div(one, _mul(s_b, s_dec, ftz), ftz))

    # q = E2M1_rne_satfinite(fl(x * enc_b)).
    codes = e2m1_code(_mul(x, _expand(enc_b, block_shape), ftz), ftz)
    return codes, scale_bytes, F32(amax)


def nvfp4_dequantize(codes, scale_bytes, amax, block_shape=(1, 16), ftz: bool = False):
    """NVFP4 dequantization: ``y = q * fl(fl(s_b * amax) * fl(1/2688))``; ``y = q * s_b`` when
    amax == 0. ``q`` is the signed E2M1 value, ``s_b`` the E4M3 scale of the element's block."""
    q = e2m1_value(codes, ftz)
    s_b = e4m3_value(scale_bytes, ftz)
    amax = _f32_in(amax, ftz)
    inv2688 = _div(F32(1.0), _F32_2688, ftz)                   # fl(1/2688)
    scale = _mul(_mul(s_b, amax, ftz), inv2688, ftz)           # fl(fl(s_b * amax) * fl(1/2688))
    scale = np.where(amax == 0, s_b, scale).astype(F32)
    return _mul(q, _expand(scale, block_shape), ftz)


# ----------------------------------------------------------------------------------------------
# NVFP4 with Four Over Six block scales (Transformer Engine's 4over6, TE-exact)
# ----------------------------------------------------------------------------------------------
# Ported line by line from NVIDIA/TransformerEngine d0067d0da6cb01811b8072a7d304f0e00344ce2b,
# transformer_engine/common/cast/nvfp4/quantize_4over6_nvfp4.cuh: compute_scale_pair (l.125-146),
# accumulate_dequant_error (l.190-202, the default error path), make_candidates (l.321-345),
# reduce_group_sum_16 (l.347-356), the selection err_map4 < err_map6 (l.494, l.541); the global
# encode scale of core_nvfp4.cuh l.79-95 and the dequantization of dequantize_nvfp4.cuh l.66-77.


def _e2m1_values(x, enc, ftz):
    """The candidate's E2M1 values q (signed float32) of ``fl(x * enc)``."""
    return e2m1_value(e2m1_code(_mul(x, enc, ftz), ftz), ftz)


def _four_over_six_error(q, sf, x, amax, six_e, error, ftz):
    """Per element: ``d = fl(fl(fl(fl(q * sf) * amax) / 6E) - x)``, then |d| or fl(d * d)."""
    val = _div(_mul(_mul(q, sf, ftz), amax, ftz), six_e, ftz)
    with np.errstate(invalid="ignore"):
        d = _out(np.subtract(val, x, dtype=F32), ftz)
    return np.abs(d) if error == "mae" else _mul(d, d, ftz)


def _line_sums(e, ftz):
    """Sum along the last axis one element after the other, from 0 (err = fl(err + e_i))."""
    total = np.zeros(e.shape[:-1], F32)
    for i in range(e.shape[-1]):
        total = _add(total, e[..., i], ftz)
    return total


def _warp_tree16(lines, ftz):
    """reduce_group_sum_16 over axis 1 (16 line sums): fl(e_i + e_{i+8}), then 4, 2, 1."""
    while lines.shape[1] > 1:
        half = lines.shape[1] // 2
        lines = _add(lines[:, :half], lines[:, half:], ftz)
    return lines[:, 0]


def nvfp4_4over6_quantize(x, block_shape=(1, 16), amax=None, e4m3_max=256, error="mae",
                          ftz: bool = False):
    """Four Over Six NVFP4 quantization as Transformer Engine's 4over6 kernel computes it.

    Per block: both candidates (the block amax mapped to 6: ``s6 = e4m3(min(base, 448))``,
    and to 4: ``s4 = e4m3(min(fl(base * 1.5), 448))``, ``base = fl(fl(bamax / 6) * S_enc)``,
    ``S_enc = fl(6E / amax)``), each rounded to nearest; the error of each summed in element
    order along the last axis (and, for (16, 16) tiles, the 16 row sums by the warp tree);
    map-to-4 kept only where its error is strictly smaller. Returns (codes, scale_bytes, amax)
    as :func:`nvfp4_quantize`; dequantize with ``y = q * fl(fl(s_b * amax) * fl(1/6E))``."""
    x = _f32_in(_check_2d(x), ftz)
    one, six_e = F32(1.0), F32(6 * e4m3_max)
    if amax is None:
        amax = np.max(np.abs(x)).astype(F32) if x.size else F32(0.0)
    amax = _f32_in(amax, ftz)
    s_enc = _min_flt_max(_div(six_e, amax, ftz))
    s_enc = np.where((amax == 0) | (s_enc == 0), one, s_enc).astype(F32)
    s_dec = _div(one, s_enc, ftz)
    base = _mul(_div(_block_reduce_absmax(x, block_shape), F32(6.0), ftz), s_enc, ftz)
    b0, b1 = _as_2d_block_shape(block_shape)
    chosen = []
    for pre in (_mul(base, F32(1.5), ftz), base):          # map-to-4, then map-to-6
        sbyte = e4m3_byte(np.minimum(pre, F32(448.0)), ftz)
        sf = e4m3_value(sbyte, ftz)
        enc = _min_flt_max(_div(one, _mul(sf, s_dec, ftz), ftz))
        q = _e2m1_values(x, _expand(enc, block_shape), ftz)
        e = _four_over_six_error(q, _expand(sf, block_shape), x, amax, six_e, error, ftz)
        lines = _line_sums(_blocked(e, block_shape), ftz)  # (M/b0, b0, N/b1)
        err = lines[:, 0] if b0 == 1 else _warp_tree16(lines, ftz)
        chosen.append((sbyte, q, err))
    (s4, q4, e4), (s6, q6, e6) = chosen
    with np.errstate(invalid="ignore"):
        four = e4 < e6                                     # ties and NaN: map-to-6
    scale_bytes = np.where(four, s4, s6).astype(np.uint8)
    q = np.where(_expand(four, block_shape), q4, q6).astype(F32)
    return e2m1_code(q, ftz), scale_bytes, F32(amax)


def nvfp4_4over6_dequantize(codes, scale_bytes, amax, block_shape=(1, 16), e4m3_max=256,
                            ftz: bool = False):
    """``y = q * fl(fl(s_b * amax) * fl(1/6E))``; ``y = q * s_b`` when amax == 0."""
    q = e2m1_value(codes, ftz)
    s_b = e4m3_value(scale_bytes, ftz)
    amax = _f32_in(amax, ftz)
    inv = _div(F32(1.0), F32(6 * e4m3_max), ftz)
    scale = _mul(_mul(s_b, amax, ftz), inv, ftz)
    scale = np.where(amax == 0, s_b, scale).astype(F32)
    return _mul(q, _expand(scale, block_shape), ftz)


# ----------------------------------------------------------------------------------------------
# MX (OCP Microscaling v1.0): 32-element blocks, E8M0 scales
# ----------------------------------------------------------------------------------------------

MX_BLOCK = 32


def _f32_fields(a):
    """(biased exponent field, mantissa field) of float32 values, as int64."""
    bits = np.asarray(a, dtype=F32).view(np.uint32).astype(np.int64)
    return (bits >> 23) & 0xFF, bits & 0x7FFFFF


def _pow2_f32(k, ftz):
    """Exact float32 2**k (k int array); built in float64 with ldexp, then cast (exact for
    k in [-149, 127])."""
    return _f64_to_f32(np.ldexp(1.0, np.asarray(k, dtype=np.int64)), ftz)


def mx_scale_exponent(bamax, elem: str, mode: str, ftz: bool = False):
    """Unbiased E8M0 exponent e (int64, in [-127, 127]) for finite block amaxes ``bamax``.

    rceil: d = fl(bamax * fl(1/max_elem)); from the float32 bits of d:
           normal d -> (exponent field - 127) + (mantissa != 0);
           subnormal/zero d -> -127 if d <= 2**-127 else -126.
    floor: e = floor(log2(bamax)) - emax_elem, from bamax's float32 exponent field.
    Both are clamped to [-127, 127]; bamax == 0 gives -127. Non-finite bamax is the caller's
    concern (the block gets scale byte 0xFF).
    """
    bamax = _f32_in(bamax, ftz)
    if mode == "rceil":
        inv_max = _div(F32(1.0), ELEM_MAX[elem], ftz)          # fl(1/max_elem)
        d = _mul(bamax, inv_max, ftz)                          # fl(bamax * fl(1/max_elem))
        efield, mant = _f32_fields(d)
        e_normal = (efield - 127) + (mant != 0)
        e_sub = np.where(d <= np.ldexp(F32(1.0), -127), -127, -126)
        e = np.where(efield == 0, e_sub, e_normal)
    elif mode == "floor":
        efield, _ = _f32_fields(bamax)
        # For a subnormal bamax floor(log2) is <= -127 while the field gives -127; after
        # subtracting emax >= 2 and clamping to -127 both give -127, so the field is exact here.
        e = (efield - 127) - MX_EMAX[elem]
    else:
        raise ValueError(f"unknown MX scale mode {mode!r}")
    e = np.where(bamax == 0, -127, e)
    return np.clip(e, -127, 127).astype(np.int64)


def mx_quantize(x, elem: str, mode: str = "rceil", ftz: bool = False):
    """MX quantization (MXFP8 E4M3/E5M2, MXFP4 E2M1), 32-element blocks along the last axis.

    Returns (codes uint8 (M, N): float8 bytes or 4-bit E2M1 codes,
             scale_bytes uint8 (M, N//32): E8M0 = e + 127, 0xFF for blocks with NaN/Inf).
    bamax == 0: e = -127 and all codes 0. NaN or Inf anywhere in a block: scale 0xFF and all
    codes of the block 0. Otherwise codes = satfinite_rne(fl(x * 2**-e)).
    """
    x = _f32_in(_check_2d(x), ftz)
    bs = (1, MX_BLOCK)
    bad = _block_any(~np.isfinite(x), bs)                      # NaN or Inf in the block
    with np.errstate(invalid="ignore"):
        bamax = _block_reduce_absmax(x, bs)
    e = mx_scale_exponent(np.where(bad, F32(0), bamax), elem, mode, ftz)
    scale_bytes = np.where(bad, 0xFF, e + 127).astype(np.uint8)

    inv_scale = _pow2_f32(-_expand(e, bs), ftz)               # exact 2**-e (normal for e<=126)
    codes = elem_encode(_mul(x, inv_scale, ftz), elem, ftz)
    zero_block = _expand(bad | (bamax == 0), bs)
    codes = np.where(zero_block, 0, codes).astype(np.uint8)
    return codes, scale_bytes


def mx_dequantize(codes, scale_bytes, elem: str, ftz: bool = False):
    """MX dequantization: value(code) * 2**e, computed exactly in float64 then rounded to float32
    (overflow -> inf, results that are float32 subnormals are flushed under ftz); scale byte 0xFF
    makes the whole block NaN."""
    codes = _check_2d(codes)
    bs = (1, MX_BLOCK)
    sb = np.asarray(scale_bytes).astype(np.int64)
    v = elem_decode(codes, elem).astype(np.float64)
    e = _expand(sb - 127, bs)
    y = _f64_to_f32(np.ldexp(v, e), ftz)
    return np.where(_expand(sb == 0xFF, bs), np.nan, y).astype(F32)


# ----------------------------------------------------------------------------------------------
# FP8 current scaling: per tensor and per block (DeepSeek-style 1x128 / 128x128)
# ----------------------------------------------------------------------------------------------

def _current_scale(amax, max_elem, ftz, nan_gives_one=True):
    """scale = min(fl(max_elem / amax), FLT_MAX); 1 when amax is 0 or inf, and when amax is NaN
    (TE's compute_scale_from_amax: the NaN elements stay NaN in FP8). ``nan_gives_one=False``
    (integers, which have no NaN code): NaN amax -> NaN scale. The clamp (as TE) keeps a tiny
    amax from giving an infinite scale, which would turn zeros into 0 * inf = NaN."""
    scale = _min_flt_max(_div(max_elem, amax, ftz))
    one = (amax == 0) | np.isinf(amax)
    if nan_gives_one:
        one = one | np.isnan(amax)
    return np.where(one, F32(1.0), scale).astype(F32)


def fp8_tensor_quantize(x, elem: str = "e4m3", amax=None, ftz: bool = False):
    """FP8 per-tensor current scaling. Returns (bytes uint8 same shape as x, scale float32,
    scale_inv float32) with bytes = satfinite_rne(fl(x * scale)), scale_inv = fl(1/scale)."""
    x = _f32_in(x, ftz)
    if amax is None:
        amax = np.max(np.abs(x)).astype(F32) if x.size else F32(0.0)
    amax = _f32_in(amax, ftz)
    scale = _current_scale(amax, ELEM_MAX[elem], ftz)
    codes = elem_encode(_mul(x, scale, ftz), elem, ftz)
    scale_inv = _div(F32(1.0), scale, ftz)
    return codes, F32(scale), F32(scale_inv)


def fp8_tensor_dequantize(codes, scale_inv, elem: str = "e4m3", ftz: bool = False):
    """value(code) * scale_inv (one fl multiply)."""
    return _mul(elem_decode(codes, elem, ftz), _f32_in(scale_inv, ftz), ftz)


def fp8_block_quantize(x, block_shape, elem: str = "e4m3", ftz: bool = False):
    """FP8 current scaling per block of ``block_shape`` ((1, 128) or (128, 128)).

    Returns (bytes uint8 (M, N), scale float32 (M//b0, N//b1), scale_inv float32 (M//b0, N//b1)).
    """
    x = _f32_in(_check_2d(x), ftz)
    bamax = _block_reduce_absmax(x, block_shape)
    scale = _current_scale(bamax, ELEM_MAX[elem], ftz)
    codes = elem_encode(_mul(x, _expand(scale, block_shape), ftz), elem, ftz)
    scale_inv = _div(F32(1.0), scale, ftz)
    return codes, scale, scale_inv


def fp8_block_dequantize(codes, scale_inv, block_shape, elem: str = "e4m3", ftz: bool = False):
    """value(code) * scale_inv of the element's block."""
    s = _expand(_f32_in(scale_inv, ftz), block_shape)
    return _mul(elem_decode(_check_2d(codes), elem, ftz), s, ftz)


# ----------------------------------------------------------------------------------------------
# Symmetric integer quantization (INT8 / INT4), per channel (row) or per group
# ----------------------------------------------------------------------------------------------

_QMAX = {8: 127, 4: 7}


def int_quantize(x, bits: int, axis_block=None, ftz: bool = False):
    """Symmetric abs-max integer quantization.

    ``axis_block=None``: one scale per row of the 2D input (per-channel); scale_inv has shape
    (M, 1). ``axis_block=g``: one scale per group of g consecutive elements along the last
    axis; scale_inv has shape (M, N//g).
    scale = fl(qmax/amax) (1 when amax is 0 or inf; a NaN amax gives a NaN scale);
    q = clip(rint(fl(x*scale)), -qmax, qmax) with NaN -> 0; scale_inv = fl(1/scale).
    Returns (q int8 (M, N), scale_inv float32).
    """
    x = _f32_in(_check_2d(x), ftz)
    qmax = _QMAX[bits]
    bs = (1, x.shape[1] if axis_block is None else int(axis_block))
    amax = _block_reduce_absmax(x, bs)
    scale = _current_scale(amax, F32(qmax), ftz, nan_gives_one=False)
    y = _mul(x, _expand(scale, bs), ftz)
    with np.errstate(invalid="ignore"):
        q = np.clip(np.rint(y), -qmax, qmax)                  # np.rint = round half to even
    q = np.where(np.isnan(q), 0, q).astype(np.int8)
    return q, _div(F32(1.0), scale, ftz)


def int_dequantize(q, scale_inv, axis_block=None, ftz: bool = False):
    """q * scale_inv (one fl multiply); scale_inv from :func:`int_quantize`."""
    q = _check_2d(q)
    bs = (1, q.shape[1] if axis_block is None else int(axis_block))
    return _mul(q.astype(F32), _expand(_f32_in(scale_inv, ftz), bs), ftz)


# ----------------------------------------------------------------------------------------------
# GGML Q4_0 / Q8_0 (32-element blocks along the last axis, fp16 block scale)
# ----------------------------------------------------------------------------------------------

GGML_BLOCK = 32


def q4_0_quantize(x, ftz: bool = False, block_shape=(1, GGML_BLOCK)):
    """GGML Q4_0: per 32-block, m = the signed value with the largest |x| (first occurrence on
    ties; NaN counts as the largest and the first NaN wins); d = fl(m / -8);
    id = fl(1/d) if d != 0 else 0 (NaN d -> NaN id);
    xi = min(15, floor(fl(fl(x*id) + 8.5))), NaN -> 8 (and clamped below at 0);
    q = xi - 8; d stored as fp16 RNE. ``block_shape`` (b0, b1): 2D tiles instead, with "first"
    in row-major order within the tile (fp4lab's ``tile=``; GGML itself has 1D blocks only).

    Returns (q int8 (M, N) in [-8, 7], d_bits uint16 (M//b0, N//b1)).
    """
    x = _f32_in(_check_2d(x), ftz)
    b0, b1 = _as_2d_block_shape(block_shape)
    tiles = _blocked(x, block_shape).transpose(0, 2, 1, 3)     # (M/b0, N/b1, b0, b1)
    flat = tiles.reshape(tiles.shape[0], tiles.shape[1], b0 * b1)
    # np.argmax returns the first maximal index and treats NaN as maximal (first NaN wins).
    idx = np.argmax(np.abs(flat), axis=-1)
    m = np.take_along_axis(flat, idx[..., None], axis=-1)[..., 0]
    d = _div(m, F32(-8.0), ftz)
    with np.errstate(divide="ignore"):
        inv = _div(F32(1.0), d, ftz)
    idd = np.where(d != 0, inv, F32(0.0)).astype(F32)         # NaN != 0 -> NaN id
    t = _add(_mul(x, _expand(idd, block_shape), ftz), F32(8.5), ftz)
    with np.errstate(invalid="ignore"):
        xi = np.clip(np.floor(t), 0, 15)
    xi = np.where(np.isnan(xi), 8, xi).astype(np.int64)
    return (xi - 8).astype(np.int8), fp16_bits(d, ftz)


def q4_0_dequantize(q, d_bits, ftz: bool = False, block_shape=(1, GGML_BLOCK)):
    """q * float32(fp16(d)) (one fl multiply)."""
    d = fp16_value(d_bits, ftz)
    return _mul(np.asarray(q).astype(F32), _expand(d, block_shape), ftz)


def q8_0_quantize(x, ftz: bool = False, block_shape=(1, GGML_BLOCK)):
    """GGML Q8_0: per 32-block, amax = max|x| (NaN-propagating); d = fl(amax/127);
    id = fl(1/d) if d != 0 else 0; q = round-half-away-from-zero(fl(x*id)) clipped to
    [-127, 127], NaN -> 0; d stored as fp16 RNE. ``block_shape``: 2D tiles instead.

    Returns (q int8 (M, N), d_bits uint16 (M//b0, N//b1)).
    """
    x = _f32_in(_check_2d(x), ftz)
    bs = _as_2d_block_shape(block_shape)
    amax = _block_reduce_absmax(x, bs)
    d = _div(amax, F32(127.0), ftz)
    with np.errstate(divide="ignore"):
        inv = _div(F32(1.0), d, ftz)
    idd = np.where(d != 0, inv, F32(0.0)).astype(F32)
    y = _mul(x, _expand(idd, bs), ftz)
    with np.errstate(invalid="ignore"):
        # roundf: half away from zero, as sign(y) * floor(|y| + 0.5) with the addition done in
        # float64, where it is exact for every float32 |y| < 2**52 (larger values clip anyway).
        r = np.sign(y) * np.floor(np.abs(y).astype(np.float64) + 0.5)
        q = np.clip(r, -127, 127)
    q = np.where(np.isnan(q), 0, q).astype(np.int8)
    return q, fp16_bits(d, ftz)


def q8_0_dequantize(q, d_bits, ftz: bool = False, block_shape=(1, GGML_BLOCK)):
    """q * float32(fp16(d)) (one fl multiply)."""
    d = fp16_value(d_bits, ftz)
    return _mul(np.asarray(q).astype(F32), _expand(d, block_shape), ftz)


# ----------------------------------------------------------------------------------------------
# Stochastic rounding: grid neighbours and round-up probability (documentation / tests)
# ----------------------------------------------------------------------------------------------

def _positive_grid(elem):
    table = {"e2m1": _E2M1_TABLE, "e4m3": _E4M3_TABLE, "e5m2": _E5M2_TABLE}[elem]
    vals = table.astype(np.float64)
    return np.unique(vals[np.isfinite(vals) & (vals >= 0)])   # sorted, includes 0


def stochastic_round_grid_probs(v, elem: str, ftz: bool = False):
    """Grid neighbours of |v| on the element grid and the SR round-up probability.

    Returns (lo, hi, p_up) as float64 arrays: lo <= |v| <= hi are neighbouring grid points
    (lo == hi == |v| when |v| is on the grid), p_up = (|v| - lo) / (hi - lo) (0 on the grid),
    so that E[SR(v)] = lo + p_up * (hi - lo) = |v|. |v| above the largest finite value is
    saturated to it (lo = hi = max, p_up = 0); NaN gives NaN for all three.
    """
    v = _f32_in(v, ftz)
    grid = _positive_grid(elem)
    a = np.minimum(np.abs(v).astype(np.float64), grid[-1])    # NaN propagates
    nan = np.isnan(a)
    a0 = np.where(nan, 0.0, a)
    lo = grid[np.searchsorted(grid, a0, side="right") - 1]
    hi = grid[np.searchsorted(grid, a0, side="left")]
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(hi > lo, (a0 - lo) / np.where(hi > lo, hi - lo, 1.0), 0.0)
    return (np.where(nan, np.nan, lo), np.where(nan, np.nan, hi), np.where(nan, np.nan, p))
