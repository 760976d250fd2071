"""The precision of an expert-parallel MoE layer's dispatch: the rows a device sends to the
devices that hold their experts, quantized before the all-to-all and dequantized after it.

torchao's MXFP8 MoE training sends its dispatched activations this way
(``to_mxfp8_a2a_dequant``): MXFP8 rows (E4M3 elements and one E8M0 scale per 32 along the
model width) forward, the backward's cotangent in its own precision; recent 671B-scale work
sends MXFP4. :func:`all_to_all` is ``jax.lax.all_to_all`` (``tiled=False``) with that
forward, for any fp4lab format whose scales travel with their rows: block and channel
formats along the last axis, and pass-through casts (``bf16``). A per-tensor scale
(NVFP4's, per-tensor FP8) would be the sender's and is refused. :func:`dispatched` gives the
same numerics on one device (a model studies the dispatch's precision without a mesh), and
:func:`payload_bytes` is what one send of such rows weighs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from fp4lab.numerics.formats import Format, get_format
from fp4lab.numerics.quantize import cast, dequantize, quantize

__all__ = ["all_to_all", "dispatched", "payload_bytes", "check_dispatch_format"]


def check_dispatch_format(fmt: str | Format | None) -> Format | None:
    """``fmt`` as a :class:`Format` (None: no quantization), refused by name where its scale
    is not carried by the rows themselves."""
    if fmt is None:
        return None
    f = get_format(fmt)
    if f.has_global_scale or f.granularity == "tensor":
        raise ValueError(f"dispatch format {f.name!r} has a per-tensor scale, which would be "
                         "each sender's own: use a block format (mxfp8, mxfp4) or a cast "
                         "(bf16)")
    return f


def payload_bytes(rows: int, width: int, fmt: str | Format | None, dtype=jnp.bfloat16) -> int:
    """The bytes of ``rows`` rows of ``width`` values sent in ``fmt`` (None: in ``dtype``):
    the arrays :func:`all_to_all` moves, elements and scales as stored."""
    f = check_dispatch_format(fmt)
    x = jax.ShapeDtypeStruct((rows, width), dtype)
    if f is None:
        return rows * width * jnp.dtype(dtype).itemsize
    if f.is_passthrough:
        return rows * width * jnp.dtype(f.element.storage).itemsize
    q = jax.eval_shape(lambda v: quantize(v, f, axis=-1), x)
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(q))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _quantized_all_to_all(x, axis_name, fmt: Format, split_axis: int, concat_axis: int):
    def move(t):  # no axis: one device, where the rows arrive as they were sent
        return t if axis_name is None else jax.lax.all_to_all(
            t, axis_name, split_axis=split_axis, concat_axis=concat_axis)

    if fmt.is_passthrough:
        return move(cast(x, fmt, "nearest", None)).astype(x.dtype)
    q = quantize(x, fmt, axis=-1)
    moved = jax.tree.map(move, q)  # the elements and their scales, each leaf along its rows
    return dequantize(moved, x.dtype)


def _fwd(x, axis_name, fmt, split_axis, concat_axis):
    return _quantized_all_to_all(x, axis_name, fmt, split_axis, concat_axis), None


def _bwd(axis_name, fmt, split_axis, concat_axis, _, g):
    if axis_name is None:
        return (g,)
    # the transpose of an all-to-all is the all-to-all that sends every block back
    return (jax.lax.all_to_all(g, axis_name, split_axis=concat_axis, concat_axis=split_axis),)


_quantized_all_to_all.defvjp(_fwd, _bwd)


def all_to_all(x: jax.Array, axis_name, fmt: str | Format | None = None, *,
               split_axis: int = 0, concat_axis: int = 0) -> jax.Array:
    """``jax.lax.all_to_all(x, axis_name, split_axis, concat_axis)`` whose forward sends
    ``x`` quantized to ``fmt`` along its last axis (None: as it is), dequantized to ``x``'s
    dtype on arrival; the backward sends the cotangent unquantized."""
    f = check_dispatch_format(fmt)
    if f is None:
        return jax.lax.all_to_all(x, axis_name, split_axis, concat_axis)
    if split_axis == x.ndim - 1 or concat_axis == x.ndim - 1:
        raise ValueError("a quantized all_to_all keeps the last axis (the blocks' axis) whole")
    return _quantized_all_to_all(x, axis_name, f, split_axis, concat_axis)


def dispatched(x: jax.Array, fmt: str | Format | None) -> jax.Array:
    """The rows ``x`` as a dispatch in ``fmt`` delivers them (:func:`all_to_all`'s numerics
    on one device: quantized and dequantized along the last axis forward, the cotangent
    passed through): what a one-device model trains with to study the dispatch's
    precision."""
    f = check_dispatch_format(fmt)
    return x if f is None else _quantized_all_to_all(x, None, f, 0, 0)
