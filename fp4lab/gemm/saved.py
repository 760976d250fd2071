"""What is kept for the backward pass: stored activations and recomputed elementwise blocks.

A :class:`~fp4lab.gemm.recipe.SavedX` names a storage format (and optionally host memory). Two
places use it:

* a quantized GEMM's ``recipe.saved_x`` (:func:`fp4lab.qdot_general`): the GEMM keeps
  ``quantize(X)`` instead of X, and its wgrad GEMM uses ``dequantize(quantize(X))``;
* :func:`recompute` for any function, typically an elementwise block (SwiGLU, squared ReLU)
  or a block ending in a GEMM: the forward pass runs the function on its input as it came
  and keeps only ``quantize(x)`` (and the other arguments); the backward pass runs the
  function again from ``dequantize(quantize(x))`` and differentiates that, as Kimi K2 does
  for its SwiGLU inputs (stored in E4M3 1x128 tiles, the SwiGLU recomputed in the backward).

Storage quantizes along the last axis (the features), in float32, and restores the input's
dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp4lab.numerics.quantize import dequantize, quantize
from fp4lab.gemm.recipe import SavedX

__all__ = ["store", "restore", "recompute"]


def store(x, saved: SavedX | None):
    """``x`` as the backward pass will find it: ``quantize(x)`` along the last axis in
    ``saved.format`` (a QArray; on the host with ``saved.offload``), with a zero-size array
    carrying ``x``'s dtype. ``None``: ``x`` unchanged."""
    if saved is None:
        return x
    q = quantize(x.astype(jnp.float32), saved.format, axis=-1)
    if saved.offload:
        q = jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Host), q)
    return q, jnp.zeros((0,), x.dtype)


def restore(stored, saved: SavedX | None):
    """The inverse of :func:`store`: ``dequantize(quantize(x))`` in ``x``'s dtype, back in
    device memory."""
    if saved is None:
        return stored
    q, like = stored
    if saved.offload:
        q = jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), q)
    return dequantize(q, jnp.float32).astype(like.dtype)


def _saved(saved) -> SavedX:
    if isinstance(saved, SavedX):
        return saved
    if isinstance(saved, str):
        return SavedX(saved)
    raise TypeError(f"saved={saved!r}: use a format name (e.g. 'fp8_block128') or a SavedX")


def recompute(fn, saved: SavedX | str = "fp8_block128"):
    """``fn`` with its first argument kept in ``saved``'s format for the backward pass.

    ``recompute(fn, saved)(x, *args)`` returns ``fn(x, *args)`` bit for bit: the forward pass
    runs ``fn`` on ``x`` as it came. What it keeps for the backward pass is ``quantize(x)``
    (codes and scales; in host memory with ``SavedX(..., offload=True)``) and ``args``,
    nothing of ``fn``'s intermediates or output. The backward pass recomputes ``fn`` from
    ``x_r = dequantize(quantize(x))`` and returns the cotangents of
    ``jax.vjp(fn, x_r, *args)``: the gradient is ``fn``'s linearization at the stored input.
    ``args`` are differentiated too (pass a following GEMM's weight to recompute it as well);
    they must be floating-point arrays or pytrees of them. ``fn`` must be hashable (a
    function; it is static under ``jit``)."""
    saved = _saved(saved)
    if not callable(fn):
        raise TypeError(f"recompute needs a function; got {fn!r}")

    @functools.wraps(fn)
    def wrapped(x, *args):
        for i, a in enumerate(jax.tree.leaves((x, args))):
            if not jnp.issubdtype(jnp.result_type(a), jnp.floating):
                raise TypeError(f"recompute({getattr(fn, '__name__', fn)!r}): argument leaf "
                                f"{i} has dtype {jnp.result_type(a)}; every argument must be "
                                "floating point (close over the others)")
        return _recompute(fn, saved, x, *args)

    return wrapped


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _recompute(fn, saved, x, *args):
    return fn(x, *args)


def _recompute_fwd(fn, saved, x, *args):
    return fn(x, *args), (store(x, saved), args)


def _recompute_bwd(fn, saved, res, g):
    stored, args = res
    _, vjp = jax.vjp(fn, restore(stored, saved), *args)
    return vjp(g)


_recompute.defvjp(_recompute_fwd, _recompute_bwd)
