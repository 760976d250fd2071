"""The standard scale schemes: abs-max (FP8, INT), NVFP4 as Transformer Engine computes it
(and its row-scaled variant), MX power-of-two scales, GGML's Q4_0/Q8_0; the protocol
(:class:`ScaleScheme`) they and the published schemes (:mod:`fp4lab.numerics.scaling.published`)
share. See :mod:`fp4lab.numerics.scaling`."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp4lab.numerics import rounding

__all__ = ["ScaleStorage", "ScaleScheme", "NoScale", "AbsMaxScale", "NVFP4Scale",
           "RowScaledNVFP4Scale", "E8M0Scale", "PowerOfTwoScale", "CeilPowerOfTwoScale",
           "GGMLQ4_0Scale", "GGMLQ8_0Scale", "Outer", "group_blocks", "nvfp4_encode_factor",
           "nvfp4_multiplier", "nvfp4_split", "nvfp4_bf16_values", "fits_bf16", "significant_bits",
           "NO_SCALE", "FP32_SCALE", "FP16_SCALE", "E4M3_SCALE", "E8M0_SCALE"]

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)

class ScaleStorage(NamedTuple):
    """How a block scale is stored: its dtype, its number format's name (for tables) and its
    bits per block (0: no scale)."""

    dtype: str
    name: str
    bits: int


NO_SCALE = ScaleStorage("float32", "fp32", 0)
FP32_SCALE = ScaleStorage("float32", "fp32", 32)
FP16_SCALE = ScaleStorage("float16", "fp16", 16)
E4M3_SCALE = ScaleStorage("float8_e4m3fn", "e4m3", 8)
E8M0_SCALE = ScaleStorage("uint8", "e8m0", 8)


class Outer(NamedTuple):
    """The part of a decode that a GEMM applies to its product instead of to the elements, as
    the hardware does (TE's NVFP4 GEMM takes the global scales as cuBLAS's ``alpha``, FP8 GEMMs
    the per-tensor ``scale_inv``): ``factor / divisor``, both float32, broadcastable to the
    blocks and constant along the block axis. A GEMM of two operands scales its float32
    product by ``alpha = fl(fl(factor_x * factor_w) * fl(1 / (divisor_x * divisor_w)))``
    (TE's ``amax_A * amax_B * fl(1 / (6 * 448)**2)``; divisors are integers whose product
    float32 holds exactly)."""

    factor: jax.Array
    divisor: jax.Array


BF16_SMALLEST = 2.0**-133  # BF16's least subnormal


def significant_bits(element) -> int:
    """The most significant bits of any of an element format's values."""
    return element.mantissa_bits + 1 if element.kind == "float" else element.bits - 1


def fits_bf16(bits: int, smallest: float) -> bool:
    """Whether every float32 number of at most ``bits`` significant bits whose last bit lies
    at or above ``smallest`` is a BF16 number (8 significant bits and float32's exponent
    range, subnormals from 2**-133 included; beyond float32's range both are infinite)."""
    return bits <= 8 and smallest >= BF16_SMALLEST


def _f32_div(a: float, b: float) -> np.float32:
    """fl(a / b) as a float32 division (not a float64 division rounded twice)."""
    return F32(a) / F32(b)


