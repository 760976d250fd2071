"""Quantizing the jnp.einsum / lax.dot_general calls inside Linen and NNX modules (attention's
score and value products, custom code), named by module path and call, as qwix intercepts
them."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from fp4lab.flax import linear_layers, op_calls, quantize_model
from fp4lab.flax.nnx import AmaxHistory, update_amax_history
from fp4lab.policy import OP_KINDS, PolicyWarning, PrecisionPolicy, Rule, explain
from fp4lab.features.probes import probe_table
from fp4lab.gemm.qdot import qdot_general, qeinsum


class Model(nn.Module):  # written without fp4lab
    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32)(x, x)
        return Mix()(x)


class Mix(nn.Module):  # custom code: a raw dot_general between two activations
    @nn.compact
    def __call__(self, x):
        gate = nn.Dense(32)(x)
        return jax.lax.dot_general(x, gate, (((2,), (2,)), ((0,), (0,))))


OPS = PrecisionPolicy(rules=(
    Rule(recipe="fp8_hybrid", kind="jnp.einsum",
         pattern=r".*MultiHeadDotProductAttention_0/einsum_\d"),
    Rule(recipe="mxfp8", kind="lax.dot_general", pattern=r"Mix_0/dot_general_0"),
), default="bf16", name="ops")


def data():
    x = jax.random.normal(jax.random.key(0), (2, 16, 32))
    return x, Model().init(jax.random.key(1), x)


def test_attention_products_and_custom_dot_generals_follow_op_rules():
    x, params = data()
    qm = quantize_model(Model(), OPS)
    t = {a.path: (a.kind, a.recipe.name) for a in qm.explain(params, x)}
    mha = "MultiHeadDotProductAttention_0"
    assert t[f"{mha}/einsum_0"] == ("jnp.einsum", "fp8_hybrid")  # q . k scores
    assert t[f"{mha}/einsum_1"] == ("jnp.einsum", "fp8_hybrid")  # weights . v
    assert t["Mix_0/dot_general_0"] == ("lax.dot_general", "mxfp8")
    assert t[f"{mha}/query"] == ("densegeneral", "bf16")  # layers keep the layer rules
    got = qm.apply(params, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(by_hand(params["params"], x)))
    g = jax.grad(lambda p: jnp.sum(qm.apply(p, x) ** 2))(params)
    gw = jax.grad(lambda p: jnp.sum(by_hand(p["params"], x) ** 2))(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gw), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and it is not the unquantized model
    assert not np.array_equal(np.asarray(got), np.asarray(quantize_model(
        Model(), "all:bf16").apply(params, x)))


def by_hand(p, x):
    """The model with the same GEMMs written out: bf16 layers, the attention products in
    fp8_hybrid (query plays X, key W; weights X, values W), Mix's product in mxfp8."""
    def dense(v, pp, dims):
        return qdot_general(v, pp["kernel"], dims, "bf16") + pp["bias"]

    a = p["MultiHeadDotProductAttention_0"]
    q, k, v = (dense(x, a[n], (((2,), (0,)), ((), ()))) for n in ("query", "key", "value"))
    w = jax.nn.softmax(qeinsum("...qhd,...khd->...hqk", q / jnp.sqrt(16.0), k, "fp8_hybrid"))
    o = qeinsum("...hqk,...khd->...qhd", w, v, "fp8_hybrid")
    x = x + dense(o, a["out"], (((2, 3), (0, 1)), ((), ())))
    gate = dense(x, p["Mix_0"]["Dense_0"], (((2,), (0,)), ((), ())))
    return qdot_general(x, gate, (((2,), (2,)), ((0,), (0,))), "mxfp8")


