"""The Flax behaviour fp4lab relies on beyond Flax's public API (fp4lab.flax.internals), pinned
on plain Flax models without fp4lab's quantization: a Flax upgrade that changes one of them
fails here, and nowhere else first."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from fp4lab.flax.internals import (OverwriteWithGradient, linen_calling_module, linen_child,
                                   linen_einsum_bias_shape, linen_filter_value, linen_lifted,
                                   linen_module_stack, nnx_calling_module, swap_class)


def test_linen_module_stack_and_the_calling_module():
    seen = {}

    class Inner(nn.Module):
        @nn.compact
        def __call__(self, x):
            seen["calling"] = linen_calling_module()
            seen["stack"] = [m.scope.path for m in linen_module_stack()]
            return nn.Dense(3)(x)

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = Inner(name="inner")(x)
            seen["child"] = linen_child(self, "inner")
            return y

    x = jnp.ones((2, 4))
    Outer().init(jax.random.key(0), x)
    assert seen["calling"].scope.path == ("inner",)
    assert seen["stack"] == [(), ("inner",)]
    assert isinstance(seen["child"], Inner)
    assert linen_calling_module() is None and linen_module_stack() == []


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.Dense(4)(x), None


def test_a_linen_transforms_arguments_are_read_off_the_lifted_module():
    def split(lifted, rng="quant"):
        return linen_filter_value(linen_lifted(lifted)[1]["split_rngs"], rng)

    for rngs, want in [({"params": True, "quant": True}, True),
                       ({"params": True, "quant": False}, False),
                       ({"params": True}, None), ({True: False}, False)]:
        scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs=rngs, length=2)
        assert linen_lifted(scan())[0] == "scan" and split(scan()) is want, rngs
    scan = nn.scan(Block, variable_axes={"params": 1, ("probes", "stats"): 0}, length=5)
    kind, args = linen_lifted(scan())
    assert (args["length"], linen_filter_value(args["variable_axes"], "params"),
            linen_filter_value(args["variable_axes"], "stats"),
            linen_filter_value(args["variable_axes"], "other")) == (5, 1, 0, None)
    vmap = nn.vmap(Block, variable_axes={"params": 0}, split_rngs={"quant": False},
                   in_axes=(0, None))
    assert linen_lifted(vmap())[0] == "vmap" and split(vmap()) is False
    assert linen_lifted(vmap())[1]["axis_size"] is None
    assert linen_lifted(Block()) is None
    assert linen_lifted(nn.remat(Block)()) is None


def test_a_linen_einsums_bias_shape():
    layer = nn.Einsum((4, 3, 5), "bd,dhk->bhk", bias_init=nn.initializers.ones)
    x = jnp.ones((2, 4))
    variables = layer.init(jax.random.key(0), x)
    bound = layer.bind(variables)
    bias, broadcast = linen_einsum_bias_shape(bound, "bd,dhk->bhk", x, jnp.ones((4, 3, 5)))
    assert tuple(bias) == variables["params"]["bias"].shape == (3, 5)
    assert tuple(broadcast) == (1, 3, 5)


def test_the_calling_nnx_module_is_found_from_its_frames():
    class Layer(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((2, 2)))

        def __call__(self, x):
            return helper(x), nnx_calling_module()

    def helper(x):  # a function called from the method: its frame has no self
        return x @ jnp.ones((2, 2))

    layer = Layer()
    _, calling = layer(jnp.ones((1, 2)))
    assert calling is layer
    assert nnx_calling_module() is None


def test_an_nnx_modules_class_swaps_and_back_with_its_state():
    class Layer(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.arange(4.0))

        def __call__(self):
            return self.w[...]

    class Loud(Layer):
        def __call__(self):
            return -super().__call__()

    layer = Layer()
    swap_class(layer, Loud)
    np.testing.assert_array_equal(layer(), -jnp.arange(4.0))
    graph, state = nnx.split(layer)
    np.testing.assert_array_equal(nnx.merge(graph, state)(), -jnp.arange(4.0))
    swap_class(layer, Layer)
    np.testing.assert_array_equal(layer(), jnp.arange(4.0))


def test_overwrite_with_gradient_is_flaxs_collection_and_filters_select_subclasses():
    """MaxText differentiates and overwrites nnx.Any(variable_type_from_name(
    "_overwrite_with_gradient")); fp4lab's probes subclass that type."""
    from flax.nnx import variablelib

    assert OverwriteWithGradient is variablelib.variable_type_from_name(
        "_overwrite_with_gradient")

    class Probe(OverwriteWithGradient):
        pass

    class Holder(nnx.Module):
        def __init__(self):
            self.p = Probe(jnp.zeros(3))
            self.w = nnx.Param(jnp.ones(3))

    state = nnx.state(Holder(), nnx.Any(OverwriteWithGradient))
    assert [path for path, _ in nnx.to_flat_state(state)] == [("p",)]
