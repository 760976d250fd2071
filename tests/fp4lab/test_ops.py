"""Quantizing the jnp.einsum / lax.dot_general calls inside Linen modules (attention's score
and value products, custom code), named by module path and call, as qwix intercepts them."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from fp4lab.flax import quantize_model
from fp4lab.policy import PolicyWarning, PrecisionPolicy, Rule
from fp4lab.qdot import probe_table, qdot_general, qeinsum


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
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gw)):
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
