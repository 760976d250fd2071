"""Helpers shared by the kernel tests: bitwise comparison and lowering for an abstract GPU."""

import jax
import numpy as np


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


def lower_for_h200(f, *args):
    """The StableHLO text of ``jit(f)`` lowered for CUDA on an abstract H200 (no GPU needed)."""
    from jax._src import mesh as mesh_lib  # AbstractDevice is not public yet

    device = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
