"""Scanned blocks (parameters stacked on a scan axis, run by a scan) as MaxText and Flax users
write them: fp4lab's per-layer state follows the stack whatever its axis, and its
stochastic-rounding streams advance from step to step whatever the host does with RNG
state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fp4lab.flax import explain, linear_layers, quantize_model
from fp4lab.numerics.metrics import METRIC_NAMES
from fp4lab.flax.nnx import LAYER_CALLS, register_layer
from fp4lab.policy import Depth, PrecisionPolicy, Rule, nemotron3
from fp4lab.gemm.qdot import qdot_general
from fp4lab import GemmState

L, D = 3, 32
DIMS = (((1,), (0,)), ((), ()))


class Block(nnx.Module):  # written without fp4lab
    def __init__(self, rngs):
        self.up = nnx.Linear(D, 2 * D, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.relu(self.up(x)))


def stacked_blocks(rngs, axis: int):
    """L blocks with their parameters stacked on ``axis`` (recorded as ``param_scan_axis``
    metadata, as MaxText's ``create_scanned_layers`` does) and other state on axis 0."""
    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Block(rngs)

    graph, params, rest = nnx.split(make(rngs), nnx.Param, ...)
    params = jax.tree.map(lambda v: v.replace(jnp.moveaxis(v[...], 0, axis),
                                              param_scan_axis=axis),
                          params, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return nnx.merge(graph, params, rest)


class HostScanned(nnx.Module):
    """A decoder whose layer scan is MaxText's: parameters moved from their scan axis to
    the front and fed in, and back out only the state that is not RNG state
    (``nnx.filter_state(..., nnx.Not(nnx.RngState))``); ``remat`` rematerializes each
    layer in the backward pass."""

    def __init__(self, rngs, axis=1, remat=False):
        self.blocks = stacked_blocks(rngs, axis)
        self.axis, self.remat = axis, remat

    def __call__(self, x):
        graph, params, rest = nnx.split(self.blocks, nnx.Param, ...)
        params = jax.tree.map(lambda v: jnp.moveaxis(v, self.axis, 0), params)

        def body(x, layer_state):
            layer = nnx.merge(graph, *layer_state)
            y = layer(x)
            return y, nnx.state(layer, nnx.All(nnx.Not(nnx.Param), nnx.Not(nnx.RngState)))

        x, rest = jax.lax.scan(jax.checkpoint(body) if self.remat else body, x, (params, rest))
        nnx.update(self.blocks, rest)
        return x


def kernels(blocks, axis):
    """Each block's (up, down) kernels and biases, as stacked on ``axis``."""
    return [tuple((jnp.take(l.kernel[...], i, axis=axis), jnp.take(l.bias[...], i, axis=axis))
                  for l in (blocks.up, blocks.down)) for i in range(L)]


def by_hand(blocks, x, axis, recipe):
    for (wu, bu), (wd, bd) in kernels(blocks, axis):
        h = jax.nn.relu(qdot_general(x, wu, DIMS, recipe) + bu)
        x = x + qdot_general(h, wd, DIMS, recipe) + bd
    return x


@pytest.mark.parametrize("axis", [0, 1])
def test_state_follows_the_scan_axis_in_the_metadata(axis):
    """A user's report: MaxText stacks parameters on param_scan_axis=1; fp4lab read the stack
    size off a kernel's leading axis (64) and the step failed with "scan got values with
    different leading axis sizes"."""
    x = jax.random.normal(jax.random.key(0), (4, D))
    m = quantize_model(HostScanned(nnx.Rngs(0), axis), "all:nvfp4")
    assert m.blocks.up.kernel[...].shape[axis] == L
    assert m.blocks.up.dot_general.sr_key[...].shape == (L, 2)
    assert m.blocks.up.dot_general.sr_count[...].shape == (L,)
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(m, x)),
                                  np.asarray(by_hand(m.blocks, x, axis, "nvfp4_no_sr")))


def test_a_stack_on_an_axis_its_metadata_does_not_name_is_refused():
    m = stacked_blocks(nnx.Rngs(0), axis=0)
    m.up.kernel = nnx.Param(jnp.moveaxis(m.up.kernel[...], 0, 1))  # stacked on 1, unsaid
    with pytest.raises(ValueError, match=r"Linear.kernel: shape \(32, 3, 64\) is not a stack "
                                         r"of \(32, 64\) along its leading axes.*param_scan_axis"):
        quantize_model(m, "all:nvfp4")


