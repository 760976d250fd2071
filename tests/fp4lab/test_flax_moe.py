"""Mixture-of-Experts models written without fp4lab (Linen and NNX: a float32 router, a top-k
dropless dispatch through ``jax.lax.ragged_dot``, experts in a latent width, a shared expert)
under ``quantize_model``: the expert stacks' ``ragged_dot`` calls follow the policy (its
default and rules, as layers do), ``explain`` lists them, the router stays as written unless a
rule names it, and the quantized model computes what the same model with its ``ragged_dot``
calls replaced by ``fp4lab.qragged_dot`` computes, gradients included."""

from __future__ import annotations

import contextlib
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp4lab
from fp4lab.flax import assignments, quantize_model
from fp4lab.policy import PolicyWarning, Rule, nemotron3

E, TOP_K, D, LATENT, HIDDEN, T = 4, 2, 32, 32, 64, 24


def _dispatch(x, logits, top_k, experts):
    """Top-k routing of the rows of ``x``: the rows sorted by expert, the group sizes, the
    order (to put them back) and the routing weights."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, idx = jax.lax.top_k(probs, top_k)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = jnp.repeat(x, top_k, axis=0)[order]
    return rows, jnp.bincount(flat, length=experts).astype(jnp.int32), order, weights


def _combine(y, order, weights):
    back = jnp.zeros_like(y).at[order].set(y)
    return (back.reshape(weights.shape + y.shape[-1:]) * weights[..., None]).sum(1)


def _experts(rows, sizes, w_up, w_down, ragged):
    return ragged(jax.nn.silu(ragged(rows, w_up, sizes)), w_down, sizes)


class LinenMoE(nn.Module):
    """``ragged``: None calls ``jax.lax.ragged_dot`` (what fp4lab intercepts); else the
    function to call instead (the test's reference)."""

    ragged: object = None

    @nn.compact
    def __call__(self, x):
        ragged = self.ragged or (lambda a, b, s: jax.lax.ragged_dot(a, b, s))
        init = nn.initializers.normal(0.1)
        logits = nn.Dense(E, name="router", dtype=jnp.float32)(x.astype(jnp.float32))
        z = nn.Dense(LATENT, name="latent_down")(x)
        rows, sizes, order, weights = _dispatch(z, logits, TOP_K, E)
        y = _experts(rows, sizes, self.param("w_up", init, (E, LATENT, HIDDEN)),
                     self.param("w_down", init, (E, HIDDEN, LATENT)), ragged)
        return nn.Dense(D, name="latent_up")(_combine(y, order, weights)) + nn.Dense(
            D, name="shared")(x)


class NNXMoE(nnx.Module):
    def __init__(self, rngs, ragged=None):
        self.ragged = ragged
        self.router = nnx.Linear(D, E, rngs=rngs)
        self.w_up = nnx.Param(jax.random.normal(rngs.params(), (E, D, HIDDEN)) * 0.1)
        self.w_down = nnx.Param(jax.random.normal(rngs.params(), (E, HIDDEN, D)) * 0.1)

    def __call__(self, x):
        ragged = self.ragged or (lambda a, b, s: jax.lax.ragged_dot(a, b, s))
        rows, sizes, order, weights = _dispatch(x, self.router(x), TOP_K, E)
        return _combine(_experts(rows, sizes, self.w_up[...], self.w_down[...], ragged),
                        order, weights)


def _x(seed=0, n=T):
    return jax.random.normal(jax.random.key(seed), (n, D), jnp.float32)


def test_linen_moe_under_nemotron3_keeps_router_and_latent_and_quantizes_experts():
    model = LinenMoE()
    x = _x()
    params = model.init(jax.random.key(1), x)
    qm = quantize_model(model, nemotron3())
    table = qm.explain(params, x)
    rows = {a.path: a for a in table}
    assert rows["router"].recipe is None
    assert rows["latent_down"].recipe.name == rows["latent_up"].recipe.name == "bf16"
    for call in ("ragged_dot_0", "ragged_dot_1"):
        assert rows[call].kind == "lax.ragged_dot" and rows[call].recipe.name == "nvfp4"
        assert rows[call].rule is None  # the policy's default
    assert rows["shared"].recipe.name == "nvfp4"
    text = str(table)
    assert "ragged_dot_1" in text and "a router: not quantized unless a rule names it" in text


@pytest.mark.filterwarnings("ignore::fp4lab.policy.PolicyWarning")  # (no blocks: no "outside")
@pytest.mark.parametrize("preset", sorted(fp4lab.policy.MOE_PRESETS))
def test_the_moe_presets_put_the_experts_in_their_recipe_and_leave_the_router(preset):
    """DeepSeek-V4, Kimi K3, gpt-oss: the expert stacks in the system's expert recipe (by
    rule, not the default), every other GEMM in its default, the router as the model
    computes it; the experts' forward and gradients are qragged_dot's under that recipe."""
    experts, default, _ = fp4lab.policy.MOE_PRESETS[preset]
    model, x = LinenMoE(), _x(4)
    params = model.init(jax.random.key(1), x)
    qm = quantize_model(model, preset)
    rows = {a.path: a for a in qm.explain(params, x)}
    assert rows["router"].recipe is None
    assert rows["ragged_dot_0"].recipe.name == rows["ragged_dot_1"].recipe.name == experts
    assert rows["ragged_dot_0"].rule is not None
    assert {rows[p].recipe.name for p in ("latent_down", "latent_up", "shared")} == {default}
    ref = quantize_model(LinenMoE(ragged=functools.partial(fp4lab.qragged_dot,
                                                           recipe=experts)), default)
    key = {"quant": jax.random.key(5)}
    got, want = (jax.grad(lambda p, m=m: jnp.sum(m.apply(p, x, rngs=key) ** 2))(params)
                 for m in (qm, ref))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def test_linen_moe_computes_the_model_with_qragged_dot_gradients_included():
    x = _x(2)
    model = LinenMoE()
    params = model.init(jax.random.key(3), x)
    policy = fp4lab.PrecisionPolicy(rules=(Rule(recipe="bf16", pattern="latent.*|shared"),),
                                    default="mxfp8")
    qm = quantize_model(model, policy)
    ref = LinenMoE(ragged=functools.partial(fp4lab.qragged_dot, recipe="mxfp8"))
    # the dense layers in BF16 through fp4lab, as the policy says, in the reference too
    ref_q = quantize_model(ref, fp4lab.PrecisionPolicy(default="bf16"))

    def loss(apply, p):
        return jnp.sum(apply(p, x) ** 2)

    got = jax.value_and_grad(functools.partial(loss, qm.apply))(params)
    want = jax.value_and_grad(functools.partial(loss, ref_q.apply))(params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and the experts are quantized: unquantized experts give another loss
    plain = quantize_model(model, fp4lab.PrecisionPolicy(rules=policy.rules, default="bf16"))
    assert float(loss(plain.apply, params)) != float(got[0])


def test_a_rule_that_names_the_router_reaches_it_and_a_catch_all_does_not():
    model, x = LinenMoE(), _x()
    params = model.init(jax.random.key(1), x)
    catch_all = fp4lab.PrecisionPolicy(rules=(Rule(recipe="mxfp8", pattern=".*"),), default="nvfp4")
    assert {a.path: a for a in quantize_model(model, catch_all).explain(params, x)}[
        "router"].recipe is None
    named = fp4lab.PrecisionPolicy(rules=(Rule(recipe="mxfp8", pattern="router"),), default="nvfp4")
    assert {a.path: a for a in quantize_model(model, named).explain(params, x)}[
        "router"].recipe.name == "mxfp8"


def test_nnx_moe_is_found_from_example_inputs_and_refused_without_them():
    x = _x(4)
    model = quantize_model(NNXMoE(nnx.Rngs(0)), "all:mxfp8", x)
    rows = {a.path: a for a in assignments(model)}
    assert rows["ragged_dot_0"].recipe.name == rows["ragged_dot_1"].recipe.name == "mxfp8"
    assert "router" not in rows  # runs as written
    ref = NNXMoE(nnx.Rngs(0), ragged=functools.partial(fp4lab.qragged_dot, recipe="mxfp8"))
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(ref(x)))

    with pytest.warns(PolicyWarning, match="found no GEMM"):  # the router runs as written
        blind = quantize_model(NNXMoE(nnx.Rngs(0)), "all:mxfp8")
    with pytest.raises(ValueError, match="calls lax.ragged_dot .* quantize_model did not "
                                         "see"):
        blind(x)


def test_an_expert_stack_refuses_per_expert_state_by_name():
    model, x = LinenMoE(), _x()
    params = model.init(jax.random.key(1), x)
    qm = quantize_model(model, fp4lab.PrecisionPolicy(default="bf16", rules=(
        Rule(recipe="fp8_delayed", pattern=".*ragged_dot_0"),)))
    with pytest.raises(ValueError, match="ragged_dot_0: recipe fp8_delayed uses delayed "
                                         "scaling's amax history"):
        qm.apply(params, x)


def test_expert_stacks_are_probed_per_expert_in_linen_and_nnx():
    """An expert stack's probe holds one metrics table per expert (Linen: the ``probes``
    collection's entry is stacked per expert; NNX: ``probe_records`` names ``.../expert_e``),
    each measured on the expert's own rows (tests/fp4lab/test_grouped.py checks the values
    against the loop over experts)."""
    model, x = LinenMoE(), _x(5)
    params = model.init(jax.random.key(1), x)
    qm = quantize_model(model, "all:mxfp8")
    probes = qm.probe_zeros(params, x)
    assert probes["ragged_dot_0"].shape == (E, *fp4lab.probe_zeros().shape)
    grads = jax.grad(lambda p: jnp.sum(qm.apply({**params, "probes": p}, x) ** 2))(
        probes)
    sqnr = fp4lab.numerics.metrics.METRIC_NAMES.index("sqnr_db")
    per_expert = np.asarray(grads["ragged_dot_0"])[:, 0, sqnr]  # fprop X of each expert
    assert np.isfinite(per_expert).all() and len(set(per_expert.tolist())) == E

    nnx_model = quantize_model(NNXMoE(nnx.Rngs(0)), "all:mxfp8", x, probes=True)
    state = nnx.state(nnx_model, fp4lab.flax.nnx.QuantProbe)
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2),
                     argnums=nnx.DiffState(0, fp4lab.flax.nnx.QuantProbe))(nnx_model)
    records = fp4lab.flax.nnx.probe_records(nnx_model, grads)
    assert {f"ragged_dot_{i}/expert_{e}" for i in (0, 1) for e in range(E)} <= set(records)
    assert len(jax.tree.leaves(state)) == 2


