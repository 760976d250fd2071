"""Fused block-quantization kernels: NVFP4 (1D 16-blocks and 2D 16x16 tiles), MXFP8 (E4M3,
E5M2; rceil and floor scales) and MXFP4, along the last axis; and dequantization to BF16.

Each kernel reads a ``(block_rows, block_cols)`` tile of the input once and writes the codes
(E2M1 packed two per byte, or FP8) and the block scales of that tile: one pass over the data
instead of XLA's several. The reference each kernel must equal bit for bit is
:func:`fp4lab.quantize` (``fp4lab/numerics/scaling/`` for the scales,
``fp4lab/numerics/rounding.py`` for the elements); ``tests/pallas_kernels/test_quantize_kernels.py``
checks that in interpret mode (CPU, CI) and on the GPU when there is one.

The wrappers take any shape: leading axes are flattened into rows and both axes are padded
with zeros to the tile, whose sizes are powers of two as Triton arrays must be (zeros change
no block statistic; the padding is sliced off); they return the same :class:`fp4lab.QArray`
as the reference.

NVFP4's per-tensor amax is a reduction over the whole tensor: the wrapper computes it with
XLA (one read of the input) unless ``global_amax`` is given, then the kernel does the rest in
one more read ("two-pass", as Transformer Engine does).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from fp4lab.numerics.backend import Kernel, Request, refusal
from fp4lab.numerics.formats import E2M1, E4M3, E5M2, Format, get_format
from fp4lab.numerics.qarray import QArray
from fp4lab.numerics.quantize import check_amax_covers
from fp4lab.numerics.rounding import abs_max
from fp4lab.numerics.scaling import NVFP4Scale, PowerOfTwoScale
from pallas_kernels.common import (KEY_SPEC, abs_bits, abs_max_bits, bits, check_input,
                                   compiler_params, e2m1_code, e2m1_value, element_index,
                                   from_bits, interpret_mode, minimum, nvfp4_scales, pack_pairs,
                                   padded_matrix, pow2, sr_key_words, sr_uniform, stochastic_e2m1,
                                   tile_size, unpack_pairs)

__all__ = ["quantize", "quantize_weight_nvfp4", "dequantize", "supports", "KernelConfig",
           "KERNELS"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """Largest tile shape and Triton launch parameters. Triton arrays have power-of-two
    shapes, so both tile sizes are powers of two (``block_cols`` at least 32); inputs
    smaller than a tile get the smallest power-of-two tile that covers them."""

    block_rows: int = 32
    block_cols: int = 256
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        for name in ("block_rows", "block_cols", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"KernelConfig.{name}={v!r} must be a power of two")
        if self.block_cols < 32:
            raise ValueError(f"KernelConfig.block_cols={self.block_cols} must be at least 32 "
                             "(one MX block)")


DEFAULT_CONFIG = KernelConfig()
# half the rows: the NVFP4 SR kernel needs 254 registers per thread with 32 x 256 tiles and
# 4 warps (ptxas, sm_90a; 255 is the limit before spilling), about 130 with 16 x 256
SR_CONFIG = KernelConfig(block_rows=16)


def supports(fmt: Format, axis: int, tile, rounding: str = "nearest") -> str | None:
    """``None`` when a quantize kernel of this module serves this request, else why not (the
    refusals of :data:`KERNELS`, as ``fp4lab.numerics.backend`` reports them)."""
    r = Request(op="quantize", format=fmt, shape=(1,), axis=axis, tile=tile, rounding=rounding)
    return _refusal(r)


def _refusal(r: Request) -> str | None:
    return refusal(r, KERNELS)


# ----------------------------------------------------------------------------- kernel bodies


def _round_e2m1(v, key_ref, stochastic, row_stride):
    """E2M1 codes of a ``(tm, tk)`` tile of scaled values: nearest-even, or stochastic with
    the uniforms of the elements' logical positions (``row_stride``: the operand's last dim)
    under the key words in ``key_ref``, the XLA path's bits."""
    if stochastic:
        tm, tk = v.shape
        index = element_index(v.shape, pl.program_id(0) * tm, pl.program_id(1) * tk,
                              row_stride)
        v = stochastic_e2m1(v, sr_uniform(index, key_ref))
    return e2m1_code(v)


