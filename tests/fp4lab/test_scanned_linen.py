"""Linen blocks scanned by ``nn.scan`` (parameters stacked by ``variable_axes={"params": 0}``):
each block draws its own stochastic-rounding keys, a new ``rngs={"quant": key}`` gives new
ones, a rematerialized block draws the keys its forward drew, and a scan that does not pass
the "quant" rng into its blocks is refused rather than run with correlated noise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from fp4lab.flax import QDense, quantize_model

L, D = 3, 16


class Block(nn.Module):  # written without fp4lab
    dense: type = nn.Dense

    @nn.compact
    def __call__(self, x, _):
        return x + self.dense(D, name="mlp")(nn.relu(x)), None


def stack(split_rngs, remat=False, dense=nn.Dense):
    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            body = nn.scan(nn.remat(Block) if remat else Block, variable_axes={"params": 0},
                           split_rngs=split_rngs, length=L)
            return body(dense, name="blocks")(x, None)[0]

    return Stack()


SPLIT = {"params": True, "quant": True}


def kernel_grad(model, params, x, key):
    """The stacked kernel's gradient: one row per block."""
    loss = lambda p: (quantize_model(model, "all:nvfp4").apply(  # noqa: E731
        p, x, rngs={"quant": key}) ** 2).sum()
    return np.asarray(jax.jit(jax.grad(loss))(params)["params"]["blocks"]["mlp"]["kernel"])


def equal_blocks(model, x):
    """Parameters with every block's equal, so only the SR keys tell the blocks apart."""
    params = model.init(jax.random.key(0), x)
    return jax.tree.map(lambda p: jnp.broadcast_to(p[:1], p.shape), params)


def test_split_quant_rng_gives_each_block_and_each_step_its_own_keys():
    x = jax.random.normal(jax.random.key(1), (8, D))
    model = stack(SPLIT)
    params = equal_blocks(model, x)
    step0 = kernel_grad(model, params, x, jax.random.key(2))
    assert len({g.tobytes() for g in step0}) == L  # distinct keys per block
    step1 = kernel_grad(model, params, x, jax.random.key(3))  # the next step's key
    assert all(not np.array_equal(a, b) for a, b in zip(step0, step1))
    np.testing.assert_array_equal(kernel_grad(model, params, x, jax.random.key(2)), step0)


def test_a_rematerialized_block_draws_the_keys_its_forward_drew():
    x = jax.random.normal(jax.random.key(1), (8, D))
    params = equal_blocks(stack(SPLIT), x)
    key = jax.random.key(2)
    np.testing.assert_array_equal(kernel_grad(stack(SPLIT, remat=True), params, x, key),
                                  kernel_grad(stack(SPLIT), params, x, key))


@pytest.mark.parametrize("remat", [False, True])
def test_a_scan_that_does_not_pass_the_quant_rng_is_refused(remat):
    """The issue's scan, split_rngs={"params": True}: Linen passes the blocks no "quant" rng
    at all, and the error told the user to pass one to apply, which they had."""
    x = jax.random.normal(jax.random.key(1), (8, D))
    model = stack({"params": True}, remat)
    params = model.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"blocks/mlp uses recipe nvfp4.*does not reach it.*"
                                         r"split_rngs=\{\.\.\., 'quant': True\}"):
        quantize_model(model, "all:nvfp4").apply(params, x, rngs={"quant": jax.random.key(2)})
    with pytest.raises(ValueError, match=r"blocks/mlp .*: pass rngs=\{'quant': key\} to apply"):
        quantize_model(model, "all:nvfp4").apply(params, x)


@pytest.mark.parametrize("remat", [False, True])
def test_a_scan_that_broadcasts_the_quant_rng_is_refused(remat):
    """split_rngs={"quant": False} hands every block the same key: the blocks' rounding noise
    would be one noise, silently; it is refused. A policy without stochastic rounding runs."""
    x = jax.random.normal(jax.random.key(1), (8, D))
    model = stack({"params": True, "quant": False}, remat)
    params = model.init(jax.random.key(0), x)
    rngs = {"quant": jax.random.key(2)}
    with pytest.raises(ValueError, match=r"blocks/mlp uses recipe nvfp4.*nn.scan at blocks gives "
                                         r"every iteration the same 'quant' rng.*'quant': True"):
        quantize_model(model, "all:nvfp4").apply(params, x, rngs=rngs)
    quantize_model(model, "all:nvfp4_no_sr").apply(params, x, rngs=rngs)
    with pytest.raises(ValueError, match=r"same 'quant' rng"):  # True: False broadcasts all
        quantize_model(stack({True: False}), "all:nvfp4").apply(params, x, rngs=rngs)
    qdense = stack({"params": True, "quant": False}, remat, lambda *a, **k: QDense(
        *a, recipe="nvfp4", **k))  # fp4lab's own layer, without quantize_model
    with pytest.raises(ValueError, match=r"nn.scan at blocks gives every iteration the same"):
        qdense.apply(params, x, rngs=rngs)


def test_a_vmap_that_broadcasts_the_quant_rng_is_refused():
    class Ensemble(nn.Module):
        @nn.compact
        def __call__(self, x):
            body = nn.vmap(Block, variable_axes={"params": 0}, in_axes=(None, None),
                           split_rngs={"params": True, "quant": False}, axis_size=L)
            return body(name="members")(x, None)[0]

    x = jax.random.normal(jax.random.key(1), (8, D))
    params = Ensemble().init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"members/mlp .*nn.vmap at members gives every"):
        quantize_model(Ensemble(), "all:nvfp4").apply(params, x, rngs={"quant": jax.random.key(2)})
