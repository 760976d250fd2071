"""The hybrid LM's Mixture-of-Experts blocks (experiments/moe.py, ``E`` in the pattern):
routing against NumPy, the dispatch and combine as a permutation, the load-balancing loss and
its gradient, and the block in the model: parameter paths, causality, what ``nemotron3``
assigns to each of its GEMMs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4lab
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


def test_a_routing_bias_chooses_the_experts_but_does_not_weigh_them():
    """DeepSeek-V3's bias: the top-k of score + bias, weighted by the unbiased scores."""
    logits = np.random.default_rng(3).normal(size=(12, 6)).astype(np.float32)
    bias = np.asarray([0.3, -0.2, 0.0, 0.25, -0.4, 0.1], np.float32)
    weights, experts, _ = moe.route(jnp.asarray(logits), 2, "sigmoid", jnp.asarray(bias))
    s = 1 / (1 + np.exp(-logits))
    want = np.argsort(-(s + bias), axis=-1, kind="stable")[:, :2]
    np.testing.assert_array_equal(np.asarray(experts), want)
    assert (want != np.argsort(-s, axis=-1, kind="stable")[:, :2]).any()  # the bias chose
    top = np.take_along_axis(s, want, -1)
    np.testing.assert_allclose(np.asarray(weights), top / top.sum(-1, keepdims=True), rtol=1e-6)


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
    with pytest.raises(ValueError, match="moe_bias_rate=-0.001 must be >= 0"):
        ModelConfig(moe_bias_rate=-0.001)
    with pytest.raises(ValueError, match="dispatch format 'nvfp4' has a per-tensor scale"):
        ModelConfig(moe_dispatch="nvfp4")


def test_the_step_moves_each_routing_bias_towards_the_mean_load(tiny, text):
    """moe_bias_rate: after each training step each MoE block's router_bias has moved by
    rate * sign(mean load - load), the loads counted here in NumPy from the router's logits
    of the step's forward and the bias before it; the optimizer (AdamW, weight decay on)
    does not touch it; the step reports the most and least loaded experts' shares."""
    import flax.linen as nn

    from experiments.run_spec import specify
    from experiments.setup import build
    from experiments.step import make_step

    tiny.model.pattern, tiny.model.moe_experts, tiny.model.moe_router = "E-E", 4, "sigmoid"
    tiny.model.moe_bias_rate, tiny.train.weight_decay = 0.01, 0.1
    tiny.precision.policy, tiny.probes.every = "bf16", 0
    setup = build(specify(tiny, text))
    assert [f.name for f in setup.features] == ["expert_loads"]
    step = make_step(setup.qmodel, setup.tx, setup.sched, tiny.seed, 0.0, setup.features,
                     setup.modes(setup.qmodel, 0))
    state, rate = setup.state, np.float32(0.01)
    for t in range(3):
        b = text.batch(tiny.seed, t, tiny.data.batch_size, tiny.data.seq_len)
        params = jax.tree.map(np.asarray, state.params)
        _, inter = setup.qmodel.model.apply(  # the BF16 model: its router is float32 anyway
            {"params": params}, jnp.asarray(b.tokens[:, :-1]), mutable=["intermediates"],
            capture_intermediates=lambda m, _: isinstance(m, nn.Dense) and m.name == "router")
        state, metrics, _ = step(state, jnp.asarray(b.tokens), jnp.asarray(b.weights))
        shares, least = [], []
        for block in ("blocks_0", "blocks_2"):
            logits = np.asarray(inter["intermediates"][block]["moe"]["router"]["__call__"][0])
            bias = params[block]["moe"][moe.BIAS]
            scores = 1 / (1 + np.exp(-logits.reshape(-1, 4).astype(np.float64)))
            chosen = np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :2]
            load = np.bincount(chosen.reshape(-1), minlength=4)
            want = bias + rate * np.sign(load.mean() - load).astype(np.float32)
            got = np.asarray(state.params[block]["moe"][moe.BIAS])
            np.testing.assert_array_equal(got, want, err_msg=f"{block}, step {t}")
            shares.append(load.max() / load.mean())
            least.append(load.min() / load.mean())
        assert float(metrics["moe_load_max"]) == pytest.approx(np.mean(shares), rel=1e-6)
        assert float(metrics["moe_load_min"]) == pytest.approx(np.mean(least), rel=1e-6)
    assert np.abs(got).max() > rate  # moved more than once


E, K, T, D, F, DEVICES = 8, 2, 32, 64, 64, 4


def _layer(x, router, w_up, w_down, expert_fn_of):
    weights, experts, _ = moe.route(x.astype(jnp.float32) @ router, K, "softmax")
    return experts, weights, expert_fn_of(w_up, w_down)


