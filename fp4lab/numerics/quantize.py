"""Quantize, dequantize and fake-quantize arrays in any fp4lab format.

``quantize(x, fmt)`` returns a :class:`QArray` pytree (``data``, ``scale``, ``global_scale``;
format, axis, tile and logical shape static). ``dequantize(q)`` inverts it and
``fake_quant(x, fmt)`` equals ``dequantize(quantize(x))`` bit for bit, with a straight-through
gradient. All three are pure, jit-compiled, and work under ``jit``, ``vmap`` and ``grad``.

Geometry. Blocks run along ``axis`` (the GEMM's reduction axis). ``tile=(t0, t1)`` instead
scales 2D tiles of the last two axes (NVFP4 16x16 weights, DeepSeek 128x128): quantizing
``W.T`` with ``tile=(t1, t0)`` gives exactly the transpose of quantizing ``W``. A length that
is not a multiple of the block is zero-padded internally (padding never changes an amax);
``data`` and ``scale`` keep the padded layout and ``dequantize`` slices back to ``shape``.

Storage. 4-bit elements (E2M1, INT4) are packed two per uint8 along ``axis``, element 2i in
the low nibble; FP8 elements are float8 dtypes; INT8 is int8. Scales: E4M3 as float8_e4m3fn
(NVFP4), E8M0 as its uint8 biased exponent (MX), float32 decode scales (FP8, INT), float16
(GGML). For NVFP4 ``global_scale`` holds the float32 tensor amax, from which TE derives its
two global factors (that is what TE stores too); it is ``None`` for other formats.

Special values and the choices where the reference systems differ: docs/numerics.md, and
``fp4lab.numerics.scaling`` per scheme.
Zeros keep their sign where the element format has one (E2M1 code 0x8 is -0).

Flush-to-zero. XLA:CPU flushes float32 subnormals (inputs and results of float ops), so an
input below 2**-126 in magnitude counts as zero, and tensors whose amax is below ~1e-35 (where
TE's NVFP4 ``S_dec`` or an MX descale becomes subnormal) follow the flushed arithmetic. Amaxes
are taken on the bit patterns, so they are exact. For every tensor whose float32 intermediates
stay normal the results equal the docs/numerics.md formulas exactly; tests cover both
regimes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from fp4lab.numerics import backend as _backend
from fp4lab.numerics import random_bits
from fp4lab.numerics import rounding as rnd
from fp4lab.numerics.formats import Format, get_format
from fp4lab.numerics.geometry import (Geometry, from_blocks, geometry, scale_from_blocks,
                             scale_to_blocks, to_blocks)
from fp4lab.numerics.qarray import QArray
from fp4lab.numerics.scaling import group_blocks

__all__ = ["QArray", "quantize", "dequantize", "fake_quant", "fake_quant_operand", "check_key",
           "straight_through",
           # the XLA reference's steps, for measuring what it does (fp4lab.numerics.metrics)
           "check_arguments", "Blocks", "quantize_blocks", "dequantize_blocks",
           "rounded_output", "trust_mask", "opaque_scales", "cast"]

Rounding = Literal["nearest", "stochastic"]


# --------------------------------------------------------------------------- validation


def check_key(key, what: str = "key"):
    """Raise a clear error unless ``key`` is a JAX PRNG key (``jax.random.key(seed)``, or a
    legacy ``jax.random.PRNGKey(seed)``: uint32 of shape (..., 2))."""
    dtype = getattr(key, "dtype", None)
    if dtype is not None and (jnp.issubdtype(dtype, jax.dtypes.prng_key) or (
            dtype == jnp.uint32 and key.shape[-1:] == (2,))):
        return key
    raise TypeError(f"{what}={key!r} is not a PRNG key: pass jax.random.key(seed) (or "
                    "split one); stochastic rounding draws its random bits from it")



def check_arguments(x, fmt, *, axis=-1, tile=None, rounding="nearest", key=None,
                    global_amax=None) -> tuple[jax.Array, Format, Geometry, int]:
    """The checks of :func:`quantize`'s arguments (the same keywords), shared by every
    function that takes them: returns ``(x, fmt, geometry, axis)``, ``x`` as an array,
    ``fmt`` a :class:`Format`, the block :class:`Geometry` and the block axis normalized to
    ``0 <= axis < x.ndim``; raises TypeError or ValueError naming the bad argument."""
    fmt = get_format(fmt)
    if not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize needs a floating-point array, got dtype {x.dtype}")
    if isinstance(tile, list):
        tile = tuple(tile)
    g, ax = geometry(x.shape, fmt, axis, tile)
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"{rounding=} is not 'nearest' or 'stochastic'")
    if rounding == "stochastic":
        if key is None:
            raise ValueError("rounding='stochastic' needs an explicit PRNG key: key=...")
        check_key(key)
        if not fmt.scaling.stochastic_ok:
            raise ValueError(f"rounding='stochastic' is not supported for format {fmt.name}: "
                             "its choice of block scale assumes rounding to nearest")
        if fmt.is_passthrough and fmt.element.name not in ("bf16", "fp16"):
            raise ValueError(f"rounding='stochastic' is not supported for pass-through format "
                             f"{fmt.name} (only bf16 and fp16)")
    outer = fmt.scaling.outer_amax
    if fmt.block and isinstance(outer, int) and outer % fmt.block:
        raise ValueError(f"format {fmt.name}: an outer amax per {outer} elements is not a "
                         f"multiple of its block {fmt.block}")
    if (outer == "slice" or isinstance(outer, int)) and (
            tile is not None or global_amax is not None):
        raise ValueError(f"format {fmt.name} takes its amax per slice along the block axis: "
                         f"no 2D tile (got tile={tile}) and no global_amax")
    if global_amax is not None and not (fmt.has_global_scale or fmt.granularity == "tensor"):
        raise ValueError(f"global_amax given, but format {fmt.name} has no per-tensor scale")
    if global_amax is not None:
        _check_global_amax(global_amax)
    return x, fmt, g, ax


def _check_global_amax(global_amax) -> None:
    """A given per-tensor amax is a finite scalar >= 0; checked where it is concrete (a
    traced one must satisfy the same, unchecked: a negative amax would act as its magnitude,
    a NaN or infinite one as the special values of docs/numerics.md)."""
    if jnp.ndim(global_amax):
        raise ValueError(f"global_amax must be a scalar, got shape {jnp.shape(global_amax)}")
    if isinstance(global_amax, jax.core.Tracer):
        return
    a = float(global_amax)
    if not (math.isfinite(a) and a >= 0):
        raise ValueError(f"global_amax={a!r} must be a finite amax >= 0 (max|x| of the tensor, "
                         "a shared amax, or one from an amax history)")


def check_amax_covers(x, global_amax) -> None:
    """Refuse a concrete ``global_amax`` below a concrete tensor's ``max|x|``: every value
    above it would saturate, and the tensor would come back clipped to ``±global_amax``
    (relative error near 1 for a small one). The public quantizers call it eagerly; inside
    ``jit`` (and in the GEMMs, where delayed scaling's amax from the history may lag the
    tensor and saturate it, as Transformer Engine's does) such an amax is taken as given."""
    if global_amax is None:
        return
    _check_global_amax(global_amax)
    if any(isinstance(v, jax.core.Tracer) for v in (x, global_amax)):
        return
    amax = float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32)), initial=0.0))
    if math.isfinite(amax) and float(global_amax) < amax:
        raise ValueError(f"global_amax={float(global_amax)!r} is below max|x|={amax!r}: every "
                         "value above it would saturate (the tensor clipped to "
                         "±global_amax); pass an amax >= max|x| (a lagging amax, as "
                         "delayed scaling's, saturates the tensor only under jax.jit, where "
                         "it is taken as given)")


