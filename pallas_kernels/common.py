"""Pieces shared by the block-quantization kernels (traced inside Pallas kernel bodies).

Every function here is written with operations the Pallas Triton lowering supports (integer
bit manipulation, comparisons, selects, ``tt.reshape``/``tt.split``) and computes exactly
what the fp4lab reference computes (``fp4lab.numerics.rounding`` / ``fp4lab.numerics.scaling``):

* :func:`abs_max_bits`: a block's ``max |x|`` on the float32 bit patterns (exact, and a NaN
  wins, as in ``fp4lab.numerics.rounding.abs_max``);
* :func:`div`: correctly rounded float32 division. Triton's ``/`` is approximate on NVIDIA
  GPUs (``div.full``: wrong E2M1 codes on 2.5e-4 of elements on an H200, docs/numerics.md), so on
  the GPU it is the PTX ``div.rn.f32`` instruction; in interpret mode (CPU) XLA's division is
  IEEE already;
* :func:`e2m1_code`: round-to-nearest-even onto the E2M1 grid and its 4-bit code in one step
  (ties go to the even code, magnitudes above 5 saturate to 6, NaN gives +0, the sign of
  zero is kept);
* :func:`pack_pairs`: two 4-bit codes per byte, element ``2i`` in the low nibble;
* :func:`sr_uniform` / :func:`stochastic_e2m1`: stochastic rounding onto E2M1 with the uniforms
  of ``fp4lab.numerics.random_bits`` (Threefry-2x32 of the key and the element's logical
  position, computed in the kernel: ``jax.random`` does not lower inside Triton kernels), so
  the kernels' SR bits equal the XLA path's;
* :func:`nvfp4_scales`: NVFP4's E4M3 block scales and element multipliers from the block and
  tensor amaxes, in ``fp4lab.numerics.scaling.NVFP4Scale``'s order of operations.

The wrappers' host-side pieces (outside the kernel bodies) are here too: :func:`check_input`,
:func:`interpret_mode`, :func:`tile_size`, :func:`padded_matrix` and
:func:`compiler_params`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from fp4lab.numerics.random_bits import counter_bits, key_words, to_uniform
from fp4lab.numerics.rounding import from_bits, pow2

__all__ = ["bits", "from_bits", "abs_bits", "minimum", "abs_max_bits", "div", "e2m1_code",
           "e2m1_value", "pack_pairs", "unpack_pairs", "pow2", "sr_uniform", "sr_key_words",
           "KEY_SPEC", "stochastic_e2m1", "element_index", "nvfp4_scales", "FLT_MAX",
           # the wrappers' host-side pieces
           "check_input", "interpret_mode", "tile_size", "padded_matrix", "compiler_params"]

FLT_MAX = float(jnp.finfo(jnp.float32).max)


def bits(x):
    """The int32 bit patterns of float32 ``x`` (:func:`from_bits` is the inverse)."""
    return lax.bitcast_convert_type(x, jnp.int32)


def abs_bits(x):
    """``|x|`` by clearing the sign bit: Triton compiles ``jnp.abs`` to ``abs.ftz.f32``,
    which flushes subnormals to zero; this keeps them, as the reference does."""
    return from_bits(bits(x) & 0x7FFFFFFF)


def minimum(a, b):
    """``min(a, b)`` that keeps a NaN in ``a``, as ``jnp.minimum`` does in XLA (``b`` is a
    number here). Triton lowers ``jnp.minimum`` to ``arith.minnumf``, PTX ``min.f32``,
    which returns the number when one operand is NaN."""
    return jnp.where(a > b, b, a)


def abs_max_bits(x, axis):
    """``max |x|`` along ``axis`` on the bit patterns (NaN > inf > finite, as the reference)."""
    return from_bits(jnp.max(bits(x) & 0x7FFFFFFF, axis=axis, keepdims=True))


def div(a, b, *, interpret: bool):
    """``fl(a / b)`` correctly rounded (IEEE round-to-nearest-even) on the GPU and in
    interpret mode; ``a`` and ``b`` are float32 arrays of one shape (or scalars)."""
    if interpret:
        return a / b
    from jax.experimental.pallas import triton as pltriton

    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    return pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]


# E2M1 round-to-nearest-even by thresholds on |v|: the grid is 0, .5, 1, 1.5, 2, 3, 4, 6 and a
# tie goes to the neighbour with the even code (strict > where the lower code is even).
_E2M1_UP = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
            (3.5, True), (5.0, False))


def e2m1_code(v):
    """The 4-bit E2M1 code (uint8, sign in bit 3) of ``v`` rounded to nearest even,
    saturating at 6; NaN gives +0 (E2M1 has no NaN; its scale carries the NaN)."""
    a = abs_bits(v)
    mag = jnp.zeros(v.shape, jnp.int32)
    for threshold, inclusive in _E2M1_UP:
        mag = mag + ((a >= threshold) if inclusive else (a > threshold)).astype(jnp.int32)
    sign = lax.shift_right_logical(bits(v), 31) << 3
    code = jnp.where(jnp.isnan(v), 0, mag | sign)
    return code.astype(jnp.uint8)


def pack_pairs(codes):
    """``(..., 2n)`` 4-bit codes -> ``(..., n)`` bytes, element ``2i`` in the low nibble."""
    *lead, n2 = codes.shape
    pairs = codes.astype(jnp.int32).reshape(*lead, n2 // 2, 2)
    lo, hi = jnp.split(pairs, 2, axis=-1)
    return (lo | (hi << 4)).reshape(*lead, n2 // 2).astype(jnp.uint8)


def unpack_pairs(packed):
    """``(..., n)`` bytes -> ``(..., 2n)`` 4-bit codes (int32), the inverse of pack_pairs."""
    p = packed.astype(jnp.int32)
    *lead, n = p.shape
    both = jnp.concatenate([(p & 0xF)[..., None], (p >> 4)[..., None]], axis=-1)
    return both.reshape(*lead, 2 * n)


def e2m1_value(code):
    """The float32 value of 4-bit E2M1 codes: ``(-1)^s * 2^(e-1) * (1 + m/2)``, subnormal
    ``m/2`` when ``e = 0`` (grid 0, .5, 1, 1.5, 2, 3, 4, 6)."""
    e = (code >> 1) & 3
    m = (code & 1) != 0
    # selects and one exact product: no addition a compiler could contract into an FMA
    mag = jnp.where(e == 0, jnp.where(m, 0.5, 0.0), pow2(e - 1) * jnp.where(m, 1.5, 1.0))
    # the sign on the bits: Pallas lowers -x to 0 - x, which gives +0 for code 0b1000 (-0)
    return from_bits(bits(mag) | ((code.astype(jnp.int32) & 8) << 28))


def sr_uniform(index, key_ref):
    """The SR uniforms of the elements at logical positions ``index`` (uint32) under the key
    words in ``key_ref`` (a ``(1, 2)`` uint32 block): ``fp4lab.numerics.random_bits``'s
    stream, the XLA path's bits."""
    return to_uniform(counter_bits(key_ref[:, 0:1], key_ref[:, 1:2], index))