@dataclasses.dataclass(frozen=True)
class ScaleScheme:
    """Base class; see the module docstring."""

    storage = FP32_SCALE  # how the block scale is stored
    # where the outer (second-level) amax that enters the block scales comes from: None, or
    # "tensor" (NVFP4's per-tensor amax), "slice" (one per slice along the block axis), or an
    # int n (one per n elements along the block axis); fp4lab.quantize computes it
    outer_amax = None
    stochastic_ok = True  # False: the scheme's choice of scale assumes rounding to nearest
    stochastic_scale = False  # True: "stochastic" rounds the block scale, not the elements

    def statistic(self, xb: jax.Array, axes: tuple[int, ...]) -> jax.Array:
        return rounding.abs_max(xb, axis=axes, keepdims=True)

    def encode(self, xb, stat, outer, element, axes: tuple[int, ...], u=None):
        """``(stored_scale, multiplier)`` of each block from its statistic ``stat``, the outer
        amax ``outer`` (:attr:`outer_amax`; None without one) and, for schemes whose choice
        of scale looks at the block's elements, ``xb`` blocked over ``axes``; ``u``: one
        uniform per block, for schemes with ``stochastic_scale``."""
        raise NotImplementedError(f"{type(self).__name__} defines no encode")

    def scale_elements(self, xb, multiplier):
        """The scaled elements ``v`` (before rounding) from :meth:`encode`'s multiplier:
        ``fl(x * multiplier)``; schemes that divide by their scale override it."""
        return xb * multiplier

    def round_stochastic(self, v, element, u):
        """Stochastic rounding of the scaled elements with uniforms ``u`` (one per element)."""
        return rounding.round_stochastic(v, element, u)

    def dequantize(self, q, scale, tensor_amax, element):
        """The element values ``q`` times the :meth:`multipliers`, in order."""
        for m in self.multipliers(scale, tensor_amax, element):
            q = q * m
        return q

    def multipliers(self, scale, tensor_amax, element) -> tuple[jax.Array, ...]:
        """The decode multipliers :meth:`dequantize` applies in order (a scheme that
        dequantizes otherwise overrides :meth:`dequantize` instead)."""
        raise NotImplementedError(f"{type(self).__name__} defines no multipliers")

    def gemm_split(self, scale, tensor_amax, element) -> tuple[tuple[jax.Array, ...],
                                                               Outer | None] | None:
        """How a GEMM decodes the operand (docs/numerics.md, "The GEMM"): the multipliers it
        applies to the elements, in order, and the :class:`Outer` factor it applies to the
        product instead (None: none); or None (the default): the elements are
        :meth:`dequantize`'s values, in float32."""
        return None

    def bf16_values(self, element) -> bool:
        """Whether the GEMM multiplies the inner values of :meth:`gemm_split` as BF16: they
        are all BF16 numbers (at or above 2**-126, for MX; docs/numerics.md, "The GEMM").
        Otherwise float32."""
        return False

    def round_nearest(self, v, element):
        return rounding.round_nearest(v, element)

    def bad_scale(self, scale) -> jax.Array:
        """Per block: True where the stored scale is zero or subnormal (scale health)."""
        s = scale.astype(jnp.float32)
        return jnp.abs(s) < float(jnp.finfo(self.storage.dtype).smallest_normal)

    def mask_codes(self, q, scale):
        """Hook to override element values in special blocks before they are encoded."""
        return q


@dataclasses.dataclass(frozen=True)
class NoScale(ScaleScheme):
    """Pass-through casts (BF16/FP16/FP32): no scale."""

    storage = NO_SCALE


@dataclasses.dataclass(frozen=True)
class AbsMaxScale(ScaleScheme):
    """Current (abs-max) scaling with a float32 scale, per tensor, channel or block.

    ``scale = min(fl(max_elem / amax), FLT_MAX)``, elements ``fl(x * scale)`` (saturating);
    the stored scale is the decode scale ``fl(1 / scale)`` (TE's ``scale_inv``), so
    dequantization is ``q * scale_inv``. Used by FP8 per-tensor (TE current scaling),
    DeepSeek-V3 style 1x128 / 128x128 FP8 and symmetric INT8/INT4.

    Special amaxes, as TE's ``compute_scale_from_amax``: 0 or inf gives scale 1 (so an Inf
    element saturates to the max and the rest quantizes at scale 1); the clamp keeps a tiny
    amax from giving an infinite scale (and 0 * inf = NaN). A NaN amax gives scale 1 for FP8
    elements, as TE does: the NaN elements stay NaN (the element format has one). Integers
    have no NaN code, so there a NaN amax gives a NaN scale: the block dequantizes to NaN
    rather than losing the NaN."""

    def encode(self, xb, stat, tensor_amax, element, axes=(), u=None):
        scale = jnp.minimum(rounding.div(F32(element.max), stat), FLT_MAX)
        one = (stat == 0) | jnp.isinf(stat)
        if element.has_nan:
            one = one | jnp.isnan(stat)
        scale = jnp.where(one, F32(1), scale)
        return rounding.div(F32(1), scale), scale

    def multipliers(self, scale, tensor_amax, element):
        return (scale,)

    def gemm_split(self, scale, tensor_amax, element):
        # the decode scale after the product, as FP8 GEMMs take scale_inv (where it is constant
        # along the GEMM's reduction: per tensor or per channel; fp4lab.quantize checks)
        return (), Outer(scale, F32(1))

    def bf16_values(self, element):
        return fits_bf16(significant_bits(element), element.min_subnormal)