# --------------------------------------------------------------------------- core


class Blocks(NamedTuple):
    """What :func:`quantize_blocks` computed, in the blocked layout of its geometry."""

    v: jax.Array  # fl(x * multiplier), before rounding, blocked layout
    q: jax.Array  # element values on the grid (float32), blocked layout
    scale: jax.Array | None  # stored scale, keepdims (broadcastable to blocks)
    tensor_amax: jax.Array | None  # the per-tensor amax where the scheme uses one (NVFP4)


def quantize_blocks(x, fmt: Format, g: Geometry, rounding, key, global_amax) -> Blocks:
    """The XLA reference quantizer of a scaled (not pass-through) format up to the codes:
    ``x`` in float32, zero-padded and blocked by ``g``, its block scales and multipliers
    (``fmt.scaling``), the scaled values ``v`` and their rounding ``q`` onto the element grid
    (``fmt.scaling.round_nearest``, or stochastic with ``key``). Arguments as
    :func:`check_arguments` returns and :func:`quantize` takes them; :func:`quantize` encodes
    exactly these ``q`` and stores exactly these scales."""
    scheme, elem = fmt.scaling, fmt.element
    xb = to_blocks(x.astype(jnp.float32), g)
    stat = scheme.statistic(xb, g.reduce_axes)
    if global_amax is not None:
        global_amax = jnp.asarray(global_amax, jnp.float32)
    tensor_amax = _outer_amax(scheme.outer_amax, stat, g, global_amax)
    if scheme.outer_amax is None and global_amax is not None:  # per-tensor scaling, given amax
        stat = jnp.broadcast_to(global_amax, stat.shape)
    u_scale = None
    if scheme.stochastic_scale and rounding == "stochastic":
        u_scale = random_bits.uniform(key, stat.shape)  # one per block: the scale is rounded
    scale, mult = scheme.encode(xb, stat, tensor_amax, elem, g.reduce_axes, u_scale)
    v = scheme.scale_elements(xb, mult)
    if rounding == "stochastic" and not scheme.stochastic_scale:
        # drawn at the elements' logical positions (the padding, all zeros, rounds to 0)
        q = scheme.round_stochastic(v, elem, to_blocks(random_bits.uniform(key, g.shape), g))
    else:
        q = scheme.round_nearest(v, elem)
    if elem.kind == "int":
        q = jnp.where(q == 0, 0.0, q)  # integers have no -0
    return Blocks(v, q, scale, tensor_amax)


