"""Rounding onto an element format's grid, saturating casts and 4-bit code packing.

All functions are pure, work elementwise on float32 arrays and are exact: every value is a
float32 on the target grid, computed with power-of-two scalings (exact) and a single rounding.

Conventions shared by the whole package:
* Round-to-nearest is ties-to-even and saturating ("satfinite"): magnitudes above the
  format's max become ±max, infinities included. NaN stays NaN in values; as a *code*, NaN
  becomes +0 in formats without NaN (E2M1, integers) and the format's NaN in FP8.
* Stochastic rounding rounds the magnitude up with probability ``(|v| - lo) / (hi - lo)``
  between its grid neighbours, from uniforms ``u`` in [0, 1) that the caller draws from an
  explicit key: unbiased for ``|v| <= max``.
* Signs are kept, including on zero: ``-0.1`` rounds to ``-0.0`` (E2M1 code 0x8), as the
  hardware conversions do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax

if TYPE_CHECKING:  # formats imports scaling, which imports this module
    from fp4lab.formats import ElementFormat

__all__ = [
    "float_bits",
    "from_bits",
    "pow2",
    "exponent",
    "abs_max",
    "round_nearest",
    "round_stochastic",
    "uniform",
    "saturate",
    "encode",
    "decode",
    "pack_nibbles",
    "unpack_nibbles",
]

FLT_MAX = float(jnp.finfo(jnp.float32).max)


def float_bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint32)


def from_bits(b: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(b.astype(jnp.uint32), jnp.float32)


def pow2(e: jax.Array) -> jax.Array:
    """Exact float32 ``2**e`` for integer ``e`` in [-126, 127] (built from the bits)."""
    return from_bits((e.astype(jnp.int32) + 127) << 23)


def exponent(a: jax.Array) -> jax.Array:
    """``floor(log2(|a|))`` for normal float32 ``a``; -127 for zero and subnormals (int32)."""
    return ((float_bits(a) >> 23) & 0xFF).astype(jnp.int32) - 127


def abs_max(x: jax.Array, axis=None, keepdims: bool = False) -> jax.Array:
    """``max |x|`` computed on the float32 bit patterns.

    Integer max over the magnitudes' bits is exact even for subnormals (which float max on a
    flush-to-zero CPU would drop), and it propagates NaN: every NaN's magnitude bits exceed
    those of inf. The result is a float32 (NaN if any element is NaN). On XLA:CPU it is also
    faster than a float max for block amaxes (measured 1.6x on the NVFP4 fake-quant)."""
    mag = float_bits(x.astype(jnp.float32)) & 0x7FFFFFFF
    return from_bits(jnp.max(mag, axis=axis, keepdims=keepdims))


def saturate(v: jax.Array, fmt: ElementFormat) -> jax.Array:
    """Clip to the finite range of ``fmt`` (NaN stays NaN)."""
    return jnp.clip(v, fmt.min_value, fmt.max)


def _float_grid_scaled(a: jax.Array, fmt: ElementFormat):
    """For non-negative ``a <= max``: ``t = a / ulp(a)`` and ``ulp`` on fmt's grid (exact)."""
    m = fmt.mantissa_bits
    e = jnp.maximum(exponent(a), fmt.emin)
    return a * pow2(m - e), pow2(e - m)


def round_nearest(v: jax.Array, fmt: ElementFormat) -> jax.Array:
    """Round float32 ``v`` to the nearest value of ``fmt`` (ties to even, saturating)."""
    v = v.astype(jnp.float32)
    if fmt.kind == "int":
        return saturate(jnp.round(v), fmt)
    if fmt.bits > 8:
        # BF16/FP16/FP32: XLA's convert is a single RNE rounding (not saturating).
        return v.astype(fmt.storage).astype(jnp.float32)
    # Minifloats: exact power-of-two scaling and one RNE rounding. (Measured on XLA:CPU this is
    # ~1.6x faster than a float8 convert, which XLA emulates in software.)
    a = jnp.minimum(jnp.abs(v), fmt.max)
    t, ulp = _float_grid_scaled(a, fmt)
    return jnp.copysign(jnp.round(t) * ulp, v)


