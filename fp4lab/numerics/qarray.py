"""The QArray pytree: a quantized array (codes, block scales, the per-tensor scale) with its
format and geometry as static data. Below everything that produces or consumes one: the
XLA quantizers (:mod:`fp4lab.numerics.quantize`), the kernels (``pallas_kernels``), the GEMMs.

Layouts (docs/numerics.md): ``data`` and ``scale`` are in the padded block layout along
``axis`` (or of 2D ``tile``s of the last two axes); 4-bit elements are packed two per byte
along ``axis``, element 2i in the low nibble; ``shape`` is the logical shape.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from fp4lab.numerics.formats import Format

__all__ = ["QArray"]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["data", "scale", "global_scale"],
    meta_fields=["format", "axis", "tile", "shape"],
)
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized array. ``data``/``scale`` are in the padded block layout (see module doc).

    ``global_scale`` is NVFP4's per-tensor value as Transformer Engine stores it: the float32
    tensor amax (the encode and decode factors are ``2688 / amax`` and its inverse), also
    readable as :attr:`tensor_amax`; ``None`` for formats without one."""

    data: jax.Array
    scale: jax.Array | None
    global_scale: jax.Array | None
    format: Format
    axis: int
    tile: tuple[int, int] | None
    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def tensor_amax(self) -> jax.Array | None:
        """The per-tensor amax (NVFP4), the same array as ``global_scale``."""
        return self.global_scale

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        from fp4lab.numerics.quantize import dequantize  # the QArray is below the quantizers

        return dequantize(self, dtype)

    def __repr__(self) -> str:
        geo = f"tile={self.tile}" if self.tile else f"axis={self.axis}"
        return f"QArray({self.format.name}, shape={self.shape}, {geo})"
