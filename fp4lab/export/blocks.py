"""What every layout shares: a quantized kernel in the ``[..., out, in]`` form the engines
store (:class:`Blocks`), and back to a QArray (codes packed by the core's
:func:`fp4lab.numerics.rounding.pack_nibbles`); tensor names; the NVFP4 per-tensor values the
layouts store (2688 from the element formats, the block factors from the core's NVFP4
scheme); optional imports, errors."""

from __future__ import annotations

import dataclasses
import importlib
import struct
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fp4lab.numerics import rounding
from fp4lab.numerics.formats import E2M1, E4M3, get_format
from fp4lab.numerics.qarray import QArray

EXTRA = "pip install 'fp4lab[export]'"
F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
# what a file parser raises on bytes that are not what they should be
PARSE_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, struct.error)


# ---------------------------------------------------------------- QArray <-> block arrays


def unpack(data: np.ndarray, halves: int | None = None) -> np.ndarray:
    """4-bit codes, one a byte, from packed bytes along the last axis (fp4lab's order, or
    GGML's with ``halves``: :func:`fp4lab.numerics.rounding.unpack_nibbles`)."""
    return np.asarray(rounding.unpack_nibbles(jnp.asarray(data), -1, halves=halves))


def pack(codes: np.ndarray, halves: int | None = None) -> np.ndarray:
    """Inverse of :func:`unpack` (:func:`fp4lab.numerics.rounding.pack_nibbles`)."""
    return np.asarray(rounding.pack_nibbles(jnp.asarray(codes), -1, halves=halves))


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A quantized kernel in the layouts' common form: ``[..., out, in]`` codes (4-bit codes
    one per byte, or int8), ``[..., out, in / block]`` scales (their stored dtype), the
    format and the per-tensor amax (NVFP4)."""

    codes: np.ndarray
    scales: np.ndarray
    format: str
    block: int
    amax: np.float32 | None


def blocks(path: str, q: QArray) -> Blocks:
    """The ``[..., out, in]`` form of a QArray quantized along the input axis ``-2`` of a
    ``[..., in, out]`` kernel (or in 2D tiles of its last two axes, each row of a tile
    carrying the tile's scale)."""
    fmt = q.format
    if fmt.granularity != "block":
        raise ValueError(f"{path}: format {fmt.name!r} is not a block format")
    nd, block, k = q.ndim, fmt.block, q.shape[-2]
    if k % block:
        raise ValueError(f"{path}: K = {k} is not a whole number of {block}-blocks (a "
                         "checkpoint layout has no padding)")
    data, scale = np.asarray(q.data), np.asarray(q.scale)
    four = fmt.element.bits == 4
    if q.tile:  # tiles of the last two axes: data is packed along the last axis (out)
        tk, tn = q.tile  # a partial last tile along out is fine: its rows keep its scale
        if tk != block:
            raise ValueError(f"{path}: tile {q.tile} does not have {block} rows along K")
        codes = unpack(data) if four else data
        codes = np.swapaxes(codes[..., :k, :q.shape[-1]], -1, -2)
        scales = np.repeat(np.swapaxes(scale, -1, -2), tn, axis=-2)[..., :q.shape[-1], :]
    else:
        if q.axis % nd != nd - 2:
            raise ValueError(f"{path}: blocks along axis {q.axis} of shape {q.shape}; a "
                             "kernel [..., in, out] is quantized along in (axis -2)")
        codes = np.swapaxes(data, -1, -2)
        codes = unpack(codes) if four else codes
        scales = np.swapaxes(scale, -1, -2)
    amax = None if q.global_scale is None else F32(q.global_scale)
    return Blocks(np.ascontiguousarray(codes), np.ascontiguousarray(scales), fmt.name,
                  block, amax)


def qarray(codes_out_in: np.ndarray, scales_out_in: np.ndarray, fmt: str,
           amax=None) -> QArray:
    """The QArray (``[..., in, out]``, blocks along ``in``) of ``[..., out, in]`` codes."""
    f = get_format(fmt)
    data = pack(codes_out_in) if f.element.bits == 4 else codes_out_in
    nd = codes_out_in.ndim
    shape = codes_out_in.shape[:-2] + (codes_out_in.shape[-1], codes_out_in.shape[-2])
    return QArray(data=jnp.asarray(np.ascontiguousarray(np.swapaxes(data, -1, -2))),
                  scale=jnp.asarray(np.ascontiguousarray(np.swapaxes(scales_out_in, -1, -2))),
                  global_scale=None if amax is None else jnp.asarray(F32(amax)),
                  format=f, axis=nd - 2, tile=None, shape=shape)


# ------------------------------------------------------------- NVFP4's per-tensor values

NVFP4_FACTOR = F32(E2M1.max * E4M3.max)  # 2688: 6 (E2M1's max) * 448 (E4M3's max)


def nvfp4_amax(path: str, b: Blocks) -> np.float32:
    """The finite tensor amax of an NVFP4 kernel (refused otherwise, naming it)."""
    if b.format != "nvfp4":
        raise ValueError(f"{path}: format {b.format!r} is not NVFP4")
    if b.amax is None or not np.isfinite(b.amax):
        raise ValueError(f"{path}: the tensor amax is {b.amax}; an NVFP4 checkpoint's "
                         "global scale must be finite")
    return b.amax


def nvfp4_encode_factor(amax: np.float32) -> np.float32:
    """Transformer Engine's ``S_enc = min(fl(2688 / amax), FLT_MAX)``, 1 for an amax of 0
    (or one whose quotient is 0), as :class:`fp4lab.numerics.scaling.NVFP4Scale` encodes
    (docs/numerics.md). The quotients here are NumPy's IEEE float32 divisions, correctly
    rounded as the core's ``rounding.div`` is, but with subnormals kept: a checkpoint's value
    is C's, and XLA:CPU (so ``rounding.div`` on CPU) flushes a subnormal quotient to 0."""
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = np.minimum(NVFP4_FACTOR / F32(amax), FLT_MAX)
    return F32(1) if amax == 0 or s_enc == 0 else F32(s_enc)


def nvfp4_decode_scale(amax: np.float32) -> np.float32:
    """``fl(amax / 2688)`` (IEEE, subnormals kept): ModelOpt's ``weight_scale_2``."""
    return F32(F32(amax) / NVFP4_FACTOR)


def nvfp4_block_factors(b: Blocks) -> np.ndarray:
    """fp4lab's per-block decode factors ``fl(fl(s_b * amax) * fl(1/2688))`` (``s_b``
    when amax is 0), from the core's NVFP4 scheme itself."""
    fmt = get_format("nvfp4")
    s = jnp.asarray(b.scales)
    (m,) = fmt.scaling.multipliers(s, jnp.float32(b.amax), fmt.element)
    return np.asarray(m)


# -------------------------------------------------------------------------------- naming


def tensor_name(path: str) -> str:
    """A parameter path's tensor name: ``blocks_0/mlp/up/kernel`` -> ``blocks_0.mlp.up.weight``
    (a kernel is stored transposed, ``[out, in]``, as the engines store weights)."""
    layer, _, leaf = path.rpartition("/")
    return ".".join(p for p in (layer.replace("/", "."), "weight" if leaf == "kernel" else leaf)
                    if p)


def is_kernel(path: str, value) -> bool:
    return path.rpartition("/")[2] == "kernel" and np.ndim(value) >= 2


def plain(value) -> np.ndarray:
    a = np.asarray(value)
    if not np.issubdtype(a.dtype, np.floating) and a.dtype not in (ml_dtypes.bfloat16,):
        raise TypeError(f"a parameter of dtype {a.dtype}: only floating-point tensors export")
    return a


# ------------------------------------------------------------------------ files, errors


def require(module: str):
    """An optional dependency (the ``export`` extra), or a one-line error naming the extra."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"fp4lab.export needs the {module.partition('.')[0]!r} "
                                  f"package: {EXTRA}", name=e.name) from None


def corrupt(path: Path, detail) -> ValueError:
    return ValueError(f"{str(path)!r} is truncated or corrupt: {detail}")