def _outer_amax(outer, stat, g: Geometry, global_amax):
    """The outer amax a scheme's block scales take (``ScaleScheme.outer_amax``), keepdims:
    None; the tensor's (or the given ``global_amax``); one per slice along the block axis;
    or one per ``outer`` elements along it, broadcast to its blocks."""
    if outer is None:
        return None
    if outer == "tensor":
        return global_amax if global_amax is not None else rnd.abs_max(stat)
    (inner,) = g.reduce_axes
    if outer == "slice":  # over the block axis's blocks (keepdims)
        return rnd.abs_max(stat, axis=(inner - 1, inner), keepdims=True)
    return group_blocks(stat, inner, outer // g.block[0],
                        lambda s, a: rnd.abs_max(s, axis=a, keepdims=True))


@functools.partial(jax.jit, static_argnames=("fmt", "axis"))
def trust_mask(x: jax.Array, fmt: str | Format, *, axis: int = -1) -> jax.Array:
    """Where quantizing ``x`` (round to nearest) leaves the scaled value strictly inside the
    element range, ``|v| < max``: QuEST's trust estimator passes the gradient only there
    (Quartet's ``mask = |v| < 6``; :func:`fake_quant`'s ``mask_saturated`` keeps ``|v| = max``
    too). Bool, shaped like ``x``."""
    x, fmt, g, _ = check_arguments(x, fmt, axis=axis)
    if fmt.is_passthrough:
        return jnp.ones(x.shape, bool)
    b = quantize_blocks(x, fmt, g, "nearest", None, None)
    return from_blocks(jnp.abs(b.v) < fmt.element.max, g)


def opaque_scales(scale, tensor_amax):
    """The stored scales and amax behind a barrier: when XLA can prove them constant (a
    QArray or a ``global_amax`` closed over by a jitted function) it reassociates
    ``(s * amax) * fl(1/2688)`` into ``s * fl(amax / 2688)`` and ``(q * 2**a) * 2**b`` into
    ``q * 2**(a + b)`` (a constant 2**-127 is then flushed to zero on CPU)."""
    return rnd.opaque(scale, tensor_amax)


