"""Where a quantizer's blocks lie: 1D blocks along an axis or 2D tiles of the last two axes,
zero-padded to whole blocks (padding never changes an amax), and the blocked layout the
scale schemes work in (:class:`Geometry`, :func:`to_blocks`, :func:`from_blocks`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fp4lab.numerics.formats import Format

__all__ = ["Geometry", "geometry", "normalize_axis", "to_blocks", "from_blocks",
           "scale_to_blocks", "scale_from_blocks"]


class Geometry(NamedTuple):
    """Block layout: ``x`` (padded) is reshaped so block axis ``a`` becomes ``(n_a, b_a)``
    (the "blocked layout" of :func:`quantize_blocks`). Static: hashable, a jit argument."""

    shape: tuple[int, ...]  # logical
    axes: tuple[int, ...]  # blocked axes of the logical array, ascending
    block: tuple[int, ...]  # block size along each of ``axes``
    per_tensor: bool = False  # one scale for everything (stored as a scalar)

    @property
    def padded(self) -> tuple[int, ...]:
        out = list(self.shape)
        for a, b in zip(self.axes, self.block, strict=True):
            out[a] = -(-out[a] // b) * b if b else 0  # (a per-tensor block of an empty axis)
        return tuple(out)

    @property
    def blocked(self) -> tuple[int, ...]:
        out = []
        for i, n in enumerate(self.padded):
            if i in self.axes:
                b = self.block[self.axes.index(i)]
                out += [n // b if b else 1, b]  # (one empty per-tensor block)
            else:
                out.append(n)
        return tuple(out)

    def inner(self, a: int) -> int:
        """Position in the blocked layout of the within-block dim of logical axis ``a``."""
        return a + sum(1 for x in self.axes if x <= a)

    @property
    def reduce_axes(self) -> tuple[int, ...]:
        return tuple(self.inner(a) for a in self.axes)


def normalize_axis(axis: Any, shape) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"axis must be an int, got {axis!r}")
    nd = len(shape)
    if not -nd <= axis < nd:
        raise ValueError(f"{axis=} out of range for shape {tuple(shape)}")
    return axis % nd


def geometry(shape, fmt: Format, axis, tile) -> tuple[Geometry, int]:
    shape = tuple(int(s) for s in shape)
    nd = len(shape)
    if fmt.granularity in ("none", "tensor"):
        if tile is not None:
            raise ValueError(f"tile={tile} does not fit format {fmt.name}: it has "
                             f"{fmt.granularity} granularity, not blocks")
        ax = normalize_axis(axis, shape) if nd else 0
        if fmt.granularity == "none":
            return Geometry(shape, (), ()), ax
        return Geometry(shape, tuple(range(nd)), shape, per_tensor=True), ax
    if nd == 0:
        raise ValueError(f"format {fmt.name} scales along an axis; got a scalar")
    ax = normalize_axis(axis, shape)
    if tile is None:
        if fmt.granularity == "channel":
            size = shape[ax] + (shape[ax] % 2 if fmt.element.packed else 0)
            return Geometry(shape, (ax,), (max(size, 2 if fmt.element.packed else 1),)), ax
        return Geometry(shape, (ax,), (fmt.block,)), ax
    if fmt.granularity != "block":
        raise ValueError(f"tile={tile} does not fit format {fmt.name}: it has "
                         f"{fmt.granularity} granularity")
    if (not isinstance(tile, tuple) or len(tile) != 2
            or not all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in tile)):
        raise ValueError(f"tile={tile!r} must be a pair of positive ints such as (16, 16)")
    if fmt.element.packed and tile[1] % 2:
        raise ValueError(f"tile={tile} does not fit format {fmt.name}: 4-bit elements are "
                         "packed in pairs along the last axis, so tile[1] must be even")
    if nd < 2:
        raise ValueError(f"tile={tile} needs an array with at least 2 dims, got shape {shape}")
    if ax != nd - 1:
        raise ValueError(f"with tile={tile} the tile covers the last two axes; {axis=} must "
                         f"be -1 (or {nd - 1})")
    return Geometry(shape, (nd - 2, nd - 1), tile), ax


def to_blocks(x: jax.Array, g: Geometry) -> jax.Array:
    """``x`` zero-padded to whole blocks and reshaped to the blocked layout of ``g``."""
    pad = [(0, p - s) for s, p in zip(g.shape, g.padded, strict=True)]
    if any(hi for _, hi in pad):
        x = jnp.pad(x, pad)
    return x.reshape(g.blocked)


def from_blocks(y: jax.Array, g: Geometry) -> jax.Array:
    """An array of the blocked layout of ``g`` (values or a mask, one per element) in the
    logical layout: reshaped to ``g.padded`` and the padding sliced off (shape ``g.shape``).
    No arithmetic: the values are the same bits."""
    y = y.reshape(g.padded)
    if g.padded != g.shape:
        y = y[tuple(slice(0, s) for s in g.shape)]
    return y


def scale_to_blocks(scale: jax.Array, g: Geometry) -> jax.Array:
    """Stored scale -> keepdims shape broadcastable to the blocks."""
    if g.per_tensor:
        return scale.reshape((1,) * len(g.blocked))
    return jnp.expand_dims(scale, g.reduce_axes)


def scale_from_blocks(scale: jax.Array, g: Geometry) -> jax.Array:
    """Keepdims block scale -> stored layout: block dims squeezed; a scalar per tensor."""
    return scale.reshape(()) if g.per_tensor else jnp.squeeze(scale, g.reduce_axes)
