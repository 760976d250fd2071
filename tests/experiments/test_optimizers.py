"""experiments.optimizers: which parameters Muon takes, the per-head qkv split against a NumPy
Newton-Schulz oracle, the inner AdamW, the momentum dtype, bad settings
(a Muon run learns and resumes: test_train.py's end-to-end resume)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

from experiments.model import HybridLM
from experiments.optimizers import make_optimizer, muon_partition
from experiments.step import model_config

COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, optax's "standard"


def _params(tiny, mtp=False):
    cfg = dataclasses.replace(model_config(tiny), mtp=mtp)
    return HybridLM(cfg).init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))["params"]


def _paths(tree, keep):
    flat = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))[0]
    return sorted("/".join(str(k.key) for k in p) for p, v in flat if keep(v))


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tiny):
    params = _params(tiny, mtp=True)
    muon = _paths(muon_partition(params), lambda v: v is not None)
    assert muon == [
        "blocks_0/mamba/in_proj/kernel", "blocks_0/mamba/out_proj/kernel",
        "blocks_1/attention/out/kernel", "blocks_1/attention/qkv/kernel",
        "blocks_2/mlp/down/kernel", "blocks_2/mlp/up/kernel",
        "mtp_block/mlp/down/kernel", "mtp_block/mlp/up/kernel", "mtp_proj/kernel"]
    adamw = _paths(muon_partition(params), lambda v: v is None)
    for name in ("embed/embedding", "head/kernel", "mtp_head/kernel", "final_norm/scale",
                 "blocks_0/mamba/conv_kernel", "blocks_0/mamba/A_log", "blocks_0/norm/scale"):
        assert name in adamw


def _newton_schulz(m):
    """Independent float64 oracle of Muon's orthogonalization of one [fan_in, fan_out]
    matrix: Frobenius-normalize, five quintic steps on the wide orientation."""
    x = m.T if m.shape[0] > m.shape[1] else m
    x = x / (np.linalg.norm(x) + 1e-8)
    a, b, c = COEFFS
    for _ in range(5):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if m.shape[0] > m.shape[1] else x


def _first_update(tiny, params, grads, **muon):
    t = tiny.train.copy_and_resolve_references()
    t.optimizer, t.warmup, t.clip, t.weight_decay, t.lr = "muon", 0, 1e9, 0.0, 0.01
    t.muon.update(muon)
    tx, sched = make_optimizer(t, num_heads=tiny.model.num_heads)
    assert float(sched(0)) == pytest.approx(0.01)
    updates, state = tx.update(grads, tx.init(params), params)
    return updates, state


def test_the_qkv_kernel_is_orthogonalized_per_head_and_the_rest_per_matrix(tiny):
    params = _params(tiny)
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(p.size), p.shape), params)
    updates, _ = _first_update(tiny, params, grads)
    beta, lr = 0.95, 0.01
    nesterov = 1 + beta / (1 + beta)  # the first step's bias-corrected Nesterov momentum
    g = np.asarray(grads["blocks_1"]["attention"]["qkv"]["kernel"], np.float64)
    d, heads = g.shape[0], tiny.model.num_heads
    k = d // heads
    u = np.asarray(updates["blocks_1"]["attention"]["qkv"]["kernel"])
    g4, u4 = g.reshape(d, 3, heads, k), u.reshape(d, 3, heads, k)
    for j in range(3):  # q, k, v
        for h in range(heads):
            want = -lr * 0.2 * np.sqrt(max(d, k)) * _newton_schulz(nesterov * g4[:, j, h])
            np.testing.assert_allclose(u4[:, j, h], want, rtol=0, atol=2e-6)
    whole = -lr * 0.2 * np.sqrt(3 * d) * _newton_schulz(nesterov * g)
    assert np.abs(u - whole).max() > 100 * 2e-6  # the split is not the whole matrix's
    up = np.asarray(grads["blocks_2"]["mlp"]["up"]["kernel"], np.float64)
    want = -lr * 0.2 * np.sqrt(max(up.shape)) * _newton_schulz(nesterov * up)
    np.testing.assert_allclose(np.asarray(updates["blocks_2"]["mlp"]["up"]["kernel"]), want,
                               rtol=0, atol=2e-6)
    # the head: the inner AdamW's first step (Nesterov, as optax runs it inside Muon)
    b1 = tiny.train.b1  # the first step's bias-corrected second moment is g^2 for any b2
    gh = np.asarray(grads["head"]["kernel"], np.float64)
    m_hat = (b1 / (1 + b1) + 1) * gh
    want = -lr * m_hat / (np.sqrt(gh ** 2) + 1e-8)
    np.testing.assert_allclose(np.asarray(updates["head"]["kernel"]), want, rtol=1e-5)
    assert updates["blocks_1"]["attention"]["qkv"]["kernel"].shape == g.shape
    # without the split: the whole [D, 3D] matrix, as optax does by default
    unsplit, _ = _first_update(tiny, params, grads, split_qkv_heads=False)
    np.testing.assert_allclose(np.asarray(unsplit["blocks_1"]["attention"]["qkv"]["kernel"]),
                               whole, rtol=0, atol=2e-6)


def test_momentum_dtype_and_newton_schulz_settings(tiny):
    params = _params(tiny)
    grads = jax.tree.map(jnp.ones_like, params)
    _, state = _first_update(tiny, params, grads, mu_dtype="bfloat16")
    from optax.contrib import MuonState

    muon_states = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
        x, MuonState)) if isinstance(x, MuonState)]
    assert len(muon_states) == 1
    assert {x.dtype for x in jax.tree.leaves(muon_states[0].mu)} == {jnp.dtype(jnp.bfloat16)}
    # the inner AdamW's first moment too; its second moment stays FP32
    adam_mu = [s.mu for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
        x, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState)]
    assert {x.dtype for x in jax.tree.leaves(adam_mu)} == {jnp.dtype(jnp.bfloat16)}
    one, _ = _first_update(tiny, params, grads, ns_steps=1, ns_coeffs=(1.5, -0.5, 0.0))
    g = np.ones(params["blocks_2"]["mlp"]["up"]["kernel"].shape)  # rank one: one cubic step
    x = g / np.linalg.norm(g)
    x = 1.5 * x - 0.5 * x @ x.T @ x
    want = -0.01 * 0.2 * np.sqrt(max(g.shape)) * x
    np.testing.assert_allclose(np.asarray(one["blocks_2"]["mlp"]["up"]["kernel"]), want,
                               atol=1e-6)


def test_bad_optimizer_settings_are_named(tiny):
    t = tiny.train.copy_and_resolve_references()
    t.optimizer = "sgd"
    with pytest.raises(ValueError, match="train.optimizer='sgd'"):
        make_optimizer(t)
    t.optimizer = "muon"
    for key, value, error in (("ns_coeffs", (1.0, 2.0), "ns_coeffs"),
                              ("ns_steps", 0, "ns_steps=0")):
        bad = t.copy_and_resolve_references()
        bad.muon[key] = value
        with pytest.raises(ValueError, match=error):
            make_optimizer(bad)