def dequantize_blocks(q, scale, tensor_amax, fmt: Format) -> jax.Array:
    """Element values ``q`` (float32, blocked layout) times the decode multipliers of their
    keepdims block ``scale`` (and NVFP4's ``tensor_amax``), in ``fmt.scaling``'s order: the
    dequantized values in float32, blocked layout. Pass the result through
    :func:`rounded_output` before anything else consumes it."""
    scale, tensor_amax = opaque_scales(scale, tensor_amax)
    return fmt.scaling.dequantize(q, scale, tensor_amax, fmt.element)


def cast(x, fmt: Format, rounding, key):
    """A pass-through format's values in its storage dtype: a cast, or stochastic rounding
    onto its grid (BF16, FP16)."""
    if rounding == "stochastic":
        return rnd.stochastic_cast(x.astype(jnp.float32), fmt.element, key).astype(
            fmt.element.storage)
    return x.astype(fmt.element.storage)


@functools.partial(jax.jit, static_argnames=("fmt", "g", "ax", "rounding"))
def _quantize(x, key, global_amax, *, fmt: Format, g: Geometry, ax: int, rounding) -> QArray:
    tile = g.block if len(g.axes) == 2 and fmt.granularity == "block" else None
    if fmt.is_passthrough:
        return QArray(cast(x, fmt, rounding, key), None, None, fmt, ax, None, g.shape)
    b = quantize_blocks(x, fmt, g, rounding, key, global_amax)
    codes = rnd.encode(fmt.scaling.mask_codes(b.q, b.scale), fmt.element)
    # Materialize the codes once: without the barrier XLA:CPU fuses the whole quantizer into
    # each strided read of the packing below and runs it several times (measured 8x slower).
    codes = jax.lax.optimization_barrier(codes)
    if fmt.element.packed:
        codes = rnd.pack_nibbles(codes, g.inner(ax))
        data_shape = list(g.padded)
        data_shape[ax] //= 2
        data = codes.reshape(data_shape)
    else:
        data = codes.reshape(g.padded)
    scale = scale_from_blocks(b.scale, g)
    return QArray(data, scale, b.tensor_amax, fmt, ax, tile, g.shape)


def quantize(
    x: jax.Array,
    fmt: str | Format,
    *,
    axis: int = -1,
    tile: tuple[int, int] | None = None,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    global_amax: jax.Array | None = None,
    backend: str = "auto",
) -> QArray:
    """Quantize ``x`` to ``fmt`` with blocks along ``axis`` (or 2D ``tile``s of the last two
    axes).

    Args:
      x: floating-point array (bf16, fp16, fp32; float64 is rounded to float32 first).
      fmt: a registry name (``fp4lab.numerics.formats.format_names()``) or a :class:`Format`.
      axis: the block axis (the GEMM reduction axis); ignored for per-tensor formats.
      tile: 2D tile shape for block formats, e.g. ``(16, 16)`` for NVFP4 weights.
      rounding: ``"nearest"`` (ties to even, saturating) or ``"stochastic"``.
      key: ``jax.random`` key, required for stochastic rounding. The same key gives the same
        bits.
      global_amax: use this per-tensor amax instead of ``max|x|`` (NVFP4's global scale; the
        amax of per-tensor FP8): e.g. a shared amax, or one from a previous step. A finite
        scalar ``>= 0``; a concrete one below a concrete ``max|x|`` is refused (it would clip
        the tensor to ``±global_amax``). A traced one must satisfy the same and is not
        checked: a smaller one saturates every value above it (delayed scaling's lagging
        amax), a negative one acts as its magnitude, NaN and inf as docs/numerics.md says.
      backend: ``"auto"``, ``"xla"`` or ``"pallas"`` (see :mod:`fp4lab.numerics.backend`); the
        kernels give the same bits.
    """
    x, fmt, g, ax = check_arguments(x, fmt, axis=axis, tile=tile, rounding=rounding,
                                    key=key, global_amax=global_amax)
    check_amax_covers(x, global_amax)
    kernel = _backend.decide(backend, _backend.Request(
        op="quantize", format=fmt, shape=x.shape, axis=ax - x.ndim, tile=tile,
        rounding=rounding))
    if kernel is not None:
        return kernel.fn(x, fmt, axis=ax - x.ndim, tile=tile, global_amax=global_amax,
                         rounding=rounding, key=key)
    return _quantize(x, key, global_amax, fmt=fmt, g=g, ax=ax, rounding=rounding)