@dataclasses.dataclass(frozen=True)
class NVFP4Scale(ScaleScheme):
    """NVFP4 two-level scaling, bit-exact with Transformer Engine (docs/numerics.md)::

        S_enc = min(fl(2688 / amax), FLT_MAX); S_enc = 1 if amax == 0 or S_enc == 0
        S_dec = fl(1 / S_enc)
        s_b   = e4m3_satfinite(min(fl(bamax * fl(S_enc * fl(1/6))), FLT_MAX))
        enc_b = min(fl(1 / fl(s_b * S_dec)), FLT_MAX)
        y     = q * fl(fl(s_b * amax) * fl(1/2688))      (q * s_b when amax == 0)

    NaN anywhere in the tensor makes amax NaN, every block scale the E4M3 NaN (0x7F) and the
    whole tensor dequantize to NaN: a NaN never disappears silently. An infinity makes amax
    inf, so S_enc = 1, its block scale saturates to 448 and dequantization gives inf/NaN.
    """

    storage = E4M3_SCALE
    outer_amax = "tensor"

    def encode(self, xb, stat, tensor_amax, element, axes=(), u=None):
        s_enc = nvfp4_encode_factor(tensor_amax, 2688)
        s_dec = rounding.div(F32(1), s_enc)
        s_b = jnp.minimum(stat * (s_enc * _f32_div(1, 6)), FLT_MAX)
        s_b = jnp.minimum(s_b, F32(448)).astype(jnp.float8_e4m3fn)
        enc = jnp.minimum(rounding.div(F32(1), s_b.astype(jnp.float32) * s_dec), FLT_MAX)
        return s_b, enc

    def multipliers(self, scale, tensor_amax, element):
        return nvfp4_multiplier(scale, tensor_amax, 2688)

    def gemm_split(self, scale, tensor_amax, element):
        return nvfp4_split(scale, tensor_amax, 2688)

    def bf16_values(self, element):
        return nvfp4_bf16_values(element)


def nvfp4_encode_factor(tensor_amax, six_e: int):
    """NVFP4's ``S_enc = min(fl(6E / amax), FLT_MAX)``, 1 where ``amax == 0`` or ``S_enc == 0``
    (``amax = inf``); ``6E`` is 2688 (E4M3's 448) or, for Four Over Six, 1536."""
    s_enc = jnp.minimum(rounding.div(F32(six_e), tensor_amax), FLT_MAX)
    return jnp.where((tensor_amax == 0) | (s_enc == 0), F32(1), s_enc)


def nvfp4_multiplier(scale, tensor_amax, six_e: int) -> tuple[jax.Array]:
    """NVFP4's decode multiplier ``fl(fl(s * amax) * fl(1/6E))`` (``s`` where amax is 0)."""
    s = scale.astype(jnp.float32)
    m = (s * tensor_amax) * _f32_div(1, six_e)
    return (jnp.where(tensor_amax == 0, s, m),)


def nvfp4_split(scale, tensor_amax, six_e: int) -> tuple[tuple[jax.Array], Outer]:
    """NVFP4 in a GEMM, as TE's: the E4M3 block scale on the elements, the per-tensor
    ``amax / 6E`` on the product (``alpha``); where amax is 0 the decode is ``q * s`` alone
    (:func:`nvfp4_multiplier`), so the outer factor is 1."""
    zero = tensor_amax == 0
    return (scale.astype(jnp.float32),), Outer(jnp.where(zero, F32(1), tensor_amax),
                                               jnp.where(zero, F32(1), F32(six_e)))


