"""fp4lab.backend: the kernel path gives the reference's bits through the public API."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4lab
from fp4lab import backend
from fp4lab.qdot import qdot_general

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
        with pytest.raises(ValueError, match="2D-tiled QArrays dequantize in XLA"):
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


def test_auto_uses_xla_off_the_gpu_and_reports_fallbacks_on_it(monkeypatch):
    fmt = fp4lab.get_format("mxfp8")
    assert backend.choose("auto", fmt) == "xla"  # this machine has no GPU: nothing is said
    with pytest.raises(ValueError, match="backend='tpu'; use one of auto, xla, pallas"):
        backend.choose("tpu", fmt)
    with pytest.raises(ValueError, match="no kernel for mxfp8: stochastic rounding"):
        backend.choose("pallas", fmt, rounding="stochastic")
    monkeypatch.setattr(backend.jax, "default_backend", lambda: "gpu")
    assert backend.choose("auto", fmt) == "pallas"
    with pytest.warns(backend.KernelFallback, match="kernels block the last axis; axis=-2"):
        assert backend.choose("auto", fmt, axis_from_end=-2) == "xla"
    with warnings.catch_warnings():  # said once per distinct case
        warnings.simplefilter("error")
        assert backend.choose("auto", fmt, axis_from_end=-2) == "xla"


def test_qdot_on_the_kernel_backend():
    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (64, 96))
    w = jax.random.normal(kw, (96, 48))
    g = jax.random.normal(kg, (64, 48))

    def run(recipe, be):
        f = lambda x, w: jnp.sum(qdot_general(x, w, DN, recipe, key=jax.random.key(3),  # noqa
                                              backend=be) * g)
        with warnings.catch_warnings():  # on "pallas", every operand has a kernel: no fallback
            warnings.simplefilter("error", backend.KernelFallback)
            return jax.value_and_grad(f, argnums=(0, 1))(x, w)

    # mxfp8, and nvfp4 without SR (the wgrad operands through the fused RHT kernel, which
    # computes the reference's transform operation for operation): the same bits
    for recipe in ("mxfp8", "nvfp4_no_sr"):
        kernel, ref = run(recipe, "pallas"), run(recipe, "xla")
        for a, b in zip(jax.tree.leaves(kernel), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # nvfp4 with SR: hashed SR bits, so gradients close to, not equal to, XLA's
    y1, (_, dw1) = run("nvfp4", "pallas")
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(ref[0]))
    exact = jax.grad(lambda w: jnp.sum(jnp.dot(x, w, precision="highest") * g))(w)
    rel = np.linalg.norm(np.asarray(dw1 - exact)) / np.linalg.norm(np.asarray(exact))
    assert rel < 0.2, rel