def rounded_output(y: jax.Array) -> jax.Array:
    """``y`` (dequantized values) behind a barrier, so that every consumer reads them rounded:
    the last operation is a product (``q * scale``), and without the barrier XLA contracts it
    with a consumer's addition (``fake_quant(x) + r``) into an FMA that never rounds it (19 %
    of NVFP4 sums moved). Same values, same dtype."""
    return rnd.opaque(y)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize(q: QArray, dtype) -> jax.Array:
    fmt = q.format
    if fmt.is_passthrough:
        return q.data.astype(dtype)
    g, _ = geometry(q.shape, fmt, q.axis, q.tile)
    data = q.data
    if fmt.element.packed:
        data = rnd.unpack_nibbles(data, q.axis)
    vals = rnd.decode(data, fmt.element).reshape(g.blocked)
    y = dequantize_blocks(vals, scale_to_blocks(q.scale, g), q.global_scale, fmt)
    return rounded_output(from_blocks(y, g).astype(dtype))


def dequantize(q: QArray, dtype=jnp.float32, *, backend: str = "auto") -> jax.Array:
    """Return the values ``q`` represents, in ``dtype`` (float32 by default); ``backend`` as
    in :func:`quantize`."""
    if not isinstance(q, QArray):
        raise TypeError(f"dequantize needs a QArray, got {type(q).__name__}")
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise TypeError(f"dequantize returns values, so dtype must be floating point; got "
                        f"{jnp.dtype(dtype)} (cast the result yourself to truncate)")
    kernel = _backend.decide(backend, _dequantize_request(q))
    if kernel is not None:
        return kernel.fn(q, jnp.dtype(dtype))
    return _dequantize(q, jnp.dtype(dtype))


def _dequantize_request(q: QArray) -> _backend.Request:
    return _backend.Request(op="dequantize", format=q.format, shape=q.shape,
                            axis=q.axis - q.ndim, tile=q.tile)


# --------------------------------------------------------------------------- fake quant


@dataclasses.dataclass(frozen=True)
class _FakeQuant:
    """How ``fake_quant`` computes its values (static): XLA, or the ``quantizer`` kernel
    (then the ``dequantizer`` kernel, or XLA's dequantize where none serves) on ``x`` with
    its block axis ``axis`` moved last when it is not."""

    fmt: Format
    g: Geometry
    rounding: str
    mask_saturated: bool
    quantizer: _backend.Kernel | None = None
    dequantizer: _backend.Kernel | None = None
    axis: int = -1  # the block axis of x (kernel path)
    tile: tuple[int, int] | None = None


def _fake_quant_values(x, key, global_amax, how: _FakeQuant):
    """(dequantized values in x.dtype, the unclipped mask or None)."""
    fmt = how.fmt
    if how.quantizer is not None:
        moved = how.tile is None and how.axis != x.ndim - 1
        xk = jnp.moveaxis(x, how.axis, -1) if moved else x
        q = how.quantizer.fn(xk, fmt, axis=-1, tile=how.tile, global_amax=global_amax,
                             rounding=how.rounding, key=key)
        y = how.dequantizer.fn(q, x.dtype) if how.dequantizer else _dequantize(q, x.dtype)
        return (jnp.moveaxis(y, -1, how.axis) if moved else y), None
    if fmt.is_passthrough:
        return cast(x, fmt, how.rounding, key).astype(x.dtype), None
    b = quantize_blocks(x, fmt, how.g, how.rounding, key, global_amax)
    y = from_blocks(dequantize_blocks(b.q, b.scale, b.tensor_amax, fmt), how.g)
    # clipped: |v| > max (a NaN is not clipped, and keeps its gradient)
    inside = from_blocks(~(jnp.abs(b.v) > fmt.element.max), how.g) if how.mask_saturated \
        else None
    return rounded_output(y.astype(x.dtype)), inside


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _straight_through(x, key, global_amax, how: _FakeQuant):
    """The one straight-through rule of both paths: identity, or zero where clipped."""
    return _fake_quant_values(x, key, global_amax, how)[0]


