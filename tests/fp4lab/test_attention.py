"""fp4lab.beyond.attention: the flash-style attention against float64 formulas, its flash backward,
and the mechanism Kimi K3 removes: BF16 P.V is biased on rows with near-repeated maxima."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4lab.beyond.attention import flash_attention


def _reference(q, k, v, causal):
    """float64 softmax attention (NumPy)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("...ld,...td->...lt", q, k) / np.sqrt(q.shape[-1])
    if causal:
        length, total = q.shape[-2], k.shape[-2]
        allowed = np.arange(total)[None, :] <= np.arange(length)[:, None] + (total - length)
        s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _inputs(shape_q, shape_k, dv, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape_q).astype(np.float32),
            rng.standard_normal(shape_k).astype(np.float32),
            rng.standard_normal(shape_k[:-1] + (dv,)).astype(np.float32))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_k", [64, 24, 7])  # whole, uneven and odd key blocks
def test_forward_equals_softmax_attention(causal, block_k):
    q, k, v = _inputs((2, 3, 20, 16), (2, 3, 50, 16), 8)
    out = np.asarray(jax.jit(lambda *a: flash_attention(*a, causal=causal, block_k=block_k))(
        q, k, v))
    np.testing.assert_allclose(out, _reference(q, k, v, causal), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_the_flash_backward_equals_the_float64_gradient(causal):
    q, k, v = _inputs((2, 12, 8), (2, 30, 8), 4, seed=1)
    w = np.random.default_rng(2).standard_normal((2, 12, 4))

    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, causal=causal, block_k=8) * w)

    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def loss64(q, k, v):
        s = jnp.einsum("bld,btd->blt", q, k) / jnp.sqrt(8.0)
        if causal:
            allowed = jnp.arange(30)[None, :] <= jnp.arange(12)[:, None] + 18
            s = jnp.where(allowed, s, -jnp.inf)
        return jnp.sum(jax.nn.softmax(s, axis=-1) @ v * w)

    with jax.enable_x64(True):
        want = jax.grad(loss64, argnums=(0, 1, 2))(*(np.float64(x) for x in (q, k, v)))
        for g, r in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-6)


def _near_ties(seed, batch=64, length=16, total=256, d=16):
    """Low-rank q/k whose keys take four values up to 1e-3 noise (many scores within a hair of
    the row maximum: unnormalized probabilities just below 1) and positive values."""
    rng = np.random.default_rng(seed)
    q = np.repeat(rng.standard_normal((batch, 1, d)), length, 1) * rng.uniform(
        0.5, 2.0, (batch, length, 1))
    k = rng.standard_normal((batch, 4, d))[:, rng.integers(0, 4, total)]
    k = k + 1e-3 * rng.standard_normal((batch, total, d))
    v = rng.uniform(0.0, 1.0, (batch, total, 8))
    v = np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32)  # BF16 values, as a kernel reads
    return q.astype(np.float32), k.astype(np.float32), v


def test_bf16_p_v_is_biased_on_near_repeated_maxima_and_fp32_is_not():
    errors = {a: [] for a in ("fp32", "bf16_p")}
    for seed in range(3):
        q, k, v = _near_ties(seed)
        ref = _reference(q, k, v, False)
        for acc in errors:
            out = np.asarray(flash_attention(q, k, v, accumulate=acc), np.float64)
            errors[acc].append((out - ref).ravel())
    e = {a: np.concatenate(v) for a, v in errors.items()}
    t = {a: x.mean() / (x.std(ddof=1) / np.sqrt(x.size)) for a, x in e.items()}
    # P just below 1 rounds up to 1 in BF16 while the row sum keeps the exact values: O too big
    assert t["bf16_p"] > 10 and e["bf16_p"].mean() > 0
    assert abs(e["fp32"].mean()) < 1e-3 * e["bf16_p"].mean()
    assert abs(e["fp32"].mean()) < 0.1 * e["fp32"].std()  # FP32's error is rounding noise
    # zero-mean values: the same rounding is not biased in O (the mechanism needs both)
    q, k, v = _near_ties(9)
    v0 = v - 0.5
    x = (np.asarray(flash_attention(q, k, v0, accumulate="bf16_p"), np.float64)
         - _reference(q, k, v0, False)).ravel()
    assert abs(x.mean()) < 0.2 * e["bf16_p"].mean()


def test_the_saved_output_enters_the_backward_pass():
    q, k, v = _near_ties(3, batch=4)
    w = np.ones((4, 16, 8), np.float32)

    def dq(saved):
        return jax.grad(lambda q: jnp.sum(flash_attention(
            q, k, v, accumulate="bf16_p", saved_dtype=saved) * w))(q)

    a, b = np.asarray(dq(jnp.float32)), np.asarray(dq(jnp.bfloat16))
    assert not np.array_equal(a, b)  # D = rowsum(dO * O) from the saved O
    out = flash_attention(q, k, v, out_dtype=jnp.bfloat16, saved_dtype=jnp.float32)
    assert out.dtype == jnp.bfloat16


def test_bad_arguments_are_named():
    q, k, v = _inputs((4, 8), (6, 8), 3)
    with pytest.raises(ValueError, match="accumulate='fp16'"):
        flash_attention(q, k, v, accumulate="fp16")
    with pytest.raises(ValueError, match="need q"):
        flash_attention(q, k[:, :4], v)
    with pytest.raises(ValueError, match="block_k=0"):
        flash_attention(q, k, v, block_k=0)
    with pytest.raises(ValueError, match="L=8 <= T=6"):
        flash_attention(np.zeros((8, 8)), k, v, causal=True)