def _experts(recipe, parallel):
    key = jax.random.key(9) if fp4lab.get_recipe(recipe).needs_key else None

    def of(w_up, w_down):
        first = jax.lax.axis_index("expert") * (E // DEVICES) if parallel else 0

        def fn(rows, sizes):
            keys = (None, None) if key is None else jax.random.split(key)
            h = fp4lab.qragged_dot(rows, w_up, sizes, recipe, keys[0], first_expert=first)
            return fp4lab.qragged_dot(jnp.square(jax.nn.relu(h)), w_down, sizes, recipe,
                                      keys[1], first_expert=first)
        return fn
    return of


def _moe_grads(recipe, dispatch_format=None, parallel=True):
    """The layer's output and gradients (x, router, up, down) of sum(y * c), on one device or
    with its experts over DEVICES devices (``expert_parallel``), and the program (lowered,
    compiled)."""
    from jax.sharding import Mesh, PartitionSpec as P

    from fp4lab.beyond.dispatch import dispatched

    rng = np.random.default_rng(4)
    args = (jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16),
            jnp.asarray(rng.normal(size=(D, E)), jnp.float32),
            jnp.asarray(rng.normal(size=(E, D, F)) / 8, jnp.bfloat16),
            jnp.asarray(rng.normal(size=(E, F, D)) / 8, jnp.bfloat16))
    c = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)

    def one(x, router, w_up, w_down):
        experts, weights, fn = _layer(x, router, w_up, w_down, _experts(recipe, False))
        rows, sizes, order = moe.dispatch(x, experts, E)
        rows = dispatched(rows, dispatch_format)  # what the all-to-all delivers
        return moe.combine(fn(rows, sizes), order, weights)

    def local(x, router, w_up, w_down):
        experts, weights, fn = _layer(x, router, w_up, w_down, _experts(recipe, True))
        return moe.expert_parallel(x, experts, weights, fn, E, "expert", dispatch_format)

    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("expert",))
    layer = jax.shard_map(local, mesh=mesh, in_specs=(P("expert"), P(), P("expert"),
                                                      P("expert")),
                          out_specs=P("expert")) if parallel else one

    def loss(*a):
        y = layer(*a)
        return jnp.sum(y * c), y

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, y), grads = f(*args)
    lowered = f.lower(*args)
    return y, grads, (lowered.as_text(), lowered.compile().as_text())


def _bits(a):
    a = np.asarray(a, np.float32)
    return a.view(np.uint32)


@pytest.mark.parametrize("recipe, dispatch", [("nvfp4", None), ("mxfp8", "mxfp4")])
def test_expert_parallel_equals_the_one_device_layer(recipe, dispatch):
    """Experts over 4 CPU devices (all-to-all dispatch and return): each expert gets the
    one-device layer's rows in the same order, so the output, dX and each expert's weight
    gradient are equal bit for bit (NVFP4: each expert's per-tensor scale is its own, and
    with ``first_expert`` each expert draws its SR bits as on one device); the router's
    gradient, a sum over every device's tokens, within float32 rounding. An MXFP4
    dispatch delivers what ``dispatched`` gives the one-device layer (the model's
    ``moe_dispatch``)."""
    (y1, g1, _), (yp, gp, hlo) = (_moe_grads(recipe, dispatch, parallel=p)
                                  for p in (False, True))
    np.testing.assert_array_equal(_bits(yp), _bits(y1))
    for name, a, b in zip(("dx", "drouter", "dup", "ddown"), gp, g1, strict=True):
        if name == "drouter":
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=name)
    from hlo import collectives, moving

    assert moving(collectives(hlo[1]))["all-to-all"] >= 4  # rows, outputs; forward, back