KEY_SPEC = pl.BlockSpec((1, 2), lambda *_: (0, 0))  # the key words, read by every program


def sr_key_words(key):
    """The key words a kernel's :func:`sr_uniform` reads: ``(1, 2)`` uint32 (zeros without a
    key, for round-to-nearest)."""
    if key is None:
        return jnp.zeros((1, 2), jnp.uint32)
    k0, k1 = key_words(key)
    return jnp.stack([k0, k1]).reshape(1, 2)


def stochastic_e2m1(v, u):
    """fp4lab.numerics.rounding.round_stochastic onto E2M1 (clip to 6, floor + Bernoulli(frac), the
    sign of ``v`` copied, -0 included)."""
    a = minimum(abs_bits(v), 6.0)
    e = jnp.maximum(((bits(a) >> 23) & 0xFF) - 127, 0)
    t = a * pow2(1 - e)
    lo = jnp.floor(t)
    r = (lo + (u < (t - lo)).astype(jnp.float32)) * pow2(e - 1)
    # copysign on the bits: Pallas lowers -x to 0 - x, which turns -0 into +0
    signed = from_bits(bits(r) | (bits(v) & jnp.int32(-(2**31))))
    return jnp.where(jnp.isnan(v), jnp.nan, signed)


def element_index(shape, row0, col0, row_stride):
    """uint32 positions ``(row0 + i) * row_stride + col0 + j`` of a tile's elements: their
    logical positions when ``row_stride`` is the operand's logical row length (a padding
    column aliases the next row's position; it holds zero, which every draw rounds to 0)."""
    row = lax.broadcasted_iota(jnp.uint32, shape, 0) + row0.astype(jnp.uint32)
    col = lax.broadcasted_iota(jnp.uint32, shape, 1) + col0.astype(jnp.uint32)
    return row * jnp.uint32(row_stride) + col


