"""NumPy oracles for the published FP4 quantizers fp4lab reproduces (fp4lab/numerics/scaling/published.py), ported from the oracles of docs/recipes/*.md (section "NumPy oracle"):

* Quartet, IST-DASLab/Quartet @ 00ccd38e544ac5fd56b7837844a427114b884ef8,
  ``src/models/quantization/quantizers/mxfp4_triton.py`` (``mxfp4_forward_kernel``): the QuEST
  forward quantizer (:func:`quest_mxfp4`) and the AlbertTsengQuantizer path
  (:func:`tseng_mxfp4`); both on already-rotated values.
* Quartet II, IST-DASLab/Quartet-II @ 8776a90b7aa0c0a400ad858a3c05a66f7ec55b73,
  ``src/models/quantization/quantizers/nvfp4_triton.py`` ``rtn_1x16s_fp4_kernel``
  (:func:`quartet2_rtn`, with or without Four Over Six) and
  ``src/models/quantization/schemes/quartet_2.py`` ``eden_1x16s_fp4_kernel`` (MS-EDEN,
  :func:`eden`).
* TetraJet-v2, thu-ml/TetraJet-v2-NVFP4Training @ ca5953f643d85c793fb3a210bf21f17fc88ce83e,
  ``kernels/csrc/quant_fp4.cu`` ``quant_fp4_from_reg`` and ``get_value_added_noise``
  (:func:`double_block`), ``kernels/csrc/quant_fp8.cu`` (:func:`tetrajet_fp8`) and
  OutControl's GEMMs, ``olmo2-training/olmo/quantization_real/linear_mix.py``
  (:func:`outcontrol_gemms`).
* FP4 All the Way (arXiv 2505.19115), ``experimental/fp4.py`` ``fake_quant_fp4(...,
  block_size=16, scale_format='e4m3')`` as its public copies give it (the authors' repository
  is not available, so no commit can be named) (:func:`atw_nvfp4`).

Conventions (fp4lab's canonical choices where the authors' kernels leave them to the compiler):

* float32, one rounding per operation (NumPy's float32 ``* / + - sqrt`` are IEEE, RNE).
* Every float32 sum runs sequentially in element order, written as an explicit loop
  (:meth:`_Arith.seqsum`), never ``np.sum``/``np.add.reduce`` (pairwise / unrolled orders).
  MS-EDEN's per-128 sums: each 16-block in element order, then the 8 block sums in order.
* ``ftz=True`` emulates XLA:CPU's DAZ/FTZ: float32 inputs and the result of every float32
  operation below 2**-126 in magnitude become a zero of the same sign.
* Stochastic rounding takes the uniforms ``u`` in [0, 1) that fp4lab draws (one per element,
  or for MS-EDEN one per 16-block): Quartet's Tseng SR takes ``hi`` when ``u < p``;
  TetraJet-v2's dither uses ``r = u - 0.5``; FP4 All the Way's SR uses ``n = u - 0.5``.
* Where fp4lab deliberately departs from the authors (stated in the class docstrings of
  fp4lab/numerics/scaling/published.py), the oracle follows fp4lab by default and reproduces the authors with a
  keyword: :func:`double_block` ``nan_propagates`` (the kernel's ``fmaxf`` drops NaN from the
  maxima), :func:`atw_nvfp4` ``saturate`` (the authors' rounding can give 8) and
  ``guard_zero_tensor`` (the authors' all-zero tensor is NaN).

Each oracle takes a 2D float32 array blocked along its last axis and returns
``(values, scale)``: the dequantized float32 values, and the per-block stored scale as float32
values, shaped ``(rows, cols // block)``. Only NumPy is imported (nothing from fp4lab).
"""

from __future__ import annotations

import numpy as np

from oracles.f32 import F32 as F
from oracles.f32 import Arith as _Arith