def test_without_op_rules_calls_are_untouched():
    x, params = data()
    plain = Model().apply(params, x)
    assert jax.lax.dot_general is not None
    layers_only = PrecisionPolicy(rules=(Rule(recipe="bf16", pattern="never"),), default="fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyWarning)
        y = quantize_model(Model(), layers_only).apply(params, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(plain), rtol=1e-5, atol=1e-5)
    assert jnp.einsum.__module__.startswith("jax")  # restored after apply


def test_op_probes_and_unmatched_op_rules():
    x, params = data()
    qm = quantize_model(Model(), OPS)
    probes = qm.probe_zeros(params, x)
    mha = probes["MultiHeadDotProductAttention_0"]
    assert {"einsum_0", "einsum_1", "query"} <= set(mha) and "dot_general_0" in probes["Mix_0"]

    def loss(pr):
        return jnp.sum(qm.apply({**params, "probes": pr}, x) ** 2)

    g = jax.grad(loss)(probes)
    scores = probe_table(g["MultiHeadDotProductAttention_0"]["einsum_0"])
    assert 0 <= scores["fprop_x"]["underflow"] < 1 and np.isfinite(scores["fprop_w"]["sqnr_db"])
    typo = PrecisionPolicy(rules=(Rule(recipe="fp8_hybrid", kind="jnp.einsum",
                                       pattern=".*Atention_0/einsum_0"),), name="typo")
    with pytest.warns(PolicyWarning, match="Atention"):
        quantize_model(Model(), typo).apply(params, x)


def test_explain_lists_calls_no_op_rule_quantizes():
    x, params = data()
    scores_only = PrecisionPolicy(rules=(Rule(recipe="fp8_hybrid", kind="jnp.einsum",
                                              pattern=r".*/einsum_0"),), name="scores")
    t = quantize_model(Model(), scores_only).explain(params, x)
    row = {a.path: a for a in t}
    assert row["MultiHeadDotProductAttention_0/einsum_0"].recipe.name == "fp8_hybrid"
    assert row["MultiHeadDotProductAttention_0/einsum_1"].recipe is None
    assert "einsum_1  jnp.einsum" in str(t) and "not quantized" in str(t)


# ----------------------------------------------------------------------------- NNX


class SelfAttention(nnx.Module):  # written without fp4lab: attention as research code has it
    def __init__(self, rngs):
        self.qkv = nnx.Linear(32, 96, rngs=rngs)
        self.out = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, x):
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        w = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / jnp.sqrt(32.0))
        return self.out(jnp.einsum("bqk,bkd->bqd", w, v))


class NNXMix(nnx.Module):
    def __init__(self, rngs):
        self.gate = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, x):
        return jax.lax.dot_general(x, self.gate(x), (((2,), (2,)), ((0,), (0,))))


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([SelfAttention(rngs) for _ in range(2)])
        self.mix = NNXMix(rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.mix(x)


NNX_OPS = PrecisionPolicy(rules=(
    Rule(recipe="fp8_hybrid", kind="jnp.einsum", pattern=r"blocks/\d/einsum_\d"),
    Rule(recipe="mxfp8", kind="lax.dot_general", pattern=r"mix/dot_general_0"),
), default="bf16", name="nnx ops")


def nnx_by_hand(m, x, scores="fp8_hybrid", mix="mxfp8"):
    """NNXModel with the same GEMMs written out (bf16 layers; query/weights play X)."""
    def dense(v, layer):
        return qdot_general(v, layer.kernel[...], (((2,), (0,)), ((), ())), "bf16") + \
            layer.bias[...]

    for b in m.blocks:
        q, k, v = jnp.split(dense(x, b.qkv), 3, axis=-1)
        w = jax.nn.softmax(qeinsum("bqd,bkd->bqk", q, k, scores) / jnp.sqrt(32.0))
        x = x + dense(qeinsum("bqk,bkd->bqd", w, v, scores), b.out)
    return qdot_general(x, dense(x, m.mix.gate), (((2,), (2,)), ((0,), (0,))), mix)


def nnx_data():
    return jax.random.normal(jax.random.key(0), (2, 8, 32)), NNXModel(nnx.Rngs(0))


def test_nnx_calls_inside_modules_follow_op_rules():
    x, m = nnx_data()
    before = jax.tree.map(np.asarray, nnx.state(m, nnx.Param))
    plain = np.asarray(m(x))
    qm = quantize_model(m, NNX_OPS, x)
    assert qm is m and isinstance(m, NNXModel) and type(m).__name__ == "NNXModel"
    jax.tree.map(np.testing.assert_array_equal, before,
                 jax.tree.map(np.asarray, nnx.state(m, nnx.Param)))  # params untouched
    t = {p: k for p, k in linear_layers(m)}
    assert t["blocks/1/einsum_1"] == "jnp.einsum" and t["mix/dot_general_0"] == \
        "lax.dot_general" and t["blocks/0/qkv"] == "linear"
    want = np.asarray(nnx_by_hand(m, x))
    np.testing.assert_array_equal(np.asarray(m(x)), want)
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(m, x)), want)
    assert not np.array_equal(want, plain)
    g = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m)
    gw = nnx.grad(lambda m: jnp.sum(nnx_by_hand(m, x) ** 2))(m)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 nnx.state(g, nnx.Param), nnx.state(gw, nnx.Param))
    assert jnp.einsum.__module__.startswith("jax")  # restored after the call