def test_an_mxfp8_dispatch_sends_about_half_the_bytes_and_changes_nothing_under_mxfp8():
    """MXFP8 rows on the wire (E4M3 elements, an E8M0 scale per 32; the backward in BF16):
    the program's forward all-to-alls send what fp4lab.beyond.dispatch.payload_bytes says
    less than BF16 rows. Under the mxfp8 recipe the experts quantize the rows they get to
    the same values (MX quantization is idempotent), so the output and dX equal the BF16
    dispatch's bit for bit, and the weight gradients nearly (their wgrad X operand is
    quantized along the tokens from rows already rounded to three mantissa bits: equal here,
    but not by construction); an MXFP4 dispatch changes the output."""
    from fp4lab.beyond.dispatch import payload_bytes
    from hlo import stablehlo_moved_bytes

    (y0, g0, hlo0), (y8, g8, hlo8) = (_moe_grads("mxfp8", f) for f in (None, "mxfp8"))
    np.testing.assert_array_equal(_bits(y8), _bits(y0))
    np.testing.assert_array_equal(_bits(g8[0]), _bits(g0[0]))
    for a, b in zip(g8[2:], g0[2:], strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2e-2, atol=1e-2)
    slots = DEVICES * (T // DEVICES) * K  # each device's send buffer: (DEVICES, T/P * k, D)
    saved = payload_bytes(slots, D, None) - payload_bytes(slots, D, "mxfp8")
    assert saved == slots * D - slots * D // 32  # 1 + 1/32 bytes a value, not 2
    assert stablehlo_moved_bytes(hlo0[0]) - stablehlo_moved_bytes(hlo8[0]) == saved
    y4, _, _ = _moe_grads("mxfp8", "mxfp4")
    assert not np.array_equal(_bits(y4), _bits(y0))
    with pytest.raises(ValueError, match="dispatch format 'nvfp4' has a per-tensor scale"):
        payload_bytes(4, 32, "nvfp4")


def test_the_hybrid_lm_trains_expert_parallel_with_the_one_device_numbers(tiny, text):
    """model.moe_parallel: the experts split over the 8 test devices (all-to-all dispatch and
    return in the compiled step; without it, none). Under NVFP4 with stochastic rounding the
    training loss's gradients equal the data-parallel run's bit for bit, the experts' also
    the one-device model's; three trainer steps give the same losses
    and loads, their parameters equal but for the rounding of the gradient's global norm
    (a sum over the devices' shards of the expert stacks, in another order)."""
    from hlo import collectives, moving

    from experiments.run_spec import specify
    from experiments.setup import build
    from experiments.step import make_loss, make_step

    tiny.model.pattern, tiny.model.moe_experts, tiny.probes.every = "E", 8, 0
    tiny.precision.policy = "nvfp4"
    runs = {}
    for parallel in (False, True):
        tiny.model.moe_parallel = parallel
        setup = build(specify(tiny, text))
        batches = [setup.place.put(text.batch(tiny.seed, t, tiny.data.batch_size,
                                              tiny.data.seq_len)) for t in range(3)]
        loss_fn = make_loss(setup.qmodel, 0.0)
        grads = jax.jit(jax.grad(lambda p, t, w: loss_fn(p, {}, {}, t, w, jax.random.key(3))[
            0]))(setup.state.params, *batches[0])
        step = make_step(setup.qmodel, setup.tx, setup.sched, tiny.seed, 0.0, setup.features,
                         setup.modes(setup.qmodel, 0))
        hlo = step.func.lower(setup.state, *batches[0], **step.keywords).compile().as_text()
        state, metrics, params0 = setup.state, [], jax.tree.map(np.asarray, setup.state.params)
        for tokens, weights in batches:
            state, m, _ = step(state, tokens, weights)
            metrics.append((float(m["loss"]), float(m["moe_load_max"])))
        runs[parallel] = (grads, hlo, metrics, jax.tree.map(np.asarray, state.params))
    (g1, hlo1, m1, p1), (gp, hlop, mp, pp) = runs[False], runs[True]
    assert moving(collectives(hlo1))["all-to-all"] == 0
    assert moving(collectives(hlop))["all-to-all"] >= 3  # rows, counts, outputs (and back)
    jax.tree.map(np.testing.assert_array_equal, g1, gp)
    assert m1 == mp and m1[0][1] > 1
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(
        a).max()), p1, pp)

    tokens, weights = (np.asarray(a) for a in batches[0])
    one = setup.qmodel.model.clone(cfg=dataclasses.replace(setup.qmodel.model.cfg,
                                                           moe_parallel=False))
    on_one = jax.device_put((params0, tokens, weights), jax.devices()[0])
    one_grads = jax.jit(jax.grad(lambda p, t, w: make_loss(
        dataclasses.replace(setup.qmodel, model=one), 0.0)(p, {}, {}, t, w, jax.random.key(3))[
            0]))(*on_one)
    experts = lambda g: g["blocks_0"]["moe"]["experts"]  # noqa: E731
    jax.tree.map(np.testing.assert_array_equal, experts(one_grads), experts(gp))


def test_expert_parallelism_refuses_what_it_cannot_run(tiny, text):
    from experiments.run_spec import specify

    tiny.model.pattern, tiny.model.moe_parallel = "E", True
    with pytest.raises(ValueError, match=r"model.moe_parallel=True .* probes.every=6"):
        specify(tiny, text)
    tiny.probes.every, tiny.model.moe_experts = 0, 6
    with pytest.raises(ValueError, match="model.moe_experts=6 is not divisible by the 8 "):
        specify(tiny, text)
