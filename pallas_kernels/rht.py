"""Fused random Hadamard transform + NVFP4 quantization (+ stochastic rounding) of a wgrad
operand, written in the transposed, token-axis-blocked layout the wgrad GEMM reads.

For ``dW = X^T dY`` the NVFP4 recipe quantizes X and dY along the token axis M after a
16-point RHT along M. Given ``x`` of shape ``(M, K)`` (tokens first, as activations and
gradients are stored), :func:`rht_quantize_nvfp4` returns the QArray of
``rht(x, axis=0).T`` (shape ``(K, M16)``, ``M16 = ceil(M/16)*16``) quantized to NVFP4 along its
last axis: the same layout as ``fp4lab.quantize(fp4lab.numerics.hadamard.rht(x, 0).T, "nvfp4",
...)``, the reference it follows. Two passes, as Transformer Engine does: one kernel computes the
per-tile amax of the transformed tensor (its maximum is NVFP4's global amax), the second transforms
again, quantizes and writes codes and scales.

Exactness. The kernel computes the transform exactly as the reference does
(``fp4lab.numerics.hadamard``: signs, four float32 butterfly stages of additions, one scaling by
1/4, rounding to the input dtype), on the 16 strided rows ``i, i + 16, ...`` of its tile, so with
``rounding="nearest"`` its codes and scales equal the reference's bit for bit on every input,
infinities and NaN included. There is no matrix product and no multiply-add to contract: the
transform costs four additions per element instead of a (16-wide, mostly zero) block-diagonal GEMM.

With ``rounding="stochastic"`` (the recipe's setting) the uniforms are
``fp4lab.numerics.random_bits``'s: Threefry-2x32 of the key and each element's logical
position in the tokens-first ``(M16, K)`` operand the GEMM quantizes (``token * K + feature``,
as ``fp4lab.gemm``'s XLA path draws them for ``rht(x, 0)`` blocked along axis 0), computed in
the kernel, so the stochastic codes equal the XLA path's bit for bit too. Positions are 32-bit:
the table refuses stochastic rounding of a tensor of 2**32 elements or more (the XLA path
draws it).

Layout. A tile is ``(TM, TK)`` of ``x`` with ``TM = 16 G`` tokens. Output element ``j`` of
every 16-token group is a ``(G, TK)`` array; the 16 codes of a group and feature are packed
into two little-endian uint32 words (element ``j`` in bits ``4(j % 8)`` to ``4(j % 8) + 3`` of
word ``j // 8``), which is the byte layout of the packed E2M1 data (element ``2i`` in the low
nibble of byte ``i``): the wrapper bitcasts the words to bytes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from fp4lab.numerics.backend import Kernel, Request, refusal
from fp4lab.numerics.formats import E2M1, Format, get_format
from fp4lab.numerics.hadamard import rht, rht_signs_and_scale
from fp4lab.numerics.qarray import QArray
from fp4lab.numerics.quantize import check_amax_covers
from fp4lab.numerics.scaling import NVFP4Scale
from fp4lab.numerics.rounding import abs_max
from pallas_kernels.common import (KEY_SPEC, abs_max_bits, bits, check_input, compiler_params,
                                   e2m1_code, from_bits, interpret_mode, nvfp4_scales,
                                   padded_matrix, sr_key_words, sr_uniform, stochastic_e2m1,
                                   tile_size)
from pallas_kernels.quantize import KernelConfig

__all__ = ["rht_quantize_nvfp4"]


def _transform(x_ref, signs, dtype):
    """The RHT of every 16-token group of the ``(TM, TK)`` tile, as 16 ``(TM/16, TK)``
    float32 arrays (output ``j`` of each group), rounded to the input dtype as the reference
    does: ``fp4lab.numerics.hadamard.rht``'s arithmetic, operation for operation."""
    groups = x_ref.shape[0] // 16
    u = [x_ref[pl.ds(i, groups, stride=16), :].astype(jnp.float32) * s_i
         for i, s_i in enumerate(signs)]
    h = 1
    while h < 16:
        for i in range(16):
            if not i & h:
                u[i], u[i + h] = u[i] + u[i + h], u[i] - u[i + h]
        h *= 2
    return [(v * np.float32(0.25)).astype(dtype).astype(jnp.float32) for v in u]


def _group_abs_max(y):
    """``max_j |y_j|`` elementwise over the 16 outputs (NaN wins, as abs_max_bits)."""
    return from_bits(functools.reduce(jnp.maximum, [bits(v) & 0x7FFFFFFF for v in y]))


def _amax_kernel(x_ref, amax_ref, *, signs, dtype):
    m = _group_abs_max(_transform(x_ref, signs, dtype))
    amax_ref[...] = abs_max_bits(abs_max_bits(m, 1), 0)  # one axis at a time (Triton)