def nvfp4_scales(bamax, amax, *, interpret: bool):
    """NVFP4's block scale (float8_e4m3fn) and element multiplier (float32) of blocks whose
    ``max |x|`` is ``bamax``, in a tensor whose amax is ``amax`` (broadcast to ``bamax``'s
    shape), with fp4lab.numerics.scaling.NVFP4Scale's operations in its order."""
    s_enc = minimum(div(jnp.full_like(amax, 2688.0), amax, interpret=interpret), FLT_MAX)
    s_enc = jnp.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
    s_dec = div(jnp.ones_like(s_enc), s_enc, interpret=interpret)
    sixth = np.float32(1) / np.float32(6)  # fl(1/6), computed on the host (IEEE)
    s_b = minimum(minimum(bamax * (s_enc * sixth), FLT_MAX), 448.0)
    s_b = s_b.astype(jnp.float8_e4m3fn)
    denom = s_b.astype(jnp.float32) * s_dec
    enc = minimum(div(jnp.ones_like(denom), denom, interpret=interpret), FLT_MAX)
    return s_b, enc


# ----------------------------------------------------------------------------- wrappers


def check_input(x):
    """Refuse what no quantize kernel takes: a non-floating dtype (TypeError) or an empty
    array or scalar (ValueError), naming the dtype or shape."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize kernels need a floating-point input, got {x.dtype}")
    if x.ndim < 1 or x.size == 0:
        raise ValueError(f"quantize kernels need a non-empty array, got shape {x.shape}")


def interpret_mode(interpret: bool | None) -> bool:
    """Whether to run a kernel in interpret mode: ``interpret`` as given, or when it is None,
    True off the GPU (CPU tests run the same kernel bodies)."""
    return jax.default_backend() != "gpu" if interpret is None else interpret


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def tile_size(n: int, limit: int, least: int) -> int:
    """The tile size for an axis of length ``n``: a power of two (Triton arrays have
    power-of-two shapes), ``least <= t <= limit`` unless ``least > limit`` (then ``least``),
    and no larger than ``n`` needs."""
    return max(least, min(limit, _next_power_of_2(n)))


def padded_matrix(x, rows_mult: int, cols_mult: int):
    """``x`` as a 2D ``(rows, cols)`` array (leading axes flattened into rows) zero-padded to
    multiples of ``rows_mult`` and ``cols_mult``, and that padded shape ``(mp, kp)``."""
    x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
    m, k = x2.shape
    mp, kp = -(-m // rows_mult) * rows_mult, -(-k // cols_mult) * cols_mult
    if (mp, kp) != (m, k):
        x2 = jnp.pad(x2, ((0, mp - m), (0, kp - k)))
    return x2, (mp, kp)


def compiler_params(cfg, interpret: bool):
    """The Triton launch parameters of ``cfg`` (a ``pallas_kernels.quantize.KernelConfig``:
    its ``num_warps`` and ``num_stages``); None in interpret mode, which has none."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