__all__ = ["e2m1_rne", "e4m3_rne_sat", "e4m3_code", "e4m3_value", "quest_mxfp4", "tseng_mxfp4",
           "quartet2_rtn", "eden", "double_block", "tetrajet_fp8", "outcontrol_gemms",
           "atw_nvfp4", "GAUSSIAN_SCALE"]

GAUSSIAN_SCALE = F(2.92247856 / 6.0)  # Quartet's gs, a float32 constant of the kernel


def _absmax(g, axis=-1):
    """max |g| along ``axis`` (keepdims); NaN propagates (torch's ``amax``, Triton's max)."""
    return np.max(np.abs(g), axis=axis, keepdims=True).astype(F)


# --------------------------------------------------------------------------- element grids


def e2m1_rne(v):
    """float32 -> E2M1 value, nearest, ties to even, saturating at 6 (cvt.rn.satfinite.e2m1);
    the sign is ``v``'s, NaN stays NaN."""
    v = np.asarray(v, F)
    a = np.abs(v).astype(np.float64)
    step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))
    with np.errstate(invalid="ignore"):
        q = np.minimum(np.round(np.minimum(a, 6.0) / step) * step, 6.0)
    return np.copysign(q, v).astype(F)


_MIDPOINTS = ((0.25, .5), (0.75, 1), (1.25, 1.5), (1.75, 2), (2.5, 3), (3.5, 4), (5, 6))


def e2m1_gt(a):
    """Quartet's RTN magnitude: strict ``>`` against the midpoints, ties toward zero; NaN -> 0."""
    a = np.asarray(a, F)
    out = np.zeros_like(a)
    for thr, val in _MIDPOINTS:
        out = np.where(a > F(thr), F(val), out)
    return out


def e2m1_ge(a):
    """Quartet II's ``rtn_fp4`` magnitude: ``>=`` against the midpoints, ties away from zero."""
    a = np.asarray(a, F)
    out = np.zeros_like(a)
    for thr, val in _MIDPOINTS:
        out = np.where(a >= F(thr), F(val), out)
    return out


def sign_positive(v):
    """The Triton kernels' sign: +1 where ``v > 0``, else -1 (zeros and NaN get -1)."""
    return np.where(np.asarray(v) > 0, F(1), F(-1))


def e4m3_rne_sat(v):
    """float32 -> E4M3 (fn) value, nearest-even, saturating at +-448; NaN stays NaN."""
    v = np.asarray(v, F).astype(np.float64)
    a = np.abs(v)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), -6)
        ulp = 2.0 ** (e - 3)
        q = np.minimum(np.round(a / ulp) * ulp, 448.0)
    q = np.where(a == 0, 0.0, q)
    return np.where(np.isnan(v), np.nan, np.copysign(q, v)).astype(F)


def e4m3_torch(v, saturating: bool = False):
    """torch ``.to(torch.float8_e4m3fn)``, nearest-even: before PyTorch 2.13 NOT saturating
    (beyond 464, and +-inf, -> NaN); ``saturating``: PyTorch 2.13's eager cast
    (pytorch/pytorch#178817), where every magnitude beyond 448, inf included, gives +-448."""
    v = np.asarray(v, F)
    if saturating:
        return e4m3_rne_sat(np.clip(v, F(-448), F(448)))  # clip keeps NaN
    q = e4m3_rne_sat(v).astype(np.float64)
    with np.errstate(invalid="ignore"):
        bad = (np.abs(v) > 464) | ~np.isfinite(v)
    return np.where(bad, np.nan, q).astype(F)


def e4m3_value(code):
    """The value of a non-negative E4M3 (fn) code 0..0x7F (0x7F is NaN)."""
    c = np.asarray(code, np.int64)
    e, m = c >> 3, c & 7
    val = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8.0) * 2.0 ** (e - 7))
    return np.where(c == 0x7F, np.nan, val).astype(F)