class TwoEntries(NNXModel):  # the model's body behind another method too
    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.mix(x)


def test_nnx_calls_are_quantized_whatever_method_runs_them():
    """A user's report: ``m.forward(x)`` (the body of ``__call__``) and a submodule called
    directly ran the attention products unquantized while the Linear layers stayed
    quantized, a plausible-looking output equal to a layers-only model's."""
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    m = quantize_model(TwoEntries(nnx.Rngs(0)), NNX_OPS, x)
    block = m.blocks[0]
    y = block(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(nnx_by_hand_block(block, x)))
    assert not np.array_equal(np.asarray(y), np.asarray(
        nnx_by_hand_block(block, x, scores=None)))
    want = np.asarray(nnx_by_hand(m, x))
    np.testing.assert_array_equal(np.asarray(m.forward(x)), want)
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m.forward(x))(m, x)), want)
    np.testing.assert_array_equal(np.asarray(m.mix(x)), np.asarray(qdot_general(
        x, qdot_general(x, m.mix.gate.kernel[...], (((2,), (0,)), ((), ())), "bf16")
        + m.mix.gate.bias[...], (((2,), (2,)), ((0,), (0,))), "mxfp8")))


def test_nnx_quantized_again_drops_the_old_calls():
    """A user's report: quantizing with an op rule, then with ``all:bf16``, kept the old
    MXFP4 attention products (and ``linear_layers`` listed them)."""
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    mx = PrecisionPolicy(rules=(Rule(recipe="mxfp4", kind="jnp.einsum", pattern=".*"),),
                         name="mx")
    m = quantize_model(NNXModel(nnx.Rngs(0)), mx, x)
    assert any(k == "jnp.einsum" for _, k in linear_layers(m))
    quantize_model(m, "all:bf16")
    fresh = quantize_model(NNXModel(nnx.Rngs(0)), "all:bf16")
    assert [k for _, k in linear_layers(m) if k in OP_KINDS] == []
    assert type(m.blocks[0]) is SelfAttention  # classes restored; the model itself guards
    assert type(m).__bases__ == (NNXModel,)  # (no example inputs: a ragged_dot is refused)
    np.testing.assert_array_equal(np.asarray(m(x)), np.asarray(fresh(x)))


def nnx_by_hand_block(b, x, scores="fp8_hybrid"):
    def product(spec, u, v):
        return jnp.einsum(spec, u, v) if scores is None else qeinsum(spec, u, v, scores)

    q, k, v = jnp.split(qdot_general(x, b.qkv.kernel[...], (((2,), (0,)), ((), ())), "bf16")
                        + b.qkv.bias[...], 3, axis=-1)
    w = jax.nn.softmax(product("bqd,bkd->bqk", q, k) / jnp.sqrt(32.0))
    o = product("bqk,bkd->bqd", w, v)
    return qdot_general(o, b.out.kernel[...], (((2,), (0,)), ((), ())), "bf16") + \
        b.out.bias[...]


