"""Saved-activation storage (recipe.saved_x): the backward pass uses dequantize(quantize(X)),
the residuals hold the codes and scales (and sit in host memory when offloaded), the bytes
are reported, and the default stores X unchanged."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fp4lab
from oracles import numpy_ref
from fp4lab.gemm.qdot import qdot_general, saved_bytes
from fp4lab.gemm.recipe import SavedX, get_recipe
from fp4lab.gemm.saved import recompute

DN = (((1,), (0,)), ((), ()))


def _data():
    k = jax.random.split(jax.random.key(0), 3)
    x = (jax.random.normal(k[0], (64, 256)) * 3).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (256, 32)) / 16).astype(jnp.bfloat16)
    dy = jax.random.normal(k[2], (64, 32)).astype(jnp.bfloat16)
    return x, w, dy


def _grads(recipe, x, w, dy):
    y, vjp = jax.vjp(lambda a, b: qdot_general(a, b, DN, recipe), x, w)
    return y, *vjp(dy)


@pytest.mark.parametrize("fmt", ["fp8_block128", "fp8_block128_pow2", "mxfp8", "bf16"])
def test_wgrad_uses_the_stored_x_and_nothing_else_changes(fmt):
    x, w, dy = _data()
    recipe = dataclasses.replace(get_recipe("bf16"), name=f"bf16_saved_{fmt}",
                                 saved_x=SavedX(fmt))
    y, dx, dw = jax.jit(_grads, static_argnums=0)(recipe, x, w, dy)
    y0, dx0, dw0 = jax.jit(_grads, static_argnums=0)("bf16", x, w, dy)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))  # the forward is unchanged
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx0))  # dgrad needs no X
    stored = fp4lab.dequantize(fp4lab.quantize(x.astype(jnp.float32), fmt, axis=-1))
    want = lax.dot_general(stored.astype(jnp.bfloat16), dy, (((0,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(want))
    if fmt != "bf16":  # x is already BF16: a BF16 store changes nothing
        assert not np.array_equal(np.asarray(dw), np.asarray(dw0))


def test_the_default_recipe_stores_x_as_it_came():
    x, w, dy = _data()
    for name in ("bf16", "nvfp4"):
        assert get_recipe(name).saved_x is None
    _, vjp = jax.vjp(lambda a, b: qdot_general(a, b, DN, "bf16"), x, w)
    dtypes = sorted(str(a.dtype) for a in jax.tree.leaves(vjp) if a.size == x.size)
    assert dtypes == ["bfloat16"]  # (in the GEMM's [batch, M, K] layout)


def _residuals(recipe, x, w):
    return jax.jit(lambda a, b: jax.vjp(lambda a, b: qdot_general(a, b, DN, recipe), a, b)[1])(
        x, w)


def test_the_residuals_prove_what_is_stored_and_where():
    x, w, _ = _data()
    vjp = _residuals("bf16_saved_fp8", x, w)
    leaves = jax.tree.leaves(vjp)
    assert any(a.dtype == jnp.float8_e4m3fn and a.shape == (1, 64, 256) for a in leaves)
    assert any(a.dtype == jnp.float32 and a.shape == (1, 64, 2) for a in leaves)  # 1x128
    assert not any(a.size == x.size and a.dtype == jnp.bfloat16 for a in leaves)
    host = dataclasses.replace(get_recipe("bf16_saved_fp8"), name="bf16_saved_fp8_host",
                               saved_x=SavedX("fp8_block128", offload=True))
    kinds = {(str(a.dtype), a.sharding.memory_kind) for a in jax.tree.leaves(
        _residuals(host, x, w))}
    assert ("float8_e4m3fn", "pinned_host") in kinds and ("float32", "pinned_host") in kinds
    _, dx, dw = jax.jit(_grads, static_argnums=0)(host, x, w, _data()[2])
    _, dx1, dw1 = jax.jit(_grads, static_argnums=0)("bf16_saved_fp8", x, w, _data()[2])
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(dw1))  # offload moves, exactly


def test_saved_bytes_reports_the_residuals():
    x, w, _ = _data()
    plain = saved_bytes(x, w, DN, "bf16")
    fp8 = saved_bytes(x, w, DN, "bf16_saved_fp8")
    assert plain["x"] == 64 * 256 * 2 and plain["w"] == 256 * 32 * 2
    assert fp8["x"] == 64 * 256 + 64 * 2 * 4  # E4M3 codes and one float32 scale per 128
    assert plain["x"] / fp8["x"] == pytest.approx(2 / (1 + 4 / 128))  # 1.94x, as Kimi K2
    host = dataclasses.replace(get_recipe("bf16_saved_fp8"), name="h",
                               saved_x=SavedX(offload=True))
    assert saved_bytes(jax.ShapeDtypeStruct(x.shape, x.dtype), w, DN, host)["host"] == fp8["x"]


def test_inputs_the_backward_does_not_read_are_not_saved():
    """QAT differentiates through the forward's quantized operands, and the requantizing
    recipes quantize their backward W and X from them: neither keeps X or W as they came
    (only their dtype); a recipe whose backward quantizes W and X from the inputs keeps
    both. Their gradients are unchanged (test_qdot's oracle)."""
    x, w, _ = _data()
    for name in ("fp4_qat", "tetrajet_v2", "quartet"):
        s = saved_bytes(x, w, DN, name)
        assert s["x"] == 0 and s["w"] == 0, (name, s)  # a zero-size array of each dtype
        assert s["other"] >= (64 * 256 + 256 * 32) * 2  # the forward's X and W (BF16 or FP32)
    s = saved_bytes(x, w, DN, "nvfp4")
    assert s["x"] == 64 * 256 * 2 and s["w"] == 256 * 32 * 2


def test_bad_storage_is_named():
    with pytest.raises(ValueError, match="unknown format 'e9m9'"):
        SavedX("e9m9")
    with pytest.raises(ValueError, match="saved_x, source='forward' and the trust mask need backward='quantized'"):
        dataclasses.replace(get_recipe("fp4_qat"), saved_x=SavedX())


# ---- recompute: an elementwise block kept as Q(x) and recomputed from DQ(Q(x)) ----

def _relu2(h):
    return jnp.square(jax.nn.relu(h))


def _hidden():
    """BF16 MLP hidden activations of both signs with blocks of very different ranges (the
    scales differ per 1x128 tile), an exact zero and a value at a tile's abs-max."""
    h = np.array(jax.random.normal(jax.random.key(1), (8, 256)), np.float32)
    h[:, 128:] *= 1e-3
    h[0, 0], h[1, 5] = 0.0, 40.0
    return jnp.asarray(h, jnp.bfloat16)


def _stored_numpy(h):
    """DQ(Q(h)) for fp8_block128 from the NumPy oracle (E4M3, float32 scale per 1x128)."""
    codes, _, scale_inv = numpy_ref.fp8_block_quantize(np.asarray(h, np.float32), (1, 128))
    return numpy_ref.fp8_block_dequantize(codes, scale_inv, (1, 128))


def test_recompute_runs_the_forward_on_x_and_differentiates_at_the_stored_x():
    h = _hidden()
    g = jnp.asarray(np.asarray(jax.random.normal(jax.random.key(2), h.shape)), jnp.bfloat16)
    block = recompute(_relu2, "fp8_block128")
    y, vjp = jax.vjp(jax.jit(block), h)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(_relu2(h), np.float32))
    (dh,) = vjp(g)
    # the oracle: d relu(h)^2 = g * 2 relu(h) at the stored h (each BF16 product rounds once;
    # relu passes +0 where h <= 0)
    hr = _stored_numpy(h).astype(jnp.bfloat16).astype(np.float32)
    want = np.where(hr > 0, np.asarray(g, np.float32) * 2 * hr, 0.0).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(dh).view(np.uint16), want.view(np.uint16))
    plain = jax.vjp(_relu2, h)[1](g)[0]
    assert not np.array_equal(np.asarray(dh), np.asarray(plain))  # the stored x mattered