def e4m3_code(value):
    """The code of a non-negative E4M3 value (exact grid values, NaN -> 0x7F)."""
    table = e4m3_value(np.arange(0x7F))
    v = np.asarray(value, F)
    idx = np.searchsorted(table, np.where(np.isnan(v), 0, v))
    return np.where(np.isnan(v), 0x7F, idx).astype(np.int64)


def _pow2_floor(s):
    """``2**floor(log2(s))`` for positive float32 ``s`` (exact, from frexp); NaN/inf kept."""
    s = np.asarray(s, F)
    fin = np.isfinite(s) & (s > 0)
    m, ex = np.frexp(np.where(fin, s, F(1)))
    p = np.ldexp(np.ones_like(s), (ex - 1).astype(np.int32)).astype(F)
    return np.where(fin, p, np.where(s == 0, F(0), s)).astype(F), ex - 1


def _blocks(x, b):
    x = np.asarray(x, F)
    assert x.ndim == 2 and x.shape[1] % b == 0, x.shape
    return x.reshape(x.shape[0], x.shape[1] // b, b)


# --------------------------------------------------------------------------- Quartet


def quest_mxfp4(x, *, ftz=False, group=32):
    """Quartet's QuEST forward quantizer (``mxfp4_forward_kernel`` with ``quest=True``, RTN) on
    already-rotated ``x``: ms = fl(seqsum(g*g)/32), mean = fl(seqsum(g)/32),
    std = sqrt(fl(ms - fl(mean*mean))), scale = fl(fl(gs*std) + fl32(1e-8)),
    shared = 2**floor(log2(scale)), v = fl(g/shared), q = RTN ties toward zero with the sign
    rule ``v > 0 ? + : -``, y = fl(q*shared). Returns (y, shared)."""
    A = _Arith(ftz)
    g = A.f(_blocks(x, group))
    n = F(group)
    ms = A.div(A.seqsum(A.mul(g, g)), n)
    mean = A.div(A.seqsum(g), n)
    std = A.sqrt(A.sub(ms, A.mul(mean, mean)))  # NaN where cancellation went negative
    scale = A.add(A.mul(GAUSSIAN_SCALE, std), F(1e-8))
    shared, _ = _pow2_floor(scale)
    v = A.div(g, shared)
    q = e2m1_gt(np.abs(v)) * sign_positive(v)
    y = A.mul(q, shared)
    return y.reshape(np.shape(x)), shared[..., 0]


def tseng_mxfp4(x, u=None, *, ftz=False, group=32):
    """Quartet's AlbertTsengQuantizer path (``quest=False``) on already-rotated ``x``:
    shared = fl(2**(floor(log2(amax)) - 2) / 0.75), v = fl(g/shared); with uniforms ``u`` (one
    per element) SR between the grid neighbours (lo, hi) of |v|, ``hi`` where ``u < p``,
    p = (|v| - lo) / (hi - lo); without, the kernel's RTN (ties toward zero). Sign rule
    ``v > 0 ? + : -``; y = fl(q*shared). Returns (y, shared)."""
    A = _Arith(ftz)
    g = A.f(_blocks(x, group))
    amax = _absmax(g)
    with np.errstate(all="ignore"):
        ex = np.floor(np.log2(amax.astype(np.float64)))  # exact for float32 amax; 0 -> -inf
        p2 = A.f(np.exp2(ex - 2).astype(F))
    shared = A.div(p2, F(0.75))
    v = A.div(g, shared)
    a = np.abs(v)
    sgn = sign_positive(v)
    if u is None:
        q = e2m1_gt(a) * sgn
    else:
        uu = np.asarray(u, F).reshape(g.shape)
        hi = np.full_like(a, F(0.5))
        lo = np.zeros_like(a)
        for t, h_, l_ in ((0.5, 1, .5), (1, 1.5, 1), (1.5, 2, 1.5), (2, 3, 2), (3, 4, 3),
                          (4, 6, 4)):
            hi = np.where(a > F(t), F(h_), hi)
            lo = np.where(a > F(t), F(l_), lo)
        p = A.div(A.sub(a, lo), A.sub(hi, lo))
        q = np.where(uu < p, hi, lo) * sgn
    y = A.mul(q, shared)
    return y.reshape(np.shape(x)), shared[..., 0]


# --------------------------------------------------------------------------- Quartet II


def quartet2_rtn(x, *, four_over_six=False, ftz=False, group=16):
    """Quartet II's ``rtn_1x16s_fp4_kernel`` (scale_override 1): s_dec =
    fl(fl(amax/S)/6) (1 where amax = 0; S = 448, or 256 with Four Over Six), s_b =
    e4m3(fl(fl(bamax/6)/s_dec)) (1 where 0), d = fl(s_b*s_dec), y = fl(rtn_ge(fl(x/d))*d)
    (ties away, sign rule ``x > 0 ? + : -``). Four Over Six: the candidate s_a =
    e4m3(fl(fl(fl(bamax/6)*1.5)/s_dec)), block errors seqsum(fl(fl(x-y)**2)), keep the 6
    candidate where err6 <= err4. Returns (y, block scale)."""
    A = _Arith(ftz)
    g = A.f(_blocks(x, group))
    amax = F(np.max(np.abs(g)))
    smax = F(256.0) if four_over_six else F(448.0)
    vmax = F(6.0)
    s_dec = F(1) if amax == 0 else A.div(A.div(amax, smax), vmax)
    pre = A.div(_absmax(g), vmax)

    def candidate(p):
        s = e4m3_rne_sat(A.div(p, s_dec))
        s = np.where(s == 0, F(1), s).astype(F)
        d = A.mul(s, s_dec)
        v = A.div(g, d)
        y = A.mul(e2m1_ge(np.abs(v)) * sign_positive(v), d)
        return s, y

    s6, y6 = candidate(pre)
    if not four_over_six:
        return y6.reshape(np.shape(x)), s6[..., 0]
    s4, y4 = candidate(A.mul(pre, F(1.5)))

    def err(y):
        d = A.sub(g, y)
        return A.seqsum(A.mul(d, d))

    six = err(y6) <= err(y4)
    return np.where(six, y6, y4).reshape(np.shape(x)), np.where(six, s6, s4)[..., 0]


EDEN_OVERRIDE = (17 / 16) * 0.93


def eden(x, u_scale=None, *, ftz=False, group=16, had=128):
    """Quartet II's MS-EDEN (``eden_1x16s_fp4_kernel``) on already-rotated ``x``, with the
    tensor amax max|x|: vmax = fl(6/0.988125), s_dec = fl(fl(amax/255.99)/vmax) (1 where 0),
    s_b = e4m3(fl(fl(bamax/vmax)/s_dec)) (1 where 0), xs = fl(x/fl(s_b*s_dec)), q = rtn_ge(xs)
    with the sign rule; per 128 along the row: corr = fl(num/den) (1 where den = 0),
    num = sum(fl(xs*xs)), den = sum(fl(xs*q)) (each 16-block in order, then the 8 block sums
    in order); c = fl(s_b*corr); ``u_scale`` (one uniform per 16-block): SR of c between its
    E4M3 neighbours (codes cur-1/cur or cur/cur+1 around cur = e4m3(c); ``up`` where
    ``u < fl(fl(c - down)/fl(up - down))``; 448's upper neighbour is NaN and never taken);
    without ``u_scale``: s = e4m3(c) (nearest). y = fl(fl(q*s)*s_dec). Returns (y, s)."""
    A = _Arith(ftz)
    g = A.f(_blocks(x, group))
    rows, nb, _ = g.shape
    assert nb % (had // group) == 0
    vmax = F(6.0 / EDEN_OVERRIDE)
    amax = F(np.max(np.abs(g)))
    s_dec = F(1) if amax == 0 else A.div(A.div(amax, F(255.99)), vmax)
    s_b = e4m3_rne_sat(A.div(A.div(_absmax(g), vmax), s_dec))
    s_b = np.where(s_b == 0, F(1), s_b).astype(F)
    xs = A.div(g, A.mul(s_b, s_dec))
    q = e2m1_ge(np.abs(xs)) * sign_positive(xs)
    k = had // group

    def group_sum(t):
        per16 = A.seqsum(t)  # (rows, nb, 1)
        per128 = A.seqsum(per16.reshape(rows, nb // k, k), axis=-1)  # (rows, nb/k, 1)
        return np.repeat(per128, k, axis=1)  # back to (rows, nb, 1)

    num, den = group_sum(A.mul(xs, xs)), group_sum(A.mul(xs, q))
    corr = np.where(den == 0, F(1), A.div(num, den)).astype(F)
    c = A.mul(s_b, corr)
    cur = e4m3_rne_sat(c)
    if u_scale is None:
        s = cur
    else:
        code = e4m3_code(cur)
        above = cur > c
        up = e4m3_value(np.where(above, code, code + 1))
        down = e4m3_value(np.where(above, code - 1, code))
        p = A.div(A.sub(c, down), A.sub(up, down))
        s = np.where(np.asarray(u_scale, F).reshape(c.shape) < p, up, down).astype(F)
    y = A.mul(A.mul(q, s), s_dec)
    return y.reshape(np.shape(x)), s[..., 0]


# --------------------------------------------------------------------------- TetraJet-v2


def dither(v, r, A: _Arith):
    """``get_value_added_noise``: |v| moved by r times half its binade's spacing, clamped to
    the binade ([0, 2], [2, 4], [4, 6]), with v's sign."""
    a = np.abs(v)
    res = np.where(a <= 2, np.clip(A.add(a, A.mul(r, F(.5))), 0, 2),
                   np.where(a <= 4, np.clip(A.add(a, r), 2, 4),
                            np.clip(A.add(a, A.mul(r, F(2))), 4, 6))).astype(F)
    return np.copysign(res, v).astype(F)


def double_block(x, u=None, *, nan_propagates=True, ftz=False, outer=128, inner=16):
    """TetraJet-v2's ``quant_fp4_from_reg`` along the last axis: omax per 128, outer =
    fl(fl(omax/448)/6) (1 where 0), inner = fl(fl(imax16/outer)/6) (2**-9 where 0) rounded to
    E4M3 (RNE, satfinite), d = fl(outer*inner8), inv = fl(1/d) (0 where d = 0), v = fl(x*inv),
    q = E2M1 RNE (of the dithered v with uniforms ``u``: r = u - 0.5), y = fl(q*d).
    ``nan_propagates=False`` is the kernel's ``fmaxf`` (NaN dropped from both maxima); True is
    fp4lab's choice (a NaN makes its 128-block NaN). Returns (y, inner8)."""
    A = _Arith(ftz)
    x = A.f(np.asarray(x, F))
    rows, cols = x.shape
    b16 = x.reshape(rows, cols // outer, outer // inner, inner)
    mx = _absmax if nan_propagates else (
        lambda g, axis=-1: np.nanmax(np.where(np.isnan(g), -np.inf, np.abs(g)), axis=axis,
                                     keepdims=True).astype(F))
    omax = mx(b16.reshape(rows, cols // outer, 1, outer))
    out_s = A.div(A.div(omax, F(448)), F(6))
    out_s = np.where(out_s == 0, F(1), out_s).astype(F)
    in_s = A.div(A.div(mx(b16), out_s), F(6))
    in_s = np.where(in_s == 0, F(2.0 ** -9), in_s).astype(F)
    is8 = e4m3_rne_sat(in_s)
    d = A.mul(out_s, is8)
    inv = np.where(d != 0, A.div(F(1), d), F(0)).astype(F)
    v = A.mul(b16, inv)
    if u is not None:
        r = A.sub(np.asarray(u, F).reshape(v.shape), F(0.5))
        v = dither(v, r, A)
    y = A.mul(e2m1_rne(v), d)
    return y.reshape(rows, cols), is8.reshape(rows, cols // inner)


def tetrajet_fp8(x, *, nan_propagates=True, ftz=False, block=32):
    """TetraJet-v2's MXFP8 (``quant_fp8.cu``) along the last axis: amax per 32 (``fmax``),
    e = ``cvt.rp.satfinite.ue8m0`` of fl(amax/448) (the least power of two >= it; 2**-127
    where it is at most 2**-127, zero included), v = x * 2**-e (exact), E4M3 RNE satfinite,
    y = q * 2**e. ``nan_propagates=False`` is the kernel's ``fmax`` (an Inf block then scales
    by 2**127 and gives NaN and zeros); True is fp4lab's MX rule (a NaN or Inf makes its block
    NaN). Returns (y, e) with e the unbiased exponent."""
    A = _Arith(ftz)
    b = _blocks(A.f(x), block)
    if nan_propagates:
        amax = _absmax(b)
    else:
        amax = np.nanmax(np.where(np.isnan(b), F(0), np.abs(b)), axis=-1, keepdims=True)
    d = A.div(amax.astype(F), F(448))
    fin = np.isfinite(d)
    m, ex = np.frexp(np.where(fin & (d > 0), d, F(1)).astype(np.float64))  # d = m 2**ex
    e = np.where(m == 0.5, ex - 1, ex)  # ceil(log2 d), exact for float32 d
    e = np.where(d > 0, np.maximum(e, -127), -127)
    e = np.where(np.isinf(d), 127, e)
    scale = np.ldexp(np.ones_like(d, dtype=np.float64), e)
    with np.errstate(invalid="ignore"):
        y = e4m3_rne_sat(b.astype(np.float64) / scale).astype(np.float64) * scale
    if nan_propagates:
        y = np.where(np.isfinite(amax), y, np.nan)
    else:  # 2**127: the kernel's multiplier bits (254 - 254) << 23 are the float 0
        y = np.where(np.isinf(d), np.where(np.isfinite(b), np.copysign(0.0, b), np.nan), y)
    return y.astype(F).reshape(np.shape(x)), e[..., 0]


def _padded(fn, x, multiple, **kw):
    """``fn`` (blocked along the last axis) on ``x`` zero-padded to ``multiple`` columns."""
    x = np.asarray(x, F)
    pad = -x.shape[1] % multiple
    return fn(np.pad(x, ((0, 0), (0, pad))), **kw)[0][:, :x.shape[1]]


def outcontrol_gemms(x, w, dy, channels, n, *, ftz=False):
    """TetraJet-v2's mixed NVFP4/MXFP8 layer (``linear_mix.py``) with every rounding to
    nearest and no Hadamard transform in the backward: X (M, K), W (K, N), dY (M, N) with W
    stored K-major as Flax does (the authors' ``w`` is its transpose), ``channels`` the K
    indices, the ``n`` outliers first. Forward: each part of X and W gathered in that order
    and quantized along K (double-block FP4 / MXFP8), ``Y = X4 W4 + X8 W8``. dgrad: the
    forward's W rebuilt in K's order from both dequantized parts, requantized along N with
    dY, ``dX = dY W^T``. wgrad: dW's rows of each part from that part of the forward's X
    requantized along M, with dY along M in the same format. Products in float64. Returns
    (Y, dX, dW)."""
    x, w, dy = (np.asarray(a, F) for a in (x, w, dy))
    hi, lo = np.asarray(channels[:n]), np.asarray(channels[n:])
    f4 = lambda a: _padded(double_block, a, 128, ftz=ftz)  # noqa: E731
    f8 = lambda a: _padded(tetrajet_fp8, a, 32, ftz=ftz)  # noqa: E731
    x4, x8 = f4(x[:, lo]), f8(x[:, hi])
    w4, w8 = f4(w[lo].T).T, f8(w[hi].T).T  # along K
    d = np.float64
    y = x4.astype(d) @ w4.astype(d) + x8.astype(d) @ w8.astype(d)
    wq = np.empty_like(w)
    wq[lo], wq[hi] = w4, w8
    dx = f4(dy).astype(d) @ f4(wq).astype(d).T  # both along N
    dw = np.empty(w.shape, d)
    dw[lo] = f4(x4.T).astype(d) @ f4(dy.T).astype(d).T
    dw[hi] = f8(x8.T).astype(d) @ f8(dy.T).astype(d).T
    return y, dx, dw


# --------------------------------------------------------------------------- FP4 All the Way


def fp4_121_positive(t, noise=None, *, saturate=True, A=None):
    """The authors' R(t) for t >= 0: t < 2: round(fl(2t + n))/2; t < 4: round(fl(t + n));
    else 2*round(fl(t/2 + n)) (torch.round: half to even; n = 0 for RTN, u - 0.5 for SR).
    ``saturate``: fp4lab's min(R, 6) (the authors' R reaches 8 for t >= 7)."""
    A = A or _Arith(False)
    t = np.asarray(t, F)
    n = np.zeros_like(t) if noise is None else np.asarray(noise, F).reshape(t.shape)
    s1 = np.round(A.add(A.mul(F(2), t), n)) / F(2)
    s2 = np.round(A.add(t, n))
    s3 = F(2) * np.round(A.add(A.div(t, F(2)), n))
    r = np.where(t < 2, s1, np.where(t < 4, s2, s3)).astype(F)
    return np.minimum(r, F(6)).astype(F) if saturate else r


def atw_nvfp4(x, u=None, *, saturate=True, guard_zero_tensor=True, ftz=False, block=16,
              fp8_max=448.0, saturating_cast=False):
    """FP4 All the Way's ``fake_quant_fp4(x, sr, block_size=16, scale_format='e4m3')``:
    st = fl(amax * fl(1/(6*fp8_max))), xs = fl(|x|/st), sb = e4m3_torch(fl(6/max xs)) (1 where
    that is 0, Inf or NaN), y = fl(fl(sign(x) * fl(R(fl(xs*sb))/sb)) * st) with torch.sign
    (0 for zeros); uniforms ``u``: SR with n = u - 0.5. fp4lab's two documented departures
    are the defaults: ``saturate`` (R at most 6; the authors' can give 8) and
    ``guard_zero_tensor`` (st = 1 where amax = 0; the authors' all-zero tensor is NaN).
    ``saturating_cast``: the E4M3 cast of PyTorch >= 2.13 (:func:`e4m3_torch`).
    Returns (y, sb)."""
    A = _Arith(ftz)
    g = A.f(_blocks(x, block))
    sign = np.sign(g).astype(F)  # np.sign(-0.0) = +0, as torch.sign
    a = np.abs(g)
    amax = F(np.max(a))
    st = A.mul(amax, A.div(F(1), F(6 * fp8_max)))
    if guard_zero_tensor and st == 0:
        st = F(1)
    xs = A.div(a, st)
    sb = e4m3_torch(A.div(F(6), _absmax(xs)), saturating_cast)
    sb = np.where((sb > 0) & (sb < np.inf), sb, F(1)).astype(F)
    noise = None if u is None else A.sub(np.asarray(u, F).reshape(g.shape), F(0.5))
    r = fp4_121_positive(A.mul(xs, sb), noise, saturate=saturate, A=A)
    y = A.mul(A.mul(sign, A.div(r, sb)), st)
    return y.reshape(np.shape(x)), sb[..., 0]