def round_stochastic(v: jax.Array, fmt: ElementFormat, u: jax.Array) -> jax.Array:
    """Stochastically round ``v`` onto the grid of ``fmt`` with uniforms ``u`` in [0, 1).

    The magnitude is clipped to max first, then rounded up with probability equal to its
    fractional position between the neighbouring grid points, so ``E[result] = v`` for
    ``|v| <= max``."""
    v = v.astype(jnp.float32)
    a = jnp.minimum(jnp.abs(v), fmt.max)
    if fmt.kind == "int":
        t, ulp = a, 1.0
    else:
        if fmt.emin - fmt.mantissa_bits < -126:
            raise ValueError(
                f"stochastic rounding onto {fmt.name} is not supported: its subnormal spacing "
                "is below float32's normal range"
            )
        t, ulp = _float_grid_scaled(a, fmt)
    lo = jnp.floor(t)
    up = (u < (t - lo)).astype(jnp.float32)
    return jnp.copysign((lo + up) * ulp, v)


def uniform(key: jax.Array, shape) -> jax.Array:
    """Uniforms in [0, 1) with 24 random bits each, drawn from ``key``."""
    bits = jax.random.bits(key, shape, jnp.uint32)
    return (bits >> 8).astype(jnp.float32) * (2.0**-24)


def encode(q: jax.Array, fmt: ElementFormat) -> jax.Array:
    """Encode grid values ``q`` (float32, already rounded) in fmt's storage.

    FP8/BF16/FP16/FP32 become that dtype (exact); integers become int8 (NaN -> 0); E2M1 and
    INT4 become 4-bit codes in a uint8 (sign in bit 3 for E2M1, two's complement for INT4;
    NaN -> +0), to be packed with :func:`pack_nibbles`."""
    if fmt.kind == "int":
        i = jnp.where(jnp.isnan(q), 0.0, q).astype(jnp.int8)
        return (i.astype(jnp.uint8) & 0xF) if fmt.packed else i
    if fmt.bits > 8:
        return q.astype(fmt.storage)
    # Minifloat code from the float32 bits of a grid value: normals map their exponent and top
    # mantissa bits, subnormals are integer multiples of the smallest subnormal. NaN becomes
    # the format's NaN (0x7F: E4M3 and E5M2) or +0 where there is none (E2M1).
    nan = jnp.isnan(q)
    q = jnp.where(nan, 0.0, q)
    a = jnp.abs(q)
    m = fmt.mantissa_bits
    bits = float_bits(a)
    normal = (((exponent(a) + fmt.bias) << m) | ((bits >> (23 - m)) & ((1 << m) - 1)).astype(
        jnp.int32))
    sub = (a * (1.0 / fmt.min_subnormal)).astype(jnp.int32)
    mag = jnp.where(a >= fmt.min_normal, normal, sub)
    sign = jnp.signbit(q).astype(jnp.int32) << (fmt.bits - 1)
    code = (mag | sign).astype(jnp.uint8)
    if fmt.has_nan:
        code = jnp.where(nan, jnp.uint8(0x7F), code)
    return code if fmt.packed else lax.bitcast_convert_type(code, fmt.storage)


def _code_table(fmt: ElementFormat) -> jax.Array:
    pos = fmt.grid() if fmt.kind == "float" else []
    if fmt.kind == "int":  # two's complement nibble
        vals = [float(c if c < 8 else c - 16) for c in range(16)]
    else:
        vals = pos + [-p for p in pos]
        vals[len(pos)] = -0.0
    return jnp.asarray(vals, jnp.float32)


def decode(data: jax.Array, fmt: ElementFormat) -> jax.Array:
    """Inverse of :func:`encode`: stored elements (unpacked) -> float32 values."""
    if fmt.packed:
        return jnp.take(_code_table(fmt), data.astype(jnp.int32) & 0xF)
    return data.astype(jnp.float32)


def pack_nibbles(codes: jax.Array, axis: int) -> jax.Array:
    """Pack 4-bit codes two per byte along ``axis``: element 2i in the low nibble, 2i+1 in
    the high nibble (TE's ``cast_to_fp4x2``, torch's ``float4_e2m1fn_x2``)."""
    axis = axis % codes.ndim
    n = codes.shape[axis]
    if n % 2:
        raise ValueError(f"cannot pack an odd length {n} along axis {axis}")
    pairs = codes.reshape(codes.shape[:axis] + (n // 2, 2) + codes.shape[axis + 1 :])
    lo = lax.index_in_dim(pairs, 0, axis + 1, keepdims=False)
    hi = lax.index_in_dim(pairs, 1, axis + 1, keepdims=False)
    return (lo | (hi << 4)).astype(jnp.uint8)


def unpack_nibbles(packed: jax.Array, axis: int) -> jax.Array:
    """Inverse of :func:`pack_nibbles`."""
    axis = axis % packed.ndim
    both = jnp.stack([packed & 0xF, packed >> 4], axis=axis + 1)
    shape = packed.shape[:axis] + (2 * packed.shape[axis],) + packed.shape[axis + 1 :]
    return both.reshape(shape)
