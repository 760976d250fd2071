"""The stochastic-rounding bit stream (fp4lab.numerics.random_bits): equal to JAX's own
partitionable Threefry bits, element for element, wherever it is drawn; and what rounding
needs of its statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from fp4lab.numerics import random_bits as rb


def _jax_bits(key, shape):
    with jax.threefry_partitionable(True):
        return np.asarray(jax.random.bits(key, shape, jnp.uint32))


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 17), (64, 48), (1, 1, 1, 9)])
@pytest.mark.parametrize("typed", [True, False])
def test_bits_are_jax_random_bits(shape, typed):
    key = jax.random.key(3) if typed else jax.random.PRNGKey(3)
    for k in (key, jax.random.split(key)[1], jax.random.fold_in(key, 2**31 + 5)):
        got = np.asarray(jax.jit(rb.bits, static_argnums=1)(k, shape))
        np.testing.assert_array_equal(got, _jax_bits(k, shape))


def test_random_123_known_answers():
    """Threefry-2x32-20's known-answer vectors (Random123's kat_vectors)."""
    def u(w):
        return jnp.uint32(w)

    cases = [((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
             ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
             ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0))]
    for key, ctr, want in cases:
        got = rb.threefry2x32(u(key[0]), u(key[1]), u(ctr[0]), u(ctr[1]))
        assert tuple(int(g) for g in got) == want


def test_counter_and_keys_under_vmap_and_sharding():
    keys = jax.random.split(jax.random.key(0), 4)
    got = np.asarray(jax.jit(jax.vmap(lambda k: rb.bits(k, (6, 10))))(keys))
    want = np.stack([_jax_bits(k, (6, 10)) for k in keys])
    np.testing.assert_array_equal(got, want)
    mesh = jax.make_mesh((len(jax.devices()),), ("d",))
    x = jax.device_put(jnp.zeros((8 * len(jax.devices()), 16)), NamedSharding(mesh,
                                                                             PartitionSpec("d")))
    f = jax.jit(lambda x, k: rb.bits(k, x.shape) ^ x.astype(jnp.uint32),
                out_shardings=NamedSharding(mesh, PartitionSpec("d")))
    np.testing.assert_array_equal(np.asarray(f(x, keys[1])), _jax_bits(keys[1], x.shape))


def test_explicit_counter():
    """counter_bits (what the kernels call on their tiles' positions) draws the stream's bits
    at the positions it is given."""
    key = jax.random.key(11)
    full = _jax_bits(key, (40,))
    counter = jnp.asarray([39, 0, 7, 7], jnp.uint32)
    got = rb.counter_bits(*rb.key_words(key), counter)
    np.testing.assert_array_equal(np.asarray(got), full[[39, 0, 7, 7]])


def test_beyond_32_bit_counters_draw_jax_bits():
    """A tensor of 2**32 elements or more is not drawn with 32-bit counters (they would repeat):
    it takes JAX's draw, which carries the counter's high word (traced, not run)."""
    shape = (2**16, 2**16)
    jaxpr = str(jax.make_jaxpr(lambda k: rb.bits(k, shape))(jax.random.key(0)))
    assert "random_bits" in jaxpr and "iota" not in jaxpr
    small = str(jax.make_jaxpr(lambda k: rb.bits(k, (2**16, 2**15)))(jax.random.key(0)))
    assert "random_bits" not in small


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_other_key_impls_draw_under_a_threefry_key_drawn_from_them(impl):
    key = jax.random.key(5, impl=impl)
    words = jax.random.bits(key, (2,), jnp.uint32)
    want = _jax_bits(jax.random.wrap_key_data(words, impl="threefry2x32"), (3, 4))
    np.testing.assert_array_equal(np.asarray(rb.bits(key, (3, 4))), want)
    # batched keys, as vmap over scanned layers gives them (JAX's rbg draws under vmap are
    # not its unbatched draws: the words are whatever JAX draws in that context)
    keys = jax.random.split(key, 3)
    got = np.asarray(jax.vmap(lambda k: rb.bits(k, (3, 4)))(keys))
    batch_words = jax.vmap(lambda k: jax.random.bits(k, (2,), jnp.uint32))(keys)
    for i in range(3):
        want = _jax_bits(jax.random.wrap_key_data(batch_words[i], impl="threefry2x32"), (3, 4))
        np.testing.assert_array_equal(got[i], want)
    assert not np.array_equal(got[0], got[1])


# --------------------------------------------------------------------------- statistics
# n = 2**20 draws; thresholds are ~5 sigma of the statistic under the null hypothesis, so the
# tests fail for a biased or correlated stream and (practically) never for a good one.
N = 1 << 20


@pytest.fixture(scope="module")
def streams():
    k = jax.random.split(jax.random.key(2026), 2)
    return np.asarray(rb.bits(k[0], (N,))), np.asarray(rb.bits(k[1], (N,)))


def test_uniform_bytes_and_bits(streams):
    b = streams[0]
    for shift in (0, 8, 16, 24):  # every byte: chi-square over 256 cells, 255 dof
        counts = np.bincount((b >> shift) & 0xFF, minlength=256)
        chi2 = ((counts - N / 256) ** 2 / (N / 256)).sum()
        assert chi2 < 255 + 5 * np.sqrt(2 * 255), (shift, chi2)
    ones = ((b[:, None] >> np.arange(32, dtype=np.uint32)) & 1).mean(0)
    assert np.all(np.abs(ones - 0.5) < 5 * 0.5 / np.sqrt(N)), ones


def test_no_correlation_between_neighbours_or_keys(streams):
    u0, u1 = (np.asarray(rb.to_uniform(s), np.float64) - 0.5 for s in streams)
    sigma = 1 / 12 / np.sqrt(N)  # sd of a mean of products of independent centred uniforms
    for lag in (1, 2, 16, 17):  # neighbours in a row and across a 16-element block
        assert abs(np.mean(u0[:-lag] * u0[lag:])) < 5 * sigma, lag
    assert abs(np.mean(u0 * u1)) < 5 * sigma  # split keys (operands, steps)
    pairs = np.bincount(((streams[0][:-1] >> 28) << 4) | (streams[0][1:] >> 28), minlength=256)
    chi2 = ((pairs - (N - 1) / 256) ** 2 / ((N - 1) / 256)).sum()  # neighbours' joint law
    assert chi2 < 255 + 5 * np.sqrt(2 * 255), chi2


def test_rounding_with_the_stream_is_unbiased():
    """E[SR(v)] = v onto E2M1 through fp4lab's quantizer (its own draw), for values at every
    fractional position between grid points."""
    from fp4lab.numerics.formats import E2M1
    from fp4lab.numerics.rounding import round_stochastic
    v = jnp.tile(jnp.asarray([0.1, 0.3, 0.7, 1.1, 1.26, 2.4, 3.9, 5.5], jnp.float32), N // 8)
    q = np.asarray(round_stochastic(v, E2M1, rb.uniform(jax.random.key(9), v.shape)))
    means = q.reshape(-1, 8).mean(0)
    gaps = np.asarray([0.5, 0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0])
    np.testing.assert_array_less(np.abs(means - np.asarray(v[:8])), 5 * gaps / 2 / np.sqrt(N / 8))
