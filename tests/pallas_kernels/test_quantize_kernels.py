"""pallas_kernels.quantize: every round-to-nearest kernel equals fp4lab.quantize bit for bit
(interpret mode here; the same tests run the compiled kernels on a GPU), and every kernel
lowers for an abstract H200 without one."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import FORMATS, assert_same_qarray, kernel_cases, lowered, same_bits

import fp4lab
from pallas_kernels.quantize import (
    KernelConfig,
    dequantize,
    quantize,
    quantize_weight_nvfp4,
    supports,
)

SHAPES = [(1, 16), (5, 40), (3, 7, 100), (64, 256), (33, 520), (300,)]
SMALL = KernelConfig(block_rows=16, block_cols=64)  # several tiles even on small inputs


def special(shape, dtype, seed=0):
    """Gaussian data with every special value mixed in: ties of the element grids, zeros of
    both signs, values far below and at the formats' limits, and huge outliers."""
    x = np.asarray(jax.random.normal(jax.random.key(seed), shape, jnp.float32)) * 3
    flat = x.reshape(-1)
    specials = np.array([0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 6.0, 448.0,
                         57344.0, 1e-30, -3e-39, 1e-6, 2.0 ** -9, 1e4], np.float32)
    idx = np.random.default_rng(seed).choice(flat.size, min(flat.size, specials.size),
                                             replace=False)
    flat[idx] = specials[:idx.size]
    return jnp.asarray(x).astype(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_kernels_equal_the_reference(fmt, shape):
    for dtype in (jnp.float32, jnp.bfloat16):
        x = special(shape, dtype)
        assert_same_qarray(quantize(x, fmt, config=SMALL), fp4lab.quantize(x, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_zeros_nan_and_inf_give_the_reference_result(fmt):
    z = jnp.zeros((4, 64))
    assert_same_qarray(quantize(z, fmt), fp4lab.quantize(z, fmt))
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        x = special((4, 64), jnp.float32).at[1, 7].set(bad)
        assert_same_qarray(quantize(x, fmt, config=SMALL), fp4lab.quantize(x, fmt))
    tiny = special((4, 64), jnp.float32) * 1e-37  # block amaxes near float32's bottom
    assert_same_qarray(quantize(tiny, fmt), fp4lab.quantize(tiny, fmt))


def test_nvfp4_with_a_given_global_amax():
    x = special((8, 48), jnp.float32)  # max|x| = 57344
    for amax in (1.0, 100.0, 0.0, 57344.0, 1e6):
        # an amax below max|x| (delayed scaling's lagging one) saturates: taken under jit
        assert_same_qarray(jax.jit(lambda x, a: quantize(x, "nvfp4", global_amax=a))(x, amax),
                           jax.jit(lambda x, a: fp4lab.quantize(x, "nvfp4", global_amax=a))(
                               x, amax))
    assert_same_qarray(quantize(x, "nvfp4", global_amax=1e6),
                       fp4lab.quantize(x, "nvfp4", global_amax=1e6))
    for amax, refusal in ((1.0, "is below max|x|=57344.0"), (-1.0, "global_amax=-1.0")):
        for kernel in (quantize, fp4lab.quantize):  # refused eagerly, as the reference does
            with pytest.raises(ValueError, match=re.escape(refusal)):
                kernel(x, "nvfp4", global_amax=amax)
        with pytest.raises(ValueError, match=re.escape(refusal)):
            quantize_weight_nvfp4(x[:, :32], global_amax=amax)


@pytest.mark.parametrize("shape", [(16, 16), (40, 72), (64, 256), (100, 33)])
def test_nvfp4_weight_kernel_writes_both_layouts(shape):
    w = special(shape, jnp.bfloat16, seed=3)
    row, col = quantize_weight_nvfp4(w, config=SMALL)
    assert_same_qarray(row, fp4lab.quantize(w, "nvfp4", tile=(16, 16)))
    assert_same_qarray(col, fp4lab.quantize(w.T, "nvfp4", tile=(16, 16)))
    assert_same_qarray(quantize(w, "nvfp4", tile=(16, 16)), fp4lab.quantize(w, "nvfp4",
                                                                             tile=(16, 16)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_kernel_equals_the_reference(fmt):
    x = special((9, 100), jnp.float32).at[2, 3].set(jnp.nan)
    q = fp4lab.quantize(x, fmt)
    for dtype in (jnp.bfloat16, jnp.float32):
        same_bits(dequantize(q, dtype, config=SMALL), fp4lab.dequantize(q, dtype))


def test_unsupported_inputs_say_why():
    assert "no quantize kernel for AbsMaxScale" in supports(fp4lab.get_format("fp8_e4m3"), -1,
                                                             None)
    assert "no quantize kernel for GGMLQ4_0Scale" in supports(fp4lab.get_format("int4_q4_0"),
                                                              -1, None)
    with pytest.raises(ValueError, match="no kernel: the MX FP8 quantize kernel blocks axis -1; "
                                         "axis=-2"):
        quantize(jnp.ones((32, 32)), "mxfp8", axis=0)
    with pytest.raises(ValueError, match="MX FP8 quantize kernel serves 1D blocks, not tile"):
        quantize(jnp.ones((32, 32)), "mxfp8", tile=(32, 32))
    with pytest.raises(TypeError, match="floating-point input, got int32"):
        quantize(jnp.ones((4, 32), jnp.int32), "nvfp4")
    with pytest.raises(ValueError, match="unknown format"):
        quantize(jnp.ones((4, 32)), "nvfp5")
    with pytest.raises(ValueError, match="block_cols=48 must be a power of two"):
        KernelConfig(block_cols=48)
    with pytest.raises(ValueError, match="block_cols=16 must be at least 32"):
        KernelConfig(block_cols=16)


@pytest.mark.parametrize("name", sorted(kernel_cases()))
def test_every_kernel_lowers_for_an_abstract_h200(name):
    # Triton arrays have power-of-two shapes: tiles must be too, whatever the input's shape
    for shape in [(256, 512), (5, 40), (64, 96), (100, 33), (1, 16)]:
        text = lowered(name, shape).hlo  # (shared with test_triton_compile)
        assert text.count("xla.gpu.triton") == (2 if name.startswith("rht") else 1)
        # no approximate division anywhere (Triton's float32 `/` is approximate on NVIDIA
        # GPUs); NVFP4's divisions are the PTX div.rn.f32 instruction
        assert "divf" not in text
        assert ("div.rn.f32" in text) == ("nvfp4" in name and "dequantize" not in name)


def test_nvfp4_tiles_of_a_stack_of_matrices():
    w = special((3, 40, 48), jnp.float32, seed=5)  # experts, or a GEMM's canonical (B, K, N)
    assert_same_qarray(quantize(w, "nvfp4", tile=(16, 16), config=SMALL),
                       fp4lab.quantize(w, "nvfp4", tile=(16, 16)))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("shape", [(16, 96), (5, 40), (3, 7, 100), (33, 520)])
def test_stochastic_rounding_kernels_equal_the_reference_bit_for_bit(fmt, shape):
    """The kernels draw fp4lab.numerics.random_bits' stream at each element's logical
    position: their SR codes equal the XLA path's over several tiles, with tile and block
    padding on both axes, for plain, split and folded keys (legacy uint32 keys and MaxText's
    unsafe_rbg keys too)."""
    x = special(shape, jnp.float32, seed=4).at[(0,) * len(shape)].set(1e4)  # an outlier block
    f = jax.jit(lambda x, k: quantize(x, fmt, rounding="stochastic", key=k, config=SMALL))
    for key in (jax.random.key(0), jax.random.split(jax.random.key(1))[1],
                jax.random.fold_in(jax.random.key(2), 7), jax.random.PRNGKey(3),
                jax.random.key(4, impl="unsafe_rbg")):
        assert_same_qarray(f(x, key), fp4lab.quantize(x, fmt, rounding="stochastic", key=key))
    assert_same_qarray(quantize(x, fmt, rounding="stochastic", key=jax.random.key(0)),
                       fp4lab.quantize(x, fmt, rounding="stochastic", key=jax.random.key(0)))


def test_stochastic_rounding_kernels_keep_signs_and_refuse():
    fmt = "nvfp4"
    x = special((16, 96), jnp.float32, seed=4)
    # the sign is copied, -0 included, as the reference's copysign does
    z = x.at[1, :32].set(-0.0)
    for q in (quantize(z, fmt, rounding="stochastic", key=jax.random.key(5)),
              fp4lab.quantize(z, fmt, rounding="stochastic", key=jax.random.key(5))):
        assert np.all(np.asarray(q.data)[1, :16] == 0x88)  # two -0 codes per byte
    with pytest.raises(ValueError, match="MX FP8 quantize kernel rounds nearest, not stochastic"):
        quantize(x, "mxfp8", rounding="stochastic", key=jax.random.key(0))
    with pytest.raises(ValueError, match="needs key"):
        quantize(x, fmt, rounding="stochastic")