# ------------------------------------------ DeepSeek-V3: one E5M6 copy of the attention output

B, H, L, T, K, DV = 2, 4, 16, 24, 16, 32  # H * DV = 128: one 1x128 block per query
FMT = "e5m6_block128_pow2"


def _attention_then_gemm(saved):
    """The attention output (heads merged) into a GEMM that stores its input in E5M6
    (recipe bf16_saved_e5m6_pow2); ``saved``: flash_attention's saved_format / saved_dtype."""
    from fp4lab.gemm.qdot import qdot_general

    kw = {"saved_format": saved} if saved == FMT else {"saved_dtype": saved}

    def f(q, k, v, w):
        o = flash_attention(q, k, v, causal=True, block_k=8, **kw)
        x = o.transpose(0, 2, 1, 3).reshape(B, L, H * DV)
        return qdot_general(x, w, (((2,), (0,)), ((), ())), "bf16_saved_e5m6_pow2")

    return f


def _gemm_inputs():
    q, k, v = _inputs((B, H, L, K), (B, H, T, K), DV, seed=5)
    rng = np.random.default_rng(6)
    bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)  # noqa: E731
    w = bf16(rng.standard_normal((H * DV, 24)))  # the recipe's BF16 casts are exact
    g = bf16(rng.standard_normal((B, L, 24)))
    return q, k, v, w, g


def _oracle(q, k, v, w, g, o_used):
    """float64 gradients of <g, merge(attention(q, k, v)) @ w> whose two backward consumers,
    the GEMM's wgrad and the attention's D = rowsum(dO * O), both use ``o_used``."""
    q, k, v, w, g, o_used = (np.asarray(a, np.float64) for a in (q, k, v, w, g, o_used))
    s = np.einsum("bhld,bhtd->bhlt", q, k) / np.sqrt(K)
    s = np.where(np.arange(T)[None, :] <= np.arange(L)[:, None] + (T - L), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    x_used = o_used.transpose(0, 2, 1, 3).reshape(B, L, H * DV)
    dw = np.einsum("blk,bln->kn", x_used, g)
    do = (g @ w.T).reshape(B, L, H, DV).transpose(0, 2, 1, 3)
    delta = np.sum(do * o_used, -1, keepdims=True)
    dv = np.einsum("bhlt,bhld->bhtd", p, do)
    ds = p * (np.einsum("bhld,bhtd->bhlt", do, v) - delta)
    dq = np.einsum("bhlt,bhtd->bhld", ds, k) / np.sqrt(K)
    dk = np.einsum("bhlt,bhld->bhtd", ds, q) / np.sqrt(K)
    return dq, dk, dv, dw


def test_the_e5m6_attention_output_is_one_copy_shared_by_both_consumers():
    """DeepSeek-V3 keeps the attention output once, in E5M6 with power-of-two scales, for
    the next GEMM's wgrad and the attention's backward. The vjp's residuals hold one E5M6
    copy (the GEMM's) and no other copy of O; the gradients equal a float64 oracle in which
    both consumers use DQ(Q(O)), and differ from one that uses O itself."""
    import fp4lab
    from fp4lab.beyond.attention import stored_output

    q, k, v, w, g = _gemm_inputs()
    f = _attention_then_gemm(FMT)
    _, pull = jax.vjp(f, q, k, v, w)
    res = [a for a in jax.tree.leaves(pull) if hasattr(a, "dtype")]
    o_shape = (B, H, L, DV)
    assert [a.shape for a in res if a.dtype == jnp.float16] == [(1, B * L, H * DV)]
    assert not [a for a in res if a.shape == o_shape]  # the attention keeps no O
    _, pull_dtype = jax.vjp(_attention_then_gemm("float32"), q, k, v, w)
    assert [a.shape for a in jax.tree.leaves(pull_dtype) if hasattr(a, "shape")
            and a.shape == o_shape] == [o_shape]  # a dtype: the attention's own second copy

    got = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * g), argnums=(0, 1, 2, 3)))(q, k, v, w)
    o = jax.jit(lambda *a: flash_attention(*a, causal=True, block_k=8))(q, k, v)
    o_stored = stored_output(o, fp4lab.get_format(FMT), jnp.float32)
    assert not np.array_equal(np.asarray(o_stored), np.asarray(o))
    want = _oracle(q, k, v, w, g, o_stored)
    exact = _oracle(q, k, v, w, g, o)
    for name, a, b, c in zip(("dq", "dk", "dv", "dw"), got, want, exact, strict=True):
        a, scale = np.asarray(a, np.float64), np.max(np.abs(b))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * scale, err_msg=name)
        if name != "dv":  # dV = P^T dO does not read O
            assert np.max(np.abs(a - c)) > 1e-4 * scale, name


def test_saved_format_refuses_casts_and_double_settings():
    q, k, v = _inputs((1, 4, 8), (1, 4, 8), 8)
    with pytest.raises(ValueError, match="saved_format='bf16' is a cast"):
        flash_attention(q, k, v, saved_format="bf16")
    with pytest.raises(ValueError, match="give one"):
        flash_attention(q, k, v, saved_format=FMT, saved_dtype="float32")
    with pytest.raises(ValueError, match="unknown format 'e5m7'"):
        flash_attention(q, k, v, saved_format="e5m7")
