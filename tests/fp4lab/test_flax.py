"""fp4lab.flax: quantize_model on unmodified Linen and NNX models equals a hand-built twin."""

import jax
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from fp4lab.flax import QDense, QLinear, linear_layers, quantize_model
from fp4lab.policy import PrecisionPolicy, Rule, explain

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
    plain = model(x)
    policy = PrecisionPolicy(rules=(Rule(recipe="bf16", pattern="layers/1"),
                                    Rule(recipe="mxfp8", pattern="layers/2")),
                             default="nvfp4_no_sr")
    assert [p for p, _ in linear_layers(model)] == ["layers/0", "layers/1", "layers/2"]
    quantize_model(model, policy)
    assert all(isinstance(m, QLinear) for m in model.layers)
    after = nnx.state(model, nnx.Param)
    assert jax.tree.structure(after) == jax.tree.structure(before)
    y = model(x)
    twin = NNXMLP(nnx.Rngs(0))
    twin.layers = nnx.List([QLinear.from_linear(m, r, 0) for m, r in zip(
        twin.layers, [model.layers[0].recipe, model.layers[1].recipe, model.layers[2].recipe])])
    np.testing.assert_array_equal(np.asarray(y), np.asarray(twin(x)))
    assert not np.array_equal(np.asarray(y), np.asarray(plain))
    grads = nnx.grad(lambda m: m(x).sum())(model)
    assert jax.tree.structure(grads) == jax.tree.structure(after)
    with pytest.raises(TypeError, match="Linen or NNX"):
        quantize_model(object(), policy)
