"""fp4lab.numerics.backend: the kernel table serves or refuses requests by data, and the kernel path
gives the reference's bits through the public API."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4lab
from fp4lab.numerics import backend
from fp4lab.gemm.qdot import qdot_general

DN = (((1,), (0,)), ((), ()))


def bits(a):
    return np.atleast_1d(np.asarray(a)).view(np.uint8)


@pytest.mark.parametrize("fmt,tile", [("nvfp4", None), ("nvfp4", (16, 16)), ("mxfp8", None),
                                      ("mxfp4", None)])
def test_pallas_backend_equals_xla_through_the_public_api(fmt, tile):
    x = jax.random.normal(jax.random.key(0), (24, 80), jnp.bfloat16)
    a = fp4lab.quantize(x, fmt, tile=tile, backend="pallas")
    b = fp4lab.quantize(x, fmt, tile=tile, backend="xla")
    np.testing.assert_array_equal(bits(a.data), bits(b.data))
    np.testing.assert_array_equal(bits(a.scale), bits(b.scale))
    if tile:  # no dequantize kernel for 2D tiles: the strict backend says so
        with pytest.raises(ValueError, match="dequantize kernel serves 1D blocks, not tile"):
            fp4lab.dequantize(a, backend="pallas")
    else:
        np.testing.assert_array_equal(
            bits(fp4lab.dequantize(a, jnp.bfloat16, backend="pallas")),
            bits(fp4lab.dequantize(b, jnp.bfloat16, backend="xla")))
    y, g = jax.value_and_grad(lambda t: fp4lab.fake_quant(t, fmt, tile=tile,
                                                          backend="pallas").sum())(x)
    np.testing.assert_array_equal(bits(fp4lab.fake_quant(x, fmt, tile=tile, backend="pallas")),
                                  bits(fp4lab.fake_quant(x, fmt, tile=tile, backend="xla")))
    np.testing.assert_array_equal(np.asarray(g), np.ones(x.shape, x.dtype))  # straight through


def request(fmt, **kw):
    return backend.Request(op="quantize", format=fp4lab.get_format(fmt), shape=(4, 64), **kw)


def test_auto_uses_xla_off_the_gpu_and_reports_fallbacks_on_it(monkeypatch):
    assert backend.decide("auto", request("mxfp8")) is None  # no GPU here: nothing is said
    with pytest.raises(ValueError, match="backend='tpu'; use one of auto, xla, pallas"):
        backend.decide("tpu", request("mxfp8"))
    with pytest.raises(ValueError, match="no kernel for mxfp8: the MX FP8 quantize kernel "
                                         "rounds nearest, not stochastic"):
        backend.decide("pallas", request("mxfp8", rounding="stochastic"))
    monkeypatch.setattr(backend.jax, "default_backend", lambda: "gpu")
    assert backend.decide("auto", request("mxfp8")).name == "MX FP8 quantize"
    with pytest.warns(backend.KernelFallback, match="blocks axis -1; axis=-2"):
        assert backend.decide("auto", request("mxfp8", axis=-2)) is None
    with warnings.catch_warnings():  # said once per distinct case
        warnings.simplefilter("error")
        assert backend.decide("auto", request("mxfp8", axis=-2)) is None


def test_the_table_is_data_and_fp4lab_never_imports_the_kernels():
    import subprocess
    import sys

    code = ("import fp4lab, sys; fp4lab.quantize(fp4lab.fake_quant(__import__('jax').numpy."
            "ones((2, 32)), 'nvfp4'), 'mxfp8'); assert 'pallas_kernels' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
    names = {k.name: k for k in backend.kernels()}  # registered through the entry point
    assert {"NVFP4 1D quantize", "MX FP8 quantize", "NVFP4 RHT + quantize"} <= set(names)
    assert backend.refusal(request("int4_q4_0")) == "no quantize kernel for GGMLQ4_0Scale scales"
    assert backend.refusal(request("nvfp4", tile=(64, 64))) == (
        "the NVFP4 1D quantize kernel serves 1D blocks, not tile=(64, 64); the NVFP4 2D-tile "
        "quantize kernel serves tile=(16, 16), tile=(32, 32), not tile=(64, 64)")
    assert "empty array" in backend.refusal(backend.Request(
        op="quantize", format=fp4lab.get_format("nvfp4"), shape=(0, 64)))
    with pytest.raises(TypeError, match="takes a fp4lab.numerics.backend.Kernel"):
        backend.register(lambda x: x)


# formats the kernels were not written for: new data, served or refused by the table
VARIANTS = {
    "nvfp4_b32": dataclasses.replace(fp4lab.FORMATS["nvfp4"], name="nvfp4_b32", block=32),
    "mxfp8_b16": dataclasses.replace(fp4lab.FORMATS["mxfp8"], name="mxfp8_b16", block=16),
    "mxfp4_b16": dataclasses.replace(fp4lab.FORMATS["mxfp4"], name="mxfp4_b16", block=16),
    "mxfp8_floor_b16": dataclasses.replace(fp4lab.FORMATS["mxfp8_floor"],
                                           name="mxfp8_floor_b16", block=16),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_block_sizes_give_xlas_bits_on_the_kernels(name):
    fmt = VARIANTS[name]
    x = (jax.random.normal(jax.random.key(2), (6, 96)) * 5).at[0, :3].set(
        jnp.array([0.0, -0.0, 1e4]))
    a, b = fp4lab.quantize(x, fmt, backend="pallas"), fp4lab.quantize(x, fmt, backend="xla")
    np.testing.assert_array_equal(bits(a.data), bits(b.data))
    np.testing.assert_array_equal(bits(a.scale), bits(b.scale))
    np.testing.assert_array_equal(bits(fp4lab.dequantize(a, backend="pallas")),
                                  bits(fp4lab.dequantize(b, backend="xla")))
    np.testing.assert_array_equal(bits(fp4lab.fake_quant(x, fmt, backend="pallas")),
                                  bits(fp4lab.fake_quant(x, fmt, backend="xla")))


def test_nvfp4_32x32_tiles_on_the_kernel_and_unservable_variants_refused(monkeypatch):
    x = jax.random.normal(jax.random.key(3), (40, 72)) * 3
    a = fp4lab.quantize(x, "nvfp4", tile=(32, 32), backend="pallas")
    b = fp4lab.quantize(x, "nvfp4", tile=(32, 32), backend="xla")
    np.testing.assert_array_equal(bits(a.data), bits(b.data))
    np.testing.assert_array_equal(bits(a.scale), bits(b.scale))
    b64 = dataclasses.replace(fp4lab.FORMATS["nvfp4"], name="nvfp4_b64", block=64)
    with pytest.raises(ValueError, match="serves blocks of 16 or 32, not nvfp4_b64's 64"):
        fp4lab.quantize(x, b64, backend="pallas")
    monkeypatch.setattr(backend.jax, "default_backend", lambda: "gpu")
    with pytest.warns(backend.KernelFallback, match="not nvfp4_b64's 64"):  # auto falls back
        y = fp4lab.fake_quant(x, b64)
    np.testing.assert_array_equal(bits(y), bits(fp4lab.fake_quant(x, b64, backend="xla")))


def test_qdot_on_the_kernel_backend():
    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (64, 96))
    w = jax.random.normal(kw, (96, 48))
    g = jax.random.normal(kg, (64, 48))

    def run(recipe, be):
        f = lambda x, w: jnp.sum(qdot_general(x, w, DN, recipe, jax.random.key(3),  # noqa
                                              backend=be) * g)
        with warnings.catch_warnings():  # on "pallas", every operand has a kernel: no fallback
            warnings.simplefilter("error", backend.KernelFallback)
            return jax.value_and_grad(f, argnums=(0, 1))(x, w)

    # mxfp8, nvfp4 without SR and nvfp4 with SR (the wgrad operands through the fused RHT
    # kernel, which computes the reference's transform operation for operation and draws
    # the same random bits at the same positions): the same bits
    for recipe in ("mxfp8", "nvfp4_no_sr", "nvfp4"):
        kernel, ref = run(recipe, "pallas"), run(recipe, "xla")
        for a, b in zip(jax.tree.leaves(kernel), jax.tree.leaves(ref), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_stochastic_rounding_beyond_32_bit_positions_is_refused_by_the_kernels():
    """The kernels count SR positions in 32 bits: an operand of 2**32 elements or more is
    refused by name (the XLA path draws it, with the counter's high word)."""
    from pallas_kernels.quantize import KERNELS
    from pallas_kernels.rht import KERNEL as RHT_KERNEL
    big = backend.Request(op="quantize", format=fp4lab.get_format("nvfp4"),
                          shape=(2**16, 2**16), rounding="stochastic")
    assert "2**32 elements or more" in backend.refusal(big, KERNELS)
    assert backend.refusal(dataclasses.replace(big, shape=(2**16, 2**16 - 16)), KERNELS) is None
    assert backend.refusal(dataclasses.replace(big, rounding="nearest"), KERNELS) is None
    rht = dataclasses.replace(big, op="rht_quantize", shape=(2**16 - 1, 2**16), axis=-2,
                              transform=16)  # its rows pad to 2**16
    assert "2**32 elements or more" in backend.refusal(rht, (RHT_KERNEL,))
