"""Linen blocks scanned by ``nn.scan`` (parameters stacked by ``variable_axes={"params": 0}``):
each block draws its own stochastic-rounding keys, a new ``rngs={"quant": key}`` gives new
ones, a rematerialized block draws the keys its forward drew, and a scan that does not pass
the "quant" rng into its blocks is refused rather than run with correlated noise. Calls inside
scanned blocks have the names of the unscanned model, per-block state (probes, amax histories)
is stacked as the parameters are, and rules that would split the stacked blocks are refused."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import fp4lab
from fp4lab.flax import QDense, quantize_model
from fp4lab.numerics.metrics import METRIC_NAMES

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
    assert all(not np.array_equal(a, b) for a, b in zip(step0, step1, strict=True))
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


# ----------------------------------------------------------------------------- the cases
# nn.scan traces its body twice (once for the shapes of its outputs); calls inside a scanned
# block were named by a counter that ran on through both traces, so `explain` listed
# einsum_0..einsum_3 for two einsums, a rule for einsum_0 changed nothing and one for einsum_2
# (a name the unscanned model does not have) changed the output.

from fp4lab.policy import PrecisionPolicy, Rule, nemotron3  # noqa: E402


class Attend(nn.Module):  # two jnp.einsum calls: scores, then weights times values
    @nn.compact
    def __call__(self, x, _):
        q = nn.Dense(D, name="q")(x)
        s = jnp.einsum("td,sd->ts", q, x)
        return x + jnp.einsum("ts,sd->td", jax.nn.softmax(s), x), None


def scanned(block, axes=None, **kw):
    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            body = nn.scan(block, variable_axes=axes or {"params": 0},
                           split_rngs={"params": True, "quant": True}, length=L, **kw)
            return nn.Dense(4, name="head")(body(name="blocks")(x, None)[0])

    return Stack()


def einsum_rule(pattern, recipe="nvfp4_no_sr"):
    return PrecisionPolicy(rules=(Rule(recipe=recipe, pattern=pattern, kind="jnp.einsum"),),
                           default="fp32")


def test_scanned_calls_have_the_names_of_the_unscanned_model_and_their_rules_apply():
    x = jax.random.normal(jax.random.key(1), (8, D))
    model = scanned(Attend)
    params = model.init(jax.random.key(0), x)
    table = quantize_model(model, einsum_rule("blocks/einsum_0")).explain(params, x)
    assert [(a.path, a.stack) for a in table] == [
        ("blocks/q", (L,)), ("blocks/einsum_0", (L,)), ("blocks/einsum_1", (L,)),
        ("head", ())]
    assert [a.recipe and a.recipe.name for a in table] == ["fp32", "nvfp4_no_sr", None, "fp32"]
    assert re.search(r"blocks/einsum_0 +jnp.einsum +0-2 +nvfp4_no_sr", str(table))

    class HandQuantized(nn.Module):  # the same block with the rule's einsum written by hand
        @nn.compact
        def __call__(self, x, _):
            q = nn.Dense(D, name="q")(x)
            s = fp4lab.qeinsum("td,sd->ts", q, x, "nvfp4_no_sr")
            return x + jnp.einsum("ts,sd->td", jax.nn.softmax(s), x), None

    want = scanned(HandQuantized).apply(params, x)
    got = quantize_model(model, einsum_rule("blocks/einsum_0")).apply(params, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(np.asarray(got), np.asarray(model.apply(params, x)))
    # a name the model does not have governs nothing, and says so
    with pytest.warns(fp4lab.policy.PolicyWarning, match=r"rules matched no layer.*blocks/einsum_2"):
        out = quantize_model(model, einsum_rule("blocks/einsum_2")).apply(params, x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(model.apply(params, x)))


def test_flax_attention_inside_a_scan_answers_to_the_docs_pattern():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=D)(x), None

    x = jax.random.normal(jax.random.key(1), (2, 8, D))
    model = scanned(Block)
    params = model.init(jax.random.key(0), x)
    qm = quantize_model(model, einsum_rule(r".*Attention_0/einsum_0"))
    rows = {a.path: a for a in qm.explain(params, x)}
    ops = sorted(p for p in rows if "einsum" in p)
    assert ops == ["blocks/MultiHeadDotProductAttention_0/einsum_0",
                   "blocks/MultiHeadDotProductAttention_0/einsum_1"]
    assert rows[ops[0]].recipe.name == "nvfp4_no_sr" and rows[ops[1]].recipe is None
    assert not np.array_equal(np.asarray(qm.apply(params, x)),
                              np.asarray(quantize_model(model, "all:fp32").apply(params, x)))


def test_a_shared_module_called_twice_meets_the_same_names():
    """Names are places in a module's code: a second call of the same module (weights
    shared) is governed by the same rule, as its parameters are shared."""
    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            attend = Attend(name="attend")
            return attend(attend(x, None)[0], None)[0]

    x = jax.random.normal(jax.random.key(1), (8, D))
    params = Twice().init(jax.random.key(0), x)
    table = quantize_model(Twice(), einsum_rule("attend/einsum_1")).explain(params, x)
    assert [a.path for a in table] == ["attend/q", "attend/einsum_0", "attend/einsum_1"]


def test_probes_of_scanned_blocks_are_stacked_one_per_block():
    """The docs' scan with variable_axes={"params": 0} gave one unstacked probe per scanned
    GEMM, which the blocks never saw: its gradient was exactly zero (0 % underflow, 0 dB)."""
    x = jax.random.normal(jax.random.key(1), (16, D))
    rngs = {"quant": jax.random.key(2)}
    model = scanned(Block, {"params": 0, "probes": 0})
    params = model.init(jax.random.key(0), x)
    qm = quantize_model(model, "all:nvfp4")
    probes = qm.probe_zeros(params, x)
    assert jax.tree.map(jnp.shape, probes) == {"blocks": {"mlp": {"gemm": (L, 6, len(METRIC_NAMES))}},
                                               "head": {"gemm": (6, len(METRIC_NAMES))}}
    grad = jax.grad(lambda p: qm.apply({**params, "probes": p}, x, rngs=rngs).sum())(probes)
    blocks = [fp4lab.probe_table(g) for g in grad["blocks"]["mlp"]["gemm"]]
    for table in blocks:  # NVFP4 of a Gaussian-like input flushes a few percent
        assert 0.005 < table["fprop_x"]["underflow"] < 0.2 and table["fprop_x"]["sqnr_db"] > 10
    # block 0 sees the model's input: its forward X is measured exactly as quant_metrics does
    want = fp4lab.quant_metrics(nn.relu(x), "nvfp4")
    assert blocks[0]["fprop_x"]["underflow"] == pytest.approx(float(want["underflow"]))
    # the docs' scan without "probes" in variable_axes is refused, in one sentence, at
    # probe_zeros and at apply (a collection built for another model included)
    bare = scanned(Block)
    fix = (r"blocks/mlp's probe: nn.scan at blocks stacks the blocks' parameters "
           r"\(variable_axes 'params': 0\) but not the 'probes' collection, so its blocks "
           r"would not get one each; add 'probes': 0 to its variable_axes")
    with pytest.raises(ValueError, match=fix):
        quantize_model(bare, "all:nvfp4").probe_zeros(params, x)
    with pytest.raises(ValueError, match=fix):
        quantize_model(bare, "all:nvfp4").apply({**params, "probes": probes}, x, rngs=rngs)
    unstacked = {"blocks": {"mlp": {"gemm": fp4lab.probe_zeros()}}, "head": probes["head"]}
    n = len(METRIC_NAMES)
    with pytest.raises(ValueError, match=rf"blocks/mlp's probe has shape \({n},\) here, not "
                                         rf"\(6, {n}\): build the 'probes' collection with "
                                         r"QuantizedLinen.probe_zeros"):
        qm.apply({**params, "probes": unstacked}, x, rngs=rngs)
    with pytest.raises(ValueError, match=r"head: the 'probes' collection passed to apply has "
                                         r"no probe for it"):
        qm.apply({**params, "probes": {"blocks": probes["blocks"]}}, x, rngs=rngs)


def test_delayed_scaling_under_a_scan_keeps_one_history_per_block():
    """fp8_delayed under nn.scan refused with "pass its amax history", which the user had."""
    x = jax.random.normal(jax.random.key(1), (16, D))
    model = scanned(Block, {"params": 0, "amax_history": 0})
    params = model.init(jax.random.key(0), x)
    qm = quantize_model(model, "all:fp8_delayed")
    history = qm.history_init(params, x)
    assert jax.tree.map(jnp.shape, history)["blocks"]["mlp"]["gemm"] == (L, 6, 1024)
    grad = jax.grad(lambda h: qm.apply({**params, "amax_history": h}, x).sum())(history)
    seen = np.asarray(grad["blocks"]["mlp"]["gemm"][:, 0, 0])  # each block's fprop X amax
    assert seen[0] == pytest.approx(float(jnp.abs(nn.relu(x)).max()))
    assert len(set(seen.tolist())) == L  # one history per block, each its own amax
    with pytest.raises(ValueError, match=r"blocks/mlp's amax history: nn.scan at blocks "
                                         r".*add 'amax_history': 0 to its variable_axes"):
        quantize_model(scanned(Block), "all:fp8_delayed").history_init(params, x)


def test_a_depth_rule_that_would_split_scanned_blocks_is_refused():
    """nemotron3's BF16 tail under nn.scan only warned (with advice, block=, that changed
    nothing) and trained every block in NVFP4; NNX and MaxText refuse it."""
    x = jax.random.normal(jax.random.key(1), (8, D))
    model = scanned(Block)
    params = model.init(jax.random.key(0), x)
    for call in (lambda qm: qm.apply(params, x, rngs={"quant": jax.random.key(2)}),
                 lambda qm: qm.explain(params, x)):
        with pytest.raises(ValueError, match=r"policy nemotron3: blocks/mlp is 3 blocks stacked "
                                             r"for a scan.*\(0: nvfp4, 1: nvfp4, 2: bf16\); "
                                             r"unstack the blocks \(a Python loop"):
            call(quantize_model(model, "nemotron3"))
    # without the tail the blocks run one recipe, and the head outside them is found as such
    table = quantize_model(model, nemotron3(bf16_tail=0)).explain(params, x)
    assert {a.path: (a.recipe.name, a.stack) for a in table} == {
        "blocks/mlp": ("nvfp4", (L,)), "head": ("bf16", ())}
    assert table[1].rule == 0  # "outside the blocks"
