"""The random bits of stochastic rounding: one stream, drawn the same by every backend.

Element ``i`` of a stochastically rounded operand (``i`` its row-major position in the operand's
logical shape: never a padded or tiled layout) rounds with the bits

    threefry2x32(key, (i >> 32, i & 0xFFFFFFFF)) -> (y0, y1),   bits_i = y0 ^ y1,

Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC 2011) keyed by the operand's PRNG key: exactly ``jax.random.bits(key, shape, jnp.uint32)``
with JAX's partitionable Threefry (its default since JAX 0.5), which the tests assert bit for
bit. Why this generator:

* it *is* JAX's: every guarantee fp4lab makes about SR keys (one key per operand and step,
  split per scanned layer, MaxText's streams, resumed and multi-process runs) is a guarantee
  about ``jax.random`` keys, and stays one. A key of another implementation (MaxText makes
  ``unsafe_rbg`` its default) first gives the two words of a Threefry key (one
  ``jax.random.bits`` draw of two numbers; :func:`key_words`), and the stream is that key's;
* counter-based, so each element's bits are a pure function of (key, position): the XLA path
  computes them in the quantizer's own fused loop (:func:`counter_bits`, about 100 integer
  operations an element, ~1 ns on the CI CPU) instead of materializing ``jax.random.bits``'
  array (about 20 tensor copies), and the Pallas kernels compute the same function of the same
  position inside their tiles (it uses only 32-bit add, xor and shifts, which Triton lowers), so
  SR results are equal bit for bit across backends;
* 64-bit key and 64-bit counter: no two operands share a stream unless their keys are equal,
  and no tensor reuses a counter (beyond 2**32 elements the XLA path draws with
  ``jax.random.bits`` itself, which carries the high word; the kernels refuse such tensors);
* Threefry-2x32-20 passes TestU01's BigCrush with a wide safety margin (13 rounds already
  pass); the tests here check what rounding needs of it: uniform bits, no correlation between
  neighbouring elements or between keys, unbiased rounding.

Philox-4x32-10 (cuRAND's and Transformer Engine's choice) was measured too: on XLA:CPU its
32x32->64-bit products cost ~30 ns an element (no 64-bit multiply with 32-bit outputs in
``jnp``), against ~1.3 ns here; a 32-bit integer hash (lowbias32, the kernels' earlier choice)
is faster still (~0.5 ns) but keyed by 32 bits, so operands collide after ~2**16 draws and
streams of different seeds overlap at shifted positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["COUNTER_LIMIT", "threefry2x32", "counter_bits", "key_words", "bits", "uniform",
           "to_uniform"]

COUNTER_LIMIT = 2**32  # positions a fused draw counts in one 32-bit word (the high word 0)

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA  # Threefish's key-schedule constant


def _rotl(x, r: int):
    return lax.shift_left(x, jnp.uint32(r)) | lax.shift_right_logical(x, jnp.uint32(32 - r))


def threefry2x32(k0, k1, x0, x1):
    """Threefry-2x32 with 20 rounds of counters ``(x0, x1)`` under key ``(k0, k1)`` (uint32
    arrays broadcasting together), elementwise; wrapping uint32 arithmetic only."""
    u = jnp.uint32
    ks = (k0, k1, k0 ^ k1 ^ u(_PARITY))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = _rotl(x1, r) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + u(i + 1)
    return x0, x1


def counter_bits(k0, k1, counter):
    """The 32 random bits of positions ``counter`` (uint32, below :data:`COUNTER_LIMIT`) under
    key words ``k0, k1``: ``y0 ^ y1`` of :func:`threefry2x32` at counter ``(0, counter)``."""
    y0, y1 = threefry2x32(k0, k1, jnp.zeros_like(counter), counter)
    return y0 ^ y1


def key_words(key) -> tuple[jax.Array, jax.Array]:
    """The two uint32 Threefry key words the stream of ``key`` is drawn under: a Threefry
    key's own (typed ``jax.random.key`` or a raw ``uint32[..., 2]``), or for another
    implementation (``rbg``, ``unsafe_rbg``: MaxText's default) two words drawn from it with
    ``jax.random.bits``, one draw of two numbers. Leading batch dims are kept."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if "threefry" not in str(jax.random.key_impl(key)):
            w = jax.random.bits(key, (2,), jnp.uint32)
            return w[..., 0], w[..., 1]
        key = jax.random.key_data(key)
    return key[..., 0], key[..., 1]


def bits(key, shape) -> jax.Array:
    """uint32 random bits shaped ``shape``: ``jax.random.bits(k, shape, jnp.uint32)`` with
    partitionable Threefry, ``k`` the Threefry key of :func:`key_words` (``key`` itself for a
    Threefry key): :func:`counter_bits` of the row-major positions ``0 .. size - 1``."""
    shape = tuple(shape)
    size = int(np.prod(shape, dtype=np.int64))
    k0, k1 = key_words(key)
    if size >= COUNTER_LIMIT:
        threefry = jax.random.wrap_key_data(jnp.stack([k0, k1], -1), impl="threefry2x32")
        with jax.threefry_partitionable(True):  # JAX's draw carries the counter's high word
            return jax.random.bits(threefry, shape, jnp.uint32)
    return counter_bits(k0, k1, lax.iota(jnp.uint32, size).reshape(shape))


def to_uniform(b):
    """Uniforms in [0, 1) from uint32 bits: the top 24 bits times 2**-24 (exact in float32)."""
    return lax.shift_right_logical(b, jnp.uint32(8)).astype(jnp.float32) * np.float32(2.0**-24)


def uniform(key, shape) -> jax.Array:
    """Uniforms in [0, 1) with 24 random bits each: :func:`to_uniform` of :func:`bits`."""
    return to_uniform(bits(key, shape))
