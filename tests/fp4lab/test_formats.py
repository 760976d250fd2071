"""fp4lab.numerics.formats: the registry, element grids and format properties."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp4lab
from fp4lab.numerics.formats import ELEMENTS, FORMATS, get_format


def test_registry_has_every_required_format():
    required = {"nvfp4", "mxfp8", "mxfp8_e5m2", "mxfp4", "fp8_e4m3", "fp8_e5m2",
                "fp8_block128", "int4_q4_0", "int8", "int4", "bf16", "fp16", "fp32",
                "mxfp4_floor", "mxfp8_floor"}
    assert required <= set(fp4lab.format_names())
    assert get_format("MXFP8_E4M3") is FORMATS["mxfp8"]
    assert get_format(FORMATS["nvfp4"]) is FORMATS["nvfp4"]


def test_unknown_format_lists_known_names():
    with pytest.raises(ValueError) as e:
        get_format("fp5")
    assert "'fp5'" in str(e.value) and "nvfp4" in str(e.value) and "int4_q4_0" in str(e.value)
    with pytest.raises(ValueError, match="unknown format 3"):
        get_format(3)


@pytest.mark.parametrize("name,dtype", [("e2m1", ml_dtypes.float4_e2m1fn),
                                        ("e4m3", ml_dtypes.float8_e4m3fn),
                                        ("e5m2", ml_dtypes.float8_e5m2)])
def test_element_constants_match_ml_dtypes(name, dtype):
    el = ELEMENTS[name]
    fi = ml_dtypes.finfo(dtype)
    assert el.max == float(fi.max)
    assert el.min_normal == float(fi.smallest_normal)
    assert el.min_subnormal == float(fi.smallest_subnormal)
    grid = sorted({abs(float(v)) for v in np.arange(256 if el.bits == 8 else 16, dtype=np.uint8)
                   .view(np.uint8).astype(np.uint8).view(dtype).astype(np.float32)
                   if np.isfinite(float(v))})
    assert el.grid() == grid


def test_e2m1_grid_from_numerics():
    assert ELEMENTS["e2m1"].grid() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_formats_are_hashable_static_args():
    fmt = FORMATS["nvfp4"]
    assert hash(fmt) == hash(dataclasses.replace(fmt))
    f = jax.jit(lambda x, fmt: fp4lab.fake_quant(x, fmt), static_argnums=1)
    f(jnp.ones((2, 16)), fmt)
    # a new format is a new instance, not new code
    nvfp4_32 = dataclasses.replace(fmt, name="nvfp4_b32", block=32)
    q = fp4lab.quantize(jnp.ones((2, 64)), nvfp4_32)
    assert q.scale.shape == (2, 2)


def test_bits_per_element():
    assert FORMATS["nvfp4"].bits_per_element() == 4.5
    assert FORMATS["mxfp8"].bits_per_element() == 8.25
    assert FORMATS["mxfp4"].bits_per_element() == 4.25
    assert FORMATS["int4"].bits_per_element(64) == 4.5
    assert FORMATS["bf16"].bits_per_element() == 16


def test_invalid_format_definitions_are_rejected():
    with pytest.raises(ValueError, match="block=0 requires"):
        dataclasses.replace(FORMATS["nvfp4"], block=0)
    with pytest.raises(ValueError, match="even block"):
        dataclasses.replace(FORMATS["nvfp4"], block=15)
    with pytest.raises(ValueError, match="unknown MX scale mode 'round'"):
        type(FORMATS["mxfp8"].scaling)(mode="round")
