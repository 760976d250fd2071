"""A quantized GEMM's operands as it multiplies them (docs/numerics.md, "The GEMM"): the
elements times their block scales (BF16 where those are BF16 numbers), and the per-tensor or
per-slice factor the GEMM applies to its product instead (``ScaleScheme.gemm_split``).
:func:`gemm_operand` quantizes as :func:`fp4lab.numerics.quantize.quantize` does (a kernel
where the backend picks one); :func:`split_dequantize` decodes a QArray the same way."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fp4lab.numerics import backend as _backend
from fp4lab.numerics import rounding as rnd
from fp4lab.numerics.formats import Format
from fp4lab.numerics.geometry import Geometry, from_blocks, geometry, scale_to_blocks
from fp4lab.numerics.qarray import QArray
from fp4lab.numerics.quantize import (cast, check_arguments, opaque_scales, quantize_blocks,
                                      rounded_output)
from fp4lab.numerics.scaling import Outer

__all__ = ["GemmOperand", "gemm_operand", "split_dequantize"]


class GemmOperand(NamedTuple):
    """A GEMM operand as the GEMM multiplies it (docs/numerics.md, "The GEMM"): ``values``, the
    elements times the inner multipliers of the scheme's ``gemm_split``, in BF16 where the
    scheme says they are BF16 numbers (``bf16_values``) and float32 otherwise; and the
    :class:`~fp4lab.numerics.scaling.Outer` factor the GEMM applies to its product (None:
    none), broadcastable to ``values`` with size 1 along the block axis."""

    values: jax.Array
    outer: Outer | None = None


def _logical_outer(outer: Outer, g: Geometry, ax: int) -> Outer | None:
    """``outer`` (keepdims, blocked layout) in the logical layout (size 1 along the block
    axis); None where it is not constant along the block axis (then the GEMM cannot apply it
    after the product: FP8 1x128 blocks)."""
    def logical(a):
        a = jnp.asarray(a, jnp.float32)
        if a.size == 1:
            return a.reshape(())
        if len(g.axes) != 1 or g.per_tensor:
            return None
        inner = g.inner(ax)
        if a.shape[inner - 1] != 1:
            return None
        return a.reshape(a.shape[:inner] + a.shape[inner + 1:])
    factor, divisor = logical(outer.factor), logical(outer.divisor)
    return None if factor is None or divisor is None else Outer(factor, divisor)


def _split(q, scale, tensor_amax, fmt: Format, g: Geometry, ax: int,
           outer_ok: bool) -> GemmOperand:
    """Element values ``q`` (blocked layout) with their stored scales as a GEMM operand."""
    scheme, elem = fmt.scaling, fmt.element
    scale, tensor_amax = opaque_scales(scale, tensor_amax)
    split = scheme.gemm_split(scale, tensor_amax, elem)
    inner, outer = split if split is not None else (None, None)
    if outer is not None:
        outer = _logical_outer(outer, g, ax) if outer_ok else None
        if outer is None:  # not wanted, or not constant along the reduction (FP8 1x128
            inner = None   # blocks): every multiplier on the elements, dequantize's order
    if inner is None:
        return GemmOperand(rounded_output(from_blocks(
            scheme.dequantize(q, scale, tensor_amax, elem), g)), outer)
    for m in inner:
        q = q * m
    y = from_blocks(q, g)
    return GemmOperand(rounded_output(y.astype(jnp.bfloat16) if scheme.bf16_values(elem)
                                      else y), outer)


@functools.partial(jax.jit, static_argnames=("fmt", "g", "ax", "rounding", "outer"))
def _gemm_operand(x, key, global_amax, *, fmt: Format, g: Geometry, ax: int, rounding,
                  outer: bool) -> GemmOperand:
    b = quantize_blocks(x, fmt, g, rounding, key, global_amax)
    return _split(b.q, b.scale, b.tensor_amax, fmt, g, ax, outer)


@functools.partial(jax.jit, static_argnames=("outer",))
def split_dequantize(q: QArray, outer: bool = True) -> GemmOperand:
    """A QArray as a GEMM operand (:class:`GemmOperand`): the values :func:`dequantize` gives,
    with the part of the decode the GEMM applies after its product left out (``outer=False``:
    none left out, as :func:`gemm_operand`)."""
    fmt = q.format
    if fmt.is_passthrough:
        return GemmOperand(q.data)
    g, ax = geometry(q.shape, fmt, q.axis, q.tile)
    data = rnd.unpack_nibbles(q.data, q.axis) if fmt.element.packed else q.data
    vals = rnd.decode(data, fmt.element).reshape(g.blocked)
    return _split(vals, scale_to_blocks(q.scale, g), q.global_scale, fmt, g, ax, outer)


def gemm_operand(x, fmt, *, axis=-1, tile=None, rounding="nearest", key=None,
                 global_amax=None, backend="auto", outer: bool = True) -> GemmOperand:
    """``x`` quantized as :func:`quantize` does (the same arguments; a kernel where
    ``backend`` picks one), as the GEMM multiplies it: :class:`GemmOperand`. ``outer=False``:
    every multiplier on the elements (:func:`fake_quant`'s values, in BF16 where the scheme
    multiplies BF16: MX values below 2**-126 rounded to BF16's subnormals)."""
    x, fmt, g, ax = check_arguments(x, fmt, axis=axis, tile=tile, rounding=rounding,
                                    key=key, global_amax=global_amax)
    if fmt.is_passthrough:
        return GemmOperand(cast(x, fmt, rounding, key))
    # any 1D block axis can be moved last and back (same blocks, same bits)
    moved = tile is None and fmt.granularity == "block" and ax != x.ndim - 1
    kernel = _backend.decide(backend, _backend.Request(
        op="quantize", format=fmt, shape=x.shape, axis=-1 if moved else ax - x.ndim,
        tile=tile, rounding=rounding), strict=True)
    if kernel is not None:
        xk = jnp.moveaxis(x, ax, -1) if moved else x
        op = split_dequantize(kernel.fn(xk, fmt, axis=-1 if moved else ax - x.ndim, tile=tile,
                                        global_amax=global_amax, rounding=rounding, key=key),
                              outer)
        return jax.tree.map(lambda a: jnp.moveaxis(a, -1, ax) if moved and a.ndim else a, op)
    return _gemm_operand(x, key, global_amax, fmt=fmt, g=g, ax=ax, rounding=rounding,
                         outer=outer)
