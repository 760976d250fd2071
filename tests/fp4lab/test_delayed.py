"""FP8 delayed scaling (fp4lab.features.delayed, recipe fp8_delayed): each step's per-tensor scales
come from the amax history of the previous steps, against a NumPy simulation of TE's
DelayedScaling; the history is explicit state in qdot, Linen and NNX."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from oracles import numpy_ref as ref
import pytest
from flax import linen as nn
from flax import nnx

import fp4lab
from fp4lab.features import delayed
from fp4lab.features.delayed import DelayedScaling
from fp4lab.flax import quantize_model
from fp4lab.flax.nnx import AmaxHistory, update_amax_history
from fp4lab.gemm.qdot import qdot_general
from fp4lab.gemm.recipe import OPERANDS
from fp4lab.gemm.recipe import RECIPES, Recipe
from fp4lab import GemmState

DN = (((1,), (0,)), ((), ()))
F32 = np.float32


def steps_data(n, seed=0):
    """n steps of (x, w, g) whose magnitudes grow, so the history lags the data."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((64, 32)).astype(F32) * F32(0.1)
    out = []
    for t in range(n):
        x = (rng.standard_normal((16, 64)) * 2.0**t).astype(F32)
        g = (rng.standard_normal((16, 32)) * 2.0 ** (-t)).astype(F32)
        out.append((x, w * F32(1 + t), g))
    return out


class TEHistory:
    """NumPy model of TE's DelayedScaling for one tensor: the scale of step t from the
    amaxes of steps < t (max or most recent, margin), then the step's amax rolled in."""

    def __init__(self, scaling):
        self.s, self.h = scaling, np.zeros(scaling.history_len, F32)

    def amax(self):
        a = self.h.max() if self.s.amax_compute_algo == "max" else self.h[0]
        return F32(a * F32(2.0**self.s.margin))

    def push(self, amax):
        self.h = np.concatenate([[F32(amax)], self.h[:-1]]).astype(F32)


@pytest.mark.parametrize("scaling", [DelayedScaling(history_len=3),
                                     DelayedScaling(history_len=4, amax_compute_algo="most_recent",
                                                    margin=2)])
def test_each_step_is_scaled_from_the_previous_steps(scaling):
    recipe = dataclasses.replace(RECIPES["fp8_delayed"], name="fp8_delayed_test",
                                 delayed=scaling)
    hist = delayed.init_history(scaling)
    te = {name: TEHistory(scaling) for name in OPERANDS}

    @jax.jit
    def step(x, w, g, h):
        y, vjp = jax.vjp(lambda a, b, c: qdot_general(a, b, DN, recipe,
                                                      GemmState(amax_history=c),
                                                      preferred_element_type=jnp.float32),
                         x, w, h)
        dx, dw, dh = vjp(g)
        return y, dx, dw, delayed.update(h, dh)

    for x, w, g in steps_data(5):
        # the forward operands, quantized as TE would at this step (oracle: numpy_ref)
        xq = ref.fp8_tensor_dequantize(*_codes_inv(x, "e4m3", te["fprop_x"].amax()), "e4m3")
        wq = ref.fp8_tensor_dequantize(*_codes_inv(w, "e4m3", te["fprop_w"].amax()), "e4m3")
        y, _, _, hist = step(x, w, g, hist)
        np.testing.assert_allclose(np.asarray(y), xq.astype(np.float64) @ wq, rtol=1e-5,
                                   atol=1e-5 * np.abs(xq @ wq).max())
        seen = {"fprop_x": x, "fprop_w": w, "dgrad_dy": g, "dgrad_w": w, "wgrad_x": x,
                "wgrad_dy": g}
        for name in OPERANDS:
            te[name].push(np.abs(seen[name]).max())
            np.testing.assert_array_equal(np.asarray(hist[OPERANDS.index(name)]), te[name].h)


def _codes_inv(x, elem, amax):
    codes, _, scale_inv = ref.fp8_tensor_quantize(x, elem, amax=amax)
    return codes, scale_inv


