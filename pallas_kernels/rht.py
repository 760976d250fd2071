"""Fused random Hadamard transform + NVFP4 quantization (+ stochastic rounding) of a wgrad
operand, written in the transposed, token-axis-blocked layout the wgrad GEMM reads.

For ``dW = X^T dY`` the NVFP4 recipe quantizes X and dY along the token axis M after a
16-point RHT along M. Given ``x`` of shape ``(M, K)`` (tokens first, as activations and
gradients are stored), :func:`rht_quantize_nvfp4` returns the QArray of
``rht(x, axis=0).T`` (shape ``(K, M16)``, ``M16 = ceil(M/16)*16``) quantized to NVFP4 along its
last axis: the same layout as ``fp4lab.quantize(fp4lab.hadamard.rht(x, 0).T, "nvfp4", ...)``,
the reference it follows. Two passes, as Transformer Engine does: one kernel computes the
per-tile amax of the transformed tensor (its maximum is NVFP4's global amax), the second
transforms again, quantizes and writes codes and scales.

Exactness. The transform is a float32 GEMM with the block-diagonal matrix ``diag(T, T, ...)``
per tile; its summation order is the GEMM's, not XLA's einsum's, so transformed values may
differ from the reference in the last bit before they are rounded to the input dtype. With
``rounding="nearest"`` the kernel therefore matches the reference's codes wherever the
transformed values agree (tested on inputs whose transforms are exact). With
``rounding="stochastic"`` (the recipe's setting) the uniforms come from a counter-based hash
of the element's position in the output and a 32-bit seed drawn from the jax key
(``lowbias32``, shared/GPU.md: ``jax.random`` does not lower inside Triton kernels): the
rounding is unbiased and deterministic per key, but its bits differ from the XLA path's
``jax.random`` bits, as the issue allows. Positions are 32-bit, so tensors with more than
2**32 elements reuse counters.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from fp4lab.formats import get_format
from fp4lab.hadamard import rht_matrix
from fp4lab.quantize import QArray
from fp4lab.rounding import abs_max
from pallas_kernels.common import (abs_max_bits, e2m1_code, element_index, hash_uniform,
                                   pack_pairs, stochastic_e2m1)
from pallas_kernels.quantize import (KernelConfig, _check_input, _compiler_params,
                                     _interpret_default, _nvfp4_scales, _rows_and_pad)

__all__ = ["rht_quantize_nvfp4"]


def _transform(x_ref, bd_ref, dtype):
    """The tile's RHT along its rows (the token axis), transposed: ``(TK, TM)`` float32
    values, rounded to the input dtype as the reference does."""
    xt = x_ref[...].astype(jnp.float32).T
    y = jnp.dot(xt, bd_ref[...], precision=lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32)
    return y.astype(dtype).astype(jnp.float32)


def _amax_kernel(x_ref, bd_ref, amax_ref, *, dtype):
    y = _transform(x_ref, bd_ref, dtype)
    amax_ref[...] = abs_max_bits(abs_max_bits(y, 1), 0)  # one axis at a time (Triton)


def _quantize_kernel(amax_ref, seed_ref, x_ref, bd_ref, q_ref, s_ref, *, dtype, stochastic,
                     m_total, interpret):
    y = _transform(x_ref, bd_ref, dtype)  # (TK, TM): rows are output rows (K)
    tk, tm = y.shape
    yb = y.reshape(tk, tm // 16, 16)
    amax = amax_ref[...].reshape(1, 1, 1)
    stat = abs_max_bits(yb, 2)
    s_b, enc = _nvfp4_scales(stat, jnp.broadcast_to(amax, stat.shape), interpret=interpret)
    v = (yb * enc).reshape(tk, tm)
    if stochastic:
        index = element_index((tk, tm), pl.program_id(1) * tk, pl.program_id(0) * tm, m_total)
        v = stochastic_e2m1(v, hash_uniform(index, seed_ref[...].reshape(1, 1)))
    q_ref[...] = pack_pairs(e2m1_code(v))
    s_ref[...] = s_b.reshape(tk, tm // 16)


@functools.partial(jax.jit, static_argnames=("rounding", "signs", "cfg", "interpret"))
def _rht_quantize(x, key, global_amax, *, rounding, signs, cfg: KernelConfig, interpret):
    fmt = get_format("nvfp4")
    m, k = x.shape
    m16 = -(-m // 16) * 16  # the reference's transformed (padded) token length
    tm = min(-(-cfg.block_rows // 16) * 16, -(-m16 // 32) * 32)
    tm = -(-tm // 32) * 32  # packed along the token axis: a multiple of 32
    tk = min(cfg.block_cols, -(-k // 16) * 16)
    x2, (mp, kp) = _rows_and_pad(x, tm, tk)
    t = rht_matrix(16, signs)
    bd = jnp.asarray(np.kron(np.eye(tm // 16, dtype=np.float32), t))  # diag(T, T, ...)
    grid = (mp // tm, kp // tk)
    x_spec = pl.BlockSpec((tm, tk), lambda i, j: (i, j))
    bd_spec = pl.BlockSpec((tm, tm), lambda i, j: (0, 0))
    params = _compiler_params(cfg, interpret)
    if global_amax is None:
        tiles = pl.pallas_call(
            functools.partial(_amax_kernel, dtype=x.dtype),
            out_shape=jax.ShapeDtypeStruct(grid, jnp.float32), grid=grid,
            in_specs=[x_spec, bd_spec], out_specs=pl.BlockSpec((1, 1), lambda i, j: (i, j)),
            interpret=interpret, compiler_params=params, name="fp4lab_rht_amax")(x2, bd)
        amax = abs_max(tiles)  # the maximum of the tile maxima (NaN wins)
    else:
        amax = jnp.asarray(global_amax, jnp.float32)
    stochastic = rounding == "stochastic"
    seed = (jax.random.bits(key, (), jnp.uint32) if stochastic else jnp.uint32(0))
    q, s = pl.pallas_call(
        functools.partial(_quantize_kernel, dtype=x.dtype, stochastic=stochastic,
                          m_total=mp, interpret=interpret),
        out_shape=[jax.ShapeDtypeStruct((kp, mp // 2), jnp.uint8),
                   jax.ShapeDtypeStruct((kp, mp // 16), jnp.float8_e4m3fn)],
        grid=grid,
        in_specs=[pl.BlockSpec((1, 1), lambda i, j: (0, 0)),
                  pl.BlockSpec((1, 1), lambda i, j: (0, 0)), x_spec, bd_spec],
        out_specs=[pl.BlockSpec((tk, tm // 2), lambda i, j: (j, i)),
                   pl.BlockSpec((tk, tm // 16), lambda i, j: (j, i))],
        interpret=interpret, compiler_params=params, name="fp4lab_rht_nvfp4_quantize",
    )(amax.reshape(1, 1), seed.reshape(1, 1), x2, bd)
    return QArray(q[:k, :m16 // 2], s[:k, :m16 // 16], amax, fmt, 1, None, (k, m16))


def rht_quantize_nvfp4(x, key=None, *, rounding: str = "stochastic", signs="te",
                       global_amax=None, interpret: bool | None = None,
                       config: KernelConfig = KernelConfig(block_rows=64, block_cols=64)
                       ) -> QArray:
    """NVFP4 wgrad operand: ``quantize(rht(x, axis=0).T, "nvfp4", rounding=...)`` fused
    (see module docstring); ``x`` is ``(tokens, features)``; ``key`` is required for
    stochastic rounding."""
    x = jnp.asarray(x)
    _check_input(x)
    if x.ndim != 2:
        raise ValueError(f"rht_quantize_nvfp4 takes a (tokens, features) matrix, got shape "
                         f"{x.shape}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding={rounding!r} must be 'nearest' or 'stochastic'")
    if rounding == "stochastic" and key is None:
        raise ValueError("stochastic rounding needs key=jax.random.key(...)")
    rht_matrix(16, signs)  # validates signs
    return _rht_quantize(x, key, global_amax, rounding=rounding, signs=signs, cfg=config,
                         interpret=_interpret_default(interpret))
