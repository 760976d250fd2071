"""qragged_dot (fp4lab/gemm/grouped.py) against its definition: the loop over experts that
calls qdot_general on each expert's rows with ``fold_in(key, e)``, for every registered recipe,
the forward and both gradients, bit for bit.

The loop's per-expert dots and the grouped GEMM's batched dots are XLA's, which may sum in
another order for another shape (a one-row dot is a matrix-vector product). So the comparison
runs with the dot accumulated exactly (``exact_dot``: the exact products summed with
``math.fsum``, then rounded once to float32, in both), which leaves every other bit to fp4lab;
XLA's own accumulation is checked separately against the same bound as any float32 dot.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import subprocess
from pathlib import Path

import adversarial
import jax
import ml_dtypes
import jax.numpy as jnp
import numpy as np
import pytest
from environments import CONSUMERS, python_of
from jax import lax

import fp4lab
from fp4lab.features.delayed import init_history
from fp4lab.features.outcontrol import channel_order
from fp4lab.gemm import grouped
from fp4lab.gemm import qdot as qdot_module
from fp4lab.gemm.grouped import qragged_dot
from fp4lab.gemm.recipe import OPERAND_TABLE, OPERANDS
from fp4lab.gemm.state import GemmState

# an empty expert, a one-token expert, and 35 = 2 * 16 + 3 = 32 + 3 tokens: partial NVFP4 and
# MX blocks along the tokens in wgrad, after whole ones
GROUP_SIZES = (1, 0, 35)
M, K, N = sum(GROUP_SIZES), 32, 32
DN = (((1,), (0,)), ((), ()))


def _pool(rng) -> np.ndarray:
    """Adversarial rows (values beside the rounding boundaries of NVFP4 for amax 3.0625, and of
    MXFP8), 32 wide, with the NVFP4 case's amax row first."""
    nv = adversarial.cases("nvfp4")[0].x.reshape(-1, 32)
    mx = adversarial.cases("mxfp8")[0].x[:, :32]
    first = nv[np.argmax(np.abs(nv).max(1))]
    rest = np.concatenate([nv, mx])[rng.permutation(len(nv) + len(mx))]
    return np.concatenate([first[None], rest])


def _operands(seed=0):
    rng = np.random.default_rng(seed)
    pool = _pool(rng)
    x = pool[:M].copy()
    x[M - 2] = 0.0  # a zero row, a signed zero, a subnormal
    x[M - 3, :3] = (-0.0, 1e-40, -3e-39)
    w = np.stack([pool[M + i * K:M + (i + 1) * K, :N] * 0.25 for i in range(len(GROUP_SIZES))])
    dy = pool[-M:, :N][::-1].copy()
    return (jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
            jnp.asarray(dy, jnp.float32))


def _fsum(a, b):
    """float32 of the exact sum of ``a * b`` over the last axis (exact float64 products of
    float32 values; ``math.fsum``: the correctly rounded sum; non-finite terms: IEEE's sum, the
    same in any order)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    out = np.empty(p.shape[:-1], np.float32)
    for i in np.ndindex(out.shape):
        t = p[i]
        out[i] = math.fsum(t) if np.isfinite(t).all() else np.sum(t)
    return out


def _exact_dot(a, b, dn):
    """qdot's ``_dot`` with an order-independent accumulation (module docstring)."""
    dt = jnp.promote_types(a.dtype, b.dtype)
    a, b = (t.astype(dt).astype(jnp.float32) for t in (a, b))
    (lc, rc), (lb, rb) = dn
    lf = [d for d in range(a.ndim) if d not in (*lc, *lb)]
    rf = [d for d in range(b.ndim) if d not in (*rc, *rb)]

    def host(a, b):
        a, b = np.asarray(a), np.asarray(b)
        size = lambda t, dims: math.prod(t.shape[d] for d in dims)  # noqa: E731
        a = np.transpose(a, (*lb, *lf, *lc)).reshape(size(a, lb), size(a, lf), size(a, lc))
        b = np.transpose(b, (*rb, *rf, *rc)).reshape(size(b, rb), size(b, rf), size(b, rc))
        return _fsum(a[:, :, None, :], b[:, None, :, :])

    shape = jax.eval_shape(functools.partial(lax.dot_general, dimension_numbers=dn,
                                             preferred_element_type=jnp.float32), a, b).shape
    return jax.pure_callback(lambda a, b: host(a, b).reshape(shape),
                             jax.ShapeDtypeStruct(shape, jnp.float32), a, b,
                             vmap_method="sequential")


