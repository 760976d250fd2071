"""fp4lab.gemm.qdot: forward and gradients against an oracle built here from
quantize/dequantize/dot."""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4lab
from fp4lab.numerics import scaling
from fp4lab.numerics.hadamard import hadamard_matrix, rht, rht_matrix
from fp4lab.gemm.qdot import qdot_general, qeinsum
from fp4lab.gemm.recipe import RECIPES, OperandQuant, get_recipe
from fp4lab import GemmState

HI = jax.lax.Precision.HIGHEST
DN = (((1,), (0,)), ((), ()))  # (M, K) x (K, N)


def data(m=48, k=64, n=32, dtype=jnp.bfloat16):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), dtype)
    w = (jax.random.normal(kw, (k, n)) * 0.05).astype(dtype)
    g = jax.random.normal(kg, (m, n), dtype)
    return x, w, g


def oracle_operand(v, op, axis, key, signs="te", amax=None):
    """The operand as the recipe spec says, composed explicitly from the public API
    (``amax``: the delayed-scaling amax of a per-tensor operand; below max|v| it saturates
    v, as delayed scaling does): its dequantized values. Composed under jit: op by op, the
    oracles compiled some 270 one-operation programs per shape; test_rewrites holds the
    compiled transforms and quantizers to the NumPy oracles."""
    q = quantized_operand(v, op, axis, key, signs, amax)
    return q if op.format.is_passthrough else fp4lab.dequantize(q)


def quantized_operand(v, op, axis, key, signs="te", amax=None):
    """The operand's QArray (its cast values for a pass-through format)."""
    if isinstance(signs, jax.Array):  # drawn signs: an argument, the rest static
        return _operand(v, key, amax, signs, op=op, axis=axis, signs=None)
    return _operand(v, key, amax, None, op=op, axis=axis, signs=signs)


@functools.partial(jax.jit, static_argnames=("op", "axis", "signs"))
def _operand(v, key, amax, drawn_signs, *, op, axis, signs):
    if op.hadamard:
        v = rht(v, axis, op.hadamard, signs if drawn_signs is None else drawn_signs)
    if op.format.is_passthrough:
        return v.astype(op.format.element.storage)
    return fp4lab.quantize(v.astype(jnp.float32), op.format, axis=-1 if op.tile else axis,
                           tile=op.tile, rounding=op.rounding, key=key, global_amax=amax)


class Op(NamedTuple):
    """An oracle GEMM operand (docs/numerics.md, "The GEMM"): the values ``v`` the GEMM
    multiplies and the ``factor`` / ``divisor`` it scales its product by (NumPy float32,
    broadcastable to ``v`` with size 1 along the reduction)."""

    v: jax.Array
    factor: np.ndarray = np.float32(1)
    divisor: np.ndarray = np.float32(1)
    bf16: bool = False  # whether the format's values are BF16 numbers (else: v's dtype)

    @property
    def T(self):
        return self._replace(v=self.v.T, factor=np.transpose(self.factor),
                             divisor=np.transpose(self.divisor))


NVFP4_SCHEMES = (scaling.NVFP4Scale, scaling.RowScaledNVFP4Scale, scaling.FourOverSixScale)


def gemm_operand(v, op, axis, key, signs="te", amax=None) -> Op:
    """The operand as the GEMM multiplies it, from its QArray: NVFP4 (TE's GEMM) multiplies
    ``q * s`` (the decode with amax 0) and scales the product by ``amax / 6E``; per-tensor and
    per-channel abs-max scales (FP8 scale_inv) after the product; everything else as
    dequantized."""
    q = quantized_operand(v, op, axis, key, signs, amax)
    if op.format.is_passthrough:
        return Op(q, bf16=q.dtype == jnp.bfloat16)
    scheme = q.format.scaling
    keepdims = [1 if i == axis else n for i, n in enumerate(q.shape)]
    if isinstance(scheme, NVFP4_SCHEMES):
        amax = np.asarray(q.global_scale, np.float32)
        amax = amax.reshape(keepdims if amax.size > 1 else ())
        six_e = 6 * getattr(scheme, "e4m3_max", 448)
        inner = fp4lab.dequantize(dataclasses.replace(
            q, global_scale=jnp.zeros_like(q.global_scale)))
        return Op(inner, np.where(amax == 0, 1, amax).astype(np.float32),
                  np.where(amax == 0, 1, six_e).astype(np.float32), True)
    if isinstance(scheme, scaling.AbsMaxScale) and (q.scale.size == 1 or (
            op.tile is None and q.scale.shape[axis] == 1)):
        scale = np.asarray(q.scale, np.float32)
        inner = fp4lab.dequantize(dataclasses.replace(q, scale=jnp.ones_like(q.scale)))
        return Op(inner, scale.reshape(keepdims if scale.size > 1 else ()), bf16=True)
    # MX values (E8M0 scales) are multiplied as BF16, the others as dequantized (float32)
    return Op(fp4lab.dequantize(q), bf16=isinstance(scheme, scaling.E8M0Scale))