def grads(m, x, steps=2):
    """The up-projection's kernel gradient at each of ``steps`` training steps on the same
    batch and parameters (only the SR keys can differ)."""
    step = nnx.jit(lambda m: nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m).blocks.up.kernel[...])
    return [np.asarray(step(m)) for _ in range(steps)]


def test_sr_streams_advance_when_the_host_drops_rng_state():
    """A user's report: MaxText's layer scan writes back no RNG state, so every scanned block
    drew the same SR key at every step. The stream's counter is not RNG state: it advances;
    each block has its own stream; a rematerialized forward draws the key its forward did."""
    x = jax.random.normal(jax.random.key(0), (16, D))
    first, second = grads(quantize_model(HostScanned(nnx.Rngs(0)), "all:nvfp4"), x)
    assert not np.array_equal(first, second)  # the step's keys advanced
    m = quantize_model(HostScanned(nnx.Rngs(0)), "all:nvfp4")
    np.testing.assert_array_equal(grads(m, x, 1)[0], first)  # reproducible
    assert np.asarray(m.blocks.up.dot_general.sr_count[...]).tolist() == [1] * L
    remat = quantize_model(HostScanned(nnx.Rngs(0), remat=True), "all:nvfp4")
    r0, r1 = grads(remat, x)
    np.testing.assert_array_equal(r0, first)
    np.testing.assert_array_equal(r1, second)
    keys = np.asarray(m.blocks.down.dot_general.sr_key[...])
    assert len({tuple(k) for k in keys}) == L  # one stream per block


class WithHead(HostScanned):
    def __init__(self, rngs):
        super().__init__(rngs)
        self.head = nnx.Linear(D, 8, rngs=rngs)

    def __call__(self, x):
        return self.head(super().__call__(x))


def test_stacked_blocks_are_blocks_and_depth_rules_cannot_split_them():
    """Stacked layers have no block index in their path (``blocks/up``): they are the
    model's blocks, not layers outside them, and a depth rule that would give the stacked
    blocks different recipes is refused rather than applied to all."""
    m = quantize_model(WithHead(nnx.Rngs(0)), nemotron3(bf16_tail=0))
    assert m.blocks.up.dot_general.recipe.name == "nvfp4"  # in the blocks, not outside
    assert m.head.dot_general.recipe.name == "bf16"  # outside them
    with pytest.raises(ValueError, match=r"blocks/(up|down) is 3 blocks stacked for a scan.*"
                                         r"0: nvfp4, 1: nvfp4, 2: bf16.*scan_layers=False"):
        quantize_model(WithHead(nnx.Rngs(0)), "nemotron3")


class Projection(nnx.Module):
    """Another library's layer: its own kernel and one lax.dot_general (as MaxText's
    DenseGeneral)."""

    def __init__(self, rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (D, D)) / D ** 0.5)

    def __call__(self, x):
        return jax.lax.dot_general(x, self.kernel[...], DIMS)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([Projection(rngs) for _ in range(2)])

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


def test_a_registered_layer_type_is_governed_as_a_layer():
    x = jax.random.normal(jax.random.key(1), (4, D))
    register_layer(Projection, "densegeneral")
    try:
        policy = PrecisionPolicy(rules=(Rule(recipe="mxfp8", kind="densegeneral",
                                             depth=Depth(last=1)),), default="nvfp4_no_sr")
        m = quantize_model(Net(nnx.Rngs(0)), policy, x)
        assert linear_layers(m) == [("layers/0", "densegeneral"), ("layers/1", "densegeneral")]
        assert [a.recipe.name for a in explain(policy, m)] == ["nvfp4_no_sr", "mxfp8"]
        w0, w1 = (l.kernel[...] for l in m.layers)
        want = jax.nn.relu(qdot_general(jax.nn.relu(qdot_general(x, w0, DIMS, "nvfp4_no_sr")),
                                        w1, DIMS, "mxfp8"))
        np.testing.assert_array_equal(np.asarray(m(x)), np.asarray(want))
        with pytest.raises(ValueError, match="example inputs"):
            quantize_model(Net(nnx.Rngs(0)), "all:nvfp4")
        with pytest.raises(ValueError, match="not a layer kind"):
            register_layer(Projection, "lax.dot_general")
    finally:
        LAYER_CALLS.pop(Projection, None)


