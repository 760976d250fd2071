"""TetraJet-v2's OutControl (fp4lab/features/outcontrol.py, Recipe.outliers, qdot_general's
channels=) against the authors' code, thu-ml/TetraJet-v2-NVFP4Training @
ca5953f643d85c793fb3a210bf21f17fc88ce83e, ported into tests/oracles/papers.py:

* kernels/csrc/quant_fp8.cu (MXFP8: amax/448 rounded up to a power of two by
  cvt.rp.satfinite.ue8m0, E4M3 RNE satfinite) = fp4lab's ``mxfp8``, bit for bit;
* olmo2-training/olmo/quantization_real/linear_mix.py (the mixed NVFP4/MXFP8 layer: K split
  by the chosen channels in their order, dgrad from the rebuilt forward W, wgrad split by
  rows) = qdot_general(..., GemmState(channels=)) with the split recipe;
* calibrate.py / linear_mix.py's channel choice (sum of per-step L2 norms, argsort
  descending) = fp4lab.features.outcontrol.channel_norms / channel_order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles import papers as ro

from fp4lab.features import outcontrol
from fp4lab.features.probes import probe_zeros
from fp4lab.gemm.qdot import qdot_general, qeinsum
from fp4lab.numerics.quantize import fake_quant
from fp4lab.gemm.recipe import OperandQuant, OutControl, Recipe, get_recipe
from fp4lab import GemmState

F32 = np.float32
FTZ = jax.default_backend() == "cpu"  # XLA:CPU flushes float32 subnormals
DN = (((1,), (0,)), ((), ()))  # X (M, K) @ W (K, N)
FP4 = OperandQuant(format="nvfp4_double")
AGAIN = OperandQuant(format="nvfp4_double", source="forward")
# the registry recipe with every rounding to nearest and no backward RHT: its three GEMMs are
# then deterministic, and the oracle reproduces them without fp4lab's random bits
RTN = Recipe(name="outcontrol_rtn", fprop_x=FP4, fprop_w=FP4, dgrad_dy=FP4, dgrad_w=AGAIN,
             wgrad_x=AGAIN, wgrad_dy=FP4, outliers=OutControl(align=128))


def assert_bits(got, want, what):
    g, w = np.asarray(got, F32), np.asarray(want, F32)
    bad = (g.view(np.uint32) != w.view(np.uint32)) & ~(np.isnan(g) & np.isnan(w))
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {bad.sum()} elements differ, first at {i}: got {g[i]!r}, "
                             f"oracle {w[i]!r}")


def assert_gemm(got, want, a, b, what):
    """A GEMM of exactly quantized operands against the float64 oracle: the float32 sum
    differs only by its rounding (|err| <= 2**-20 sum |a||b|); one element quantized to
    another grid point moves it by far more."""
    bound = 2.0 ** -20 * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)) + 1e-30
    err = np.abs(np.asarray(got, np.float64) - want)
    assert (err <= bound).all(), f"{what}: max error / bound {float((err / bound).max()):.3g}"


# ----------------------------------------------------------------------------- MXFP8


def fp8_cases() -> dict[str, np.ndarray]:
    """(4, 128) float32, blocks of 32 along the last axis."""
    rng = np.random.default_rng(20261202)
    c = {"normal": rng.standard_normal((4, 128)).astype(F32),
         "lognormal_rows": (rng.standard_normal((4, 128))
                            * np.exp2(rng.integers(-30, 30, (4, 1)))).astype(F32)}
    # amax at, just below and just above 448 * 2**k: where fl(amax / 448) decides the scale
    b = rng.standard_normal((4, 128)).astype(F32) * F32(0.01)
    for r, k in enumerate((0, -10, 7, -100)):
        edge = F32(448 * 2.0 ** k)
        for j, v in enumerate((edge, np.nextafter(edge, F32(0)), np.nextafter(edge, F32(1e30)),
                               F32(edge * 0.75))):
            b[r, j * 32] = v
    c["scale_edges"] = b
    # E4M3 ties at a block scale of 1 (block max 448): midpoints of the grid, both signs
    grid = ro.e4m3_value(np.arange(0x7E))
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(F32)
    t = np.zeros((4, 4, 32), F32)
    t[:, :, 0] = 448.0
    t[:, :, 1:] = np.resize(np.concatenate([mids, -mids]), (4, 4, 31))
    c["e4m3_ties"] = t.reshape(4, 128)
    # subnormal E4M3 (values far below the block max), zeros of both signs, a zero block
    s = (rng.standard_normal((4, 128)) * 1e-4).astype(F32)
    s[:, ::32] = 448.0
    s[1, 40:48] = 0.0
    s[1, 48:56] = -0.0
    s[2, 64:96] = -0.0
    c["subnormal_and_zeros"] = s
    # the largest float32 (its dequantized value overflows to Inf, as the kernel's does) and
    # amaxes whose quotient by 448 is subnormal
    m = rng.standard_normal((4, 128)).astype(F32)
    m[0, 3] = np.finfo(F32).max
    m[1, :32] = (rng.standard_normal(32) * 1e-36).astype(F32)
    m[2, 32:64] = (rng.standard_normal(32) * 1e-38).astype(F32)
    m[3, 64] = F32(448 * 2.0 ** -127 * 1.5)
    c["extremes"] = m
    return c


FP8_CASES = fp8_cases()


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_mxfp8_is_tetrajet_fp8(case):
    x = FP8_CASES[case]
    want, _ = ro.tetrajet_fp8(x, ftz=FTZ)
    assert_bits(fake_quant(jnp.asarray(x), "mxfp8", axis=-1), want, f"mxfp8 on {case}")


def test_mxfp8_ties_and_edges_are_exercised():
    """The tie case rounds both ways (nearest-even), and the edge case's three amaxes at
    448 * 2**k give two different scales (at/below: 2**k, above: 2**(k+1))."""
    t = FP8_CASES["e4m3_ties"]
    y, _ = ro.tetrajet_fp8(t, ftz=FTZ)
    mids = (np.arange(128) % 32 != 0) & (t[0] > 0)
    assert (y[0][mids] > t[0][mids]).any() and (y[0][mids] < t[0][mids]).any()
    _, e = ro.tetrajet_fp8(FP8_CASES["scale_edges"], ftz=FTZ)
    assert list(e[0]) == [0, 0, 1, 0] and list(e[2]) == [7, 7, 8, 7]


@pytest.mark.parametrize("special", [np.nan, np.inf, -np.inf])
def test_mxfp8_nan_and_inf(special):
    """fp4lab's MX rule makes a block holding NaN or Inf NaN; the kernel's ``fmax`` drops NaN
    (only the NaN element is NaN) and an Inf scales by 2**127, whose multiplier is the float 0
    (the Inf element NaN, the rest signed zeros). The other blocks agree bit for bit."""
    x = FP8_CASES["normal"].copy()
    x[1, 40] = special
    y = np.asarray(fake_quant(jnp.asarray(x), "mxfp8", axis=-1))
    assert np.isnan(y[1, 32:64]).all() and np.isnan(y).sum() == 32
    authors, _ = ro.tetrajet_fp8(x, nan_propagates=False, ftz=FTZ)
    assert np.isnan(authors).sum() == 1 and np.isnan(authors[1, 40])
    if np.isinf(special):
        assert (authors[1, 32:64][np.arange(32) != 8] == 0).all()
    keep = np.ones_like(x, bool)
    keep[1, 32:64] = False
    assert_bits(y[keep], authors[keep], "mxfp8 outside the NaN block")


# ----------------------------------------------------------------------------- the split GEMM


@functools.cache
def _operands(m, k, n, seed=0):
    """X with a few outlier channels (as the authors' activations have), W, dY."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(F32)
    x[:, rng.choice(k, k // 16, replace=False)] *= F32(40.0)
    x[3, 5] = 0.0
    w = (rng.standard_normal((k, n)) * 0.05).astype(F32)
    dy = (rng.standard_normal((m, n)) * 1e-3).astype(F32)
    return x, w, dy


def _channels(x):
    return outcontrol.channel_order(outcontrol.channel_norms(jnp.asarray(x), DN))


def _vjp(recipe, x, w, dy, channels, key=None):
    y, pull = jax.vjp(lambda a, b: qdot_general(a, b, DN, recipe,
                                                GemmState(key=key, channels=channels)),
                      jnp.asarray(x), jnp.asarray(w))
    return (y, *pull(jnp.asarray(dy)))


@pytest.mark.parametrize("k,align", [(384, 128), (200, 1)])
def test_split_gemms_match_the_authors_layer(k, align):
    """All three GEMMs, round to nearest: the authors' 128-aligned split (K = 384: 128
    outlier channels, 256 FP4) and the paper's about-10 % split with partial blocks (K = 200:
    20 outlier channels, 180 FP4, zero-padded to whole blocks)."""
    recipe = dataclasses.replace(RTN, outliers=OutControl(align=align))
    x, w, dy = _operands(64, k, 48)
    ch = _channels(x)
    n = recipe.outliers.count(k)
    assert n == (128 if align == 128 else 20)
    y, dx, dw = _vjp(recipe, x, w, dy, ch)
    want_y, want_dx, want_dw = ro.outcontrol_gemms(x, w, dy, np.asarray(ch), n, ftz=FTZ)
    scale_x = np.abs(x).max()
    assert_gemm(y, want_y, np.abs(x), np.abs(w) * 1.5, "Y")
    assert_gemm(dx, want_dx, np.abs(dy) * 1.5, np.abs(w).T * 1.5, "dX")
    assert_gemm(dw, want_dw, (np.abs(x) * 1.5).T, np.abs(dy) * 1.5, "dW")
    # the split matters: the same GEMMs without it differ from the oracle
    y0 = qdot_general(jnp.asarray(x), jnp.asarray(w), DN, recipe)
    assert np.abs(np.asarray(y0) - want_y).max() > 1e-3 * scale_x


def test_registry_recipe_forward_and_outlier_rows_match():
    """tetrajet_v2_outcontrol: its forward rounds to nearest, so Y is the oracle's; so are
    dW's outlier rows (MXFP8 round to nearest, no transform); dX and dW's FP4 rows carry SR
    and RHT16 (the same quantizers as tetrajet_v2, tested in test_published_quantizers)."""
    recipe = get_recipe("tetrajet_v2_outcontrol")
    x, w, dy = _operands(64, 320, 32, seed=1)
    ch = _channels(x)
    n = recipe.outliers.count(320)
    assert n == 32
    y, dx, dw = _vjp(recipe, x, w, dy, ch, key=jax.random.key(7))
    want_y, _, want_dw = ro.outcontrol_gemms(x, w, dy, np.asarray(ch), n, ftz=FTZ)
    assert_gemm(y, want_y, np.abs(x), np.abs(w) * 1.5, "Y")
    hi = np.asarray(ch[:n])
    assert_gemm(np.asarray(dw)[hi], want_dw[hi], (np.abs(x[:, hi]) * 1.5).T, np.abs(dy) * 1.5,
                "dW outlier rows")
    assert np.isfinite(np.asarray(dx)).all()


def test_without_channels_it_is_tetrajet_v2():
    """Before its channels are chosen, the layer is the recipe without the split: the same
    bits as tetrajet_v2 for the same key."""
    x, w, dy = _operands(32, 256, 32, seed=2)
    key = jax.random.key(3)
    for a, b in zip(_vjp("tetrajet_v2_outcontrol", x, w, dy, None, key),
                    _vjp("tetrajet_v2", x, w, dy, None, key), strict=True):
        assert_bits(a, b, "tetrajet_v2_outcontrol without channels")


def test_einsum_and_probes_with_channels():
    """qeinsum passes the channels (K flattened from two contracted dims, in order), and the
    probes measure the FP4 parts (finite rows)."""
    x, w, dy = _operands(32, 256, 32, seed=3)
    x3, w3 = jnp.asarray(x).reshape(32, 4, 64), jnp.asarray(w).reshape(4, 64, 32)
    ch = _channels(x)
    assert (outcontrol.channel_norms(x3, (((1, 2), (0, 1)), ((), ())))
            == outcontrol.channel_norms(jnp.asarray(x), DN)).all()
    a = qeinsum("mhk,hkn->mn", x3, w3, RTN, GemmState(channels=ch))
    b = qdot_general(jnp.asarray(x), jnp.asarray(w), DN, RTN, GemmState(channels=ch))
    assert_bits(a, b, "qeinsum")
    grads = jax.grad(lambda p: qdot_general(jnp.asarray(x), jnp.asarray(w), DN, RTN,
                                            GemmState(probe=p, channels=ch)).sum())(probe_zeros())
    assert np.isfinite(np.asarray(grads)[:, 0]).all()


def test_jit_and_traced_channels():
    x, w, dy = _operands(32, 256, 32, seed=4)
    f = jax.jit(lambda x, w, c: _vjp(RTN, x, w, dy, c))
    ch = _channels(x)
    for a, b in zip(f(x, w, ch), _vjp(RTN, x, w, dy, ch), strict=True):
        assert_bits(a, b, "jit")


# ----------------------------------------------------------------------------- the choice


def test_channel_norms_and_order_match_numpy():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 7, 40)).astype(F32) * np.linspace(0.1, 3, 40, dtype=F32)
    got = outcontrol.channel_norms(jnp.asarray(x), (((2,), (0,)), ((), ())))
    want = np.sqrt((x.astype(np.float64) ** 2).sum(axis=(0, 1)))
    np.testing.assert_allclose(got, want, rtol=2e-6)
    norms = np.array([1.0, 3.0, 2.0, 3.0, 0.0, 2.0], F32)
    assert outcontrol.channel_order(norms).tolist() == [1, 3, 2, 5, 0, 4]  # ties: lower first
    # the authors' choice: torch.argsort(descending) of the summed norms, on distinct sums
    sums = rng.permutation(64).astype(F32)
    assert outcontrol.channel_order(sums).tolist() == list(np.argsort(-sums, kind="stable"))


@pytest.mark.parametrize("k,fraction,align,n", [
    (1280, 0.1, 128, 128),  # the authors' 370M hidden size: int(128.0) -> one 128-block
    (384, 0.1, 128, 128), (2048, 0.1, 128, 256), (256, 0.1, 32, 32), (1000, 0.02, 16, 32),
    # the paper's simulated results: round(fraction K)
    (200, 0.1, 1, 20), (64, 0.1, 1, 6), (256, 0.1, 1, 26), (128, 0.1, 1, 13)])
def test_count(k, fraction, align, n):
    assert OutControl(fraction=fraction, align=align).count(k) == n


def test_errors_name_the_value():
    with pytest.raises(ValueError, match="K=128"):
        OutControl(align=128).count(128)  # all channels in MXFP8: no FP4 part
    with pytest.raises(ValueError, match="fraction=1.5"):
        OutControl(fraction=1.5)
    x, w = jnp.ones((4, 64)), jnp.ones((64, 8))
    with pytest.raises(ValueError, match=r"lacks \[1\]"):
        qdot_general(x, w, DN, dataclasses.replace(RTN, outliers=OutControl()),
                     GemmState(channels=jnp.arange(64).at[1].set(0)))
    with pytest.raises(ValueError, match="K=4"):
        OutControl().count(4)  # round(0.4) = 0 outlier channels
    with pytest.raises(ValueError, match="no OutControl"):
        qdot_general(x, w, DN, "nvfp4_no_sr", GemmState(channels=jnp.arange(64)))
    with pytest.raises(ValueError, match=r"shape \(32,\)"):
        qdot_general(x, w, DN, dataclasses.replace(RTN, outliers=OutControl()),
                     GemmState(channels=jnp.arange(32)))
    with pytest.raises(TypeError, match="float32"):
        qdot_general(x, w, DN, dataclasses.replace(RTN, outliers=OutControl()),
                     GemmState(channels=jnp.arange(64.0)))
    with pytest.raises(ValueError, match="OutControl splits"):
        dataclasses.replace(get_recipe("tetrajet_v2_outcontrol"),
                            fprop_x=OperandQuant(format="nvfp4_double", hadamard=16),
                            fprop_w=OperandQuant(format="nvfp4_double", hadamard=16))


def test_describe_and_explain_say_that_outcontrol_splits_k():
    from fp4lab.policy import all_layers, explain

    r = get_recipe("tetrajet_v2_outcontrol")
    assert "OutControl: splits K, the top 10% of it in mxfp8" in r.describe()
    table = str(explain(all_layers(r), ["blocks_0/mlp/up"]))
    assert "tetrajet_v2_outcontrol (splits K)" in table  # the layer's row
    assert "OutControl: splits K" in table  # and the recipe's notes