def test_recompute_with_a_following_gemm_recomputes_it_too():
    h = _hidden()
    w = (jax.random.normal(jax.random.key(3), (256, 16)) / 16).astype(jnp.bfloat16)
    g = jax.random.normal(jax.random.key(4), (8, 16)).astype(jnp.bfloat16)

    def mlp_out(h, w):
        return jnp.dot(_relu2(h), w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    y, vjp = jax.vjp(jax.jit(recompute(mlp_out, SavedX("fp8_block128"))), h, w)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(mlp_out(h, w)))
    dh, dw = vjp(g)
    hr = jnp.asarray(_stored_numpy(h), jnp.bfloat16)
    dh0, dw0 = jax.jit(lambda a, b, c: jax.vjp(mlp_out, a, b)[1](c))(hr, w, g)  # both jitted
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(dw0))  # wgrad sees relu(hr)^2
    np.testing.assert_array_equal(np.asarray(dh), np.asarray(dh0))


def test_recompute_keeps_only_the_codes_and_scales():
    h = _hidden()
    leaves = jax.tree.leaves(jax.jit(lambda a: jax.vjp(recompute(_relu2), a)[1])(h))
    assert sorted((str(a.dtype), a.shape) for a in leaves if a.size) == [
        ("float32", (8, 2)), ("float8_e4m3fn", (8, 256))]
    host = recompute(_relu2, SavedX("fp8_block128", offload=True))
    kinds = {(str(a.dtype), a.sharding.memory_kind)
             for a in jax.tree.leaves(jax.jit(lambda a: jax.vjp(host, a)[1])(h)) if a.size}
    assert kinds == {("float8_e4m3fn", "pinned_host"), ("float32", "pinned_host")}
    np.testing.assert_array_equal(  # offload moves the codes, exactly
        np.asarray(jax.jit(jax.grad(lambda a: host(a).astype(jnp.float32).sum()))(h)),
        np.asarray(jax.jit(jax.grad(lambda a: recompute(_relu2)(a).astype(
            jnp.float32).sum()))(h)))


