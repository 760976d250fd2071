"""pallas_kernels.rht: the fused RHT + NVFP4 (+ SR) wgrad-operand kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import assert_same_qarray, same_bits

import fp4lab
from fp4lab.numerics.hadamard import rht
from pallas_kernels.quantize import KernelConfig
from pallas_kernels.rht import rht_quantize_nvfp4

SMALL = KernelConfig(block_rows=32, block_cols=32)


def reference(x, signs="te", **kw):
    return fp4lab.quantize(rht(x, 0, signs=signs).T, "nvfp4", **kw)


def special(shape, dtype, seed=0):
    """Gaussian data with outliers, zeros of both signs, subnormals and huge values."""
    x = np.asarray(jax.random.normal(jax.random.key(seed), shape)) * 3
    flat = x.reshape(-1)
    specials = np.array([0.0, -0.0, 1e4, -3e4, 1e-30, -3e-39, 2.0 ** -130, 0.25, 6.0, 448.0],
                        np.float32)
    idx = np.random.default_rng(seed).choice(flat.size, min(flat.size, specials.size),
                                             replace=False)
    flat[idx] = specials[:idx.size]
    return jnp.asarray(x).astype(dtype)


@pytest.mark.parametrize("shape", [(5, 3), (100, 72), (64, 64), (33, 130), (200, 40)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_round_to_nearest_equals_the_reference_bit_for_bit(shape, dtype):
    # the same butterflies in the same order as fp4lab.numerics.hadamard.rht: equal codes and scales
    # on every input, over several tiles (SMALL) and over one (the default config)
    x = special(shape, dtype)
    assert_same_qarray(rht_quantize_nvfp4(x, rounding="nearest", config=SMALL), reference(x))
    assert_same_qarray(rht_quantize_nvfp4(x, rounding="nearest"), reference(x))


def test_zeros_infinities_nan_and_seeded_signs():
    x = special((96, 80), jnp.float32, seed=1)
    for case in (jnp.zeros((32, 32)),
                 x.at[3, 4].set(jnp.inf),  # one group's outputs infinite, amax inf
                 x.at[3, 4].set(jnp.inf).at[5, 4].set(-jnp.inf),  # inf - inf: NaN
                 x.at[3, 4].set(jnp.nan),
                 x * 1e-36):  # block amaxes near float32's bottom
        assert_same_qarray(rht_quantize_nvfp4(case, rounding="nearest", config=SMALL),
                           reference(case))
    got = rht_quantize_nvfp4(x.at[3, 4].set(jnp.nan), rounding="nearest")
    assert np.all(np.isnan(np.asarray(fp4lab.dequantize(got))))  # a NaN never disappears
    assert_same_qarray(rht_quantize_nvfp4(x, rounding="nearest", signs=7, config=SMALL),
                       reference(x, signs=7))
    top = float(jnp.max(jnp.abs(rht(x, 0))))
    for amax in (1.0, 0.0, top, 2 * top):  # below max|rht(x)|: saturates, taken under jit
        assert_same_qarray(
            jax.jit(lambda x, a: rht_quantize_nvfp4(x, rounding="nearest", global_amax=a))(
                x, amax),
            jax.jit(lambda x, a: reference(x, global_amax=a))(x, amax))
    assert_same_qarray(rht_quantize_nvfp4(x, rounding="nearest", global_amax=top),
                       reference(x, global_amax=top))
    for amax in (1.0, -2.0, float("nan")):  # refused eagerly, as the reference does
        with pytest.raises(ValueError, match="global_amax="):
            rht_quantize_nvfp4(x, rounding="nearest", global_amax=amax)


@pytest.mark.parametrize("shape", [(64, 48), (33, 130), (200, 40)])
def test_stochastic_rounding_equals_the_reference_bit_for_bit(shape):
    """The kernel's SR uniforms are fp4lab.numerics.random_bits' at each element's position in
    the tokens-first (M16, K) operand the GEMM quantizes (not the transposed output, not the
    padded tiles): its values equal the XLA path's, ``rht(x, 0)`` blocked along the tokens."""
    x = special(shape, jnp.float32, seed=3)
    f = jax.jit(lambda x, k: fp4lab.dequantize(rht_quantize_nvfp4(x, k, config=SMALL)).T)
    ref = jax.jit(lambda x, k: fp4lab.fake_quant(rht(x, 0), "nvfp4", axis=0,
                                                 rounding="stochastic", key=k))
    for key in (jax.random.key(7), jax.random.split(jax.random.key(8))[0]):
        same_bits(f(x, key), ref(x, key))
    same_bits(fp4lab.dequantize(rht_quantize_nvfp4(x, jax.random.key(9))).T,
              ref(x, jax.random.key(9)))


def test_bad_inputs():
    with pytest.raises(ValueError, match="needs key"):
        rht_quantize_nvfp4(jnp.ones((16, 16)))
    with pytest.raises(ValueError, match="takes a \\(tokens, features\\) matrix"):
        rht_quantize_nvfp4(jnp.ones((2, 16, 16)), rounding="nearest")
    with pytest.raises(ValueError, match="rounding='up'"):
        rht_quantize_nvfp4(jnp.ones((16, 16)), rounding="up")