@pytest.fixture
def exact_dot(monkeypatch):
    monkeypatch.setattr(qdot_module, "_dot", _exact_dot)
    for f in (grouped._grouped, grouped._expert_einsum):  # traced with XLA's dot elsewhere
        f.clear_cache()
    yield
    for f in (grouped._grouped, grouped._expert_einsum):
        f.clear_cache()


def _state(recipe, key, k=K, groups=3, per_expert=True):
    """A grouped call's state (stacked per expert) or expert ``per_expert``'s own."""
    hist = init_history(recipe.delayed) + 1.5 if recipe.delayed else None
    chans = (jnp.stack([channel_order(jnp.arange(k, dtype=jnp.float32) * (e + 1) % 7)
                        for e in range(groups)]) if recipe.outliers else None)
    if per_expert is True:
        return GemmState(key, None, None if hist is None else jnp.stack([hist] * groups), chans)
    e = per_expert
    return GemmState(None if key is None else jax.random.fold_in(key, e), None, hist,
                     None if chans is None else chans[e])


def _loop(x, w, dy, sizes, recipe, key):
    """The definition: qdot_general on each expert's rows, forward and gradients (each
    expert's own vjp: autodiff through slices would add the experts' zero-padded gradients,
    turning a -0 into +0); one compiled program."""
    return jax.jit(functools.partial(_loop_eager, sizes=sizes, recipe=recipe))(x, w, dy, key)


def _loop_eager(x, w, dy, key, *, sizes, recipe):
    ends = np.cumsum(sizes)
    out = []
    for e, (n, end) in enumerate(zip(sizes, ends, strict=True)):
        rows = slice(end - n, end)
        f = functools.partial(fp4lab.qdot_general, dimension_numbers=DN, recipe=recipe,
                              state=_state(recipe, key, per_expert=e))
        y, vjp = jax.vjp(f, x[rows], w[e])
        out.append((y, *vjp(dy[rows])))
    ys, dxs, dws = zip(*out, strict=True)
    return jnp.concatenate(ys), jnp.concatenate(dxs), jnp.stack(dws)


def _grads(f, x, w, dy):
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy))


def assert_same_bits(a, b, what):
    """Equal bit for bit, NaN payloads aside."""
    a, b = np.asarray(a), np.asarray(b)
    nan = np.isnan(a) & np.isnan(b)
    diff = (a.view(np.uint32) != b.view(np.uint32)) & ~nan
    assert not diff.any(), (f"{what}: {diff.sum()} of {diff.size} differ, first at "
                            f"{np.argwhere(diff)[0]}: {a[diff][0]!r} vs {b[diff][0]!r}")


# Every kind of quantizer and recipe feature under vmap (each recipe costs 5-20 s of
# compilation on the CI CPU): pass-through, FP8 delayed scaling, MX, NVFP4 (2D tiles, RHT,
# SR), a published recipe's scales with OutControl's channels, QAT with GGML blocks, a saved
# X. FP4LAB_ALL_RECIPES=1: every registered recipe (all 30 pass; Quartet II's, 19 s here,
# found div's vmap rewrite, which tests/fp4lab/test_division.py now checks directly).
_REPRESENTATIVE = ("bf16", "fp8_delayed", "mxfp8", "nvfp4", "tetrajet_v2_outcontrol",
                   "q4_0_qat", "bf16_saved_e5m6_pow2")


@pytest.mark.parametrize("recipe", [  # a shared expert scale is not the loop's: tested below
    r for r in fp4lab.recipe_names() if fp4lab.get_recipe(r).expert_scale == "expert"]
    if os.environ.get("FP4LAB_ALL_RECIPES") else _REPRESENTATIVE)
