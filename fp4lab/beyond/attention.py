"""Attention precision: a flash-style attention whose P.V accumulation and output precision
are knobs, with the flash backward that uses the saved output.

Kimi K3 keeps the attention output in FP32 in training because BF16 flash attention is
*biased* (Qiu and Yao, "Why Low-Precision Transformer Training Fails: An Analysis on Flash
Attention", arXiv 2510.04212): in rows whose scores repeat their maximum, many unnormalized
probabilities are exactly 1, and rounding the running P.V accumulator to BF16 then errs in
one direction; the backward pass's ``D = rowsum(dO * O)`` from the saved ``O`` carries the
error into every gradient.

:func:`flash_attention` computes ``softmax(q k^T * scale) v`` the way a flash kernel does:
key blocks of ``block_k`` in order, an online softmax (running row max ``m``, row sum ``l``,
accumulator ``acc``, rescaled by ``exp(m_old - m_new)`` per block), the output
``acc / l``. ``accumulate`` sets the rounding points (each a ``lax.reduce_precision`` to BF16,
round to nearest even): ``"bf16_p"`` rounds the block's unnormalized probabilities
``P = exp(s - m)`` as they enter the P.V product (the MMA multiplies BF16 values and adds in
FP32; FlashAttention-2/3's BF16 kernels), ``"bf16"`` also the accumulator after every block's
update (BF16 accumulation), ``"fp32"`` rounds nowhere.
``out_dtype`` is the output as passed on, ``saved_dtype`` the output as saved for the
backward pass. The backward (a ``jax.custom_vjp``) recomputes ``P = exp(s - lse)`` per key block
from the saved ``q``, ``k``, ``v`` and row log-sum-exp, and uses ``D = rowsum(dO * O_saved)``:

    dV = P^T dO,  dP = dO V^T,  dS = P (dP - D),  dQ = scale dS K,  dK = scale dS^T Q

all in FP32. Shapes ``q [..., L, D]``, ``k``/``v`` ``[..., T, D]`` (``[..., T, Dv]`` for
``v``), any leading batch and head axes; ``causal`` masks key ``t > query l + (T - L)``.

``saved_format`` (DeepSeek-V3's E5M6 attention output, ``e5m6_block128_pow2``): the backward
takes ``O_saved = DQ(Q(O))``, ``O`` as the output projection stores its input (its recipe's
``saved_x``): cast to ``out_dtype``, the head axis (-3) merged into the features
(``[..., L, H * Dv]``; ``[L, Dv]`` without a head axis), quantized along that axis. The
attention keeps no copy of ``O``: its backward recomputes ``O`` from ``q``, ``k``, ``v`` (the
forward's operations again: one more P.V per key block) and quantizes it as the GEMM did, so
the GEMM's stored copy is the only one kept. (Two ``custom_vjp`` residuals cannot be shared, and a
Flax layer's GEMM cannot be fused into this one.)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from fp4lab.numerics.formats import Format, get_format
from fp4lab.numerics.quantize import dequantize, quantize
from fp4lab.numerics.rounding import round_to_bf16

__all__ = ["flash_attention", "stored_output", "ACCUMULATE"]

ACCUMULATE = ("fp32", "bf16_p", "bf16")


def _scores(q, kb, scale, causal, start, length, total):
    s = jnp.einsum("...ld,...td->...lt", q, kb, precision=lax.Precision.HIGHEST) * scale
    if causal:
        rows = jnp.arange(length)[:, None] + (total - length)
        cols = start + jnp.arange(kb.shape[-2])[None, :]
        s = jnp.where(cols <= rows, s, -jnp.inf)
    return s


def _blocks(x, block):
    t = x.shape[-2]
    return [(i, x[..., i:i + block, :]) for i in range(0, t, block)]


def _forward(q, k, v, scale, causal, block_k, accumulate):
    length, total = q.shape[-2], k.shape[-2]
    keep = lambda x: x  # noqa: E731
    round_p = keep if accumulate == "fp32" else round_to_bf16
    round_acc = round_to_bf16 if accumulate == "bf16" else keep
    m = jnp.full(q.shape[:-1], -jnp.inf, jnp.float32)
    l = jnp.zeros(q.shape[:-1], jnp.float32)
    acc = jnp.zeros(q.shape[:-1] + v.shape[-1:], jnp.float32)
    for (start, kb), (_, vb) in zip(_blocks(k, block_k), _blocks(v, block_k), strict=True):
        s = _scores(q, kb, scale, causal, start, length, total)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with no key yet
        p = jnp.exp(s - safe[..., None])
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf))
        l = l * alpha + jnp.sum(p, axis=-1)
        pv = jnp.einsum("...lt,...td->...ld", round_p(p), vb, precision=lax.Precision.HIGHEST)
        acc = round_acc(acc * alpha[..., None] + pv)
        m = m_new
    out = acc / l[..., None]
    lse = m + jnp.log(l)
    return out, lse


def stored_output(o, fmt: Format, dtype):
    """``DQ(Q(o))`` in float32 as the output projection stores its input: ``o`` cast to
    ``dtype``, heads (axis -3) merged into the features, quantized along them in ``fmt``."""
    heads = o.ndim >= 3
    rows = jnp.moveaxis(o, -3, -2) if heads else o[..., None, :]  # [..., L, H, Dv]
    flat = rows.reshape(rows.shape[:-2] + (-1,)).astype(dtype).astype(jnp.float32)
    back = dequantize(quantize(flat, fmt, axis=-1), jnp.float32).reshape(rows.shape)
    return jnp.moveaxis(back, -2, -3) if heads else back[..., 0, :]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _attention(q, k, v, scale, causal, block_k, accumulate, out_dtype, saved):
    out, _ = _forward(q, k, v, scale, causal, block_k, accumulate)
    return out.astype(out_dtype)


def _attention_fwd(q, k, v, scale, causal, block_k, accumulate, out_dtype, saved):
    out, lse = _forward(q, k, v, scale, causal, block_k, accumulate)
    o_saved = None if isinstance(saved, Format) else out.astype(saved)
    return out.astype(out_dtype), (q, k, v, o_saved, lse)


def _attention_bwd(scale, causal, block_k, accumulate, out_dtype, saved, res, d_out):
    q, k, v, o_saved, lse = res
    if isinstance(saved, Format):  # O recomputed, stored as the next GEMM stores it
        o_saved = stored_output(_forward(q, k, v, scale, causal, block_k, accumulate)[0],
                                saved, out_dtype)
    length, total = q.shape[-2], k.shape[-2]
    do = d_out.astype(jnp.float32)
    delta = jnp.sum(do * o_saved.astype(jnp.float32), axis=-1)  # D = rowsum(dO * O)
    dq = jnp.zeros(q.shape, jnp.float32)
    dks, dvs = [], []
    hi = lax.Precision.HIGHEST
    for (start, kb), (_, vb) in zip(_blocks(k, block_k), _blocks(v, block_k), strict=True):
        s = _scores(q, kb, scale, causal, start, length, total)
        p = jnp.exp(s - lse[..., None])
        dvs.append(jnp.einsum("...lt,...ld->...td", p, do, precision=hi))
        dp = jnp.einsum("...ld,...td->...lt", do, vb, precision=hi)
        ds = p * (dp - delta[..., None])
        dq = dq + scale * jnp.einsum("...lt,...td->...ld", ds, kb, precision=hi)
        dks.append(scale * jnp.einsum("...lt,...ld->...td", ds, q, precision=hi))
    dk, dv = jnp.concatenate(dks, axis=-2), jnp.concatenate(dvs, axis=-2)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _saved(saved_dtype, saved_format, out_dtype):
    """What the backward pass keeps of the output: a dtype, or a block Format."""
    if saved_format is None:
        return out_dtype if saved_dtype is None else jnp.dtype(saved_dtype)
    if saved_dtype is not None:
        raise ValueError(f"saved_dtype={saved_dtype!r} and saved_format={saved_format!r}: "
                         "give one")
    fmt = get_format(saved_format)
    if fmt.is_passthrough:
        raise ValueError(f"saved_format={saved_format!r} is a cast: use saved_dtype for it")
    return fmt


def flash_attention(q, k, v, *, causal: bool = False, scale: float | None = None,
                    block_k: int = 64, accumulate: str = "fp32", out_dtype=jnp.float32,
                    saved_dtype=None, saved_format=None):
    """``softmax(q k^T * scale) v`` computed as a flash kernel does (module docstring);
    ``scale`` defaults to ``1 / sqrt(D)``, ``saved_dtype`` to ``out_dtype``;
    ``saved_format``: the backward uses the output as the next GEMM stores it in that
    block format (module docstring)."""
    if accumulate not in ACCUMULATE:
        raise ValueError(f"accumulate={accumulate!r}: use one of {', '.join(ACCUMULATE)}")
    if q.ndim < 2 or k.shape[:-2] != q.shape[:-2] or v.shape[:-1] != k.shape[:-1] or \
            k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: need q [..., L, D], "
                         "k [..., T, D], v [..., T, Dv]")
    if not isinstance(block_k, int) or block_k < 1:
        raise ValueError(f"block_k={block_k!r} must be a positive int")
    if causal and q.shape[-2] > k.shape[-2]:
        raise ValueError(f"causal attention needs L={q.shape[-2]} <= T={k.shape[-2]}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out_dtype = jnp.dtype(out_dtype)
    saved = _saved(saved_dtype, saved_format, out_dtype)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    return _attention(*f32, scale, causal, block_k, accumulate, out_dtype, saved)