class LinenShardedExperts(nn.Module):
    """The expert stacks split over mesh axis ``expert`` (``jax.shard_map``, each device its
    run of experts), the rows replicated: each device computes its experts' rows (rolled to
    the front) and a ``psum`` puts every expert's rows together, the intercepted
    ``ragged_dot`` calls under ``experts_split_over``. Without a mesh: one device."""

    mesh: object = None
    split_over: bool = True  # False: the ragged_dot calls do not say that they are split

    @nn.compact
    def __call__(self, x):
        from jax.sharding import PartitionSpec as P

        init = nn.initializers.normal(0.1)
        logits = nn.Dense(E, name="router", dtype=jnp.float32)(x)
        rows, sizes, order, weights = _dispatch(x, logits, TOP_K, E)
        stacks = (self.param("w_up", init, (E, D, HIDDEN)),
                  self.param("w_down", init, (E, HIDDEN, D)))
        ragged = lambda a, b, s: jax.lax.ragged_dot(a, b, s)  # noqa: E731
        if self.mesh is None:
            return _combine(_experts(rows, sizes, *stacks, ragged), order, weights)

        def local(rows, sizes, w_up, w_down):
            first = jax.lax.axis_index("expert") * w_up.shape[0]
            offset = jnp.sum(jnp.where(jnp.arange(E) < first, sizes, 0))
            mine = jax.lax.dynamic_slice(sizes, (first,), (w_up.shape[0],))
            split = fp4lab.flax.experts_split_over if self.split_over else (
                lambda _: contextlib.nullcontext())
            with split("expert"):
                y = _experts(jnp.roll(rows, -offset, 0), mine, w_up, w_down, ragged)
            return jax.lax.psum(jnp.roll(y, offset, 0), "expert")

        y = jax.shard_map(local, mesh=self.mesh, in_specs=(P(), P(), P("expert"), P("expert")),
                          out_specs=P())(rows, sizes, *stacks)
        return _combine(y, order, weights)