def _nvfp4_1d_kernel(amax_ref, key_ref, x_ref, q_ref, s_ref, *, block, interpret, stochastic,
                     row_stride):
    x = x_ref[...].astype(jnp.float32)
    tm, tk = x.shape
    xb = x.reshape(tm, tk // block, block)
    amax = amax_ref[...].reshape(1, 1, 1)
    s_b, enc = nvfp4_scales(abs_max_bits(xb, 2),
                            jnp.broadcast_to(amax, (tm, tk // block, 1)), interpret=interpret)
    codes = _round_e2m1((xb * enc).reshape(tm, tk), key_ref, stochastic, row_stride)
    q_ref[...] = pack_pairs(codes)
    s_ref[...] = s_b.reshape(tm, tk // block)


def _nvfp4_2d_kernel(amax_ref, x_ref, q_ref, s_ref, qt_ref, st_ref, *, tile, interpret):
    """(t0, t1) tiles: the row-wise codes and their transpose, scales shared by
    construction."""
    t0, t1 = tile
    x = x_ref[...].astype(jnp.float32)
    tm, tk = x.shape
    x4 = x.reshape(tm // t0, t0, tk // t1, t1)
    bamax = abs_max_bits(abs_max_bits(x4, 3), 1)  # (tm/t0, 1, tk/t1, 1)
    amax = amax_ref[...].reshape(1, 1, 1, 1)
    s_b, enc = nvfp4_scales(bamax, jnp.broadcast_to(amax, bamax.shape), interpret=interpret)
    codes = e2m1_code(x4 * enc).reshape(tm, tk)
    q_ref[...] = pack_pairs(codes)
    qt_ref[...] = pack_pairs(codes.T)
    s = s_b.reshape(tm // t0, tk // t1)
    s_ref[...] = s
    st_ref[...] = s.T


def _mx_kernel(key_ref, x_ref, q_ref, s_ref, *, fmt: Format, interpret, stochastic,
               row_stride):
    del interpret  # power-of-two scales: no division
    x = x_ref[...].astype(jnp.float32)
    tm, tk = x.shape
    el, block = fmt.element, fmt.block
    xb = x.reshape(tm, tk // block, block)
    stat = abs_max_bits(xb, 2)
    if fmt.scaling.mode == "rceil":
        d = stat * (np.float32(1) / np.float32(el.max))  # host constant, IEEE
        b = bits(d)
        e_field = (b >> 23) & 0xFF
        normal = e_field - 127 + ((b & 0x7FFFFF) != 0).astype(jnp.int32)
        e = jnp.where(e_field > 0, normal, jnp.where(b <= 0x00400000, -127, -126))
    else:
        e = ((bits(stat) >> 23) & 0xFF) - 127 - el.emax
    e = jnp.clip(e, -127, 127)
    finite = (bits(stat) & 0x7FFFFFFF) < 0x7F800000
    s_ref[...] = jnp.where(finite, e + 127, 255).astype(jnp.uint8).reshape(tm, tk // block)
    mult = jnp.where(finite, pow2(jnp.clip(-e, -126, 127)), 0.0)
    v = xb * mult
    if el == E2M1:
        codes = _round_e2m1(v.reshape(tm, tk), key_ref, stochastic, row_stride)
        codes = jnp.where(finite, codes.reshape(tm, tk // block, block), 0).reshape(tm, tk)
        q_ref[...] = pack_pairs(codes)
    else:
        a = minimum(abs_bits(v), el.max)  # saturate; keep the sign bit (and -0):
        v = from_bits(bits(a) | (bits(v) & jnp.int32(-(2**31))))
        q = jnp.where(finite, v, 0.0).astype(el.storage)
        q_ref[...] = q.reshape(tm, tk)


def _dequantize_kernel(amax_ref, q_ref, s_ref, y_ref, *, fmt: Format, interpret):
    """Codes and block scales of a 1D-blocked tile -> values in ``y_ref``'s dtype, with the
    reference's multipliers in its order (fp4lab.numerics.scaling ``decode``)."""
    del interpret
    el, block = fmt.element, fmt.block
    if el.packed:
        v = e2m1_value(unpack_pairs(q_ref[...]))
    else:
        v = q_ref[...].astype(jnp.float32)
    tm, tk = v.shape
    vb = v.reshape(tm, tk // block, block)
    if isinstance(fmt.scaling, NVFP4Scale):
        s = s_ref[...].astype(jnp.float32).reshape(tm, tk // block, 1)
        amax = amax_ref[...].reshape(1, 1, 1)
        inv_2688 = np.float32(1) / np.float32(2688)  # host constant, IEEE
        y = vb * jnp.where(amax == 0, s, (s * amax) * inv_2688)
    else:
        e = s_ref[...].astype(jnp.int32).reshape(tm, tk // block, 1) - 127
        hi = e >> 1
        m1 = jnp.where(e == 128, jnp.nan, pow2(jnp.clip(hi, -126, 127)))
        y = (vb * m1) * pow2(e - hi)
    y_ref[...] = y.reshape(tm, tk).astype(y_ref.dtype)


# ----------------------------------------------------------------------------- wrappers


def _tensor_amax(x, global_amax):
    """NVFP4's per-tensor amax: one XLA reduction, the reference's own (NaN wins)."""
    if global_amax is not None:
        return jnp.asarray(global_amax, jnp.float32)
    return abs_max(x.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("fmt", "cfg", "interpret", "rounding"))
def _quantize_1d(x, global_amax, key, *, fmt: Format, cfg: KernelConfig, interpret: bool,
                 rounding: str = "nearest"):
    shape = x.shape
    block = fmt.block
    k_padded = -(-shape[-1] // block) * block  # the reference's padded length
    tm = tile_size(math.prod(shape[:-1]), cfg.block_rows, 1)
    tk = tile_size(k_padded, cfg.block_cols, 32)
    x2, (mp, kp) = padded_matrix(x, tm, tk)
    grid = (mp // tm, kp // tk)
    packed = fmt.element.packed
    q_cols = tk // 2 if packed else tk
    q_dtype = jnp.uint8 if packed else fmt.element.storage
    scale_dtype = fmt.scaling.storage.dtype
    out_shape = [jax.ShapeDtypeStruct((mp, kp // tk * q_cols), q_dtype),
                 jax.ShapeDtypeStruct((mp, kp // block), scale_dtype)]
    out_specs = [pl.BlockSpec((tm, q_cols), lambda i, j: (i, j)),
                 pl.BlockSpec((tm, tk // block), lambda i, j: (i, j))]
    x_spec = pl.BlockSpec((tm, tk), lambda i, j: (i, j))
    scalar = pl.BlockSpec((1, 1), lambda i, j: (0, 0))
    stochastic = rounding == "stochastic"
    words = sr_key_words(key if stochastic else None)
    sr = dict(interpret=interpret, stochastic=stochastic, row_stride=shape[-1])
    if isinstance(fmt.scaling, NVFP4Scale):
        amax = _tensor_amax(x, global_amax)
        q, s = pl.pallas_call(
            functools.partial(_nvfp4_1d_kernel, block=block, **sr), out_shape=out_shape,
            grid=grid,
            in_specs=[scalar, KEY_SPEC, x_spec], out_specs=out_specs,
            interpret=interpret, compiler_params=compiler_params(cfg, interpret),
            name="fp4lab_nvfp4_quantize")(amax.reshape(1, 1), words, x2)
        global_scale = amax
    else:
        q, s = pl.pallas_call(
            functools.partial(_mx_kernel, fmt=fmt, **sr), out_shape=out_shape, grid=grid,
            in_specs=[KEY_SPEC, x_spec], out_specs=out_specs,
            interpret=interpret, compiler_params=compiler_params(cfg, interpret),
            name=f"fp4lab_{fmt.name}_quantize")(words, x2)
        global_scale = None
    m = math.prod(shape[:-1])
    q_len = k_padded // 2 if packed else k_padded
    q = q[:m, :q_len].reshape(*shape[:-1], q_len)
    s = s[:m, :k_padded // block].reshape(*shape[:-1], k_padded // block)
    return QArray(q, s, global_scale, fmt, x.ndim - 1, None, shape)


def quantize(x, fmt: str | Format, *, axis: int = -1, tile=None, global_amax=None,
             rounding: str = "nearest", key=None, interpret: bool | None = None,
             config: KernelConfig | None = None) -> QArray:
    """The kernel path of :func:`fp4lab.quantize` for NVFP4 (1D, or ``tile=(16, 16)``),
    MXFP8 (E4M3/E5M2, rceil/floor) and MXFP4 along the last axis: round-to-nearest equal to
    the reference bit for bit, and so is stochastic rounding (1D E2M1 formats; the same
    Threefry bits at the same logical positions, ``fp4lab.numerics.random_bits``).

    ``interpret`` defaults to True off the GPU (CPU tests run the same kernel bodies).
    ``config`` defaults to :data:`DEFAULT_CONFIG`, or :data:`SR_CONFIG` for stochastic
    rounding, whose in-kernel Threefry needs more registers per element."""
    if config is None:
        config = SR_CONFIG if rounding == "stochastic" else DEFAULT_CONFIG
    fmt = get_format(fmt)
    x = jnp.asarray(x)
    check_input(x)
    check_amax_covers(x, global_amax)
    axis = axis if axis < 0 else axis - x.ndim
    reason = _refusal(Request(op="quantize", format=fmt, shape=x.shape, axis=axis, tile=tile,
                              rounding=rounding))
    if reason:
        raise ValueError(f"no kernel: {reason}")
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs key=jax.random.key(...)")
    interpret = interpret_mode(interpret)
    if tile is not None:
        if x.ndim == 2:
            return _quantize_2d(x, global_amax, fmt=fmt, tile=tile, cfg=config,
                                interpret=interpret)[0]
        # a stack of matrices (experts, the canonical (B, K, N) weight of a GEMM): one
        # global amax over the stack, as the reference, and the 2D kernel per matrix
        amax = _tensor_amax(x, global_amax)
        stack = x.reshape(-1, *x.shape[-2:])
        row = jax.vmap(lambda m: _quantize_2d(m, amax, fmt=fmt, tile=tile, cfg=config,
                                              interpret=interpret)[0])(stack)
        q, s = row.data, row.scale
        return QArray(q.reshape(*x.shape[:-2], *q.shape[-2:]),
                      s.reshape(*x.shape[:-2], *s.shape[-2:]), amax, fmt, x.ndim - 1, tile,
                      x.shape)
    return _quantize_1d(x, global_amax, key, fmt=fmt, cfg=config, interpret=interpret,
                        rounding=rounding)


@functools.partial(jax.jit, static_argnames=("fmt", "tile", "cfg", "interpret"))
def _quantize_2d(w, global_amax, *, fmt: Format, tile, cfg: KernelConfig, interpret: bool):
    lead, (r, c) = w.shape[:-2], w.shape[-2:]
    if lead:
        raise ValueError(f"2D weight quantization takes a matrix, got shape {w.shape}")
    t0, t1 = tile
    rp, cp = -(-r // t0) * t0, -(-c // t1) * t1  # the reference's padded shape
    # whole tiles, and the transposed copy packs along rows: both tile sizes at least 32
    tm, tk = tile_size(rp, cfg.block_rows, 32), tile_size(cp, cfg.block_cols, 32)
    w2, (mp, kp) = padded_matrix(w, tm, tk)
    amax = _tensor_amax(w, global_amax)
    kernel = functools.partial(_nvfp4_2d_kernel, tile=tile, interpret=interpret)
    scale = fmt.scaling.storage.dtype
    q, s, qt, st = pl.pallas_call(
        kernel, grid=(mp // tm, kp // tk),
        out_shape=[jax.ShapeDtypeStruct((mp, kp // 2), jnp.uint8),
                   jax.ShapeDtypeStruct((mp // t0, kp // t1), scale),
                   jax.ShapeDtypeStruct((kp, mp // 2), jnp.uint8),
                   jax.ShapeDtypeStruct((kp // t1, mp // t0), scale)],
        in_specs=[pl.BlockSpec((1, 1), lambda i, j: (0, 0)),
                  pl.BlockSpec((tm, tk), lambda i, j: (i, j))],
        out_specs=[pl.BlockSpec((tm, tk // 2), lambda i, j: (i, j)),
                   pl.BlockSpec((tm // t0, tk // t1), lambda i, j: (i, j)),
                   pl.BlockSpec((tk, tm // 2), lambda i, j: (j, i)),
                   pl.BlockSpec((tk // t1, tm // t0), lambda i, j: (j, i))],
        interpret=interpret, compiler_params=compiler_params(cfg, interpret),
        name=f"fp4lab_{fmt.name}_quantize_2d")(amax.reshape(1, 1), w2)
    row = QArray(q[:rp, :cp // 2], s[:rp // t0, :cp // t1], amax, fmt, 1, tile, (r, c))
    col = QArray(qt[:cp, :rp // 2], st[:cp // t1, :rp // t0], amax, fmt, 1, (t1, t0), (c, r))
    return row, col


def quantize_weight_nvfp4(w, *, global_amax=None, interpret: bool | None = None,
                          config: KernelConfig = DEFAULT_CONFIG, fmt: str | Format = "nvfp4",
                          tile: tuple[int, int] = (16, 16)) -> tuple[QArray, QArray]:
    """NVFP4 with 2D tiles (16x16) of a weight matrix ``w`` in one pass: ``(quantize(w),
    quantize(w.T))`` as :func:`fp4lab.quantize` with ``tile=(16, 16)`` gives them, the second
    being the transposed copy that dgrad reads (the same scales, transposed)."""
    w = jnp.asarray(w)
    check_input(w)
    check_amax_covers(w, global_amax)
    fmt = get_format(fmt)
    if w.ndim != 2:
        raise ValueError(f"quantize_weight_nvfp4 takes a matrix, got shape {w.shape}")
    reason = _refusal(Request(op="quantize", format=fmt, shape=w.shape, tile=tile))
    if reason:
        raise ValueError(f"no kernel: {reason}")
    return _quantize_2d(w, global_amax, fmt=fmt, tile=tile, cfg=config,
                        interpret=interpret_mode(interpret))


@functools.partial(jax.jit, static_argnames=("dtype", "cfg", "interpret"))
def _dequantize_1d(q: QArray, dtype, *, cfg: KernelConfig, interpret: bool):
    fmt, shape = q.format, q.shape
    packed = fmt.element.packed
    k_padded = q.scale.shape[-1] * fmt.block
    data = q.data.reshape(-1, q.data.shape[-1])
    scale = q.scale.reshape(-1, q.scale.shape[-1])
    m = data.shape[0]
    tm, tk = tile_size(m, cfg.block_rows, 1), tile_size(k_padded, cfg.block_cols, 32)
    mp, kp = -(-m // tm) * tm, -(-k_padded // tk) * tk
    data = jnp.pad(data, ((0, mp - m), (0, (kp // 2 if packed else kp) - data.shape[1])))
    scale = jnp.pad(scale, ((0, mp - m), (0, kp // fmt.block - scale.shape[1])))
    amax = (q.global_scale if q.global_scale is not None else jnp.float32(0)).reshape(1, 1)
    q_cols = tk // 2 if packed else tk
    y = pl.pallas_call(
        functools.partial(_dequantize_kernel, fmt=fmt, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((mp, kp), dtype), grid=(mp // tm, kp // tk),
        in_specs=[pl.BlockSpec((1, 1), lambda i, j: (0, 0)),
                  pl.BlockSpec((tm, q_cols), lambda i, j: (i, j)),
                  pl.BlockSpec((tm, tk // fmt.block), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((tm, tk), lambda i, j: (i, j)),
        interpret=interpret, compiler_params=compiler_params(cfg, interpret),
        name=f"fp4lab_{fmt.name}_dequantize")(amax.astype(jnp.float32), data, scale)
    return y[:m, :shape[-1]].reshape(shape)


def dequantize(q: QArray, dtype=jnp.bfloat16, *, interpret: bool | None = None,
               config: KernelConfig = DEFAULT_CONFIG) -> jax.Array:
    """The kernel path of :func:`fp4lab.dequantize` for 1D-blocked NVFP4/MX QArrays (last
    axis): one read of codes and scales, one write of ``dtype`` values (BF16 by default, for
    the emulated GEMM on GPUs without FP4 tensor cores)."""
    reason = _refusal(Request(op="dequantize", format=q.format, shape=q.shape,
                              axis=q.axis - q.ndim, tile=q.tile))
    if reason:
        raise ValueError(f"no kernel: {reason}")
    return _dequantize_1d(q, jnp.dtype(dtype), cfg=config,
                          interpret=interpret_mode(interpret))


# The requests these kernels serve, as data (fp4lab.numerics.backend's table;
# pallas_kernels.register)
KERNELS = (
    Kernel(name="NVFP4 1D quantize", op="quantize", scheme=NVFP4Scale, elements=(E2M1,),
           blocks=(16, 32), roundings=("nearest", "stochastic"), fn=quantize),
    Kernel(name="NVFP4 2D-tile quantize", op="quantize", scheme=NVFP4Scale, elements=(E2M1,),
           tiles=((16, 16), (32, 32)), fn=quantize),
    Kernel(name="MX FP8 quantize", op="quantize", scheme=PowerOfTwoScale,
           elements=(E4M3, E5M2), blocks=(16, 32), fn=quantize),
    Kernel(name="MX FP4 quantize", op="quantize", scheme=PowerOfTwoScale, elements=(E2M1,),
           blocks=(16, 32), roundings=("nearest", "stochastic"), fn=quantize),
    Kernel(name="NVFP4 dequantize", op="dequantize", scheme=NVFP4Scale, elements=(E2M1,),
           blocks=(16, 32), fn=dequantize),
    Kernel(name="MX dequantize", op="dequantize", scheme=PowerOfTwoScale,
           elements=(E4M3, E5M2, E2M1), blocks=(16, 32), fn=dequantize),
)