def test_every_recipe_is_the_loop_over_experts(recipe, exact_dot):
    r = fp4lab.get_recipe(recipe)
    x, w, dy = _operands()
    key = jax.random.key(7) if r.needs_key else None
    sizes = jnp.asarray(GROUP_SIZES, jnp.int32)
    got = _grads(lambda a, b: qragged_dot(a, b, sizes, r, _state(r, key)), x, w, dy)
    want = _loop(x, w, dy, GROUP_SIZES, r, key)
    for what, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        assert_same_bits(a, b, f"{recipe} {what}")


def test_xla_accumulation_differs_from_the_loop_only_by_summation_order():
    """With XLA's own float32 dots (the one-token expert's is a matrix-vector product), the
    grouped GEMM and the loop agree within float32 accumulation error. (MXFP8: the check is
    of the summation, whatever the format.)"""
    r = fp4lab.get_recipe("mxfp8")
    x, w, dy = _operands(1)
    key = None
    sizes = jnp.asarray(GROUP_SIZES, jnp.int32)
    got = _grads(lambda a, b: qragged_dot(a, b, sizes, r, key), x, w, dy)
    want = _loop(x, w, dy, GROUP_SIZES, r, key)
    for what, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        b = np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=0, atol=M * 2.0**-23 * np.abs(b).max(),
                                   err_msg=what)


def test_inf_and_nan_stay_in_their_expert(exact_dot):
    """A NaN in expert 0's row and an inf in the weight of expert 1 (which has no rows): the
    loop's results, expert 2's all finite (jax.lax.ragged_dot on CPU multiplies expert 1's
    inf by the zeros it puts in the other experts' rows, and every row becomes NaN). NVFP4:
    each expert's per-tensor scale is its own, so neither reaches another expert's."""
    recipe = "nvfp4"
    r = fp4lab.get_recipe(recipe)
    x, w, dy = _operands(2)
    x, w = x.at[0, 3].set(jnp.nan), w.at[1, 5, 1].set(jnp.inf)
    key = jax.random.key(2) if r.needs_key else None
    sizes = jnp.asarray(GROUP_SIZES, jnp.int32)
    got = _grads(lambda a, b: qragged_dot(a, b, sizes, r, key), x, w, dy)
    want = _loop(x, w, dy, GROUP_SIZES, r, key)
    for what, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        assert_same_bits(a, b, f"{recipe} {what}")
    y, dx, dw = map(np.asarray, got)
    assert np.isfinite(y[1:]).all() and np.isfinite(dx[1:]).all() and np.isfinite(dw[2]).all()
    assert np.isnan(y[0]).any()


def _torchao_agrees(a):
    """``a`` without the two kinds of MXFP8 blocks on which torchao 0.18's ``to_mx`` departs
    from TE's MX rules (docs/numerics.md, "MX formats"; test_torchao_departs_...): rows
    (along the last axis) whose largest magnitude lies below ``2^-100`` are lifted by ``2^64``
    (no block scale ``2^-127``), and magnitudes within ``2^-16`` above ``448 * 2^k`` become
    ``448 * 2^k`` (no RCEIL block amax whose float32 ``log2`` rounds down to an integer)."""
    amax = np.abs(a).max(-1, keepdims=True)
    a = np.where((amax > 0) & (amax < 2.0**-100), a * 2.0**64, a)
    m, e = np.frexp(np.abs(a) / 448.0)
    split = (m > 0.5) & (m <= 0.5 + 2.0**-16)
    return np.where(split, np.sign(a) * np.ldexp(448.0, e - 1), a).astype(np.float32)


# Blocks on which torchao 0.18's to_mx departs from TE's MX rules: a block amax one float32 ulp
# above 448 * 2^5 (d = fl(amax / 448) = 2^5 (1 + 2^-23): TE's RCEIL reads e = 6 from d's bits;
# torchao's ceil(log2(d)) in float32 rounds log2(d) down to 5, so its scale is 2^5, the amax
# saturates to 448 * 2^5 and the small elements keep a bit more), and a block of scale 2^-127
# with nonzero elements (torchao's RCEIL quantizes it with the scale 1, so it becomes zeros;
# its FLOOR quantizes with 2^-126 and stores 2^-127, halving it); a block both agree on.
_DEPARTURES = np.stack([
    np.r_[np.nextafter(np.float32(448 * 32), np.float32(np.inf)), np.linspace(-1.0, 1.5, 31)],
    np.linspace(-1.5e-36, 1.2e-36, 32),
    np.linspace(-3.0, 2.0, 32),
]).astype(np.float32)