def nvfp4_bf16_values(element) -> bool:
    """E2M1 times an E4M3 scale: at most 2 + 4 significant bits, from 2**-10 to 2688."""
    return fits_bf16(significant_bits(element) + 4,
                     element.min_subnormal * float(jnp.finfo(jnp.float8_e4m3fn).smallest_subnormal))


@dataclasses.dataclass(frozen=True)
class RowScaledNVFP4Scale(ScaleScheme):
    """NVFP4 whose second-level amax is one per slice along the block axis instead of one per
    tensor: per row (token) of an activation blocked along K, per feature of its transposed
    copy blocked along the tokens; Transformer Engine's row-scaled NVFP4 activations
    (``NVTE_NVFP4_ROW_SCALED_ACTIVATION``, quantize_transpose_nvfp4.cuh at d0067d0). Every
    other step is :class:`NVFP4Scale`'s, with the slice's amax in place of the tensor's.
    TE refuses it with 2D tiles, stochastic rounding and a given (reduced) amax: so does
    ``fp4lab.quantize``."""

    storage = E4M3_SCALE
    outer_amax = "slice"
    stochastic_ok = False

    encode = NVFP4Scale.encode
    multipliers = NVFP4Scale.multipliers
    gemm_split = NVFP4Scale.gemm_split
    bf16_values = NVFP4Scale.bf16_values


@dataclasses.dataclass(frozen=True)
class E8M0Scale(ScaleScheme):
    """Power-of-two block scales ``2**e``, stored as the E8M0 byte ``e + 127``; subclasses
    choose ``e`` (:meth:`exponent`, clamped to [-127, 127]). A block holding NaN or Inf gets
    the NaN byte 0xFF and zero codes; it dequantizes to NaN."""

    storage = E8M0_SCALE

    def exponent(self, stat, element):
        raise NotImplementedError

    def encode(self, xb, stat, tensor_amax, element, axes=(), u=None):
        finite = jnp.isfinite(stat)
        e = self.exponent(stat, element)
        byte = jnp.where(finite, e + 127, 255).astype(jnp.uint8)
        mult = jnp.where(finite, rounding.pow2(jnp.clip(-e, -126, 127)), 0.0)
        return byte, mult

    def multipliers(self, scale, tensor_amax, element):
        e = scale.astype(jnp.int32) - 127
        hi = e >> 1  # floor(e / 2): both factors stay normal floats for e in [-127, 127]
        m1 = jnp.where(scale == 255, jnp.nan, rounding.pow2(hi))
        return (m1, rounding.pow2(e - hi))

    def mask_codes(self, q, scale):
        return jnp.where(scale == 255, 0.0, q)  # NaN blocks store zero codes

    def gemm_split(self, scale, tensor_amax, element):
        return self.multipliers(scale, tensor_amax, element), None

    def bf16_values(self, element):
        """An element times ``2**e`` (at most 8 significant bits) is a BF16 number at or above
        2**-126; below, BF16's subnormals hold it only down to the block exponent whose least
        element value is 2**-133 (E4M3: -124, E5M2: -117) and the GEMM rounds the rest to
        them, where XLA:CPU flushes float32 operands to zero anyway (docs/numerics.md)."""
        return significant_bits(element) <= 8

    def bad_scale(self, scale):
        return scale == 0  # 2**-127: the exponent clamped at the bottom of E8M0's range


