"""train.grad_reduce: the training step's gradients reduced explicitly over 8 replicas equal a
NumPy reduction of the replicas' own gradients (per parameter mode), the global token mean's
gradient when the replicas' masks differ, and a run trains."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from experiments.model import HybridLM
from experiments.step import GradReduce, make_grad_fn, model_config
from experiments.train import train
from fp4lab.flax import quantize_model

N = 8


def _fp32(xs):  # replica order, FP32
    out = xs[0].astype(np.float32)
    for t in xs[1:]:
        out = (out + t).astype(np.float32)
    return out


def _bf16_tree(xs):  # pairwise, a BF16 add (exact sum rounded once) at every node
    level = [x.astype(ml_dtypes.bfloat16) for x in xs]
    while len(level) > 1:
        nxt = [(a.astype(np.float64) + b.astype(np.float64)).astype(ml_dtypes.bfloat16)
               for a, b in zip(level[0::2], level[1::2], strict=False)]
        level = nxt + ([level[-1]] if len(level) % 2 else [])
    return level[0].astype(np.float32)


def test_the_step_reduces_the_replicas_gradients_as_its_modes_say(tiny, text):
    devices = jax.devices()[:N]
    assert len(devices) == N
    mesh = Mesh(np.array(devices), ("data",))
    tiny.model.pattern = "-"  # one MLP block (and the head): each reduction mode on its leaves
    model = HybridLM(model_config(tiny))
    b = text.batch(0, 0, N, tiny.data.seq_len)
    params = model.init(jax.random.key(0), jnp.asarray(b.tokens[:, :-1]))["params"]
    qm = quantize_model(model, "all:nvfp4")  # stochastic rounding: each replica its own key
    reduce = GradReduce("fp32", (("head/.*", "bf16_tree"),))
    fn = jax.jit(make_grad_fn(qm, 0.0, reduce, mesh, with_local=True))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))  # noqa: E731
    (loss, _), (grads, _), _, local = fn(params, {}, {}, put(b.tokens), put(b.weights),
                                      jax.random.key(3))
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    local_flat = jax.tree.leaves(local)
    assert len(flat) == len(local_flat)
    for (path, g), per_replica in zip(flat, local_flat, strict=True):
        name = "/".join(str(k.key) for k in path)
        xs = np.asarray(per_replica)
        assert xs.shape[0] == N
        want = (_bf16_tree(xs) if name.startswith("head/") else _fp32(xs)) / N
        np.testing.assert_array_equal(np.asarray(g), want, err_msg=name)
    assert not np.array_equal(np.asarray(local_flat[0][0]), np.asarray(local_flat[0][1]))
    assert np.isfinite(float(loss))


def test_unequal_masks_reduce_to_the_global_token_mean_gradient(tiny, text):
    """Replicas with different numbers of valid tokens (replica r keeps 4r + 1 of its 32,
    the MTP loss one fewer): the explicitly reduced loss and gradients are the global token
    mean's, as XLA's all-reduce of the global batch's gradient gives them (not the mean of
    the replicas' own means, which weighs replica 0's single token as much as replica 7's
    29)."""
    devices = jax.devices()[:N]
    mesh = Mesh(np.array(devices), ("data",))
    tiny.model.mtp, tiny.model.dtype = True, "float32"  # FP32 GEMMs: only the order differs
    model = HybridLM(model_config(tiny))
    b = text.batch(0, 0, N, tiny.data.seq_len)
    params = model.init(jax.random.key(0), jnp.asarray(b.tokens[:, :-1]))["params"]
    weights = (np.arange(b.weights.shape[1])[None, :]
               < 4 * np.arange(N)[:, None] + 1).astype(np.float32)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))  # noqa: E731
    args = (params, {}, {}, put(b.tokens), put(weights), jax.random.key(3))
    (loss, main), (grads, _), _ = jax.jit(make_grad_fn(model, 0.3, GradReduce("fp32"),
                                                       mesh))(*args)
    (want_loss, want_main), (want, _), _ = jax.jit(make_grad_fn(model, 0.3, None))(*args)
    np.testing.assert_allclose(float(main), float(want_main), rtol=2e-6)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=2e-6)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                            jax.tree.leaves(want), strict=True):
        scale = float(np.max(np.abs(np.asarray(w))))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5 * scale,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_a_run_with_bf16_reduction_of_the_head_trains_and_logs_mtp_survival(tiny, text,
                                                                           tmp_path):
    from experiments.records import read_jsonl

    tiny.precision.policy, tiny.probes.every, tiny.model.pattern = "bf16", 0, "-"
    tiny.model.mtp, tiny.model.mtp_tied_head, tiny.train.grad_survival = True, True, True
    tiny.train.grad_reduce, tiny.train.grad_reduce_rules = "fp32", (("head/.*", "bf16_ring"),)
    r = train(tiny, tmp_path / "run", data=text, progress=False)
    assert r["status"] == "ok" and r["final_train_loss"] < 5.5
    steps = [x for x in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in x]
    assert len(steps) == tiny.train.steps
    survival = [x["mtp_grad_survival"] for x in steps]
    error = [x["mtp_grad_error"] for x in steps]
    assert all(np.isfinite(survival)) and all(e > 1e-3 for e in error)  # BF16 loses some
    assert r["step_metric_means"]["mtp_grad_error"] == pytest.approx(np.mean(error))
    tiny.train.grad_survival, tiny.model.mtp_tied_head = True, False
    with pytest.raises(ValueError, match="mtp_tied_head=True"):
        train(tiny, tmp_path / "untied", data=text, progress=False)
    tiny.train.grad_survival = False
    tiny.probes.every = 6
    with pytest.raises(ValueError, match="set probes.every=0"):
        train(tiny, tmp_path / "probed", data=text, progress=False)
    tiny.probes.every, tiny.train.grad_reduce = 0, "bf16_zigzag"
    with pytest.raises(ValueError, match="unknown gradient-reduction mode 'bf16_zigzag'"):
        train(tiny, tmp_path / "bad", data=text, progress=False)
