"""Helpers shared by the kernel tests: bitwise comparison, every kernel entry point, and
lowering for an abstract GPU (no GPU needed)."""

import dataclasses
import functools
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import fp4lab
from pallas_kernels.quantize import dequantize, quantize, quantize_weight_nvfp4
from pallas_kernels.rht import rht_quantize_nvfp4

FORMATS = ["nvfp4", "mxfp8", "mxfp8_e5m2", "mxfp8_floor", "mxfp4", "mxfp4_floor"]
# formats the kernels serve as data, not as names: other block sizes of the same schemes
VARIANTS = {"nvfp4_b32": dataclasses.replace(fp4lab.FORMATS["nvfp4"], name="nvfp4_b32",
                                             block=32),
            "mxfp8_b16": dataclasses.replace(fp4lab.FORMATS["mxfp8"], name="mxfp8_b16",
                                             block=16)}


def same_bits(a, b):
    a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def assert_same_qarray(k, r):
    same_bits(k.data, r.data)
    same_bits(k.scale, r.scale)
    if r.global_scale is None:
        assert k.global_scale is None
    else:
        same_bits(k.global_scale, r.global_scale)
    assert (k.format, k.axis, k.tile, k.shape) == (r.format, r.axis, r.tile, r.shape)


def kernel_cases(shape=(256, 512), dtype=jnp.bfloat16):
    """``name -> (function, abstract arguments, stochastic)`` for every kernel entry point
    in compiled (not interpret) mode, on an input of ``shape``. Not cached: new functions
    make JAX lower again, which ``triton_modules`` needs to see the Triton modules."""
    x = jax.ShapeDtypeStruct(shape, dtype)
    key = jax.eval_shape(lambda: jax.random.key(0))
    cases = {}
    for fmt in FORMATS:
        cases[f"quantize {fmt}"] = (lambda x, f=fmt: quantize(x, f, interpret=False), (x,),
                                    False)
        q = jax.eval_shape(lambda x, f=fmt: fp4lab.quantize(x, f), x)
        cases[f"dequantize {fmt}"] = (lambda q: dequantize(q, interpret=False), (q,), False)
    for fmt in ("nvfp4", "mxfp4"):
        cases[f"quantize {fmt} SR"] = (
            lambda x, k, f=fmt: quantize(x, f, rounding="stochastic", key=k, interpret=False),
            (x, key), True)
    for name, fmt in VARIANTS.items():
        cases[f"quantize {name}"] = (lambda x, f=fmt: quantize(x, f, interpret=False), (x,),
                                     False)
    cases["quantize nvfp4 16x16 (+transposed)"] = (
        lambda w: quantize_weight_nvfp4(w, interpret=False), (x,), False)
    cases["quantize nvfp4 32x32 (+transposed)"] = (
        lambda w: quantize_weight_nvfp4(w, tile=(32, 32), interpret=False), (x,), False)
    cases["rht + nvfp4"] = (
        lambda x: rht_quantize_nvfp4(x, rounding="nearest", interpret=False), (x,), False)
    cases["rht + nvfp4 SR"] = (lambda x, k: rht_quantize_nvfp4(x, k, interpret=False),
                               (x, key), True)
    return cases


def lower_for_h200(f, *args):
    """The StableHLO text of ``jit(f)`` lowered for CUDA on an abstract H200 (no GPU needed)."""
    from jax._src import mesh as mesh_lib  # AbstractDevice is not public yet

    device = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


class Lowered(NamedTuple):
    hlo: str  # lower_for_h200's StableHLO text
    modules: list  # triton_modules' (name, TTIR text, num_warps, num_stages)
    stochastic: bool


@functools.cache
def lowered(name: str, shape: tuple[int, int] = (256, 512)) -> Lowered:
    """Kernel case ``name`` of :func:`kernel_cases` on an input of ``shape``, lowered for an
    abstract H200 once per test process: the lowering checks (test_quantize_kernels) and the
    sm_90 compile check (test_triton_compile) read the same lowering."""
    f, args, stochastic = kernel_cases(shape)[name]
    hlo, modules = _lower_capturing_triton(f, *args)
    return Lowered(hlo, modules, stochastic)


def triton_modules(f, *args):
    """The Triton (TTIR) modules of ``f``'s kernels as JAX lowers them for an H200: a list of
    ``(name, TTIR text, num_warps, num_stages)`` in launch order. JAX embeds each module as
    MLIR bytecode in the custom call; this hooks the (private) lowering function to get its
    text, which upstream Triton can parse."""
    return _lower_capturing_triton(f, *args)[1]


def _lower_capturing_triton(f, *args) -> tuple[str, list]:
    """``(lower_for_h200's text, triton_modules' list)`` from one lowering."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    lower = registration.lowering.lower_jaxpr_to_triton_module
    texts = []

    def capture(*a, **kw):
        result = lower(*a, **kw)
        texts.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        hlo = lower_for_h200(f, *args)
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    launch = re.findall(r"num_stages = (\d+) : i32, num_warps = (\d+) : i32", hlo)
    names = re.findall(r"^module @(\w+)", "\n".join(texts), re.M)
    assert len(launch) == len(texts) == len(names), (len(launch), len(texts), len(names))
    return hlo, [(n, t, int(w), int(s)) for n, t, (s, w) in zip(names, texts, launch, strict=True)]
