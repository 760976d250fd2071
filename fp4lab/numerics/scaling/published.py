"""The quantizers of published recipes, each written from its authors' code
(docs/recipes/*.md name the repository, commit and lines) one float32 operation per step:
Four Over Six (as Transformer Engine runs it), Quartet's QuEST and Tseng quantizers, Quartet
II's RTN and MS-EDEN, TetraJet-v2's double-block NVFP4 and FP4 All the Way's NVFP4. Sums run
in a fixed order (element order within a block, then block sums in order), the canonical
order the test oracles use where the authors' kernels leave it to the compiler (Triton's
tl.sum). The protocol is :class:`fp4lab.numerics.scaling.standard.ScaleScheme`'s."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from fp4lab.numerics import rounding
from fp4lab.numerics.scaling.standard import (
    E4M3_SCALE, F32, FLT_MAX, E8M0Scale, ScaleScheme, _f32_div, group_blocks, nvfp4_bf16_values,
    nvfp4_encode_factor, nvfp4_multiplier, nvfp4_split)

__all__ = ["FourOverSixScale", "QuESTScale", "TsengScale", "Quartet2Scale", "EdenScale",
           "DoubleBlockScale", "EncodeFactorE4M3Scale"]


@dataclasses.dataclass(frozen=True)
class FourOverSixScale(ScaleScheme):
    """NVFP4 with Four Over Six block scaling (arXiv 2512.02010), bit-exact with Transformer
    Engine's 4over6 quantizer (``quantize_4over6_nvfp4.cuh``, NVIDIA/TransformerEngine
    d0067d0; docs/numerics.md): each block is quantized twice, its amax mapped to 6 and to 4,
    and keeps the candidate with the smaller error::

        S_enc = min(fl(6E / amax), FLT_MAX); S_enc = 1 if amax == 0 or S_enc == 0
        S_dec = fl(1 / S_enc);  base = fl(fl(bamax / 6) * S_enc)       (a true division)
        s6 = e4m3_satfinite(min(base, 448)),  s4 = e4m3_satfinite(min(fl(base * 1.5), 448))
        enc_c = min(fl(1 / fl(s_c * S_dec)), FLT_MAX);  q_c = rne_e2m1(fl(x * enc_c))
        err_c = sum over the block, in element order, of |d| (mae) or fl(d * d) (mse),
                d = fl(fl(fl(fl(q_c * s_c) * amax) / 6E) - x)
        keep 4 if err_4 < err_6 (ties and NaN: 6);  y = q * fl(fl(s * amax) * fl(1/6E))

    ``E`` is ``e4m3_max`` (256: TE's default for 4/6, room for the 1.5x of map-to-4; 448 as
    plain NVFP4). A 16x16 tile sums each line along the block axis in element order, then the
    16 line sums by TE's warp tree (``e_i + e_{i+8}``, then 4, 2, 1). Rounding to nearest
    only (TE refuses stochastic rounding with 4/6). NaN and Inf as :class:`NVFP4Scale`."""

    e4m3_max: int = 256
    error: Literal["mae", "mse"] = "mae"

    chooses_map_to_4 = True
    storage = E4M3_SCALE
    outer_amax = "tensor"
    stochastic_ok = False

    def __post_init__(self):
        if self.e4m3_max not in (256, 448):
            raise ValueError(f"e4m3_max={self.e4m3_max!r}: use 256 (4/6's default) or 448")
        if self.error not in ("mae", "mse"):
            raise ValueError(f"error={self.error!r}: use 'mae' (TE's default) or 'mse'")

    def _base(self, stat, tensor_amax):
        """``(S_enc, base = fl(fl(bamax / 6) * S_enc))``."""
        s_enc = nvfp4_encode_factor(tensor_amax, 6 * self.e4m3_max)
        return s_enc, rounding.div(stat, F32(6)) * s_enc

    def map_to_6(self, stat, tensor_amax):
        """The E4M3 scale each block would get mapped to 6 (plain NVFP4's choice): a stored
        scale that differs from it is a block mapped to 4."""
        return jnp.minimum(self._base(stat, tensor_amax)[1], F32(448)).astype(
            jnp.float8_e4m3fn)

    def _candidate(self, pre, s_dec, xb, tensor_amax, element, axes):
        """One candidate's stored scale ``e4m3(min(pre, 448))``, multiplier and block error."""
        s_c = jnp.minimum(pre, F32(448)).astype(jnp.float8_e4m3fn)
        sf = s_c.astype(jnp.float32)
        enc = jnp.minimum(rounding.div(F32(1), sf * s_dec), FLT_MAX)
        q = rounding.round_nearest(xb * enc, element)
        d = rounding.div((q * sf) * tensor_amax, F32(6 * self.e4m3_max)) - xb
        e = jnp.abs(d) if self.error == "mae" else rounding.opaque(d * d)
        return s_c, enc, _block_error_sum(e, axes)

    def encode(self, xb, stat, tensor_amax, element, axes=(), u=None):
        s_enc, base = self._base(stat, tensor_amax)
        s_dec = rounding.div(F32(1), s_enc)
        s4, enc4, err4 = self._candidate(base * F32(1.5), s_dec, xb, tensor_amax, element, axes)
        s6, enc6, err6 = self._candidate(base, s_dec, xb, tensor_amax, element, axes)
        four = err4 < err6  # strictly: ties and NaN errors keep map-to-6
        return jnp.where(four, s4, s6), jnp.where(four, enc4, enc6)

    def multipliers(self, scale, tensor_amax, element):
        return nvfp4_multiplier(scale, tensor_amax, 6 * self.e4m3_max)

    def gemm_split(self, scale, tensor_amax, element):
        return nvfp4_split(scale, tensor_amax, 6 * self.e4m3_max)

    def bf16_values(self, element):
        return nvfp4_bf16_values(element)


def _sum_in_order(a, axis):
    """Float32 sum along ``axis`` (keepdims) one element after the other, from the first."""
    total = jax.lax.index_in_dim(a, 0, axis)
    for i in range(1, a.shape[axis]):
        total = total + jax.lax.index_in_dim(a, i, axis)
    return total


def _block_error_sum(e, axes: tuple[int, ...]):
    """Per block (keepdims over ``axes``), the float32 sum of ``e`` as TE's 4/6 kernel adds it:
    along the last block axis one element after the other (``err = fl(err + e_i)``, from 0);
    for a 2D tile, then the line sums by the warp tree ``a_i = fl(e_i + e_{i+8})``, 4, 2, 1.
    Each addition is its own XLA add (no reduction whose order XLA chooses)."""
    total = _sum_in_order(e, axes[-1])
    if len(axes) == 2:
        lines = axes[0]
        while total.shape[lines] > 1:
            half = total.shape[lines] // 2
            total = (jax.lax.slice_in_dim(total, 0, half, axis=lines)
                     + jax.lax.slice_in_dim(total, half, 2 * half, axis=lines))
    return total


def _sign_positive(r, v):
    """``r`` (a magnitude) with the sign the authors' Triton kernels give it: ``+`` where
    ``v > 0``, ``-`` elsewhere (so a zero, of either sign, becomes -0)."""
    return jnp.where(v > 0, r, -r)


def _e4m3(x):
    """float32 ``x >= 0`` to E4M3, nearest-even, saturating at 448 (``cvt.rn.satfinite``)."""
    return jnp.minimum(x, F32(448)).astype(jnp.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class QuESTScale(E8M0Scale):
    """Quartet's forward quantizer (QuEST, IST-DASLab/Quartet 00ccd38,
    ``mxfp4_triton.py:51-57,130-165``): the block's scale comes from its standard deviation,
    not its maximum::

        ms = fl(sum(x*x) / n), mean = fl(sum(x) / n), std = sqrt(fl(ms - fl(mean*mean)))
        e  = floor(log2(fl(fl(gs * std) + 1e-8)))      gs = fl(2.92247856 / 6)
        v  = x / 2**e;  q = round to nearest E2M1, ties toward zero, sign + only where v > 0

    The block scale ``2**e`` is stored as its E8M0 byte (``e`` stays within [-27, 126]);
    values with ``|v| >= 6`` saturate, and Quartet's trust estimator passes the gradient only
    where ``|v| < 6`` (:func:`fp4lab.numerics.quantize.trust_mask`). A constant block has std 0 and
    quantizes to ``6 * 2**-27``-sized steps (as the authors' code does); NaN or Inf in a
    block gives the NaN byte (Quartet: NaN values too)."""

    gaussian_scale: float = 2.92247856 / 6.0
    eps: float = 1e-8

    stochastic_ok = False

    def statistic(self, xb, axes):
        (a,) = axes
        n = F32(xb.shape[a])
        ms = rounding.div(_sum_in_order(rounding.opaque(xb * xb), a), n)
        mean = rounding.div(_sum_in_order(xb, a), n)
        return jnp.sqrt(ms - rounding.opaque(mean * mean))

    def exponent(self, stat, element):
        scale = rounding.opaque(F32(self.gaussian_scale) * stat) + F32(self.eps)
        return jnp.clip(rounding.exponent(scale), -127, 127)

    def round_nearest(self, v, element):
        return _sign_positive(jnp.abs(rounding.round_nearest_ties(v, element, "toward_zero")), v)


@dataclasses.dataclass(frozen=True)
class TsengScale(ScaleScheme):
    """Quartet's backward quantizer (``AlbertTsengQuantizer``, IST-DASLab/Quartet 00ccd38,
    ``mxfp4_triton.py:58-61,70-129``): the scale of Tseng et al.'s "3/4 trick", which keeps
    every scaled value below 6 so that stochastic rounding never clips::

        d = fl(2**(floor(log2(amax)) - 2) / 0.75) = 2**(E-2) * fl(4/3);  v = fl(x / d)

    ``d`` is stored in float32 (no E8M0 byte can hold it; a hardware GEMM folds the 4/3 into
    its alpha). An all-zero block gives d = 0 and -0 values, NaN or Inf a NaN scale (NaN
    values). Elements round stochastically as fp4lab's SR does, which is the authors' law
    (``u < p`` rounds up), with the authors' sign rule (zeros become -0); ``rounding=
    "nearest"`` is the kernel's RTN branch (``stochastic=False``): ties toward zero, the same
    sign rule, as :class:`QuESTScale`."""

    def encode(self, xb, stat, tensor_amax, element, axes=(), u=None):
        e = rounding.exponent(stat)
        d = rounding.pow2(jnp.maximum(e - 2, -126)) * _f32_div(4, 3)
        d = jnp.where(e <= -125, F32(0), d)  # zero (or a subnormal amax: d underflows)
        d = jnp.where(jnp.isfinite(stat), d, F32(np.nan))
        return d, d

    def scale_elements(self, xb, d):
        return jnp.where(d == 0, F32(-0.0), rounding.div(xb, d))

    def round_nearest(self, v, element):  # the kernel's RTN branch: ties toward zero
        return _sign_positive(jnp.abs(rounding.round_nearest_ties(v, element, "toward_zero")), v)

    def round_stochastic(self, v, element, u):
        return _sign_positive(jnp.abs(rounding.round_stochastic(v, element, u)), v)

    def multipliers(self, scale, tensor_amax, element):
        return (scale,)

    def mask_codes(self, q, scale):
        return jnp.where(jnp.isnan(scale), 0.0, q)


def _quartet2_s_dec(tensor_amax, scales_max: float, val_max):
    """Quartet II's tensor scale ``fl(fl(amax / scales_max) / val_max)``, 1 where amax is 0."""
    s = rounding.div(rounding.div(tensor_amax, F32(scales_max)), val_max)
    return jnp.where(tensor_amax == 0, F32(1), s)


def _quartet2_block(pre):
    """Quartet II's block scale: ``e4m3(pre)``, 1 where that is 0, as float32."""
    s = _e4m3(pre).astype(jnp.float32)
    return jnp.where(s == 0, F32(1), s)


def _round_away(v, element):
    return _sign_positive(jnp.abs(rounding.round_nearest_ties(v, element, "away")), v)


@dataclasses.dataclass(frozen=True)
class Quartet2Scale(ScaleScheme):
    """Quartet II's forward NVFP4 quantizer (IST-DASLab/Quartet-II 8776a90,
    ``nvfp4_triton.py`` ``rtn_1x16s_fp4_kernel``), optionally with Four Over Six::

        s_dec = fl(fl(amax / S) / 6)  (1 where amax = 0),  S = 448, or 256 with 4/6
        s_b   = e4m3(fl(fl(bamax / 6) / s_dec))  (1 where that is 0);  d = fl(s_b * s_dec)
        v     = fl(x / d);  q = nearest E2M1, ties AWAY from zero;  y = fl(q * d)
        4/6:  s_a = e4m3(fl(fl(fl(bamax / 6) * 1.5) / s_dec)), the same steps; keep the
              map-to-6 block where err6 <= err4, err = sum of fl((x - y)**2) in element order

    Differences from Transformer Engine's NVFP4 (:class:`NVFP4Scale`): the decode-side
    arithmetic (divisions, not TE's encode factor), ties away from zero, a zero block scale
    replaced by 1, 4/6 choosing by squared error with ties to 6."""

    four_over_six: bool = False

    storage = E4M3_SCALE
    outer_amax = "tensor"
    stochastic_ok = False

    @property
    def scales_max(self) -> float:
        return 256.0 if self.four_over_six else 448.0

    @property
    def chooses_map_to_4(self) -> bool:
        return self.four_over_six

    def map_to_6(self, stat, tensor_amax):
        """The E4M3 scale each block would get mapped to 6 (a stored scale that differs from
        it is a block mapped to 4)."""
        s_dec = _quartet2_s_dec(tensor_amax, self.scales_max, F32(6))
        return _quartet2_block(rounding.div(rounding.div(stat, F32(6)), s_dec)).astype(
            jnp.float8_e4m3fn)

    def encode(self, xb, stat, tensor_amax, element, axes=(), u=None):
        s_dec = _quartet2_s_dec(tensor_amax, self.scales_max, F32(6))
        pre = rounding.div(stat, F32(6))
        s6 = _quartet2_block(rounding.div(pre, s_dec))
        d6 = s6 * s_dec
        if not self.four_over_six:
            return s6.astype(jnp.float8_e4m3fn), d6
        s4 = _quartet2_block(rounding.div(pre * F32(1.5), s_dec))
        d4 = s4 * s_dec
        (a,) = axes

        def err(d):
            y = rounding.opaque(_round_away(rounding.div(xb, d), element) * d)
            return _sum_in_order(rounding.opaque((xb - y) * (xb - y)), a)

        six = err(d6) <= err(d4)
        return (jnp.where(six, s6, s4).astype(jnp.float8_e4m3fn), jnp.where(six, d6, d4))

    def scale_elements(self, xb, d):
        return rounding.div(xb, d)

    def round_nearest(self, v, element):
        return _round_away(v, element)

    def multipliers(self, scale, tensor_amax, element):
        return (scale.astype(jnp.float32) * _quartet2_s_dec(tensor_amax, self.scales_max,
                                                            F32(6)),)


@dataclasses.dataclass(frozen=True)
class EdenScale(ScaleScheme):
    """Quartet II's backward quantizer, MS-EDEN (IST-DASLab/Quartet-II 8776a90,
    ``schemes/quartet_2.py`` ``eden_1x16s_fp4_kernel``, the Triton training code), applied
    after the recipe's 128-point RHT::

        vmax  = fl(6 / 0.988125);  s_dec = fl(fl(amax / 255.99) / vmax)  (1 where amax = 0)
        s_b   = e4m3(fl(fl(bamax / vmax) / s_dec))  (1 where 0);  xs = fl(x / fl(s_b * s_dec))
        q     = nearest E2M1 of xs, ties away from zero
        corr  = fl(sum(xs*xs) / sum(xs*q)) per 128 along the block axis (1 where the
                denominator is 0; sums: each 16-block in element order, then the 8 in order)
        c     = fl(s_b * corr), stochastically rounded to one of its E4M3 neighbours
                (``u < fl(fl(c - down) / fl(up - down))`` takes ``up``; 448's upper
                neighbour is the NaN byte, which is never taken)
        y     = fl(fl(q * s) * s_dec)

    The correction makes the rounding unbiased in the rotated domain; with
    ``rounding="nearest"`` the corrected scale is rounded to nearest instead."""

    scale_override: float = (17 / 16) * 0.93
    group: int = 128

    storage = E4M3_SCALE
    outer_amax = "tensor"
    stochastic_scale = True

    def _s_dec(self, tensor_amax):
        return _quartet2_s_dec(tensor_amax, 255.99, F32(6.0 / self.scale_override))

    def encode(self, xb, stat, tensor_amax, element, axes=(), u=None):
        (a,) = axes
        vmax = F32(6.0 / self.scale_override)
        s_dec = self._s_dec(tensor_amax)
        s_b = _quartet2_block(rounding.div(rounding.div(stat, vmax), s_dec))
        d = s_b * s_dec
        xs = rounding.div(xb, d)
        q = _round_away(xs, element)
        k = self.group // xb.shape[a]

        def group_sum(t):
            return group_blocks(_sum_in_order(rounding.opaque(t), a), a, k,
                                 lambda g, ax: _sum_in_order(g, ax))

        num, den = group_sum(xs * xs), group_sum(xs * q)
        corr = jnp.where(den == 0, F32(1), rounding.div(num, den))
        c = rounding.opaque(s_b * corr)
        cur = _e4m3(c)
        if u is None:
            return cur, d
        code = jax.lax.bitcast_convert_type(cur, jnp.uint8)
        above = cur.astype(jnp.float32) > c
        up = jnp.where(above, code, code + 1)
        down = jnp.where(above, code - 1, code)
        as_f32 = lambda b: jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(  # noqa: E731
            jnp.float32)
        p = rounding.div(c - as_f32(down), as_f32(up) - as_f32(down))
        s = jnp.where(u < p, up, down)
        return jax.lax.bitcast_convert_type(s, jnp.float8_e4m3fn), d

    def scale_elements(self, xb, d):
        return rounding.div(xb, d)

    def round_nearest(self, v, element):
        return _round_away(v, element)

    def round_stochastic(self, v, element, u):
        return _round_away(v, element)  # the scale was rounded stochastically, not these

    def multipliers(self, scale, tensor_amax, element):
        return (scale.astype(jnp.float32), self._s_dec(tensor_amax))


@dataclasses.dataclass(frozen=True)
class DoubleBlockScale(ScaleScheme):
    """TetraJet-v2's double-block NVFP4 (thu-ml/TetraJet-v2-NVFP4Training ca5953f,
    ``kernels/csrc/quant_fp4.cu`` ``quant_fp4_from_reg``): a float32 outer scale per 128
    elements along the block axis in place of NVFP4's per-tensor scale, E4M3 inner scales
    per 16::

        outer = fl(fl(amax128 / 448) / 6)  (1 where 0)
        inner = e4m3(fl(fl(amax16 / outer) / 6))  (2**-9 before the cast where 0)
        d = fl(outer * inner);  v = fl(x * fl(1 / d));  q = nearest-even E2M1;  y = fl(q * d)

    ``global_scale`` holds each 16-block's outer amax (the 128-block's, repeated). Stochastic
    rounding is TetraJet-v2's dithering: ``r = u - 0.5`` moves ``|v|`` by ``r`` times half
    the spacing of its binade (0.5, 1, 2 below 2, 4, 6), clamped to the binade, then
    nearest-even. The authors' kernel drops NaN from its maxima (``fmaxf``); here a NaN makes
    its 128-block NaN, as NaN does in every fp4lab format."""

    outer: int = 128

    storage = E4M3_SCALE

    @property
    def outer_amax(self) -> int:  # one amax per `outer` elements along the block axis
        return self.outer

    @staticmethod
    def _outer(amax):
        o = rounding.div(rounding.div(amax, F32(448)), F32(6))
        return jnp.where(o == 0, F32(1), o)

    def encode(self, xb, stat, tensor_amax, element, axes=(), u=None):
        inner = rounding.div(rounding.div(stat, self._outer(tensor_amax)), F32(6))
        inner = _e4m3(jnp.where(inner == 0, F32(2.0**-9), inner))
        d = self._outer(tensor_amax) * inner.astype(jnp.float32)
        inv = jnp.where(d != 0, rounding.div(F32(1), d), F32(0))
        return inner, inv

    def multipliers(self, scale, tensor_amax, element):
        return (self._outer(tensor_amax) * scale.astype(jnp.float32),)

    def round_stochastic(self, v, element, u):
        r = u - F32(0.5)
        a = jnp.abs(v)
        dithered = jnp.where(a <= 2, jnp.clip(a + r * F32(0.5), 0, 2),
                             jnp.where(a <= 4, jnp.clip(a + r, 2, 4),
                                       jnp.clip(a + r * F32(2), 4, 6)))
        return rounding.round_nearest(jnp.copysign(dithered, v), element)


@dataclasses.dataclass(frozen=True)
class EncodeFactorE4M3Scale(ScaleScheme):
    """The NVFP4 quantizer of FP4 All the Way (arXiv 2505.19115; ``experimental/fp4.py``
    ``fake_quant_fp4(..., block_size=16, scale_format='e4m3')`` as its public copies give
    it): the per-block *encode* factor is what is rounded to E4M3::

        st = fl(amax * fl(1 / (6 * fp8_max)));  xs = fl(x / st)
        sb = e4m3(fl(6 / max|xs|)): 1 where that is 0, Inf or NaN
        v  = fl(xs * sb);  q = nearest-even E2M1;  y = fl(fl(q / sb) * st)

    ``e4m3()`` is PyTorch's ``.to(torch.float8_e4m3fn)``, whose overflow rule changed in
    PyTorch 2.13 (pytorch/pytorch#178817): before, the eager cast gave NaN beyond 464 (a block
    far below the tensor's amax, whose ``6 / max|xs|`` exceeds 464, falls back to ``sb = 1`` and
    flushes to zero); from 2.13 it saturates at 448 (inf too), so such a block keeps its values
    and an all-zero block stores 448. ``saturating_cast=False`` (format ``nvfp4_atw``) is the
    rule of the PyTorch the paper ran on (2025); ``True`` (``nvfp4_atw_sat``) the authors' code
    under PyTorch >= 2.13.

    Two deliberate departures, both in docs/numerics.md: the authors' rounding does not
    saturate (a block whose rounded-up subnormal ``sb`` gives ``v >= 7`` rounds to 8, off the
    E2M1 grid), here it saturates at 6 so the codes stay E2M1; an all-zero tensor gives NaN
    there (``0 / 0``) and zeros here. SR is the authors' ``round(k*v + u - 0.5) / k``. The
    sign is the authors' ``torch.sign(x) * R``: an input zero of either sign gives +0, and a
    zero ``R`` keeps the sign ``round`` gave it (SR: -0 where ``k*|v| + n`` is negative), so
    a zero result's sign is that of ``sign(x) * R``."""

    fp8_max: float = 448.0
    saturating_cast: bool = False

    storage = E4M3_SCALE
    outer_amax = "tensor"

    def _st(self, tensor_amax):
        st = tensor_amax * _f32_div(1, 6 * self.fp8_max)
        return jnp.where(st == 0, F32(1), st)

    def encode(self, xb, stat, tensor_amax, element, axes=(), u=None):
        st = self._st(tensor_amax)
        f = rounding.div(F32(6), rounding.div(stat, st))
        sb = _e4m3(f)  # torch's cast: nearest-even, 464 (a tie) to 448 ...
        ok = sb.astype(jnp.float32) > 0  # (0 and NaN: 1)
        if not self.saturating_cast:  # ... beyond it NaN before PyTorch 2.13, hence 1
            ok = ok & (f <= 464)
        sb = jnp.where(ok, sb, jnp.ones_like(sb))
        return sb, (st, sb.astype(jnp.float32))

    def scale_elements(self, xb, m):
        st, sb = m
        return rounding.opaque(rounding.div(xb, st)) * sb

    @staticmethod
    def _sign(v):
        """torch.sign: +1, -1, or +0 for a zero of either sign (NaN: 0)."""
        return jnp.where(v > 0, F32(1), jnp.where(v < 0, F32(-1), F32(0)))

    def round_nearest(self, v, element):  # sign(x) * R: a zero of either sign gives +0
        return self._sign(v) * jnp.abs(rounding.round_nearest(v, element))

    def round_stochastic(self, v, element, u):
        n = u - F32(0.5)
        a = jnp.abs(v)
        k = jnp.where(a < 2, F32(2), jnp.where(a < 4, F32(1), F32(0.5)))
        r = jnp.round(rounding.opaque(a * k) + n) / k  # a * k: exact (a power of two)
        # sign(x) * R: R is -0 where round() of a negative sum gave -0 (the authors' sign)
        return self._sign(v) * jnp.minimum(r, F32(element.max))

    def dequantize(self, q, scale, tensor_amax, element):
        return rounding.opaque(rounding.div(q, scale.astype(jnp.float32))) * self._st(
            tensor_amax)