def _st_fwd(x, key, global_amax, how):
    return _fake_quant_values(x, key, global_amax, how)


def _st_bwd(how, inside, dy):
    dx = dy if inside is None else jnp.where(inside, dy, jnp.zeros_like(dy))
    return dx, None, None


_straight_through.defvjp(_st_fwd, _st_bwd)


def straight_through(x, y):
    """``y`` (a rounding of ``x``: same shape and dtype) with the identity gradient to ``x``.

    The usual form ``x + stop_gradient(y - x)`` computes its value, and gets it wrong where
    ``y`` saturates or underflows: rounding onto E4M3 (``y = 448``), ``x = inf`` gives NaN
    (``inf - inf``), ``|x| >= 16896`` in bfloat16 (1.07e9 in float32) gives 0, 384 or 512, and
    ``y = -0`` comes out ``+0``. Here the forward value is ``y``, bit for bit."""
    if jnp.shape(x) != jnp.shape(y) or jnp.result_type(x) != jnp.result_type(y):
        raise ValueError(f"straight_through needs y like x; got x {jnp.result_type(x)}"
                         f"{list(jnp.shape(x))} and y {jnp.result_type(y)}{list(jnp.shape(y))}")
    return _identity_gradient(x, y)


@jax.custom_vjp
def _identity_gradient(x, y):
    return y


def _identity_fwd(x, y):
    return y, None


def _identity_bwd(_, dy):
    return dy, None


_identity_gradient.defvjp(_identity_fwd, _identity_bwd)


@functools.partial(jax.jit, static_argnames=("how",))
def _fake_quant(x, key, global_amax, *, how: _FakeQuant):
    return _straight_through(x, key, global_amax, how)


def fake_quant(
    x: jax.Array,
    fmt: str | Format,
    *,
    axis: int = -1,
    tile: tuple[int, int] | None = None,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    global_amax: jax.Array | None = None,
    mask_saturated: bool = False,
    backend: str = "auto",
) -> jax.Array:
    """``dequantize(quantize(x, ...))`` in ``x.dtype``, bit for bit, without storing codes;
    its gradient is straight-through (identity), or, with ``mask_saturated=True``, zero where
    the scaled input exceeded the element format's max (was clipped). Arguments as
    :func:`quantize`; on the kernel path the codes are materialized (quantize kernel, then
    dequantize kernel)."""
    check_amax_covers(x, global_amax)
    return fake_quant_operand(x, fmt, axis=axis, tile=tile, rounding=rounding, key=key,
                              global_amax=global_amax, mask_saturated=mask_saturated,
                              backend=backend, strict=True)


def fake_quant_operand(x, fmt, *, axis=-1, tile=None, rounding="nearest", key=None,
                       global_amax=None, mask_saturated=False, backend="auto",
                       strict=True) -> jax.Array:
    """:func:`fake_quant`; ``strict=False`` (a GEMM's operands): ``backend="pallas"`` falls
    back to XLA with a warning where no kernel serves, instead of raising."""
    x, fmt, g, ax = check_arguments(x, fmt, axis=axis, tile=tile, rounding=rounding,
                                    key=key, global_amax=global_amax)
    how = _FakeQuant(fmt, g, rounding, bool(mask_saturated))
    # any 1D block axis can be moved last and back (same blocks, same bits)
    kernel_axis = -1 if tile is None and fmt.granularity == "block" else ax - x.ndim
    quantizer = _backend.decide(
        backend, _backend.Request(op="quantize", format=fmt, shape=x.shape, axis=kernel_axis,
                                  tile=tile, rounding=rounding),
        unsupported="mask_saturated needs the XLA path" if mask_saturated else None,
        strict=strict)
    if quantizer is not None:
        how = dataclasses.replace(how, quantizer=quantizer, axis=ax, tile=tile,
                                  dequantizer=_backend.find(_backend.Request(
                                      op="dequantize", format=fmt, shape=x.shape, tile=tile)))
    return _fake_quant(x, key, global_amax, how=how)