def test_recompute_names_bad_arguments():
    with pytest.raises(ValueError, match="unknown format 'e9m9'"):
        recompute(_relu2, "e9m9")
    with pytest.raises(TypeError, match="use a format name"):
        recompute(_relu2, 8)
    with pytest.raises(TypeError, match="argument leaf 1 has dtype int32"):
        recompute(lambda h, n: h * n)(_hidden(), jnp.int32(2))


def test_recompute_at_infinities_nan_max_and_subnormals():
    """The forward is fn(x) bit for bit, whatever x holds; the backward differentiates at the
    stored x, which follows the storage format's rules (docs/numerics.md: in fp8_block128 an
    infinite amax gives scale 1, so inf is stored as 448 and float32's max as 448; NaN stays)."""
    big = np.finfo(np.float32).max
    vals = np.float32([np.inf, -np.inf, np.nan, big, -big, 1e-40, -1e-40, 2.0 ** -9, -0.0, 3.0])
    x = jnp.asarray(np.tile(vals, 26)[:256].reshape(2, 128))
    y, vjp = jax.vjp(recompute(jnp.square, "fp8_block128"), x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jnp.square(x)))
    (dx,) = vjp(jnp.ones_like(x))
    stored = np.asarray(fp4lab.dequantize(fp4lab.quantize(x, "fp8_block128")))
    np.testing.assert_array_equal(np.asarray(dx), 2 * stored)
    np.testing.assert_array_equal(np.asarray(dx)[0, :5], [896.0, -896.0, np.nan, 896.0, -896.0])