def _check_departures(theirs):
    for fmt, rule, differ in (("mxfp8", "rceil", [True, True, False]),
                              ("mxfp8_floor", "floor", [False, True, False])):
        ours = np.asarray(fp4lab.dequantize(fp4lab.quantize(jnp.asarray(_DEPARTURES), fmt)))
        got = theirs[f"{rule}/blocks"]
        assert (ours != got).any(-1).tolist() == differ, (rule, ours - got)
    assert theirs["rceil/blocks"][0, 0] == 448 * 32  # saturated: torchao's scale 2^5
    assert (theirs["rceil/blocks"][1] == 0).all()
    np.testing.assert_array_equal(theirs["floor/blocks"][1],
                                  np.asarray(fp4lab.dequantize(fp4lab.quantize(
                                      jnp.asarray(_DEPARTURES[1]), "mxfp8_floor"))) / 2)


def test_mxfp8_is_torchaos_grouped_gemm(exact_dot, tmp_path):
    """torchao's own MXFP8 grouped GEMM (tests/consumers/torchao_grouped.py: its MoE training
    autograd function, emulated, each expert's tokens zero-padded to whole blocks) on the same
    operands, RCEIL and FLOOR scales: the operands torchao multiplies in its three GEMMs, their
    products summed exactly, are fp4lab's results bit for bit (an empty expert, one token, 35
    tokens: a partial wgrad block; ties of E4M3 and of the scale rule), and torchao's BF16
    outputs are fp4lab's within BF16 rounding. Where torchao's ``to_mx`` departs from TE's
    rules (``_DEPARTURES``), it departs as docs/numerics.md says, and nowhere else."""
    x, w, dy = (_torchao_agrees(np.asarray(t)) for t in _operands())
    dy = dy.astype(ml_dtypes.bfloat16).astype(np.float32)  # torchao's dY has its output's dtype
    sizes = np.asarray(GROUP_SIZES)
    np.savez(tmp_path / "in.npz", x=x, w=w, dy=dy, sizes=sizes, blocks=_DEPARTURES)
    done = subprocess.run([str(python_of(CONSUMERS)), str(Path(__file__).parents[1] / "consumers"
                                                          / "torchao_grouped.py"),
                           str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(tmp_path / "out.npz") as f:
        theirs = {k: f[k] for k in f.files}
    _check_departures(theirs)
    starts = np.cumsum(sizes) - sizes
    for recipe, rule in (("mxfp8", "rceil"), ("mxfp8_floor", "floor")):
        t = {k.split("/")[1]: v for k, v in theirs.items() if k.startswith(rule + "/")}
        ends = t["fprop_offs"].astype(int)  # torchao's padded groups
        padded = np.diff(ends, prepend=0)
        np.testing.assert_array_equal(padded, -(-sizes // 32) * 32)
        want = {"y": np.zeros((M, N), np.float32), "dx": np.zeros((M, K), np.float32),
                "dw": np.zeros((len(sizes), K, N), np.float32)}
        for e, (start, n) in enumerate(zip(starts, sizes, strict=True)):
            rows = slice(ends[e] - padded[e], ends[e] - padded[e] + n)
            group = slice(ends[e] - padded[e], ends[e])
            want["y"][start:start + n] = _fsum(t["fprop_a"][rows, None], t["fprop_b"][e].T[None])
            want["dx"][start:start + n] = _fsum(t["dgrad_a"][rows, None], t["dgrad_b"][e].T[None])
            want["dw"][e] = _fsum(t["wgrad_a"][:, group][:, None], t["wgrad_b"][group].T[None]).T
        got = _grads(lambda a, b: qragged_dot(a, b, jnp.asarray(sizes), recipe), x, w, dy)
        for what, a in zip(("y", "dx", "dw"), got, strict=True):
            assert_same_bits(a, want[what], f"{recipe} {what} (torchao's operands)")
            bf16 = np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32)
            np.testing.assert_allclose(t[what], bf16, rtol=2.0**-7, atol=1e-30,
                                       err_msg=f"{recipe} {what} (torchao's output)")


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_probes_per_expert_are_the_loops(recipe):
    """A probe stacked per expert measures each expert's own rows as the loop's qdot_general
    on them would: its slot's zeros change no count (MXFP8's all-zero wgrad blocks would be
    "bad scales", and every rate over all elements would be diluted; NVFP4's RHT pads the
    tokens to 16, whose padding counts as the loop's). Counts exactly; sums (MSE, SQNR, the
    noise ratio) up to float32 summation order."""
    r = fp4lab.get_recipe(recipe)
    x, w, dy = _operands(4)
    key = jax.random.key(4) if r.needs_key else None
    sizes = jnp.asarray(GROUP_SIZES, jnp.int32)
    zeros = jnp.stack([fp4lab.probe_zeros()] * len(GROUP_SIZES))

    def grouped_loss(probe, x, w, dy):
        y = qragged_dot(x, w, sizes, r, GemmState(key, probe))
        return jnp.sum(y * dy)

    def loop_loss(probes, x, w, dy):
        ends = np.cumsum(GROUP_SIZES)
        total = 0.0
        for e, (n, end) in enumerate(zip(GROUP_SIZES, ends, strict=True)):
            k = None if key is None else jax.random.fold_in(key, e)
            y = fp4lab.qdot_general(x[end - n:end], w[e], DN, r, GemmState(k, probes[e]))
            total += jnp.sum(y * dy[end - n:end])
        return total

    # operands as arguments: constants would be measured by XLA's constant folder, which
    # keeps the subnormals that XLA:CPU's run time flushes (docs/numerics.md)
    got = np.asarray(jax.jit(jax.grad(grouped_loss))(zeros, x, w, dy))
    want = np.asarray(jax.jit(jax.grad(loop_loss))(zeros, x, w, dy))
    names = fp4lab.numerics.metrics.METRIC_NAMES
    summed = [names.index(n) for n in ("mse", "rel_mse", "sqnr_db", "noise_ratio")]
    counted = [i for i in range(len(names)) if i not in summed]
    assert_same_bits(got[..., counted], want[..., counted], f"{recipe} counted metrics")
    np.testing.assert_allclose(got[..., summed], want[..., summed], rtol=1e-5)


def _stack_amaxes(recipe, x, w, dy, sizes):
    """The amax of each operand over the whole expert stack, in OPERANDS order, in NumPy from
    each expert's tensors (an RHT operand's after its transform along the expert's own
    tokens, zero-padded to the transform's width)."""
    from fp4lab.numerics.hadamard import rht

    ends = np.cumsum(sizes)
    out = []
    for o in OPERAND_TABLE:
        op = recipe.operands[o.name]
        t = {"x": x, "w": w, "dy": dy}[o.role]
        if o.role == "w":
            parts = [np.asarray(t)]
        else:  # the experts' rows, canonical (1, rows, width)
            parts = [np.asarray(t[end - n:end])[None] for n, end in zip(sizes, ends,
                                                                       strict=True) if n]
        if op.hadamard:  # along the tokens (axis 1): wgrad's X and dY
            parts = [np.asarray(rht(jnp.asarray(a), o.axis, op.hadamard, recipe.signs(op)))
                     for a in parts]
        out.append(max(float(np.abs(a).max(initial=0.0)) for a in parts))
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("sizes", [GROUP_SIZES, (12, 20, 5)])
def test_a_shared_expert_scale_is_each_experts_gemm_scaled_for_the_stacks_amax(
        sizes, exact_dot, monkeypatch):
    """``nvfp4_shared_scale``: every expert's six operands take the stack's per-tensor amax
    (NVFP4's FP32 global scale from the amax over all experts; RHT operands' after the
    transform), so it is bit for bit the loop of ``qdot_general`` over experts under
    ``nvfp4`` with each operand scaled for the stack's amax, computed here in NumPy (given as
    delayed scaling gives its history's amax), stochastic rounding included. Not ``nvfp4``'s:
    experts whose amaxes differ (expert 2's rows 8x larger) change. A dense GEMM has one
    tensor: ``qdot_general`` under the shared recipe is ``nvfp4``'s bit for bit."""
    from fp4lab.gemm import operand_quant

    shared = fp4lab.get_recipe("nvfp4_shared_scale")
    x, w, dy = _operands(5)
    ends = np.cumsum(sizes)
    x = x[:sum(sizes)].at[ends[1]:].multiply(8.0)
    dy = dy[:sum(sizes)]
    key = jax.random.key(11)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = _grads(lambda a, b: qragged_dot(a, b, group_sizes, shared, key), x, w, dy)
    own = _grads(lambda a, b: qragged_dot(a, b, group_sizes, "nvfp4", key), x, w, dy)
    dense = [_grads(lambda a, b, r=r: fp4lab.qdot_general(a, b, DN, r, key), x, w[0], dy)
             for r in (shared, "nvfp4")]

    amaxes = dict(zip(OPERANDS, _stack_amaxes(shared, x, w, dy, sizes), strict=True))
    given = operand_quant.OperandContext.of

    def of(recipe, key, history, tensors=None, gemms=()):
        ctx = given(recipe, key, history)
        ctx.amax.update({k: jnp.float32(v) for k, v in amaxes.items()})
        return ctx

    monkeypatch.setattr(qdot_module.OperandContext, "of", of)
    want = _loop(x, w, dy, sizes, fp4lab.get_recipe("nvfp4"), key)
    for what, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        assert_same_bits(a, b, f"shared {what}")
    assert (np.asarray(got[0]) != np.asarray(own[0])).any()
    for what, a, b in zip(("y", "dx", "dw"), *dense, strict=True):
        assert_same_bits(a, b, f"dense {what}")


def test_rows_after_the_groups_are_zero_and_rows_beyond_capacity_nan():
    x, w, dy = _operands(3)
    f = jax.jit(lambda x, w, sizes: qragged_dot(x, w, sizes, "mxfp8", capacity=20))
    y, vjp = jax.vjp(lambda x: f(x, w, jnp.asarray([3, 0, 30])), x)
    (dx,) = vjp(dy)
    y, dx = np.asarray(y), np.asarray(dx)
    assert (y[33:] == 0).all() and (dx[33:] == 0).all()  # rows after sum(group_sizes)
    assert np.isnan(y[23:33]).all() and np.isfinite(y[:23]).all()  # expert 2's rows 20..29
    assert (dx[23:33] == 0).all()
    ok = np.asarray(qragged_dot(x, w, jnp.asarray([3, 0, 30]), "mxfp8"))
    np.testing.assert_array_equal(y[:23], ok[:23])


@pytest.mark.parametrize("call, message", [
    (lambda x, w, s: qragged_dot(x[None], w, s), r"lhs \(M, K\) and rhs \(G, K, N\)"),
    (lambda x, w, s: qragged_dot(x, w[:, :5], s), r"lhs \(M, K\) and rhs \(G, K, N\)"),
    (lambda x, w, s: qragged_dot(x, w, s[:2]), r"group_sizes must be integers of shape \(3,\)"),
    (lambda x, w, s: qragged_dot(x, w, s * 1.0), r"group_sizes must be integers"),
    (lambda x, w, s: qragged_dot(x, w, s.at[1].set(-1)), r"negative size"),
    (lambda x, w, s: qragged_dot(x, w, s, capacity=0), r"capacity=0"),
    (lambda x, w, s: qragged_dot(x, w, s, "nvfp4"), r"stochastic rounding: pass a key"),
    (lambda x, w, s: qragged_dot(x, w, s, "bf16", GemmState(probe=fp4lab.probe_zeros())),
     r"probe"),
    (lambda x, w, s: dataclasses.replace(fp4lab.get_recipe("fp8_delayed"), name="d",
                                         expert_scale="shared"),
     r"expert_scale='shared' with delayed scaling"),
    (lambda x, w, s: qragged_dot(x, w, s, "fp8_delayed", GemmState(
        amax_history=init_history(fp4lab.get_recipe("fp8_delayed").delayed))),
     r"amax_history has shape \(6, \d+\); qragged_dot takes one per expert"),
])
def test_bad_arguments_are_refused_by_name(call, message):
    x, w, _ = _operands()
    with pytest.raises((ValueError, TypeError), match=message):
        call(x, w, jnp.asarray(GROUP_SIZES, jnp.int32))


# each expert's operands: slots (E, B, C, K) and every token (B, S, K), from the adversarial pool
_SLOTS, _TOKENS = (3, 2, 6, K), (4, 9, K)


@pytest.mark.parametrize("recipe", ["nvfp4"])  # (every quantizer: the vmapped core's tests)
def test_an_expert_einsum_is_the_loop_of_qeinsum_over_experts(recipe, exact_dot):
    """``qexpert_einsum``: each expert's GEMM is ``qeinsum`` of its own slice (or of the X
    every expert shares) with the key ``fold_in(key, first_expert + e)``, forward and
    gradients bit for bit, for the three forms of MaxText's dense path (X with the expert axis
    leading, X without it, X with it inside). Where every expert reads the same X, its
    gradient sums the experts' in XLA's order, not the loop's: equal to float32 rounding."""
    r = fp4lab.get_recipe(recipe)
    x, w, dy = _operands(2)
    key = jax.random.key(3) if r.needs_key else None
    pool = jnp.concatenate([x, dy])
    slots = pool[:36].reshape(_SLOTS)
    tokens = jnp.concatenate([pool, pool[:2]])[:36].reshape(_TOKENS)
    for spec, xs, one, x_axis, out_axis in [
            ("EBCM,EMH -> EBCH", slots, "BCM,MH->BCH", 0, 0),
            ("BSM,EMH->BSEH", tokens, "BSM,MH->BSH", None, 2),
            ("BSEM,EMH->BSEH", jnp.moveaxis(slots, 0, 2), "BSM,MH->BSH", 2, 2)]:
        def dy_like(f, a, b):  # a gradient of the output's shape, sign and scale mixed
            return jax.random.normal(jax.random.key(1), jax.eval_shape(f, a, b).shape) * 3

        def mine(a, b, spec=spec):
            return grouped.qexpert_einsum(spec, a, b, r, key, first_expert=2)

        got = jax.jit(lambda a, b, f=mine: _grads(f, a, b, dy_like(f, a, b)))(xs, w)

        def loop(a, b, one=one, x_axis=x_axis, out_axis=out_axis):
            ys = [fp4lab.qeinsum(one, a if x_axis is None else jnp.take(a, e, x_axis), b[e],
                                 r, None if key is None else jax.random.fold_in(key, 2 + e))
                  for e in range(3)]
            return jnp.stack(ys, out_axis)

        want = jax.jit(lambda a, b, f=loop: _grads(f, a, b, dy_like(f, a, b)))(xs, w)
        for what, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
            if what == "dx" and x_axis is None:  # the experts' dX summed in XLA's order
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max())
            else:
                assert_same_bits(a, b, f"{recipe} {spec} {what}")


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4_shared_scale"])
def test_an_expert_einsum_over_full_slots_is_qragged_dot_over_their_rows(recipe, exact_dot):
    """Slots every expert fills are ``qragged_dot``'s rows in another layout: the same bits,
    forward and gradients, per-expert or shared scales alike."""
    x, w, dy = _operands(4)
    rows, grads = x[:36], dy[:36]
    key = jax.random.key(9)
    sizes = jnp.full((3,), 12, jnp.int32)
    got = _grads(lambda a, b: grouped.qexpert_einsum("ERK,EKN->ERN", a, b, recipe, key),
                 rows.reshape(3, 12, K), w, grads.reshape(3, 12, N))
    want = _grads(lambda a, b: qragged_dot(a, b, sizes, recipe, key), rows, w, grads)
    for what, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        assert_same_bits(np.asarray(a).reshape(np.shape(b)), b, f"{recipe} {what}")


@pytest.mark.parametrize("spec, shapes, message", [
    ("BSM,MEH->BSEH", ((2, 3, K), (K, 3, N)), r"the weight's first letter is the expert axis"),
    ("BSM,EMH->BSH", ((2, 3, K), (3, K, N)), r"the output keeps it"),
    ("EBM,EMH->EBH", ((2, 3, K), (3, K, N)), r"x's expert axis has 2 experts, w 3"),
])
def test_a_bad_expert_einsum_is_refused_by_name(spec, shapes, message):
    a, b = (jnp.zeros(s, jnp.float32) for s in shapes)
    with pytest.raises(ValueError, match=message):
        grouped.qexpert_einsum(spec, a, b, "mxfp8")