def test_nnx_op_calls_explain_and_errors():
    x, m = nnx_data()
    calls = op_calls(m, jax.ShapeDtypeStruct(x.shape, x.dtype))  # values do not matter
    assert calls == [("blocks/0/einsum_0", "jnp.einsum"), ("blocks/0/einsum_1", "jnp.einsum"),
                     ("blocks/1/einsum_0", "jnp.einsum"), ("blocks/1/einsum_1", "jnp.einsum"),
                     ("mix/dot_general_0", "lax.dot_general")]
    scores = PrecisionPolicy(rules=(Rule(recipe="fp8_hybrid", kind="jnp.einsum",
                                         pattern=r".*/einsum_0"),), name="scores")
    t = explain(scores, linear_layers(m) + calls)
    assert {a.path: a.recipe for a in t}["blocks/0/einsum_1"] is None
    assert "not quantized" in str(t)
    with pytest.raises(ValueError, match=r"'/.*/einsum_0/ kind=jnp.einsum'.*needs example inputs"):
        quantize_model(m, scores)
    with pytest.raises(ValueError, match="Linen model"):
        quantize_model(Model(), scores, x)
    with pytest.warns(PolicyWarning, match="Atention"):
        quantize_model(m, PrecisionPolicy(rules=(Rule(
            recipe="fp8_hybrid", kind="jnp.einsum", pattern=".*Atention"),), name="typo"), x)
    # quantizing again finds the calls afresh: the typo policy left no op installed
    assert [k for _, k in linear_layers(m) if k in OP_KINDS] == []
    np.testing.assert_array_equal(np.asarray(quantize_model(m, NNX_OPS, x)(x)),
                                  np.asarray(nnx_by_hand(m, x)))


@pytest.mark.parametrize("policy", ["all:nvfp4", NNX_OPS])
def test_nnx_example_inputs_the_model_cannot_take_are_refused(policy):
    """Example inputs are run (abstractly) whether or not the policy needs them to find calls:
    a wrong feature size was accepted silently where no op rule looked at it."""
    x, m = nnx_data()
    with pytest.raises(ValueError, match=r"quantize_model: NNXModel does not run on the "
                                         r"example inputs \(shapes \(2, 8, 31\)\): .*31"):
        quantize_model(m, policy, jnp.ones((2, 8, 31)))
    quantize_model(m, policy, x)  # the right size still goes through


def test_nnx_op_streams_and_histories():
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    sr = PrecisionPolicy(rules=(Rule(recipe="nvfp4", kind="jnp.einsum",
                                     pattern=r".*einsum_1"),), default="bf16", name="sr")

    def run(**kw):  # nvfp4 rounds gradients stochastically: two steps' gradients
        m = quantize_model(NNXModel(nnx.Rngs(0)), sr, x, **kw)
        return [np.asarray(nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m).blocks[0].qkv.kernel[...])
                for _ in range(2)]

    first, second = run(seed=1)
    assert not np.array_equal(first, second)  # each call draws a fresh SR key
    np.testing.assert_array_equal(run(seed=1)[0], first)  # stable across constructions
    assert not np.array_equal(run(seed=2)[0], first)
    np.testing.assert_array_equal(run(rngs=nnx.Rngs(quant=4))[0],
                                  run(rngs=nnx.Rngs(quant=4))[0])
    delayed = PrecisionPolicy(rules=(Rule(recipe="fp8_delayed", kind="lax.dot_general",
                                          pattern="mix/dot_general_0"),), name="delayed")
    m = quantize_model(NNXModel(nnx.Rngs(0)), delayed, x)
    h0 = np.asarray(m.mix.fp4lab_ops["dot_general_0"].amax_history[...])
    diff = nnx.DiffState(0, nnx.Any(nnx.Param, AmaxHistory))
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2), argnums=diff)(m)
    update_amax_history(m, grads)
    h1 = np.asarray(m.mix.fp4lab_ops["dot_general_0"].amax_history[...])
    assert not np.array_equal(h0, h1) and np.all(h1[:, 0] > 0)  # this step's amaxes rolled in


class ScannedModel(nnx.Module):  # blocks stacked by nnx.vmap, run by nnx.scan
    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return SelfAttention(rngs)

        self.blocks = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return x + block(x)

        return body(x, self.blocks)