@dataclasses.dataclass(frozen=True)
class PowerOfTwoScale(E8M0Scale):
    """MX (OCP Microscaling) E8M0 block scales, stored as the biased exponent byte.

    ``rceil`` (default; TE MXFP8, torchao RCEIL): ``e = ceil(log2(fl(amax * fl(1/max))))``
    from the float32 bits; ``floor`` (OCP, torchao FLOOR): ``e = floor(log2(amax)) - emax``.
    Both clamped to [-127, 127]; amax = 0 gives e = -127. A block holding NaN or Inf gets the
    NaN byte 0xFF and zero codes; it dequantizes to NaN.
    """

    mode: Literal["rceil", "floor"] = "rceil"

    def __post_init__(self):
        if self.mode not in ("rceil", "floor"):
            raise ValueError(f"unknown MX scale mode {self.mode!r}; use 'rceil' or 'floor'")

    def exponent(self, stat, element):
        if self.mode == "rceil":
            d = stat * _f32_div(1, element.max)
            bits = rounding.float_bits(d)
            e_field = ((bits >> 23) & 0xFF).astype(jnp.int32)
            mant = bits & 0x7FFFFF
            normal = e_field - 127 + (mant != 0).astype(jnp.int32)
            sub = jnp.where(bits <= 0x00400000, -127, -126)  # d <= 2**-127 rounds to -127
            e = jnp.where(e_field > 0, normal, sub)
        else:
            e = rounding.exponent(stat) - element.emax
        return jnp.clip(e, -127, 127)


@dataclasses.dataclass(frozen=True)
class CeilPowerOfTwoScale(E8M0Scale):
    """Power-of-two block scales that never saturate (DeepSeek-V3's "round scaled" scales):
    ``e = ceil(log2(amax / max))`` exactly, the least integer with ``amax <= max * 2**e``,
    clamped to [-127, 127], stored as MX's E8M0 byte.

    Exact in float32 without a division or a logarithm: for normal ``amax = 1.f * 2**E`` and
    ``max = 1.g * 2**emax``, ``e = E - emax + (f > g)``, comparing the two mantissa fields.
    amax = 0 or subnormal (whose exact exponent lies below -127 for every element format) gives
    e = -127; a NaN or Inf in the block gives the NaN byte, zero codes and NaN values, as MX."""

    def exponent(self, stat, element):
        bits = rounding.float_bits(stat)
        e_field = ((bits >> 23) & 0xFF).astype(jnp.int32)
        max_mant = int(np.float32(element.max).view(np.uint32)) & 0x7FFFFF
        above = ((bits & 0x7FFFFF) > max_mant).astype(jnp.int32)
        e = jnp.where(e_field > 0, e_field - 127 - element.emax + above, -127)
        return jnp.clip(e, -127, 127)


def _q4_0_thresholds() -> np.ndarray:
    """``T(n)`` for ``n = 1..15``: the smallest float32 ``v`` with ``fl(v + 8.5) >= n``.

    Found once, here, with NumPy's IEEE float32 addition: from ``n - 8.5`` (where the sum is
    exactly ``n``) step down one float32 at a time while the rounded sum still reaches ``n``.
    ``fl(v + 8.5)`` is non-decreasing in ``v``, so ``floor(fl(v + 8.5)) >= n`` exactly when
    ``v >= T(n)``."""
    eight_half, down = F32(8.5), F32(-np.inf)
    out = []
    for n in range(1, 16):
        v = F32(n - 8.5)
        while F32(np.nextafter(v, down) + eight_half) >= n:
            v = np.nextafter(v, down)
        out.append(v)
    table = np.array(out, F32)
    n = np.arange(1, 16)
    off = np.where(n >= 9, 2.0**-21, np.where(n >= 5, 2.0**-22, 0.0))
    assert np.array_equal(table, (n - 8.5 - off).astype(F32)), table  # round_nearest's form
    return table


Q4_0_THRESHOLDS = _q4_0_thresholds()  # T(1), ..., T(15)


