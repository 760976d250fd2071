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
* ``mse``: ``||x - x̂||² / n`` (absolute; the quantity TE's debug features threshold);
  ``rel_mse``: ``||x - x̂||² / ||x||²``; ``sqnr_db``: ``20 log10(||x|| / ||x - x̂||)`` (inf
  when exact).
* ``bad_scales``: fraction of blocks whose stored scale is zero or subnormal (E4M3, FP16,
  FP32 scales) or clamped at 2**-127 (E8M0): "scale health".

Padding added to reach a whole block is excluded from every count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp4lab import rounding
from fp4lab.formats import Format
from fp4lab.quantize import (check_arguments, dequantize_blocks, from_blocks, quantize_blocks,
                             rounded_output)

__all__ = ["quant_metrics", "METRIC_NAMES", "error_metrics"]

METRIC_NAMES = ("underflow", "underflow_all", "saturation", "mse", "rel_mse", "sqnr_db",
                "bad_scales")


def _rate(count: jax.Array, total) -> jax.Array:
    """``count / total`` for an int32 count: exact counts (float32 sums of booleans stop
    counting at 2**24 elements), then one correctly rounded division (``rounding.div``: a
    division by the constant ``total`` is not turned into a reciprocal product)."""
    return rounding.div(count.astype(jnp.float32), jnp.maximum(total, 1).astype(jnp.float32))


def error_metrics(x: jax.Array, y: jax.Array) -> dict[str, jax.Array]:
    """Underflow, MSE, relative MSE and SQNR of an approximation ``y`` of ``x`` (float32).

    The underflow rates are exact counts and one rounding; the error sums are float32
    reductions in the order XLA chooses, so they agree across backends to rounding, not to
    the bit (docs/numerics.md)."""
    x = x.astype(jnp.float32)
    y = y.astype(jnp.float32)
    nonzero = x != 0
    flushed = jnp.sum(nonzero & (y == 0), dtype=jnp.int32)
    signal = jnp.sum(jnp.square(x))
    noise = jnp.sum(jnp.square(x - y))
    return {
        "underflow": _rate(flushed, jnp.sum(nonzero, dtype=jnp.int32)),
        "underflow_all": _rate(flushed, jnp.int32(x.size)),
        "mse": noise / max(x.size, 1),
        "rel_mse": noise / signal,
        "sqnr_db": 10.0 * (jnp.log10(signal) - jnp.log10(noise)),
    }


@functools.partial(jax.jit, static_argnames=("fmt", "g", "rounding"))
def _metrics(x, key, global_amax, *, fmt: Format, g, rounding):
    if fmt.is_passthrough:
        y = x.astype(fmt.element.storage)
        zero = jnp.float32(0)
        return {**error_metrics(x, y), "saturation": zero, "bad_scales": zero}
    b = quantize_blocks(x, fmt, g, rounding, key, global_amax)
    # the dequantized values rounded (no FMA with the subtraction in error_metrics)
    y = rounded_output(from_blocks(dequantize_blocks(b.q, b.scale, b.tensor_amax, fmt), g))
    lowest = fmt.scaling.round_nearest(jnp.float32(-jnp.finfo(jnp.float32).max), fmt.element)
    saturated = from_blocks((b.v > fmt.element.max) | (b.v < lowest), g)
    bad = fmt.scaling.bad_scale(b.scale)
    return {
        **error_metrics(x, y),
        "saturation": _rate(jnp.sum(saturated, dtype=jnp.int32), jnp.int32(saturated.size)),
        "bad_scales": _rate(jnp.sum(bad, dtype=jnp.int32), jnp.int32(bad.size)),
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
    """Metrics (see module doc) of quantizing ``x`` to ``fmt``; arguments as ``quantize``."""
    x, fmt, g, _ = check_arguments(x, fmt, axis=axis, tile=tile, rounding=rounding, key=key,
                                   global_amax=global_amax)
    out = _metrics(x, key, global_amax, fmt=fmt, g=g, rounding=rounding)
    return {k: out[k] for k in METRIC_NAMES}
