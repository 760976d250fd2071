"""fp4lab.flax: quantize_model on unmodified Linen and NNX models equals a hand-built twin."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from fp4lab.flax import QDense, QLinear, explain, linear_layers, quantize_model
from fp4lab.flax import linen as qlinen
from fp4lab.flax import nnx as qnnx
import fp4lab
from fp4lab.policy import PrecisionPolicy, Rule
from fp4lab import GemmState

HI = jax.lax.Precision.HIGHEST
POLICY = PrecisionPolicy(rules=(Rule(recipe="bf16", pattern="layers_1"),
                                Rule(recipe="mxfp8", pattern="layers_2")), default="nvfp4")


class LinenMLP(nn.Module):  # written without fp4lab
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = nn.Dense(32, name=f"layers_{i}")(x)
            x = nn.relu(x) if i < 2 else x
        return x


class LinenTwin(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i, r in enumerate(["nvfp4", "bf16", "mxfp8"]):
            x = QDense(32, recipe=r, name=f"layers_{i}")(x)
            x = nn.relu(x) if i < 2 else x
        return x


def test_linen_quantize_model_equals_twin_and_keeps_params():
    x = jax.random.normal(jax.random.key(0), (4, 8, 32))
    model = LinenMLP()
    params = model.init(jax.random.key(1), x)
    qm = quantize_model(model, POLICY)
    rngs = {"quant": jax.random.key(2)}
    f = lambda p, x: qm.apply(p, x, rngs=rngs).sum()  # noqa: E731
    y = qm.apply(params, x, rngs=rngs)
    want = LinenTwin().apply(params, x, rngs=rngs)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    assert not np.array_equal(np.asarray(y), np.asarray(model.apply(params, x)))
    assert jax.tree.structure(LinenTwin().init(jax.random.key(1), x)) == jax.tree.structure(params)
    g = jax.jit(jax.grad(f))(params, x)
    assert jax.tree.structure(g) == jax.tree.structure(params)
    with pytest.raises(ValueError, match="rngs=\\{'quant': key\\}"):
        qm.apply(params, x)
    assert [r.recipe.name for r in explain(POLICY, params)] == ["nvfp4", "bf16", "mxfp8"]
    with pytest.raises(TypeError, match="for a Flax model use fp4lab.flax.explain"):
        fp4lab.explain(POLICY, params)  # the core explains paths; fp4lab.flax explains models


class NNXMLP(nnx.Module):  # written without fp4lab
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(3)])

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = nnx.relu(x) if i < 2 else x
        return x


def test_nnx_quantize_model_equals_twin_and_keeps_params():
    x = jax.random.normal(jax.random.key(0), (4, 8, 32))
    model = NNXMLP(nnx.Rngs(0))
    before = nnx.state(model, nnx.Param)
    kernels = [m.kernel for m in model.layers]
    plain = model(x)
    policy = PrecisionPolicy(rules=(Rule(recipe="bf16", pattern="layers/1"),
                                    Rule(recipe="mxfp8", pattern="layers/2")),
                             default="nvfp4_no_sr")
    assert linear_layers(model) == [("layers/0", "linear"), ("layers/1", "linear"),
                                    ("layers/2", "linear")]
    assert quantize_model(model, policy) is model
    assert [m.dot_general.recipe.name for m in model.layers] == ["nvfp4_no_sr", "bf16", "mxfp8"]
    assert all(m.kernel is k for m, k in zip(model.layers, kernels, strict=True))  # the same Param objects
    after = nnx.state(model, nnx.Param)
    assert jax.tree.structure(after) == jax.tree.structure(before)
    y = model(x)
    twin, rngs = NNXMLP(nnx.Rngs(0)), nnx.Rngs(0)  # the same parameter draws, in order
    twin.layers = nnx.List([QLinear(32, 32, recipe=r, rngs=rngs)
                            for r in ["nvfp4_no_sr", "bf16", "mxfp8"]])
    np.testing.assert_array_equal(np.asarray(y), np.asarray(twin(x)))
    assert not np.array_equal(np.asarray(y), np.asarray(plain))
    grads = nnx.grad(lambda m: m(x).sum())(model)
    assert jax.tree.structure(grads) == jax.tree.structure(after)
    with pytest.raises(TypeError, match="Linen or NNX"):
        quantize_model(object(), policy)


# ---------------------------------------------------------------- general layers and einsums


class LinenAttention(nn.Module):  # written without fp4lab: DenseGeneral and Einsum layers
    @nn.compact
    def __call__(self, x):
        qkv = nn.DenseGeneral((3, 4, 8), name="qkv")(x)  # (b, s, 3, heads, head_dim)
        q, k, v = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
        a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8 ** 0.5)
        o = jnp.einsum("bhqk,bkhd->bqhd", a, v)
        o = nn.DenseGeneral(32, axis=(-2, -1), name="out")(o)
        return nn.Einsum((32, 16), "bsd,df->bsf", name="mlp")(o)


class LinenAttentionTwin(nn.Module):
    recipes: tuple = ("nvfp4", "mxfp8", "fp8_hybrid")

    @nn.compact
    def __call__(self, x):
        r = self.recipes
        qkv = qlinen.QDenseGeneral((3, 4, 8), recipe=r[0], name="qkv")(x)
        q, k, v = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
        a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8 ** 0.5)
        o = jnp.einsum("bhqk,bkhd->bqhd", a, v)
        o = qlinen.QDenseGeneral(32, axis=(-2, -1), recipe=r[1], name="out")(o)
        return qlinen.QEinsum((32, 16), "bsd,df->bsf", recipe=r[2], name="mlp")(o)


def test_linen_dense_general_and_einsum_are_intercepted():
    x = jax.random.normal(jax.random.key(0), (2, 16, 32))
    policy = PrecisionPolicy(rules=(Rule(recipe="mxfp8", pattern="out"),
                                    Rule(recipe="fp8_hybrid", kind="einsum")), default="nvfp4")
    model = LinenAttention()
    params = model.init(jax.random.key(1), x)
    qm = quantize_model(model, policy)
    assert qm.layers(params, x) == [("qkv", "densegeneral"), ("out", "densegeneral"),
                                    ("mlp", "einsum")]
    assert [a.recipe.name for a in qm.explain(params, x, strict=True)] == [
        "nvfp4", "mxfp8", "fp8_hybrid"]
    rngs = {"quant": jax.random.key(2)}
    twin = LinenAttentionTwin()
    assert jax.tree.structure(twin.init(jax.random.key(1), x)) == jax.tree.structure(params)
    np.testing.assert_array_equal(np.asarray(qm.apply(params, x, rngs=rngs)),
                                  np.asarray(twin.apply(params, x, rngs=rngs)))
    loss = lambda f: lambda p: (f(p, x, rngs=rngs) ** 2).sum()  # noqa: E731
    g, gt = jax.grad(loss(qm.apply))(params), jax.grad(loss(twin.apply))(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gt), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the unquantized model differs, and bf16 everywhere is a plain bf16 model
    assert not np.array_equal(np.asarray(qm.apply(params, x, rngs=rngs)),
                              np.asarray(model.apply(params, x)))


def test_linen_einsum_keeps_input_as_x_and_kernel_as_w():
    # the kernel (W) is quantized in 16x16 tiles by nvfp4: a transposed spec must not swap roles
    x = jax.random.normal(jax.random.key(0), (4, 32))
    layer = qlinen.QEinsum((16, 32), "bd,fd->bf", recipe="nvfp4_no_sr", use_bias=False)
    params = layer.init(jax.random.key(1), x)
    w = params["params"]["kernel"]
    want = jnp.einsum("bd,fd->bf", fp4lab.fake_quant(x, "nvfp4"),
                      fp4lab.fake_quant(w, "nvfp4", tile=(16, 16)), precision=HI)
    np.testing.assert_allclose(np.asarray(layer.apply(params, x)), np.asarray(want),
                               rtol=1e-6, atol=1e-6)


class NNXGeneral(nnx.Module):  # written without fp4lab
    def __init__(self, rngs):
        self.qkv = nnx.LinearGeneral(32, (3, 4, 8), rngs=rngs)
        self.mlp = nnx.Einsum("bsd,df->bsf", (96, 16), (16,), rngs=rngs)

    def __call__(self, x):
        return self.mlp(self.qkv(x).reshape(x.shape[:-1] + (96,)))


def test_nnx_linear_general_and_einsum_are_quantized_and_draw_fresh_keys():
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    model = quantize_model(NNXGeneral(nnx.Rngs(0)), "all:nvfp4", seed=3)
    assert linear_layers(model) == [("mlp", "einsum"), ("qkv", "lineargeneral")]
    assert isinstance(model.mlp.einsum_op, qnnx.QuantEinsum)
    twin, rngs = NNXGeneral(nnx.Rngs(0)), nnx.Rngs(0)
    twin.qkv = qnnx.QLinearGeneral(32, (3, 4, 8), recipe="nvfp4_no_sr", rngs=rngs)
    twin.mlp = qnnx.QEinsum("bsd,df->bsf", (96, 16), (16,), recipe="nvfp4_no_sr", rngs=rngs)
    # nvfp4's forward GEMM has no SR, so it equals the no-SR twin
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(twin(x)))

    @nnx.jit
    def grads(m):
        return nnx.grad(lambda m: (m(x) ** 2).sum())(m)

    g1, g2 = grads(model), grads(model)  # SR keys advance: gradients differ call to call
    assert not np.array_equal(np.asarray(g1.qkv.kernel[...]), np.asarray(g2.qkv.kernel[...]))
    again = quantize_model(NNXGeneral(nnx.Rngs(0)), "all:nvfp4", seed=3)
    again(x)  # the same calls in the same order draw the same keys
    np.testing.assert_array_equal(np.asarray(grads(again).qkv.kernel[...]),
                                  np.asarray(g1.qkv.kernel[...]))  # reproducible from the seed


# ---------------------------------------------------------------- scan, remat, sharding


class Block(nn.Module):
    dense: type = nn.Dense

    @nn.compact
    def __call__(self, x, _):
        h = nn.relu(self.dense(64, name="up")(x))
        return x + self.dense(32, name="down")(h), None


def scanned(dense):
    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            body = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                           split_rngs={"params": True, "quant": True}, length=3)
            return body(dense=dense, name="blocks")(x, None)[0]

    return Stack()


def test_linen_scan_and_remat_equal_the_twin_and_every_block_draws_its_own_key():
    x = jax.random.normal(jax.random.key(0), (4, 8, 32))
    model = scanned(nn.Dense)
    params = model.init(jax.random.key(1), x)
    assert params["params"]["blocks"]["up"]["kernel"].shape == (3, 32, 64)
    qm = quantize_model(model, "all:nvfp4")
    twin = scanned(functools.partial(QDense, recipe="nvfp4"))
    rngs = {"quant": jax.random.key(5)}
    loss = lambda f: lambda p: (f(p, x, rngs=rngs) ** 2).sum()  # noqa: E731
    grad = jax.jit(jax.grad(loss(qm.apply)))
    g = grad(params)
    gt = jax.jit(jax.grad(loss(twin.apply)))(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gt), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # with all blocks' weights equal, per-block SR keys still give per-block gradients
    same = jax.tree.map(lambda p: jnp.broadcast_to(p[:1], p.shape), params)
    gs = grad(same)["params"]["blocks"]["up"]["kernel"]
    assert not np.array_equal(np.asarray(gs[0]), np.asarray(gs[1]))


def test_linen_sharded_parameters_give_the_unsharded_result():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    x = jax.random.normal(jax.random.key(0), (8, 8, 32))
    model = LinenMLP()
    params = model.init(jax.random.key(1), x)
    qm = quantize_model(model, "all:mxfp8")
    f = jax.jit(lambda p, x: qm.apply(p, x))
    want = f(params, x)
    sharded = jax.tree.map(lambda p: jax.device_put(p, NamedSharding(
        mesh, P(None, "model") if p.ndim == 2 else P("model"))), params)
    got = f(sharded, jax.device_put(x, NamedSharding(mesh, P("data"))))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_linen_probes_collect_every_layers_gemm_numerics():
    from fp4lab.numerics.metrics import METRIC_NAMES, quant_metrics

    x = jax.random.normal(jax.random.key(0), (4, 8, 32))
    model = LinenMLP()
    params = model.init(jax.random.key(1), x)
    qm = quantize_model(model, "all:mxfp8")
    probes = qm.probe_zeros(params, x)
    assert set(probes) == {"layers_0", "layers_1", "layers_2"}

    def loss(params, probes):
        return (qm.apply({**params, "probes": probes}, x) ** 2).sum()

    g, gp = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, probes)
    g0 = jax.jit(jax.grad(loss))(params, jax.tree.map(lambda p: None, probes))  # no probes
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    w = params["params"]["layers_1"]["kernel"]
    want = quant_metrics(w[None], "mxfp8", axis=1)  # fprop W: blocks along K
    row = np.asarray(gp["layers_1"]["gemm"][1])
    np.testing.assert_array_equal(row, np.asarray([want[k] for k in METRIC_NAMES]))


def test_the_kernel_backend_through_quantize_model_gives_the_same_bits():
    x = jax.random.normal(jax.random.key(0), (4, 8, 32))
    model = LinenMLP()
    params = model.init(jax.random.key(1), x)
    outs = [quantize_model(model, "all:mxfp8", backend=b).apply(params, x)
            for b in ("xla", "pallas")]
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
    nnx_outs = [quantize_model(NNXMLP(nnx.Rngs(0)), "all:nvfp4_no_sr", backend=b)(x)
                for b in ("xla", "pallas")]
    np.testing.assert_array_equal(np.asarray(nnx_outs[0]), np.asarray(nnx_outs[1]))


def test_nnx_stochastic_rounding_is_seeded_by_the_models_rngs():
    def wgrad(**kw):
        model = NNXMLP(nnx.Rngs(0))
        quantize_model(model, "all:nvfp4", **kw)  # SR on the gradients
        g = nnx.grad(lambda m: (m(jnp.ones((4, 32))) ** 2).sum())(model)
        return np.asarray(jax.tree.leaves(nnx.state(g, nnx.Param))[0])

    np.testing.assert_array_equal(wgrad(rngs=nnx.Rngs(quant=5)), wgrad(rngs=nnx.Rngs(quant=5)))
    assert not np.array_equal(wgrad(rngs=nnx.Rngs(quant=5)), wgrad(rngs=nnx.Rngs(quant=6)))
    assert not np.array_equal(wgrad(seed=1), wgrad(seed=2))
    np.testing.assert_array_equal(wgrad(rngs=nnx.Rngs(7)), wgrad(rngs=nnx.Rngs(7)))  # default


class LinenEinsumMLP(nn.Module):  # written without fp4lab: a Dense and an Einsum (K = 4 x 16)
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(64, name="up")(x).reshape(x.shape[:-1] + (4, 16))
        return nn.Einsum((4, 16, 32), "bthk,hkn->btn", use_bias=False, name="down")(h)


def test_linen_outcontrol_collections():
    """OutControl through QuantizedLinen: a mutable "channel_norms" collection sums each
    GEMM's per-channel input norms (K flattened, in order: the Einsum's 4 x 16), an
    "outlier_channels" collection splits the GEMMs as GemmState(channels=) does, and
    neither leaves the recipe without the split, which is tetrajet_v2's."""
    model = LinenEinsumMLP()
    x = jax.random.normal(jax.random.key(0), (2, 8, 32)) * jnp.linspace(0.1, 4, 32)
    params = model.init(jax.random.key(1), x)
    qm = quantize_model(model, "all:tetrajet_v2_outcontrol")
    rngs = {"quant": jax.random.key(2)}
    y, upd = qm.apply(params, x, rngs=rngs, mutable=["channel_norms"])
    norms = upd["channel_norms"]
    np.testing.assert_allclose(norms["up"]["gemm"],
                               np.sqrt((np.asarray(x, np.float64) ** 2).sum(axis=(0, 1))),
                               rtol=1e-5)
    assert norms["down"]["gemm"].shape == (64,) and (norms["down"]["gemm"] > 0).all()
    _, again = qm.apply({**params, **upd}, x, rngs=rngs, mutable=["channel_norms"])
    np.testing.assert_allclose(again["channel_norms"]["up"]["gemm"], 2 * norms["up"]["gemm"],
                               rtol=1e-6)
    base = quantize_model(model, "all:tetrajet_v2").apply(params, x, rngs=rngs)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(base))
    order = jax.tree.map(fp4lab.features.outcontrol.channel_order, norms)
    split = qm.apply({**params, "outlier_channels": order}, x, rngs=rngs)
    assert not np.array_equal(np.asarray(split), np.asarray(y))
    # the Dense layer, by hand: its GEMM with the channels, plus its bias
    p = params["params"]["up"]
    want = fp4lab.qdot_general(x, p["kernel"], (((2,), (0,)), ((), ())),
                               "tetrajet_v2_outcontrol",
                               GemmState(key=jax.random.key(5), channels=order["up"]["gemm"])
                               ) + p["bias"]
    up_split = quantize_model(nn.Dense(64), "all:tetrajet_v2_outcontrol").apply(
        {"params": p, "outlier_channels": {"gemm": order["up"]["gemm"]}}, x,
        rngs={"quant": jax.random.key(5)})
    # (its forward rounds to nearest: the layer's key, drawn from its rng stream, is not used)
    np.testing.assert_array_equal(np.asarray(up_split), np.asarray(want))


def test_nnx_refuses_outcontrol():
    with pytest.raises(ValueError, match="OutControl.*NNX"):
        QLinear(32, 16, recipe="tetrajet_v2_outcontrol", rngs=nnx.Rngs(0))