def folded(t: Op, axis: int) -> Op:
    """``t`` with a factor that varies along the reduction ``axis`` multiplied into the
    values (QAT's backward with the forward's per-channel W): ``fl(v * fl(f * fl(1 / d)))``."""
    if all(np.ndim(a) == 0 or np.shape(a)[axis] == 1 for a in (t.factor, t.divisor)):
        return t
    f32 = np.float32
    m = f32(t.factor) * (f32(1) / f32(t.divisor))
    return Op(jnp.asarray(np.asarray(t.v, f32) * m.astype(f32)))


def gemm(a, b):
    """``a @ b`` as the quantized GEMM computes it: the values' products accumulated in
    float32 (BF16 operands where both are BF16 numbers, which only the order of the sum can
    tell), then ``fl(product * fl(fl(fa * fb) * fl(1 / (da * db))))`` in NumPy float32."""
    a, b = (t if isinstance(t, Op) else Op(t, bf16=t.dtype == jnp.bfloat16) for t in (a, b))
    a, b = folded(a, 1), folded(b, 0)
    both = a.bf16 and b.bf16
    y = np.asarray(dot(*(jnp.asarray(t.v).astype(jnp.bfloat16) if both else t.v
                         for t in (a, b))))
    if all(np.all(t.factor == 1) and np.all(t.divisor == 1) for t in (a, b)):
        return jnp.asarray(y)
    f32 = np.float32
    alpha = (f32(a.factor) * f32(b.factor)) * (f32(1) / (f32(a.divisor) * f32(b.divisor)))
    return jnp.asarray(y * alpha.astype(f32))


def history_for(recipe):
    """An amax history whose maximum differs per operand (None: no delayed scaling)."""
    r = get_recipe(recipe)
    if r.delayed is None:
        return None
    h = np.zeros((6, r.delayed.history_len), np.float32)
    h[:, 3] = [2.5, 0.125, 1.75, 0.0625, 3.5, 0.5]
    return jnp.asarray(h)


def dot(a, b):
    dt = jnp.promote_types(a.dtype, b.dtype)
    return jnp.matmul(a.astype(dt), b.astype(dt), precision=HI if dt == jnp.float32 else None,
                      preferred_element_type=jnp.float32)


def signs_of(r, name, key):
    """The operand's sign vector: the recipe's fixed one, or for ``"random"`` the documented
    draw (``jax.random.rademacher`` of ``fold_in(key, 6 + GEMM index)``, fprop 0, dgrad 1,
    wgrad 2)."""
    op = r.operands[name]
    s = r.signs(op)
    if s != "random" or not op.hadamard:
        return s
    gemm = {"fprop": 0, "dgrad": 1, "wgrad": 2}[name.split("_")[0]]
    return jax.random.rademacher(jax.random.fold_in(key, 6 + gemm), (op.hadamard,), jnp.float32)


