"""The hybrid LM's Mixture-of-Experts blocks (experiments/moe.py, ``E`` in the pattern):
routing against NumPy, the dispatch and combine as a permutation, the load-balancing loss and
its gradient, and the block in the model: parameter paths, causality, what ``nemotron3``
assigns to each of its GEMMs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import moe
from experiments.model import HybridLM, ModelConfig
from fp4lab.flax import quantize_model

CFG = ModelConfig(pattern="E*", d_model=32, num_heads=2, moe_experts=4, moe_top_k=2,
                  moe_shared=True, moe_latent=16)


@pytest.mark.parametrize("score", moe.ROUTER_SCORES)
def test_route_is_the_top_k_of_the_scores_normalized(score):
    logits = np.random.default_rng(0).normal(size=(10, 5)).astype(np.float32)
    weights, experts, probs = moe.route(jnp.asarray(logits), 3, score)
    s = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True) if score == "softmax" else \
        1 / (1 + np.exp(-logits))
    want = np.argsort(-s, axis=-1, kind="stable")[:, :3]
    np.testing.assert_array_equal(np.asarray(experts), want)
    top = np.take_along_axis(s, want, -1)
    np.testing.assert_allclose(np.asarray(weights), top / top.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(probs), s / s.sum(-1, keepdims=True), rtol=1e-6)
    with pytest.raises(ValueError, match="router score 'relu'"):
        moe.route(jnp.asarray(logits), 3, "relu")


def test_dispatch_sorts_rows_by_expert_and_combine_undoes_it():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(7, 3)), jnp.float32)
    experts = jnp.asarray([[2, 0], [1, 2], [0, 3], [3, 1], [2, 1], [0, 2], [1, 0]])
    rows, sizes, order = moe.dispatch(x, experts, 5)
    np.testing.assert_array_equal(np.asarray(sizes), [4, 4, 4, 2, 0])  # expert 4: none
    owner = np.asarray(experts).reshape(-1)[np.asarray(order)]
    assert (np.diff(owner) >= 0).all()  # sorted by expert
    np.testing.assert_array_equal(np.asarray(rows), np.repeat(np.asarray(x), 2, 0)[order])
    weights = jnp.asarray(rng.uniform(size=(7, 2)), jnp.float32)
    y = moe.combine(rows * 2.0, order, weights)
    np.testing.assert_allclose(np.asarray(y), 2 * np.asarray(x) * np.asarray(
        weights).sum(-1, keepdims=True), rtol=1e-6)


def test_balance_loss_is_one_when_even_and_its_gradient_enters_the_backward_only():
    even = jnp.asarray([[0, 1], [2, 3], [1, 0], [3, 2]])
    assert float(moe.balance_loss(jnp.full((4, 4), 0.25), even)) == pytest.approx(1.0)
    skewed = jnp.asarray([[0, 1]] * 4)
    assert float(moe.balance_loss(jnp.full((4, 4), 0.25), skewed)) == pytest.approx(1.0)
    probs = jax.nn.softmax(jnp.asarray([[3.0, 0, 0, 0]] * 4))
    assert float(moe.balance_loss(probs, skewed)) > 1.5  # load and scores both on expert 0

    logits = jnp.asarray(np.random.default_rng(2).normal(size=(6, 4)), jnp.float32)
    x = jnp.arange(3.0)

    def aux(lg):
        _, experts, probs = moe.route(lg, 2, "softmax")
        return moe.balance_loss(probs, experts)

    def loss(lg, x):
        return jnp.sum(moe.with_aux_loss(x, aux(lg), 0.25) ** 2)

    value, (g_logits, g_x) = jax.value_and_grad(loss, argnums=(0, 1))(logits, x)
    assert float(value) == float(jnp.sum(x ** 2))  # the forward is x's alone
    np.testing.assert_allclose(np.asarray(g_logits), 0.25 * np.asarray(jax.grad(aux)(logits)),
                               rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(g_x), 2 * np.asarray(x))


def test_the_moe_block_in_the_model():
    model = HybridLM(CFG)
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 256)
    params = model.init(jax.random.key(1), tokens)
    p = params["params"]["blocks_0"]["moe"]
    assert jax.tree.map(jnp.shape, p) == {
        "router": {"kernel": (32, 4)}, "latent_down": {"kernel": (32, 16)},
        "experts": {"up": (4, 16, 64), "down": (4, 64, 16)},  # 4 * 32 / top-2
        "latent_up": {"kernel": (16, 32)},
        "shared_expert": {"up": {"kernel": (32, 64)}, "down": {"kernel": (64, 32)}}}
    f = jax.jit(model.apply)
    base, _ = f(params, tokens)
    for t in (5,):  # routing is per token: a later token never changes an earlier one
        out, _ = f(params, tokens.at[:, t].set((tokens[:, t] + 1) % 256))
        np.testing.assert_array_equal(np.asarray(out[:, :t]), np.asarray(base[:, :t]))

    rows = {a.path: a for a in quantize_model(model, "nemotron3").explain(params, tokens)}
    assert rows["blocks_0/moe/router"].recipe is None  # float32, as written
    assert rows["blocks_0/moe/latent_down"].recipe.name == "bf16"
    for gemm in ("experts/ragged_dot_0", "experts/ragged_dot_1", "shared_expert/up"):
        assert rows[f"blocks_0/moe/{gemm}"].recipe.name == "nvfp4", gemm


def test_bad_moe_configs():
    with pytest.raises(ValueError, match=r"moe_top_k=5 must lie in \[1, moe_experts=4\]"):
        ModelConfig(moe_experts=4, moe_top_k=5)
    with pytest.raises(ValueError, match="moe_router='relu'"):
        ModelConfig(moe_router="relu")
    with pytest.raises(ValueError, match="moe_latent=-1"):
        ModelConfig(moe_latent=-1)