def test_nnx_scanned_blocks_get_stacked_hooks_and_ops():
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    m = ScannedModel(nnx.Rngs(0))
    assert op_calls(m, x) == [("blocks/einsum_0", "jnp.einsum"),
                              ("blocks/einsum_1", "jnp.einsum")]
    policy = PrecisionPolicy(rules=(Rule(recipe="fp8_hybrid", kind="jnp.einsum",
                                         pattern=r"blocks/einsum_\d"),),
                             default="nvfp4", name="scanned")
    quantize_model(m, policy, x)
    keys = m.blocks.qkv.dot_general.sr_key[...]  # one SR stream per stacked block
    assert keys.shape == (3, 2) and len({tuple(np.asarray(k)) for k in keys}) == 3
    assert m.blocks.fp4lab_ops["einsum_0"].sr_key[...].shape == (3, 2)
    b = m.blocks

    def by_hand(x):
        def block(x, p):
            qkv, out = p
            q, k, v = jnp.split(qdot_general(x, qkv[0], (((2,), (0,)), ((), ())), "nvfp4_no_sr")
                                + qkv[1], 3, axis=-1)
            w = jax.nn.softmax(qeinsum("bqd,bkd->bqk", q, k, "fp8_hybrid") / jnp.sqrt(32.0))
            o = qeinsum("bqk,bkd->bqd", w, v, "fp8_hybrid")
            return x + qdot_general(o, out[0], (((2,), (0,)), ((), ())), "nvfp4_no_sr") + \
                out[1], None

        params = ((b.qkv.kernel[...], b.qkv.bias[...]), (b.out.kernel[...], b.out.bias[...]))
        return jax.lax.scan(block, x, params)[0]

    # the forward pass rounds to nearest (nvfp4's SR is on gradients only)
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(m, x)),
                                  np.asarray(jax.jit(by_hand)(x)))


class Matmul(nnx.Module):  # a GEMM fp4lab cannot see: `@`
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 32)))

    def __call__(self, x):
        return x @ self.w[...]


class ThreeOperands(nnx.Module):  # an einsum no two-operand rule can take
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 32)))

    def __call__(self, x):
        return jnp.einsum("bqd,de,bke->bqk", x, self.w[...], x)


class LinenMatmul(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x @ self.param("w", nn.initializers.normal(), (32, 32))


def test_a_policy_that_governs_nothing_says_so():
    """A user's report: a model whose only GEMM is ``x @ self.w`` under ``all:nvfp4``, an op
    rule on such a model, or a three-operand einsum with the rule's pattern elsewhere, stayed
    unquantized without a word."""
    x = jnp.ones((2, 8, 32))
    dot_rule = PrecisionPolicy(rules=(Rule(recipe="nvfp4", kind="lax.dot_general"),),
                               name="dots")
    elsewhere = PrecisionPolicy(rules=(Rule(recipe="nvfp4", kind="jnp.einsum",
                                            pattern="attention/.*"),), name="elsewhere")
    cases = [(Matmul, "all:nvfp4", "no GEMM to govern.*x @ w"),
             (Matmul, dot_rule, "no GEMM.*rules matched no layer: '/.\\*/ kind=lax.dot_general'"),
             (ThreeOperands, elsewhere, "rules matched no layer: '/attention/.\\*/")]
    for model, policy, match in cases:
        with pytest.warns(PolicyWarning, match=match):
            quantize_model(model(nnx.Rngs(0)), policy, x)
        with pytest.raises(ValueError, match=match):
            quantize_model(model(nnx.Rngs(0)), policy, x, strict=True)
    params = LinenMatmul().init(jax.random.key(0), x)
    with pytest.warns(PolicyWarning, match="no GEMM to govern"):
        quantize_model(LinenMatmul(), "all:nvfp4").apply(params, x)
    with warnings.catch_warnings():  # a model with GEMMs is not warned about
        warnings.simplefilter("error", PolicyWarning)
        quantize_model(NNXModel(nnx.Rngs(0)), "all:nvfp4")
