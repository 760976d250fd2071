"""pallas_kernels.rht: the fused RHT + NVFP4 (+ SR) wgrad-operand kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import assert_same_qarray, lower_for_h200

import fp4lab
from fp4lab.hadamard import rht
from pallas_kernels.quantize import KernelConfig
from pallas_kernels.rht import hash_uniform, rht_quantize_nvfp4

SMALL = KernelConfig(block_rows=32, block_cols=32)


def reference(x, **kw):
    return fp4lab.quantize(rht(x, 0).T, "nvfp4", **kw)


@pytest.mark.parametrize("shape", [(5, 3), (100, 72), (64, 64), (33, 130)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_round_to_nearest_equals_the_reference_when_the_transform_is_exact(shape, dtype):
    # integer inputs: every partial sum of +-x_i/4 is exact, so any summation order gives the
    # reference's transformed values and the kernel must give its exact codes and scales
    x = jax.random.randint(jax.random.key(0), shape, -8, 9).astype(dtype)
    assert_same_qarray(rht_quantize_nvfp4(x, rounding="nearest", config=SMALL), reference(x))


def test_round_to_nearest_on_gaussian_data_and_special_values():
    x = jax.random.normal(jax.random.key(1), (96, 80))
    k, r = rht_quantize_nvfp4(x, rounding="nearest", config=SMALL), reference(x)
    assert np.mean(np.asarray(k.data) != np.asarray(r.data)) < 1e-3  # last-bit sum order
    np.testing.assert_array_equal(np.asarray(k.scale).view(np.uint8),
                                  np.asarray(r.scale).view(np.uint8))
    z = jnp.zeros((32, 32))
    assert_same_qarray(rht_quantize_nvfp4(z, rounding="nearest"), reference(z))
    nan = x.at[3, 4].set(jnp.nan)
    got = rht_quantize_nvfp4(nan, rounding="nearest")
    assert np.isnan(float(got.global_scale))
    assert np.all(np.isnan(np.asarray(fp4lab.dequantize(got))))  # a NaN never disappears


def test_stochastic_rounding_is_unbiased_and_deterministic_per_key():
    x = jax.random.normal(jax.random.key(2), (64, 48))
    y = np.asarray(rht(x, 0).T)
    f = jax.jit(lambda k: fp4lab.dequantize(rht_quantize_nvfp4(x, k, config=SMALL)))
    mean = np.mean([np.asarray(f(jax.random.key(i))) for i in range(64)], axis=0)
    rne_err = np.abs(np.asarray(fp4lab.dequantize(reference(x))) - y).mean()
    assert np.abs(mean - y).mean() < 0.3 * rne_err  # the error averages away; RNE's does not
    a, b = f(jax.random.key(7)), f(jax.random.key(7))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(f(jax.random.key(8))))


def test_hash_uniforms_look_uniform():
    u = np.asarray(hash_uniform(jnp.arange(1 << 16, dtype=jnp.uint32), jnp.uint32(12345)))
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    hist = np.histogram(u, bins=16, range=(0, 1))[0]
    assert hist.min() > 0.9 * hist.mean()


def test_bad_inputs():
    with pytest.raises(ValueError, match="needs key"):
        rht_quantize_nvfp4(jnp.ones((16, 16)))
    with pytest.raises(ValueError, match="takes a \\(tokens, features\\) matrix"):
        rht_quantize_nvfp4(jnp.ones((2, 16, 16)), rounding="nearest")
    with pytest.raises(ValueError, match="rounding='up'"):
        rht_quantize_nvfp4(jnp.ones((16, 16)), rounding="up")


def test_lowers_for_an_abstract_h200():
    x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
    key = jax.eval_shape(lambda: jax.random.key(0))
    text = lower_for_h200(lambda x, k: rht_quantize_nvfp4(x, k, interpret=False), x, key)
    assert text.count("xla.gpu.triton") == 2  # the amax pass and the quantize pass
    assert "divf" not in text and "div.rn.f32" in text