def test_experts_split_over_devices_compute_the_one_device_experts():
    """``fp4lab.flax.experts_split_over``: with the expert stacks over 2 devices, NVFP4 with
    stochastic rounding gives the one-device model's output and each expert's weight
    gradients bit for bit, each expert drawing its one-device bits; without it the second
    device's experts draw the first's bits and the weight gradients differ. A probe of a
    split stack is refused by name."""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    x = _x(6)
    params = LinenShardedExperts().init(jax.random.key(2), x)
    key = {"quant": jax.random.key(8)}

    def grads(model):
        qm = quantize_model(model, "nvfp4")
        return jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(qm.apply(
            p, x, rngs=key) ** 2), argnums=(0, 1)))(params, x)

    (y1, (g1, dx1)), (y2, (g2, dx2)), (_, (g3, _)) = (grads(LinenShardedExperts(*a)) for a in (
        (), (mesh,), (mesh, False)))
    assert y1 == y2
    for name in ("w_up", "w_down"):
        np.testing.assert_array_equal(g1["params"][name], g2["params"][name])
        assert (g1["params"][name] != g3["params"][name]).any()  # other SR bits
    # the router's and X's: the programs around the experts differ (psum, shard_map), and
    # XLA reduces the routing weights' gradient in another order
    for a, b in zip(jax.tree.leaves((g1["params"]["router"], dx1)),
                    jax.tree.leaves((g2["params"]["router"], dx2)), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(a).max())

    with pytest.raises(ValueError, match=r"op ragged_dot_0: its expert stack is split over "
                                         r"mesh axis 'expert'.*no probes"):
        qm = quantize_model(LinenShardedExperts(mesh), "nvfp4")
        qm.apply({**params, "probes": qm.probe_zeros(params, x)}, x, rngs=key)