def test_forward_operand_equals_fake_quant_with_the_history_amax():
    """Bit for bit: fprop X with a nonzero history is fake_quant(x, global_amax=max(hist))."""
    r = RECIPES["fp8_delayed"]
    x, w, _ = steps_data(1)[0]
    hist = delayed.init_history(r.delayed).at[0, 5].set(3.0).at[1, 0].set(0.25)
    y = qdot_general(x, w, DN, r, GemmState(amax_history=hist),
                     preferred_element_type=jnp.float32)
    # under jit: the history's amax may lie below the tensor's (eagerly that is refused)
    lagging = jax.jit(lambda t, a: fp4lab.quantize(t, "fp8_e4m3", global_amax=a))
    xq = lagging(jnp.asarray(x), F32(3.0))
    wq = lagging(jnp.asarray(w), F32(0.25))
    # the GEMM multiplies the FP8 elements and scales the product by scale_inv_x * scale_inv_w
    # (docs/numerics.md, "The GEMM")
    prod = jnp.matmul(xq.data.astype(jnp.bfloat16), wq.data.astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32)
    alpha = np.asarray(xq.scale, F32) * np.asarray(wq.scale, F32)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(prod) * alpha)


def test_history_is_required_and_checked():
    x, w, _ = steps_data(1)[0]
    with pytest.raises(ValueError, match="fp8_delayed uses delayed scaling: pass its amax_history"):
        qdot_general(x, w, DN, "fp8_delayed")
    with pytest.raises(ValueError, match=r"amax_history has shape \(6, 3\).*\(6, 1024\)"):
        qdot_general(x, w, DN, "fp8_delayed", GemmState(amax_history=jnp.zeros((6, 3))))
    with pytest.raises(ValueError, match="has no delayed scaling"):
        qdot_general(x, w, DN, "fp8_hybrid", GemmState(amax_history=jnp.zeros((6, 3))))
    with pytest.raises(ValueError, match="amax_compute_algo"):
        DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="per-tensor operand"):
        Recipe(name="bad", fprop_x=RECIPES["mxfp8"].fprop_x, delayed=DelayedScaling())


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="down")(nn.relu(nn.Dense(32, name="up")(x)))


def test_linen_history_collection_is_carried_by_the_step():
    model, x = MLP(), jnp.asarray(steps_data(1)[0][0][:, :16])
    params = model.init(jax.random.key(0), x)
    qm = quantize_model(model, "all:fp8_delayed")
    hist = qm.history_init(params, x)
    assert set(hist) == {"up", "down"} and hist["up"]["gemm"].shape == (6, 1024)
    with pytest.raises(ValueError, match="amax_history' collection"):
        qm.apply(params, x)

    def loss(p, h, x):
        return jnp.mean(qm.apply({**p, "amax_history": h}, x) ** 2)

    for t in range(3):
        xt = x * 2.0**t
        g_p, g_h = jax.grad(loss, argnums=(0, 1))(params, hist, xt)
        hist = delayed.update(hist, g_h)
    up = np.asarray(hist["up"]["gemm"])
    np.testing.assert_array_equal(up[0, :3], [np.abs(np.asarray(x)).max() * 2.0**t
                                              for t in (2, 1, 0)])  # most recent first
    assert not up[:, 3:].any()


def test_nnx_history_variable_and_update():
    class M(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(16, 32, rngs=rngs)

        def __call__(self, x):
            return self.up(x)

    model = quantize_model(M(nnx.Rngs(0)), "all:fp8_delayed")
    x = jnp.asarray(steps_data(1)[0][0][:, :16])
    for t in range(2):
        grads = nnx.grad(lambda m: jnp.mean(m(x * 2.0**t) ** 2),
                         argnums=nnx.DiffState(0, nnx.Any(nnx.Param, AmaxHistory)))(model)
        update_amax_history(model, grads)
    h = np.asarray(model.up.dot_general.amax_history[...])
    np.testing.assert_array_equal(h[0, :2], [np.abs(np.asarray(x)).max() * 2, np.abs(
        np.asarray(x)).max()])


def test_probes_show_the_scale_lag_as_saturation():
    """A tensor that grew 8x since its history saturates under the delayed scale; the same
    GEMM with current scaling does not."""
    from fp4lab.features.probes import probe_table, probe_zeros

    r = RECIPES["fp8_delayed"]
    x, w, _ = steps_data(1)[0]
    hist = delayed.init_history(r.delayed).at[:, 0].set(
        jnp.asarray([np.abs(x).max() / 8, np.abs(w).max(), 1, 1, 1, 1], jnp.float32))

    def saturation(recipe, h):
        f = lambda p: jnp.sum(qdot_general(x, w, DN, recipe,  # noqa: E731
                                           GemmState(probe=p, amax_history=h)))
        return probe_table(jax.grad(f)(probe_zeros()))["fprop_x"]["saturation"]

    assert saturation(r, hist) > 0.05
    assert saturation("fp8_hybrid", None) < 0.002  # (the amax itself may round just above)