@dataclasses.dataclass(frozen=True)
class GGMLQ4_0Scale(ScaleScheme):
    """GGML Q4_0 (as used for Gemma-style QAT checkpoints): per 32-block, ``m`` = the signed
    value of largest magnitude (first on ties), ``d = fl(m / -8)``, ``id = fl(1/d)`` (0 when
    d = 0), ``q = min(15, floor(fl(fl(x * id) + 8.5))) - 8`` in [-8, 7], ``d`` stored as
    float16; dequantize ``q * d``. Matches GGML's arithmetic (values and scales), with our
    packing (two's complement nibbles, element 2i low) rather than GGML's byte layout.

    The element rounding needs ``v = fl(x * id)`` rounded before 8.5 is added, and XLA
    contracts ``x * id + 8.5`` into one FMA (on CPU and GPU alike), which moved codes. So no
    addition consumes ``v``: with ``k = floor(v)``, ``floor(fl(v + 8.5))`` is ``k + 9`` when
    ``v`` reaches the threshold ``T(k + 9)`` (the least float32 whose rounded sum with 8.5 is
    ``k + 9``; :data:`Q4_0_THRESHOLDS`) and ``k + 8`` otherwise. This equals GGML's
    ``clip(floor(fl(v + 8.5)), 0, 15)`` for every float32 ``v``; NaN gives code 0."""

    storage = FP16_SCALE

    def statistic(self, xb, axes):
        """The value of largest magnitude in each block (the first in row-major order on
        ties, for 2D tiles too; a NaN wins)."""
        last = tuple(range(-len(axes), 0))
        flat = jnp.moveaxis(xb, axes, last)
        lead = flat.shape[:-len(axes)]
        flat = flat.reshape(lead + (math.prod(flat.shape[len(lead):]),))
        idx = jnp.argmax(jnp.abs(flat), axis=-1, keepdims=True)
        return jnp.expand_dims(jnp.take_along_axis(flat, idx, axis=-1)[..., 0], axes)

    def encode(self, xb, stat, tensor_amax, element, axes=(), u=None):
        d = rounding.div(stat, F32(-8))
        inv = jnp.where(d != 0, rounding.div(F32(1), d), F32(0))
        return d.astype(jnp.float16), inv

    def multipliers(self, scale, tensor_amax, element):
        return (scale.astype(jnp.float32),)

    def round_nearest(self, v, element):
        # T(n) = (n - 8.5) - off(n) exactly, off = 0, 2**-22, 2**-21 for n in 1..4, 5..8,
        # 9..15 (half the float32 spacing just below n, where that is finer than v's own;
        # checked against the searched table at import). k = floor(v) stands between the
        # product and every addition, so nothing can be contracted.
        k = jnp.floor(v)
        n = k + F32(9)
        off = jnp.where(n >= 9, F32(2.0**-21), jnp.where(n >= 5, F32(2.0**-22), F32(0)))
        up = (v >= (k + F32(0.5)) - off).astype(jnp.float32)
        xi = jnp.clip(k + F32(8) + up, F32(0), F32(15))
        return jnp.where(jnp.isnan(v), F32(0), xi - F32(8))


@dataclasses.dataclass(frozen=True)
class GGMLQ8_0Scale(ScaleScheme):
    """GGML Q8_0: per 32-block ``d = fl(amax / 127)``, ``id = fl(1/d)`` (0 when d = 0),
    ``q = roundf(fl(x * id))`` (half away from zero), ``d`` stored as float16."""

    storage = FP16_SCALE

    def encode(self, xb, stat, tensor_amax, element, axes=(), u=None):
        d = rounding.div(stat, F32(127))
        inv = jnp.where(d != 0, rounding.div(F32(1), d), F32(0))
        return d.astype(jnp.float16), inv

    def multipliers(self, scale, tensor_amax, element):
        return (scale.astype(jnp.float32),)

    def round_nearest(self, v, element):
        r = jax.lax.round(v, jax.lax.RoundingMethod.AWAY_FROM_ZERO)
        return jnp.clip(r, -element.max, element.max)


def group_blocks(per_block, inner: int, k: int, reduce):
    """A per-block array (keepdims: block dims of size 1 in the blocked layout) reduced over
    groups of ``k`` consecutive blocks along the block-count axis ``inner - 1`` with
    ``reduce(array, axis)`` (keepdims), broadcast back to one entry per block. The last group
    is padded with zero blocks."""
    count = inner - 1
    n = per_block.shape[count]
    pad = -n % k
    if pad:
        widths = [(0, pad if d == count else 0) for d in range(per_block.ndim)]
        per_block = jnp.pad(per_block, widths)
    shape = per_block.shape
    g = per_block.reshape(shape[:count] + ((n + pad) // k, k) + shape[count + 1:])
    r = jnp.broadcast_to(reduce(g, count + 1), g.shape).reshape(shape)
    return jax.lax.slice_in_dim(r, 0, n, axis=count)