def _quantize_kernel(amax_ref, key_ref, x_ref, q_ref, s_ref, *, signs, dtype, stochastic,
                     features, interpret):
    y = _transform(x_ref, signs, dtype)
    groups, tk = y[0].shape
    amax = amax_ref[...].reshape(1, 1)
    s_b, enc = nvfp4_scales(_group_abs_max(y), jnp.broadcast_to(amax, (groups, tk)),
                            interpret=interpret)
    if stochastic:  # the position of (token 16 g + j, feature) in the (M16, K) operand
        group = lax.broadcasted_iota(jnp.uint32, (groups, tk), 0) + (
            pl.program_id(0) * groups).astype(jnp.uint32)
        col = lax.broadcasted_iota(jnp.uint32, (groups, tk), 1) + (
            pl.program_id(1) * tk).astype(jnp.uint32)
        base = group * jnp.uint32(16 * features) + col
    words = [jnp.zeros((groups, tk), jnp.uint32), jnp.zeros((groups, tk), jnp.uint32)]
    for j, v in enumerate(y):
        v = v * enc
        if stochastic:
            v = stochastic_e2m1(v, sr_uniform(base + jnp.uint32(j * features), key_ref))
        words[j // 8] = words[j // 8] | (e2m1_code(v).astype(jnp.uint32) << (4 * (j % 8)))
    q_ref[...] = jnp.stack([words[0].T, words[1].T], axis=-1).reshape(tk, 2 * groups)
    s_ref[...] = s_b.T


@functools.partial(jax.jit, static_argnames=("fmt", "rounding", "signs", "cfg", "interpret"))
def _rht_quantize(x, key, global_amax, *, fmt, rounding, signs, cfg: KernelConfig, interpret):
    m, k = x.shape
    m16 = -(-m // 16) * 16  # the reference's transformed (padded) token length
    tm, tk = tile_size(m16, cfg.block_rows, 16), tile_size(k, cfg.block_cols, 16)  # tm = 16 G
    x2, (mp, kp) = padded_matrix(x, tm, tk)
    sign_vector = tuple(float(v) for v in rht_signs_and_scale(16, signs)[0])
    grid = (mp // tm, kp // tk)
    x_spec = pl.BlockSpec((tm, tk), lambda i, j: (i, j))
    params = compiler_params(cfg, interpret)
    if global_amax is None:
        tiles = pl.pallas_call(
            functools.partial(_amax_kernel, signs=sign_vector, dtype=x.dtype),
            out_shape=jax.ShapeDtypeStruct(grid, jnp.float32), grid=grid,
            in_specs=[x_spec], out_specs=pl.BlockSpec((1, 1), lambda i, j: (i, j)),
            interpret=interpret, compiler_params=params, name="fp4lab_rht_amax")(x2)
        amax = abs_max(tiles)  # the maximum of the tile maxima (NaN wins)
    else:
        amax = jnp.asarray(global_amax, jnp.float32)
    stochastic = rounding == "stochastic"
    words = sr_key_words(key if stochastic else None)
    words, s = pl.pallas_call(
        functools.partial(_quantize_kernel, signs=sign_vector, dtype=x.dtype,
                          stochastic=stochastic, features=k, interpret=interpret),
        out_shape=[jax.ShapeDtypeStruct((kp, mp // 8), jnp.uint32),
                   jax.ShapeDtypeStruct((kp, mp // 16), jnp.float8_e4m3fn)],
        grid=grid,
        in_specs=[pl.BlockSpec((1, 1), lambda i, j: (0, 0)), KEY_SPEC, x_spec],
        out_specs=[pl.BlockSpec((tk, tm // 8), lambda i, j: (j, i)),
                   pl.BlockSpec((tk, tm // 16), lambda i, j: (j, i))],
        interpret=interpret, compiler_params=params, name="fp4lab_rht_nvfp4_quantize",
    )(amax.reshape(1, 1), words, x2)
    q = lax.bitcast_convert_type(words, jnp.uint8).reshape(kp, mp // 2)
    return QArray(q[:k, :m16 // 2], s[:k, :m16 // 16], amax, fmt, 1, None, (k, m16))


RHT_CONFIG = KernelConfig(block_rows=64, block_cols=64)  # rht_quantize_nvfp4's default tiles


def rht_quantize_nvfp4(x, key=None, *, rounding: str = "stochastic", signs="te",
                       global_amax=None, fmt: str | Format = "nvfp4",
                       interpret: bool | None = None,
                       config: KernelConfig = RHT_CONFIG
                       ) -> QArray:
    """NVFP4 wgrad operand: ``quantize(rht(x, axis=0).T, "nvfp4", rounding=...)`` fused
    (see module docstring); ``x`` is ``(tokens, features)``; ``key`` is required for
    stochastic rounding."""
    x = jnp.asarray(x)
    check_input(x)
    if x.ndim != 2:
        raise ValueError(f"rht_quantize_nvfp4 takes a (tokens, features) matrix, got shape "
                         f"{x.shape}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding={rounding!r} must be 'nearest' or 'stochastic'")
    if rounding == "stochastic" and key is None:
        raise ValueError("stochastic rounding needs key=jax.random.key(...)")
    fmt = get_format(fmt)
    reason = refusal(Request(op="rht_quantize", format=fmt, shape=x.shape, axis=-2,
                             rounding=rounding, transform=16), (KERNEL,))
    if reason:
        raise ValueError(f"no kernel: {reason}")
    rht_signs_and_scale(16, signs)  # validates signs
    if global_amax is not None:  # the amax of the transformed tensor (eagerly: refused below)
        concrete = not any(isinstance(v, jax.core.Tracer) for v in (x, global_amax))
        check_amax_covers(rht(x, 0, signs=signs) if concrete else x, global_amax)
    return _rht_quantize(x, key, global_amax, fmt=fmt, rounding=rounding, signs=signs,
                         cfg=config, interpret=interpret_mode(interpret))


def _kernel_fn(x, fmt, key, *, rounding, signs):
    return rht_quantize_nvfp4(x, key, rounding=rounding, signs=signs, fmt=fmt)


# the request this kernel serves, as data (fp4lab.numerics.backend's table; pallas_kernels.register)
KERNEL = Kernel(name="NVFP4 RHT + quantize", op="rht_quantize", scheme=NVFP4Scale,
                elements=(E2M1,), blocks=(16,), roundings=("nearest", "stochastic"), axes=(-2,),
                transforms=(16,), ndims=(2,), fn=_kernel_fn)