class NNXShardMapMoE(NNXMoE):
    """:class:`NNXMoE` with its experts computed under ``jax.shard_map`` (as MaxText computes
    them), each device routing its share of the tokens (mesh axis ``data``) to every expert."""

    def __init__(self, rngs, mesh):
        super().__init__(rngs)
        self.mesh = mesh

    def __call__(self, x):
        from jax.sharding import PartitionSpec as P

        def local(x, logits, w_up, w_down):
            rows, sizes, order, weights = _dispatch(x, logits, TOP_K, E)
            return _combine(_experts(rows, sizes, w_up, w_down, jax.lax.ragged_dot), order,
                            weights)

        return jax.shard_map(local, mesh=self.mesh, in_specs=(P("data"),) * 2 + (P(),) * 2,
                             out_specs=P("data"))(x, self.router(x), self.w_up[...],
                                                  self.w_down[...])


def test_nnx_experts_under_shard_map_draw_fresh_and_per_device_sr_bits():
    """NNX state cannot be written inside ``jax.shard_map``: the SR draws of the calls made
    there advance their counters when the module's method returns. On a 1-device mesh the
    model computes what it computes without ``shard_map``, bit for bit (NVFP4 with SR,
    without its RHT for a smaller program; gradients included), and every call draws new
    bits; on 2 devices each draws its own (two equal halves of the tokens get different
    rounding)."""
    from jax.sharding import Mesh

    x = _x(7)

    @nnx.jit
    def step(model, x):
        return nnx.grad(lambda m, x: jnp.sum(m(x) ** 2), argnums=(0, 1))(model, x)

    plain = quantize_model(NNXMoE(nnx.Rngs(0)), "nvfp4_no_rht", x)
    one = quantize_model(NNXShardMapMoE(nnx.Rngs(0), Mesh(jax.devices()[:1], ("data",))),
                         "nvfp4_no_rht", x)
    for _ in range(2):  # the second call draws the second keys on both
        for a, b in zip(jax.tree.leaves(step(plain, x)), jax.tree.leaves(step(one, x)),
                        strict=True):
            np.testing.assert_array_equal(a, b)
    counts = [int(v[...]) for _, v in nnx.iter_graph(one) if isinstance(v, nnx.Variable)
              and type(v).__name__ == "QuantCounter"]
    assert counts == [2, 2]  # ragged_dot_0 and _1, one draw a call
    first, second = (step(one, x)[0]["w_up"][...] for _ in range(2))
    assert (first != second).any()

    two = quantize_model(NNXShardMapMoE(nnx.Rngs(0), Mesh(jax.devices()[:2], ("data",))),
                         "nvfp4_no_rht", jnp.concatenate([x, x]))
    halves = step(two, jnp.concatenate([x, x]))[1]
    assert (halves[:T] != halves[T:]).any()  # another device's bits
    assert np.linalg.norm(halves[:T] - halves[T:]) < 0.3 * np.linalg.norm(halves[:T])