def block_diagonal_rht(length, n, signs):
    """The dense matrix ``Tb`` (length x length, a multiple of n) with ``rht(x, -1) = x @ Tb``
    for a row vector x: ``diag(s) H_n / sqrt(n)`` per group, in float64 (not the butterflies)."""
    if isinstance(signs, jax.Array):
        t = np.asarray(signs, np.float64)[:, None] * hadamard_matrix(n) / np.sqrt(n)
    else:
        t = rht_matrix(n, signs).astype(np.float64)
    return np.kron(np.eye(length // n), t)


def trust_oracle(v, op, axis):
    """QuEST's trust mask ``|v / 2**e| < 6``, e from the stored E8M0 bytes of ``v``'s blocks."""
    q = fp4lab.quantize(v.astype(jnp.float32), op.format, axis=axis)
    e = np.asarray(q.scale).astype(np.int64) - 127
    s = np.repeat(2.0 ** e, op.format.block, axis=axis)
    return np.abs(np.asarray(v, np.float64) / s) < op.format.element.max


def oracle(x, w, g, recipe, key):
    """(y, dx, dw) for Y = X W with X (M,K), W (K,N), dY (M,N); keys fold_in(key, 0..5).
    A forward transform is a change of basis around the GEMM: every GEMM runs on the rotated
    X and W (``rht`` in their dtype, widened to float32), and the gradients with respect to
    them map back by ``Tb^T`` (dX) and ``Tb`` (dW), in float64 here."""
    r = get_recipe(recipe)
    n_h = r.fprop_x.hadamard
    if not n_h:
        return oracle_in_basis(x, w, g, r, key)
    sx = signs_of(r, "fprop_x", key)
    plain = dataclasses.replace(r, fprop_x=dataclasses.replace(r.fprop_x, hadamard=0),
                                fprop_w=dataclasses.replace(r.fprop_w, hadamard=0))
    xr, wr = (rht(t, axis, n_h, sx).astype(jnp.float32) for t, axis in ((x, 1), (w, 0)))
    y, dx, dw = oracle_in_basis(xr, wr, g, plain, key)
    tb = block_diagonal_rht(xr.shape[1], n_h, sx)
    dx = jnp.asarray((np.asarray(dx, np.float64) @ tb.T)[:, :x.shape[1]], jnp.float32)
    dw = jnp.asarray((tb @ np.asarray(dw, np.float64))[:w.shape[0]], jnp.float32)
    return y, dx, dw


def oracle_in_basis(x, w, g, r, key):
    """The oracle of a recipe without a forward transform. Operands ``source="forward"``
    requantize the forward's X or W; the trust mask zeroes dX and dW where the forward
    quantizers clipped X and W (Quartet)."""
    k = [None if key is None else jax.random.fold_in(key, i) for i in range(6)]
    h = history_for(r)
    a = [None if h is None else jnp.max(h[i]) for i in range(6)]
    split = gemm_operand if not r.requantizes else lambda *a, **k: Op(oracle_operand(*a, **k))
    xq = split(x, r.fprop_x, 1, k[0], amax=a[0])
    wq = split(w, r.fprop_w, 0, k[1], amax=a[1])
    y = gemm(xq, wq)
    if r.backward == "ste":
        return y, gemm(g, wq.T), gemm(xq.T, g)
    dyq = gemm_operand(g, r.dgrad_dy, 1, k[2], signs_of(r, "dgrad_dy", key), amax=a[2])
    if r.dgrad_w.source == "forward":
        wq2 = gemm_operand(wq.v, r.dgrad_w, 1, k[3], signs_of(r, "dgrad_w", key))
    elif r.fprop_w.tile and r.fprop_w == r.dgrad_w:
        wq2 = wq
    else:
        wq2 = gemm_operand(w, r.dgrad_w, 1, k[3], signs_of(r, "dgrad_w", key), amax=a[3])
    dx = gemm(dyq, wq2.T)
    if r.trust:
        dx = jnp.where(trust_oracle(x, r.fprop_x, 1), dx, 0)
    if r.saved_x is not None:  # the backward pass finds X as stored: DQ(Q(X)) along K
        x = oracle_operand(x, OperandQuant(format=r.saved_x.format), 1, None).astype(x.dtype)
    x_src = xq.v if r.wgrad_x.source == "forward" else x
    xq3 = gemm_operand(x_src, r.wgrad_x, 0, k[4], signs_of(r, "wgrad_x", key), amax=a[4])
    dyq3 = gemm_operand(g, r.wgrad_dy, 0, k[5], signs_of(r, "wgrad_dy", key), amax=a[5])
    dw = gemm(xq3.T, dyq3)
    if r.trust:
        dw = jnp.where(trust_oracle(w, r.fprop_w, 0), dw, 0)
    return y, dx, dw


def assert_equal_up_to_sum_order(a, b):
    """GEMM outputs: equal up to the float32 accumulation order (which differs between two
    GEMM calls, or between a sharded and an unsharded one) and then one unit in the last place
    of the result's dtype. The tolerance is keyed by dtype: eps(dtype) * |b| + 8 * eps(fp32) *
    max|b|."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    ulp = float(jnp.finfo(a.dtype).eps)
    af, bf = a.astype(np.float64), b.astype(np.float64)
    tol = ulp * np.abs(bf) + 8 * float(np.finfo(np.float32).eps) * np.abs(bf).max()
    bad = np.abs(af - bf) > tol
    assert not bad.any(), f"{bad.sum()} elements differ by more than 1 ulp: {af[bad][:4]} " \
        f"vs {bf[bad][:4]}"


def run(x, w, g, recipe, key):
    h = history_for(recipe)
    y, vjp = jax.vjp(lambda a, b: qdot_general(a, b, DN, recipe,
                                               GemmState(key=key, amax_history=h),
                                               preferred_element_type=jnp.float32), x, w)
    dx, dw = vjp(g.astype(jnp.float32))
    return y, dx, dw


def _custom(name, fwd, bwd, **kw):
    return fp4lab.Recipe(name=name, fprop_x=fwd, fprop_w=fwd, dgrad_dy=bwd, dgrad_w=bwd,
                         wgrad_x=bwd, wgrad_dy=bwd, **kw)


# recipes no paper publishes that combine the features in other ways: a forward transform
# with a backward from the inputs (it sees the rotated X and W) or with QAT, the trust mask
# without a transform, fixed random signs in the forward
CUSTOM = [
    _custom("rht_forward_from_input", OperandQuant(format="nvfp4", hadamard=16),
            OperandQuant(format="nvfp4", rounding="stochastic")),
    _custom("rht_forward_qat", OperandQuant(format="mxfp4", hadamard=32),
            OperandQuant(format="bf16"), backward="ste", hadamard_signs=7),
    _custom("trust_from_input", OperandQuant(format="quest_mxfp4"),
            OperandQuant(format="mxfp4", hadamard=16), trust=True),
    _custom("rht_forward_random_trust", OperandQuant(format="mxfp4", hadamard=32),
            OperandQuant(format="mxfp8", source="input"), trust=True, hadamard_signs="random"),
]


# (tetrajet_v2_outcontrol without channels is tetrajet_v2 bit for bit, and with them has its
# own oracle: tests/fp4lab/test_outcontrol.py)
@pytest.mark.parametrize("recipe", [r for r in RECIPES if RECIPES[r].outliers is None] + CUSTOM,
                         ids=lambda r: getattr(r, "name", r))
def test_forward_and_gradients_equal_the_oracle(recipe):
    x, w, g = data()
    key = jax.random.key(7)
    y, dx, dw = jax.jit(run, static_argnums=3)(x, w, g, recipe, key)
    ey, edx, edw = oracle(x, w, g.astype(jnp.float32), recipe, key)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ey))  # forward: bit for bit
    assert_equal_up_to_sum_order(dx, edx.astype(x.dtype))
    assert_equal_up_to_sum_order(dw, edw.astype(w.dtype))


def test_bf16_recipe_equals_a_plain_bf16_dot():
    x, w, g = data()
    y = qdot_general(x, w, DN, "bf16")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jnp.dot(x, w)))
    gx, gw = jax.grad(lambda a, b: jnp.sum(qdot_general(a, b, DN, "bf16") * g), (0, 1))(x, w)
    ex, ew = jax.grad(lambda a, b: jnp.sum(jnp.dot(a, b) * g), (0, 1))(x, w)
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(ex))
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(ew))


@pytest.mark.parametrize("recipe", ["fp4_qat", "int4_qat", "q4_0_qat", "mxfp4_weights"])
def test_qat_recipes_are_straight_through(recipe):
    x, w, g = data(dtype=jnp.float32)
    r = get_recipe(recipe)
    xq = oracle_operand(x, r.fprop_x, 1, None)  # a BF16 cast for these recipes
    wq = oracle_operand(w, r.fprop_w, 0, None)
    _, dx, dw = run(x, w, g, recipe, None)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(dot(g, wq.T)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(dot(xq.T, g)), rtol=1e-5, atol=1e-5)


def test_rht_matrix_is_orthogonal_and_cancels_in_wgrad():
    t = rht_matrix(16)
    np.testing.assert_allclose(t @ t.T, np.eye(16), atol=1e-6)
    np.testing.assert_array_equal(np.abs(hadamard_matrix(16)), 1)
    np.testing.assert_allclose(rht_matrix(16)[0] * 4, [1] * 16)  # first row: s0 * ones
    x, _, g = data(m=40, dtype=jnp.float32)  # 40 tokens: padded to 48 inside the RHT
    plain = dot(x.T, g)
    rotated = dot(rht(x, 0).T, rht(g, 0))
    np.testing.assert_allclose(np.asarray(rotated), np.asarray(plain), rtol=2e-5, atol=2e-5)
    # with quantization off (fp32 operands), wgrad with and without RHT agree to fp32 rounding
    fp32_rht = RECIPES["fp32"].__class__(
        name="fp32_rht", wgrad_x=fp4lab.gemm.recipe.OperandQuant(format="fp32", hadamard=16),
        wgrad_dy=fp4lab.gemm.recipe.OperandQuant(format="fp32", hadamard=16))
    w = jnp.zeros((64, 32))
    _, _, dw_rht = run(x, w, g, fp32_rht, None)
    _, _, dw = run(x, w, g, "fp32", None)
    np.testing.assert_allclose(np.asarray(dw_rht), np.asarray(dw), rtol=2e-5, atol=2e-5)
    # a seeded sign vector is another orthogonal transform
    t7 = rht_matrix(32, 7)
    np.testing.assert_allclose(t7 @ t7.T, np.eye(32), atol=1e-6)


def test_stochastic_rounding_mean_gradient_approaches_exact():
    x, w, g = data(m=32, k=32, n=16, dtype=jnp.float32)
    exact_dx = dot(g, oracle_operand(w, RECIPES["nvfp4"].dgrad_w, 1, None).T)
    keys = jax.random.split(jax.random.key(0), 400)
    dxs = jax.vmap(lambda k: run(x, w, g, "nvfp4", k)[1])(keys)
    mean = np.asarray(dxs).mean(0)
    single = np.asarray(dxs[0])
    err_mean = np.linalg.norm(mean - exact_dx) / np.linalg.norm(exact_dx)
    err_one = np.linalg.norm(single - exact_dx) / np.linalg.norm(exact_dx)
    # averaging 400 independent draws shrinks the SR noise by ~sqrt(400) = 20; what remains is
    # the (deterministic, RTN-like) quantization of the block scales' saturation
    assert err_mean < err_one / 5, (err_mean, err_one)


def test_keys_differ_per_operand_and_are_reproducible():
    x, w, g = data()
    a = run(x, w, g, "nvfp4", jax.random.key(1))
    b = run(x, w, g, "nvfp4", jax.random.key(1))
    c = run(x, w, g, "nvfp4", jax.random.key(2))
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    assert not np.array_equal(np.asarray(a[1]), np.asarray(c[1]))


def test_general_dimension_numbers_and_batch_dims():
    kx, kw = jax.random.split(jax.random.key(3))
    # attention-like: (batch, heads, q, d) x (batch, heads, k, d) contracting d, batch (b, h)
    q = jax.random.normal(kx, (2, 3, 8, 32))
    k = jax.random.normal(kw, (2, 3, 16, 32))
    dn = (((3,), (3,)), ((0, 1), (0, 1)))
    y = qdot_general(q, k, dn, "fp32")
    np.testing.assert_allclose(np.asarray(y), np.asarray(
        jax.lax.dot_general(q, k, dn, precision=HI)), rtol=1e-6, atol=1e-5)
    # per batch entry, quantized: equals the einsum through quantized operands along d
    y4 = qeinsum("bhqd,bhkd->bhqk", q, k, "mxfp8")
    e4 = jnp.einsum("bhqd,bhkd->bhqk", fp4lab.fake_quant(q, "mxfp8"),
                    fp4lab.fake_quant(k, "mxfp8"), precision=HI)
    np.testing.assert_allclose(np.asarray(y4), np.asarray(e4), rtol=1e-6, atol=1e-5)
    # leading token axes and a transposed weight (N, K)
    x = jax.random.normal(kx, (2, 5, 64))
    wt = jax.random.normal(kw, (24, 64))
    y = qdot_general(x, wt, (((2,), (1,)), ((), ())), "mxfp8")
    e = jnp.einsum("bsk,nk->bsn", fp4lab.fake_quant(x, "mxfp8"), fp4lab.fake_quant(wt, "mxfp8"),
                   precision=HI)
    np.testing.assert_allclose(np.asarray(y), np.asarray(e), rtol=1e-6, atol=1e-5)
    gx = jax.grad(lambda a: qdot_general(a, wt, (((2,), (1,)), ((), ())), "fp32").sum())(x)
    assert gx.shape == x.shape


def test_contracting_size_not_a_multiple_of_the_block_is_padded():
    x = jax.random.normal(jax.random.key(4), (8, 40))  # K = 40: NVFP4 pads to 48
    w = jax.random.normal(jax.random.key(5), (40, 8))
    r = get_recipe("nvfp4_no_sr")
    y = qdot_general(x, w, DN, r)
    e = gemm(gemm_operand(x, r.fprop_x, 1, None), gemm_operand(w, r.fprop_w, 0, None))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(e.astype(y.dtype)))
    # the padding adds nothing: the float64 product of the dequantized operands
    exact = np.asarray(fp4lab.fake_quant(x, "nvfp4"), np.float64) @ np.asarray(
        fp4lab.fake_quant(w, "nvfp4", tile=(16, 16)), np.float64)
    np.testing.assert_allclose(np.asarray(y), exact, rtol=2e-6, atol=1e-6)


def test_bad_inputs():
    x, w, _ = data()
    with pytest.raises(ValueError, match="unknown recipe 'nvfp5'.*nvfp4"):
        qdot_general(x, w, DN, "nvfp5")
    with pytest.raises(ValueError, match="recipe nvfp4 uses stochastic rounding: pass a key"):
        qdot_general(x, w, DN, "nvfp4")
    with pytest.raises(TypeError, match="lhs has dtype int32"):
        qdot_general(jnp.ones((4, 64), jnp.int32), w, DN, "bf16")
    with pytest.raises(ValueError, match="differ"):
        qdot_general(x, w[:32], DN, "bf16")
    with pytest.raises(ValueError, match="does not match ranks"):
        qeinsum("...abc,df->...f", x, w)
    with pytest.raises(ValueError, match="summed alone"):
        qeinsum("md,df->m", x, w)
    # misspelt keywords are errors, not silently ignored
    for bad in ({"bakend": "xla"}, {"probes": None}, {"recipie": "nvfp4"}):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(bad))}'"):
            qdot_general(x, w, DN, "bf16", **bad)
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            qeinsum("md,df->mf", x, w, "bf16", **bad)
    with pytest.raises(TypeError, match="key=1 is not a PRNG key"):
        qdot_general(x, w, DN, "nvfp4", GemmState(key=1))
    # what Flax layers pass is accepted
    y = qdot_general(x, w, DN, "bf16", precision=None, preferred_element_type=jnp.float32,
                     out_sharding=None)
    assert y.dtype == jnp.float32


# dimension numbers lax.dot_general refuses: qdot_general used to take an out-of-range or
# negative axis modulo the rank and silently contract another axis (the first case
# equalled the axis-1 product)
BAD_DIMS = [
    ((((3,), (0,)), ((), ())), r"lhs axis 3 is not an axis of the lhs of shape \(4, 8\)"),
    ((((-1,), (0,)), ((), ())), r"lhs axis -1 is not an axis .*negative axes are refused"),
    ((((1,), (-2,)), ((), ())), r"rhs axis -2 is not an axis of the rhs"),
    ((((1,), (5,)), ((), ())), r"rhs axis 5 is not an axis of the rhs of shape \(8, 3\)"),
    ((((1, 1), (0, 0)), ((), ())), r"the lhs's contracting and batch axes \(1, 1\) repeat"),
    ((((1,), (0,)), ((1,), (1,))), r"the lhs's contracting and batch axes \(1, 1\) repeat"),
    ((((1,), (0, 1)), ((), ())), r"pair up unequal axis counts"),
    ((((1.0,), (0,)), ((), ())), r"lhs axis 1.0 is not an axis"),
    (((1,), (0,)), r"is not \(\(lhs_contracting, rhs_contracting\), \(lhs_batch"),
]


@pytest.mark.parametrize("dims,error", BAD_DIMS)
def test_dimension_numbers_lax_refuses_are_refused(dims, error):
    x, w = jnp.ones((4, 8)), jnp.ones((8, 3))
    with pytest.raises((TypeError, ValueError)):  # the reference refuses them too
        jax.lax.dot_general(x, w, dims)
    with pytest.raises(ValueError, match=error):
        qdot_general(x, w, dims, "bf16")
    with pytest.raises(ValueError, match=error):
        fp4lab.gemm.qdot.saved_bytes(x, w, dims, "nvfp4")


BAD_SPECS = [("md,dn->mx", r"output letters \['x'\] are in neither operand"),
             ("md,dn->mnn", r"\['n'\] repeat in the output"),
             ("mdd,dn->mn", r"\['d'\] repeat in the first operand \(a diagonal or trace"),
             ("md,dnn->mn", r"\['n'\] repeat in the second operand"),
             ("m1,dn->mn", r"'m1' has characters other than letters"),
             ("md,dn", r"must look like 'bsd,df->bsf'"),
             ("md,dn->m", r"\['n'\] of the second operand are summed alone")]


@pytest.mark.parametrize("spec,error", BAD_SPECS)
def test_einsum_specs_that_are_no_gemm_are_refused(spec, error):
    with pytest.raises(ValueError, match=error):
        qeinsum(spec, jnp.ones((4, 8)), jnp.ones((8, 3)), "bf16")


def test_intercepted_calls_validate_their_dimension_numbers():
    """A model's own lax.dot_general / jnp.einsum calls, quantized by an op rule, are checked
    as qdot_general checks them."""
    import flax.linen as nn
    from fp4lab.flax import quantize_model
    from fp4lab.policy import PrecisionPolicy, Rule

    class Mix(nn.Module):
        dims: tuple

        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.normal(), (8, 3))
            return jax.lax.dot_general(x, w, self.dims)

    x = jnp.ones((4, 8))
    policy = PrecisionPolicy(rules=(Rule(recipe="mxfp8", kind="lax.dot_general"),))
    good = Mix((((1,), (0,)), ((), ())))
    params = good.init(jax.random.key(0), x)
    quantize_model(good, policy).apply(params, x)
    with pytest.raises(ValueError, match=r"lhs axis -1 is not an axis"):
        quantize_model(Mix((((-1,), (0,)), ((), ()))), policy).apply(params, x)


def test_qeinsum_ellipses_name_the_same_dims_in_every_term():
    kx, kw = jax.random.split(jax.random.key(6))
    x = jax.random.normal(kx, (2, 3, 5, 32))
    w = jax.random.normal(kw, (32, 16))
    y = qeinsum("...d,df->...f", x, w, "mxfp8")
    e = jnp.einsum("...d,df->...f", fp4lab.fake_quant(x, "mxfp8"), fp4lab.fake_quant(w, "mxfp8"),
                   precision=HI)
    np.testing.assert_allclose(np.asarray(y), np.asarray(e), rtol=1e-6, atol=1e-5)
    # an ellipsis on both sides is a batch (the experts' einsum)
    xe = jax.random.normal(kx, (4, 6, 32))
    we = jax.random.normal(kw, (4, 32, 8))
    ye = qeinsum("...td,...df->...tf", xe, we, "fp32")
    np.testing.assert_allclose(np.asarray(ye), np.asarray(
        jnp.einsum("etd,edf->etf", xe, we, precision=HI)), rtol=1e-6, atol=1e-5)


def test_sharded_qdot_equals_unsharded():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = np.array(jax.devices()[:8])
    assert devices.size == 8, "tests run with 8 simulated CPU devices (tests/conftest.py)"
    mesh = Mesh(devices.reshape(4, 2), ("data", "model"))
    x, w, g = data(m=64, k=64, n=32)
    key = jax.random.key(11)
    f = jax.jit(run, static_argnums=3)
    want = f(x, w, g, "nvfp4", key)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
    gs = jax.device_put(g, NamedSharding(mesh, P("data", "model")))
    got = f(xs, ws, gs, "nvfp4", key)
    assert got[0].sharding.spec == P("data", "model")
    for a, b in zip(got, want, strict=True):
        assert_equal_up_to_sum_order(b, a)
    # the quantized operands themselves are bit-identical under sharding
    fq = jax.jit(lambda t: fp4lab.fake_quant(t, "nvfp4", tile=(16, 16)))
    np.testing.assert_array_equal(np.asarray(fq(ws)), np.asarray(fq(w)))


# ----------------------------------------------------------------------------- probes


def test_probes_report_known_underflow_of_every_operand():
    # MXFP8 (E4M3, power-of-two scales): in a block whose amax is 1, magnitudes below half the
    # smallest subnormal 2**-9 * 2**-8 flush to zero. Each 32-block holds one 1.0 and 31 tiny
    # values, so exactly 31/32 of the nonzero entries underflow along the block axis.
    from fp4lab.numerics.metrics import METRIC_NAMES
    from fp4lab.features.probes import probe_table, probe_zeros
    from fp4lab.gemm.recipe import OPERANDS

    tiny = 2.0 ** -20
    blockish = np.full((64, 64), tiny, np.float32)
    blockish[:, ::32] = 1.0  # along axis 1: one 1.0 per 32-block
    x = jnp.asarray(blockish)  # fprop X blocks run along K = axis 1
    w = jnp.asarray(blockish.T.copy())  # fprop W blocks run along K = axis 0
    dy = jnp.asarray(blockish)  # dgrad dY blocks run along N = axis 1

    def loss(x, w, probe):
        return jnp.sum(qdot_general(x, w, DN, "mxfp8", GemmState(probe=probe)) * dy)

    gp = jax.grad(loss, argnums=2)(x, w, probe_zeros())
    t = probe_table(gp)
    assert list(t) == list(OPERANDS) and list(t["fprop_x"]) == list(METRIC_NAMES)
    for op in ("fprop_x", "fprop_w", "dgrad_dy"):
        assert t[op]["underflow"] == 31 / 32, (op, t[op])
        assert t[op]["saturation"] == 0.0
    # wgrad quantizes X and dY along the token axis (axis 0): each column is all 1.0 or all
    # tiny, so every block is scaled to its own amax and represented exactly
    for op in ("wgrad_x", "wgrad_dy"):
        assert t[op]["underflow"] == 0.0 and t[op]["rel_mse"] == 0.0, (op, t[op])
    # the probe does not change the result or the real gradients
    g0 = jax.grad(loss, argnums=(0, 1))(x, w, None)
    g1 = jax.grad(loss, argnums=(0, 1))(x, w, probe_zeros())
    for a, b in zip(g0, g1, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_probes_of_qat_backward_are_nan_and_bf16_is_exact_for_bf16_inputs():
    from fp4lab.features.probes import probe_table, probe_zeros

    x, w, g = data()
    loss = lambda p, r: jnp.sum(qdot_general(x, w, DN, r, GemmState(probe=p)) * g)  # noqa: E731
    t = probe_table(jax.grad(loss)(probe_zeros(), "fp4_qat"))
    assert all(np.isnan(v) for op in ("dgrad_dy", "wgrad_dy") for v in t[op].values())
    assert t["fprop_w"]["rel_mse"] > 0
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    tb = probe_table(jax.grad(lambda p: jnp.sum(qdot_general(xb, wb, DN, "bf16",
                                                             GemmState(probe=p))))(probe_zeros()))
    assert tb["fprop_x"]["rel_mse"] == 0 and tb["fprop_x"]["underflow"] == 0
    with pytest.raises(ValueError, match="probe has shape"):
        qdot_general(x, w, DN, "bf16", GemmState(probe=jnp.zeros(3)))


def _op_counts(fn, *args):
    import collections
    import re

    text = jax.jit(fn).lower(*args).compile().as_text()
    return collections.Counter(re.findall(r"= \S+ ([a-z-]+)\(", text))


def test_a_constant_cotangent_is_quantized_at_run_time():
    """``qdot_general(...).sum()``: dY is a constant, whose quantization XLA's constant folder
    once computed at compile time (23 s at 2048^2). The compiled backward must keep the same
    reductions and divisions (the dY quantizers) as with a dY passed at run time, and give the
    same bits."""
    x, w, _ = data(64, 64, 64, jnp.float32)
    key = jax.random.key(3)

    def y(x, w):
        return qdot_general(x, w, DN, "nvfp4", GemmState(key=key))

    def by_sum(x, w):
        return jax.grad(lambda x, w: y(x, w).sum(), argnums=(0, 1))(x, w)

    def by_vjp(x, w, ct):
        return jax.vjp(y, x, w)[1](ct)

    ones = jnp.ones((64, 64), jnp.float32)
    folded, runtime = _op_counts(by_sum, x, w), _op_counts(by_vjp, x, w, ones)
    for op in ("reduce", "divide"):
        assert folded[op] == runtime[op], (op, folded[op], runtime[op])
    for a, b in zip(jax.jit(by_sum)(x, w), jax.jit(by_vjp)(x, w, ones), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_qat_backward_is_straight_through_at_special_values():
    """QAT's straight-through backward uses the forward's quantized operands, no arithmetic on
    X - Q(X): infinities, NaN, float32's max and subnormals in X leave dX = dY Q(W)^T finite
    and exact, and reach dW = Q(X)^T dY only where the product itself has them."""
    x, w, g = data(dtype=jnp.float32)
    big = np.finfo(np.float32).max
    special = [np.inf, -np.inf, np.nan, big, -big, 1e30, 1e-40, -1e-40, 2.0 ** -133, -0.0]
    x = x.at[0, :len(special)].set(jnp.asarray(special, jnp.float32))
    r = get_recipe("fp4_qat")
    xq, wq = oracle_operand(x, r.fprop_x, 1, None), oracle_operand(w, r.fprop_w, 0, None)
    y, dx, dw = run(x, w, g, "fp4_qat", None)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(dot(xq, wq)))
    assert np.isfinite(np.asarray(dx)).all()
    assert_equal_up_to_sum_order(dx, dot(g, wq.T))
    want = np.asarray(dot(xq.T, g))
    finite = np.isfinite(want)
    assert not finite[:3].any() and finite[len(special):].all()
    np.testing.assert_array_equal(np.asarray(dw)[~finite], want[~finite])
    assert_equal_up_to_sum_order(np.asarray(dw)[finite], want[finite])