def test_the_model_records_what_each_gemm_got():
    from fp4lab.flax import assignments

    m = quantize_model(WithHead(nnx.Rngs(0)), nemotron3(bf16_tail=0))
    rows = {a.path: (a.stack, a.recipe.name) for a in assignments(m)}
    assert explain(nemotron3(bf16_tail=0), m) == assignments(m)  # explain reads the record
    assert rows == {"blocks/down": ((L,), "nvfp4"), "blocks/up": ((L,), "nvfp4"),
                    "head": ((), "bf16")}
    row = next(line.split() for line in str(assignments(m)).splitlines()
               if line.startswith("blocks/up"))
    assert row[:4] == ["blocks/up", "linear", f"0-{L - 1}", "nvfp4"]
    with pytest.raises(ValueError, match="not quantized by"):
        assignments(Block(nnx.Rngs(0)))


def test_probes_of_stacked_blocks_are_each_blocks_own_numerics():
    """quantize_model(probes=True): each stacked block's probe gradient holds the numerics of
    that block's operands, as its own GEMM measures them by hand; a host that overwrites the
    probes with their gradient (MaxText) reads the same records off the model."""
    from fp4lab import probe_table, probe_zeros
    from fp4lab.flax import probe_records
    from fp4lab.flax.nnx import QuantProbe

    x = jax.random.normal(jax.random.key(0), (16, D))
    m = quantize_model(HostScanned(nnx.Rngs(0), axis=1, remat=True), "all:nvfp4", probes=True)
    assert m.blocks.up.dot_general.probe[...].shape == (L, 6, len(METRIC_NAMES))
    diff = nnx.DiffState(0, nnx.Any(nnx.Param, QuantProbe))
    grads = nnx.jit(nnx.grad(lambda m: jnp.mean(m(x) ** 2), argnums=diff))(m)
    records = probe_records(m, grads)
    assert sorted(records) == [f"blocks/{n}[{i}]" for n in ("down", "up") for i in range(L)]

    def measured(a, w):  # one GEMM's forward operands, measured by hand
        probe = jax.grad(lambda p: jnp.sum(qdot_general(a, w, DIMS, "nvfp4_no_sr",
                                                        GemmState(probe=p))))
        table = probe_table(probe(probe_zeros()))
        return {op: table[op] for op in ("fprop_x", "fprop_w")}

    h = x
    for i, ((wu, bu), (wd, bd)) in enumerate(kernels(m.blocks, 1)):
        up = jax.nn.relu(qdot_general(h, wu, DIMS, "nvfp4_no_sr") + bu)
        for name, (a, w) in {"up": (h, wu), "down": (up, wd)}.items():
            record = records[f"blocks/{name}[{i}]"]
            assert {op: record[op] for op in ("fprop_x", "fprop_w")} == measured(a, w)
            assert all(np.isfinite(list(record[op].values())).sum() >= 5
                       for op in ("dgrad_dy", "wgrad_dy", "wgrad_x"))
        h = h + qdot_general(up, wd, DIMS, "nvfp4_no_sr") + bd
    assert records["blocks/up[0]"]["wgrad_dy"] != records["blocks/up[1]"]["wgrad_dy"]
    nnx.update(m, nnx.state(grads, QuantProbe))  # what MaxText's step does with them
    np.testing.assert_equal(probe_records(m), records)  # NaN (unquantized) equal to NaN


def test_a_probe_that_measured_nothing_says_nan():
    """An identity recipe on operands already of its dtype runs as written (exact, nothing
    to measure): its probe's gradient is zero, read as NaN (not measured), never as 0 % error;
    on float32 operands the same recipe rounds them, and that is measured."""
    from fp4lab.flax import probe_records
    from fp4lab.flax.nnx import QuantProbe

    policy = PrecisionPolicy(rules=(Rule(recipe="bf16", kind="lax.dot_general"),),
                             default="bf16")
    for dtype, measured in [(jnp.bfloat16, False), (jnp.float32, True)]:
        x = jax.random.normal(jax.random.key(0), (4, D), dtype)
        net = Net(nnx.Rngs(0))
        nnx.update(net, jax.tree.map(lambda v: v.astype(dtype), nnx.state(net, nnx.Param)))
        m = quantize_model(net, policy, x, probes=True)
        grads = nnx.grad(lambda m: jnp.sum(m(x)), argnums=nnx.DiffState(0, QuantProbe))(m)
        records = probe_records(m, grads)
        assert sorted(records) == ["layers/0/dot_general_0", "layers/1/dot_general_0"]
        sqnr = [r["fprop_x"]["sqnr_db"] for r in records.values()]
        assert np.all(np.isfinite(sqnr)) if measured else np.all(np.isnan(sqnr))
    with pytest.raises(ValueError, match="no probe gradient"):
        probe_records(m, nnx.state(m, nnx.Param))