class NNXEinsumMoE(nnx.Module):
    """Experts as einsums (MaxText's dense path: every token through every expert, the
    top-k weights zero elsewhere) through ``fp4lab.flax.expert_einsum``; ``einsum``: what to
    call instead (the test's reference)."""

    def __init__(self, rngs, einsum=None):
        self.einsum = einsum
        self.router = nnx.Linear(D, E, rngs=rngs)
        self.w_up = nnx.Param(jax.random.normal(rngs.params(), (E, D, HIDDEN)) * 0.1)
        self.w_down = nnx.Param(jax.random.normal(rngs.params(), (E, HIDDEN, D)) * 0.1)

    def __call__(self, x):
        from fp4lab.flax import expert_einsum

        einsum = self.einsum or expert_einsum
        probs = jax.nn.softmax(self.router(x), axis=-1)
        top, _ = jax.lax.top_k(probs, TOP_K)
        weights = jnp.where(probs >= top[:, -1:], probs, 0.0)
        h = jax.nn.silu(einsum("TM,EMH->TEH", x, self.w_up[...]))
        return jnp.einsum("TEM,TE->TM", einsum("TEH,EHM->TEM", h, self.w_down[...]), weights)


@pytest.mark.parametrize("policy", ["all:mxfp8", "kimi_k3", "all:bf16"])
def test_nnx_experts_as_einsums_are_expert_stacks(policy):
    """``expert_einsum`` calls are expert stacks as ``ragged_dot`` calls are: found from
    example inputs, given the policy's default or its rule of kind ``experts`` (the MoE
    presets'), computed by ``qexpert_einsum`` expert by expert (forward and gradients
    equal); the router and the combine einsum stay as written. (On a BF16 model a BF16
    policy runs the einsums as written: MaxText's losses, tests/fp4lab/test_maxtext.py.)"""
    x = _x(9)
    model = quantize_model(NNXEinsumMoE(nnx.Rngs(0)), policy, x)
    rows = {a.path: a for a in assignments(model)}
    experts = {"all:mxfp8": "mxfp8", "kimi_k3": fp4lab.policy.MOE_PRESETS["kimi_k3"][0],
               "all:bf16": "bf16"}[policy]
    assert set(rows) >= {"expert_einsum_0", "expert_einsum_1"} and "router" not in rows
    assert {rows[f"expert_einsum_{i}"].recipe.name for i in (0, 1)} == {experts}
    assert rows["expert_einsum_0"].kind == "fp4lab.expert_einsum"
    assert not fp4lab.get_recipe(experts).needs_key  # (the reference draws no key)
    ref = NNXEinsumMoE(nnx.Rngs(0), einsum=functools.partial(fp4lab.qexpert_einsum,
                                                             recipe=experts))
    loss = lambda m: jnp.sum(m(x) ** 2)  # noqa: E731
    for a, b in zip(jax.tree.leaves(nnx.grad(loss)(model)), jax.tree.leaves(nnx.grad(loss)(ref)),
                    strict=True):
        np.testing.assert_array_equal(a, b)


class LinenEinsumExperts(nn.Module):
    einsum: object = None

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(0.1), (E, D, HIDDEN))
        return (self.einsum or fp4lab.flax.expert_einsum)("TM,EMH->TEH", x, w)


def test_linen_experts_as_einsums_are_expert_stacks():
    x = _x(2)
    params = LinenEinsumExperts().init(jax.random.key(1), x)
    qm = quantize_model(LinenEinsumExperts(), "all:mxfp8")
    [row] = qm.explain(params, x)
    assert (row.path, row.kind, row.recipe.name) == ("expert_einsum_0", "fp4lab.expert_einsum",
                                                      "mxfp8")
    ref = LinenEinsumExperts(functools.partial(fp4lab.qexpert_einsum, recipe="mxfp8"))
    np.testing.assert_array_equal(qm.apply(params, x), ref.apply(params, x))


def test_probes_of_experts_under_shard_map_are_the_devices_mean():
    """A probe read inside ``jax.shard_map`` gets the sum of the devices' gradients, which
    fp4lab makes their mean: two devices each holding the same tokens report the metrics one
    device reports for them (MXFP8: no SR, so every operand's are equal), not twice them."""
    from jax.sharding import Mesh

    x = _x(3)

    def records(model, x):
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2),
                         argnums=nnx.DiffState(0, fp4lab.flax.nnx.QuantProbe))(model)
        return fp4lab.flax.nnx.probe_records(model, grads)

    one = records(quantize_model(NNXMoE(nnx.Rngs(0)), "all:mxfp8", x, probes=True), x)
    two = quantize_model(NNXShardMapMoE(nnx.Rngs(0), Mesh(jax.devices()[:2], ("data",))),
                         "all:mxfp8", jnp.concatenate([x, x]), probes=True)
    two = records(two, jnp.concatenate([x, x]))
    assert set(one) == set(two) and len(one) == 2 * E
    for name in one:
        assert one[name] == two[name], name
