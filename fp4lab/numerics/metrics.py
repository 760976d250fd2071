"""Numerics probes: what quantizing a tensor to a format does to it.

:func:`quant_metrics` returns a dict of float32 scalars (a pytree, so it works under ``jit``,
``vmap`` and inside a training step):

* ``underflow``: flush-to-zero rate, ``count(x != 0 and x̂ == 0) / count(x != 0)`` (nonzero
  denominator, fp4lab's default; NVFP4 on N(0, 1) gives about 6.8 %).
* ``underflow_all``: the same count over *all* elements (the denominator of TE's debug
  feature), for comparison with TE logs.
* ``saturation``: ``count(x * enc outside [lowest, max_elem]) / count(x)``, measured before
  clipping: the values the element range clips. ``lowest`` is the least value the format's
  rounding gives, ``-max_elem`` except for GGML Q4_0, whose codes reach -8 (the block
  maximum's own code), so a block it represents exactly saturates nothing.
* ``overflow``: ``count(x finite and x̂ not finite) / count(x finite)``: finite values the
  format dequantizes to ±inf or NaN. NVFP4 (and Four Over Six) of a tensor whose amax is at
  least ``FLT_MAX / 448`` (about 7.6e35) do that, as Transformer Engine's decode does: the
  multiplier ``fl(s_b * amax)`` overflows, the block's nonzero values become ±inf and its zeros
  NaN (docs/numerics.md); the error metrics are then inf/NaN, and this says why.
* ``mse``: ``||x - x̂||² / n`` (absolute; the quantity TE's debug features threshold);
  ``rel_mse``: ``||x - x̂||² / ||x||²``; ``sqnr_db``: ``20 log10(||x|| / ||x - x̂||)`` (inf
  when exact).
* ``bad_scales``: fraction of blocks whose stored scale is zero or subnormal (E4M3, FP16,
  FP32 scales) or clamped at 2**-127 (E8M0): "scale health".
* ``block_dynamic_range``: the largest ``log2(max |x| / min |x|)`` over the nonzero elements
  of a block, over the blocks (0 for blocks of zeros), in the format's own blocks (the whole
  tensor for pass-through formats): Transformer Engine's ``max_blockwise_dynamic_range``
  (``debug/features/utils/stats_computation.py``), the range a block's one scale must span.
* ``map4_share``: the fraction of blocks Four Over Six maps to 4 (TE's 4/6 and Quartet II's;
  0 for every other format).
* ``noise_ratio``: ``||x|| / sqrt(E||SR(x) - x||²)``, the tensor's norm over the standard
  deviation of the noise stochastic rounding onto the format would add (from the format's
  own scales: ``sum m² (|v| - lo)(hi - |v|)`` for each scaled element ``v`` between grid
  neighbours ``lo``, ``hi``, ``m`` its dequantization multiplier, plus ``m² (|v| - max)²``
  where it clips), whatever the operand's own rounding. FP4 All the Way (arXiv 2505.19115)
  argues that quantized training stops helping once the gradient's norm falls below about
  ``sqrt(3)`` times its quantization noise: on the gradient operands (``dgrad_dy``,
  ``wgrad_dy``) this is that ratio for the operand (the paper's exact definition, which
  gradient and which noise, could not be read here: docs/recipes/fp4_all_the_way.md).

Padding added to reach a whole block is excluded from every count, and so are the elements
outside ``valid`` (:func:`operand_metrics`; a block counts where it holds a valid element):
the zero rows of a Mixture-of-Experts expert's slot (``fp4lab.qragged_dot``) measure as the
expert's own rows alone would.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp4lab.numerics import rounding
from fp4lab.numerics.formats import Format
from fp4lab.numerics.geometry import from_blocks, to_blocks
from fp4lab.numerics.quantize import (check_amax_covers, check_arguments, dequantize_blocks,
                             quantize_blocks, rounded_output)

__all__ = ["quant_metrics", "operand_metrics", "METRIC_NAMES", "error_metrics"]

METRIC_NAMES = ("underflow", "underflow_all", "saturation", "mse", "rel_mse", "sqnr_db",
                "bad_scales", "block_dynamic_range", "map4_share", "noise_ratio", "overflow")


def _rate(count: jax.Array, total) -> jax.Array:
    """``count / total`` for an int32 count: exact counts (float32 sums of booleans stop
    counting at 2**24 elements), then one correctly rounded division (``rounding.div``: a
    division by the constant ``total`` is not turned into a reciprocal product)."""
    return rounding.div(count.astype(jnp.float32), jnp.maximum(total, 1).astype(jnp.float32))


def _count(mask, valid=None) -> jax.Array:
    """``count(mask)`` where ``valid`` (everywhere for None), int32."""
    return jnp.sum(mask if valid is None else mask & valid, dtype=jnp.int32)


def error_metrics(x: jax.Array, y: jax.Array, valid: jax.Array | None = None
                  ) -> dict[str, jax.Array]:
    """Underflow, overflow, MSE, relative MSE and SQNR of an approximation ``y`` of ``x``
    (float32), over the elements where ``valid`` (a boolean array of ``x``'s shape; None: all).

    The underflow and overflow rates are exact counts and one rounding; the error sums are float32
    reductions in the order XLA chooses, so they agree across backends to rounding, not to
    the bit (docs/numerics.md)."""
    x = x.astype(jnp.float32)
    y = y.astype(jnp.float32)
    if valid is not None:
        x, y = jnp.where(valid, x, 0.0), jnp.where(valid, y, 0.0)
    nonzero = x != 0
    flushed = _count(nonzero & (y == 0))
    finite = jnp.isfinite(x)
    overflowed = _count(finite & ~jnp.isfinite(y), valid)
    signal = jnp.sum(jnp.square(x))
    noise = jnp.sum(jnp.square(x - y))
    size = jnp.int32(x.size) if valid is None else _count(valid)
    return {
        "underflow": _rate(flushed, _count(nonzero)),
        "underflow_all": _rate(flushed, size),
        "overflow": _rate(overflowed, _count(finite, valid)),
        "mse": noise / jnp.maximum(size, 1).astype(jnp.float32),
        "rel_mse": noise / signal,
        "sqnr_db": 10.0 * (jnp.log10(signal) - jnp.log10(noise)),
    }


def _block_dynamic_range(xb: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """``max`` over blocks of ``log2(amax) - log2(min nonzero |x|)`` (0 for a zero block)."""
    a = jnp.abs(xb.astype(jnp.float32))
    amax = jnp.max(a, axis=axes, initial=0.0)
    amin = jnp.min(jnp.where(a == 0, jnp.inf, a), axis=axes, initial=jnp.inf)
    per_block = jnp.where(amax != 0, jnp.log2(amax) - jnp.log2(amin), 0.0)
    return jnp.max(per_block, initial=0.0)


def _map4_share(xb, b, fmt: Format, axes, blocks_valid) -> jax.Array:
    if not getattr(fmt.scaling, "chooses_map_to_4", False):  # Four Over Six, Quartet II's
        return jnp.float32(0)
    six = fmt.scaling.map_to_6(rounding.abs_max(xb, axis=axes, keepdims=True), b.tensor_amax)
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint8)
    four = bits(b.scale) != bits(six)
    return _rate(_count(four, blocks_valid), _blocks(four, blocks_valid))


def _blocks(per_block, blocks_valid) -> jax.Array:
    """The number of blocks counted: all, or those holding a valid element."""
    return jnp.int32(per_block.size) if blocks_valid is None else _count(blocks_valid)


def _noise_ratio(signal, v, multiplier, element) -> jax.Array:
    """``sqrt(signal / E||SR - x||²)`` from the scaled values ``v`` and their multipliers."""
    a = jnp.abs(v)
    inside = jnp.minimum(a, element.max)
    lo, hi = rounding.grid_neighbours(inside, element)
    var = (inside - lo) * (hi - inside) + jnp.square(a - inside)
    noise = jnp.sum(jnp.where(jnp.isfinite(var), jnp.square(multiplier) * var, 0.0))
    return jnp.sqrt(signal / noise)


@functools.partial(jax.jit, static_argnames=("fmt", "g", "rounding"))
def _metrics(x, key, global_amax, valid, *, fmt: Format, g, rounding):
    if fmt.is_passthrough:
        y = x.astype(fmt.element.storage)
        zero = jnp.float32(0)
        signal = jnp.sum(jnp.square(x.astype(jnp.float32)))
        return {**error_metrics(x, y, valid), "saturation": zero, "bad_scales": zero,
                "block_dynamic_range": _block_dynamic_range(x.reshape(-1), (0,)),
                "map4_share": zero,
                "noise_ratio": _noise_ratio(signal, x.astype(jnp.float32), jnp.float32(1),
                                            fmt.element)}
    b = quantize_blocks(x, fmt, g, rounding, key, global_amax)
    xb = to_blocks(x.astype(jnp.float32), g)
    # the dequantized values rounded (no FMA with the subtraction in error_metrics)
    y = rounded_output(from_blocks(dequantize_blocks(b.q, b.scale, b.tensor_amax, fmt), g))
    lowest = fmt.scaling.round_nearest(jnp.float32(-jnp.finfo(jnp.float32).max), fmt.element)
    saturated = from_blocks((b.v > fmt.element.max) | (b.v < lowest), g)
    bad = fmt.scaling.bad_scale(b.scale)
    # a block counts where it holds a valid element (padding to whole blocks is not valid)
    blocks_valid = None if valid is None else jnp.any(
        to_blocks(valid, g), axis=g.reduce_axes, keepdims=True)
    return {
        **error_metrics(x, y, valid),
        "saturation": _rate(_count(saturated, valid),
                            jnp.int32(saturated.size) if valid is None else _count(valid)),
        "bad_scales": _rate(_count(bad, blocks_valid), _blocks(bad, blocks_valid)),
        "block_dynamic_range": _block_dynamic_range(xb, g.reduce_axes),
        "map4_share": _map4_share(xb, b, fmt, g.reduce_axes, blocks_valid),
        "noise_ratio": _noise_ratio(jnp.sum(jnp.square(xb)), b.v, fmt.scaling.dequantize(
            jnp.ones_like(b.v), b.scale, b.tensor_amax, fmt.element),
            fmt.element),
    }


def quant_metrics(
    x: jax.Array,
    fmt: str | Format,
    *,
    axis: int = -1,
    tile: tuple[int, int] | None = None,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    global_amax: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Metrics (see module doc) of quantizing ``x`` to ``fmt``; arguments as ``quantize``
    (a concrete ``global_amax`` below a concrete ``max|x|`` is refused, as there)."""
    check_amax_covers(x, global_amax)
    return operand_metrics(x, fmt, axis=axis, tile=tile, rounding=rounding, key=key,
                           global_amax=global_amax)


def operand_metrics(x, fmt, *, axis=-1, tile=None, rounding="nearest", key=None,
                    global_amax=None, valid=None) -> dict[str, jax.Array]:
    """:func:`quant_metrics` of a GEMM operand (the probes): its ``global_amax``, from an amax
    history, may lie below ``max|x|`` and saturate it, which is what the probe measures.
    ``valid``: a boolean array broadcastable to ``x``'s shape, the elements counted (the rest
    must be zeros, which change no scale: an expert's slot beyond its rows); None: all."""
    x, fmt, g, _ = check_arguments(x, fmt, axis=axis, tile=tile, rounding=rounding, key=key,
                                   global_amax=global_amax)
    if valid is not None:
        valid = jnp.broadcast_to(valid, x.shape)
    out = _metrics(x, key, global_amax, valid, fmt=fmt, g=g, rounding=rounding)
    return {k: out[k] for k in METRIC_NAMES}
