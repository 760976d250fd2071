"""The published FP4 quantizers (fp4lab/numerics/scaling.py, "published recipes") against the NumPy
oracles of tests/oracles/papers.py, bit for bit (uint32 views: -0/+0 count, all NaNs equal):

* quest_mxfp4, tseng_mxfp4: IST-DASLab/Quartet @ 00ccd38e544ac5fd56b7837844a427114b884ef8,
  src/models/quantization/quantizers/mxfp4_triton.py
* nvfp4_quartet2, nvfp4_quartet2_4over6: IST-DASLab/Quartet-II @
  8776a90b7aa0c0a400ad858a3c05a66f7ec55b73, nvfp4_triton.py rtn_1x16s_fp4_kernel
* nvfp4_eden: Quartet-II @ 8776a90, src/models/quantization/schemes/quartet_2.py
  eden_1x16s_fp4_kernel
* nvfp4_double: thu-ml/TetraJet-v2-NVFP4Training @ ca5953f643d85c793fb3a210bf21f17fc88ce83e,
  kernels/csrc/quant_fp4.cu quant_fp4_from_reg
* nvfp4_atw, nvfp4_atw_sat: FP4 All the Way, experimental/fp4.py fake_quant_fp4 (public
  copies; no commit), under PyTorch's E4M3 cast before 2.13 (NaN beyond 464) and from 2.13
  (saturating)

Stochastic rounding: the oracles take the uniforms fp4lab draws, ``uniform(key, (M, K//b,
b))`` per element (``(M, K//16, 1)`` per scale for MS-EDEN). The hand-checked examples of
docs/recipes/*.md are literal values here, independent of the oracles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles import papers as ro

from fp4lab.numerics.quantize import dequantize, fake_quant, quantize

F32 = np.float32
FTZ = jax.default_backend() == "cpu"  # XLA:CPU flushes float32 subnormals
QUARTET = "IST-DASLab/Quartet @ 00ccd38e544ac5fd56b7837844a427114b884ef8"
QUARTET2 = "IST-DASLab/Quartet-II @ 8776a90b7aa0c0a400ad858a3c05a66f7ec55b73"
TETRAJET = "thu-ml/TetraJet-v2-NVFP4Training @ ca5953f643d85c793fb3a210bf21f17fc88ce83e"

ORACLES = {  # format: (oracle, block, stochastic: "element" | "scale" | None)
    "quest_mxfp4": (ro.quest_mxfp4, 32, None),
    "tseng_mxfp4": (ro.tseng_mxfp4, 32, "element"),
    "nvfp4_quartet2": (ro.quartet2_rtn, 16, None),
    "nvfp4_quartet2_4over6": (functools.partial(ro.quartet2_rtn, four_over_six=True), 16, None),
    "nvfp4_eden": (ro.eden, 16, "scale"),
    "nvfp4_double": (ro.double_block, 16, "element"),
    "nvfp4_atw": (ro.atw_nvfp4, 16, "element"),
    "nvfp4_atw_sat": (functools.partial(ro.atw_nvfp4, saturating_cast=True), 16, "element"),
}
FORMATS = list(ORACLES)
STOCHASTIC = [f for f in FORMATS if ORACLES[f][2]]
TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32)


def bits_differ(got, want) -> int:
    """Elements whose float32 bits differ; NaN equals NaN whatever its payload."""
    g, w = np.asarray(got, F32), np.asarray(want, F32)
    assert g.shape == w.shape, (g.shape, w.shape)
    both_nan = np.isnan(g) & np.isnan(w)
    return int(((g.view(np.uint32) != w.view(np.uint32)) & ~both_nan).sum())


def assert_bits(got, want, what):
    n = bits_differ(got, want)
    if n:
        g, w = np.asarray(got, F32), np.asarray(want, F32)
        bad = np.argwhere((g.view(np.uint32) != w.view(np.uint32)) & ~(np.isnan(g) & np.isnan(w)))
        i = tuple(bad[0])
        raise AssertionError(f"{what}: {n} elements differ, first at {i}: got {g[i]!r}, "
                             f"oracle {w[i]!r}")


def uniforms(fmt, key, shape):
    """The uniforms fp4lab's rounding draws (fp4lab.numerics.random_bits: JAX's own Threefry
    bits at each element's position, or one per block for a stochastic scale), in the oracle's
    layout, computed here from ``jax.random.bits`` itself."""
    m, k = shape
    draw = (m, k // 16, 1) if ORACLES[fmt][2] == "scale" else (m, k)
    bits = np.asarray(jax.random.bits(key, draw, jnp.uint32))
    return (bits >> 8).astype(np.float32) * np.float32(2.0**-24)


def oracle(fmt, x, u=None, **kw):
    fn = ORACLES[fmt][0]
    return fn(np.asarray(x, F32), u, ftz=FTZ, **kw) if u is not None else fn(
        np.asarray(x, F32), ftz=FTZ, **kw)


# ----------------------------------------------------------------------------- inputs


def _row_blocks(rng, blocks, b):
    return np.concatenate(blocks).astype(F32) if blocks else rng.standard_normal(b)


def adversarial_cases() -> dict[str, np.ndarray]:
    """(4, 256) float32 tensors (blocks along the last axis; 128-blocks for EDEN and
    TetraJet-v2). Ties are built for a block scale of 1 (Quartet II: amax 2688 or 1536 gives
    s_dec = 1 and block max 6 gives s_b = 1; TetraJet-v2: 128-max 2688 and 16-max 6) and of
    2**k for QuEST (its power-of-two scale)."""
    rng = np.random.default_rng(20260301)
    c = {}
    c["normal"] = rng.standard_normal((4, 256)).astype(F32)
    c["student_t"] = rng.standard_t(2.0, (4, 256)).astype(F32)
    c["lognormal_rows"] = (rng.standard_normal((4, 256))
                           * np.exp2(rng.integers(-20, 20, (4, 1)))).astype(F32)
    ties = np.zeros((4, 256), F32)
    ties[0, 0] = 2688.0  # tensor and 128-block max: s_dec = 1 (RTN), outer = 1 (TetraJet-v2)
    ties[2, 0] = 2688.0
    for r in range(4):
        for blk in range(1, 16):
            seg = np.zeros(16, F32)
            seg[0] = 6.0 if blk % 2 else 12.0  # block max 6 (scale 1) or 12 (scale 2)
            t = TIES * (1 if blk % 2 else 2)
            seg[1:8] = t
            seg[8:15] = -t
            seg[15] = -0.0 if blk % 3 else 0.0
            ties[r, blk * 16:(blk + 1) * 16] = seg
    c["ties"] = ties
    t46 = ties.copy()
    t46[0, 0] = t46[2, 0] = 1536.0  # Four Over Six: S = 256 -> s_dec = 1
    c["ties_4over6"] = t46
    # QuEST: a block with a power-of-two shared scale, ties of it among its elements
    q = np.zeros((4, 256), F32)
    base = np.array([3, -3, 1, -1, .5, -.5, 2, -2], F32)
    for r in range(4):
        for blk in range(8):
            seg = np.zeros(32, F32)
            seg[:8] = base * 4
            seg[8:15] = TIES * 2  # block (r, r)'s shared scale is 2 (2**(r - blk) * 2)
            seg[15:22] = -TIES * 2
            q[r, blk * 32:(blk + 1) * 32] = seg * F32(2.0 ** (r - blk))
    c["quest_ties"] = q
    z = rng.standard_normal((4, 256)).astype(F32)
    z[:, ::7] = 0.0
    z[:, 3::7] = -0.0
    z[1, 32:64] = 0.0  # all-zero blocks (and a zero 16-block everywhere in 32..63)
    z[2, 128:256] = -0.0  # an all-zero 128-block of -0
    c["zeros_blocks"] = z
    c["all_zero"] = np.zeros((4, 256), F32)
    c["all_minus_zero"] = np.full((4, 256), -0.0, F32)
    cst = np.repeat(rng.standard_normal((4, 16, 1)).astype(F32), 16, axis=2).reshape(4, 256)
    cst[0, :32] = 0.1
    c["constant_blocks"] = cst
    mt = (rng.standard_normal((4, 256)) * 1e-6).astype(F32)
    mt[0, 5] = 3.0e4  # the tensor max in one block, tiny values elsewhere: subnormal E4M3
    mt[3, 200:216] = (rng.standard_normal(16) * 1e-9).astype(F32)
    mt[3, 64:80] = (rng.standard_normal(16) * 3e4 / 448 / 16).astype(F32)
    c["max_and_tiny"] = mt
    th = rng.standard_normal((4, 256)).astype(F32)
    grid_mids = np.concatenate([TIES, [0.5, 1, 1.5, 2, 3, 4, 6]]).astype(F32)
    for r in range(4):
        for blk in range(16):
            seg = th[r, blk * 16:(blk + 1) * 16]
            seg[0] = 6.0
            m = grid_mids[(blk + r) % len(grid_mids)]
            seg[1:4] = [np.nextafter(m, F32(0)), m, np.nextafter(m, F32(10))]
            seg[4:7] = -seg[1:4]
    th[0, 0] = 2688.0
    c["thresholds"] = th
    o = rng.standard_normal((4, 256)).astype(F32)
    o[1, 77] = 1.0e7  # a single huge outlier
    c["outlier"] = o
    ex = (rng.standard_normal((4, 256)) * 0.01).astype(F32)
    ex[:, 0] = [2688.0, 1800.0, 1790.0, 448.0 * 6 * 0.5]  # ATW: subnormal sb rounded up
    ex[0, 16] = 1800.0
    ex[0, 17] = 1790.0
    c["atw_subnormal_sb"] = ex
    return c


CASES = adversarial_cases()


@functools.cache
def _x(name):
    return jnp.asarray(CASES[name])


# ----------------------------------------------------------------------------- bit-exact


@pytest.mark.parametrize("fmt", FORMATS)
def test_nearest_matches_the_oracle(fmt):
    """Round to nearest, every case: fake_quant and dequantize(quantize) equal the oracle of
    the authors' arithmetic (Quartet @ 00ccd38, Quartet-II @ 8776a90, TetraJet-v2 @ ca5953f,
    FP4 All the Way experimental/fp4.py) bit for bit, and the stored scales are the oracle's."""
    for name, x in CASES.items():
        if fmt.startswith("nvfp4_atw") and name == "atw_subnormal_sb":
            continue  # the authors' 8: a documented deviation, tested below
        want, scale = oracle(fmt, x)
        assert_bits(fake_quant(_x(name), fmt), want, f"{fmt} {name} fake_quant")
        q = quantize(_x(name), fmt)
        assert_bits(dequantize(q), want, f"{fmt} {name} dequantize(quantize)")
        s = np.asarray(q.scale)
        s = np.exp2(s.astype(np.float64) - 127).astype(F32) if s.dtype == np.uint8 else \
            s.astype(F32)
        assert_bits(s, scale, f"{fmt} {name} scale")


def test_ties_are_exercised():
    """The tie cases put elements exactly on the E2M1 midpoints (Quartet @ 00ccd38: ties toward
    zero; Quartet-II @ 8776a90: ties away; TetraJet-v2 @ ca5953f: ties to even), so the three
    rules give different values there."""
    x = CASES["ties"]
    y2, _ = ro.quartet2_rtn(x)
    yd, _ = ro.double_block(x)
    assert y2[1, 21] == 3.0 and yd[1, 21] == 2.0  # 2.5: away -> 3, even -> 2
    assert y2[1, 22] == 4.0 and yd[1, 22] == 4.0  # 3.5: both 4
    assert y2[1, 23] == 6.0 and yd[1, 23] == 4.0  # 5
    yq, shared = ro.quest_mxfp4(CASES["quest_ties"])
    assert shared[0, 0] == 2.0  # 2**floor(log2(gs*std)) at block (0, 0)
    np.testing.assert_array_equal(yq[0, 8:15], F32([0, .5, 1, 1.5, 2, 3, 4]) * 2)  # to zero


@pytest.mark.parametrize("fmt", STOCHASTIC)
def test_stochastic_matches_the_oracle(fmt):
    """Stochastic rounding with fp4lab's own uniforms fed to the oracle: Quartet @ 00ccd38
    (Tseng SR: hi where u < p), Quartet-II @ 8776a90 (MS-EDEN: SR of the E4M3 scale, one
    uniform per 16-block), TetraJet-v2 @ ca5953f (dither r = u - 0.5), FP4 All the Way
    (n = u - 0.5)."""
    for i, name in enumerate(["student_t", "ties", "zeros_blocks", "max_and_tiny"]):
        key = jax.random.key(100 + i)
        x = CASES[name]
        u = uniforms(fmt, key, x.shape)
        want, scale = oracle(fmt, x, u)
        got = fake_quant(_x(name), fmt, rounding="stochastic", key=key)
        assert_bits(got, want, f"{fmt} {name} SR fake_quant")
        q = quantize(_x(name), fmt, rounding="stochastic", key=key)
        assert_bits(dequantize(q), want, f"{fmt} {name} SR dequantize(quantize)")
        # the draws matter: the nearest result differs somewhere
        if name == "student_t":
            assert bits_differ(got, oracle(fmt, x)[0]) > 0


def test_eden_scale_sr_takes_both_neighbours():
    """Quartet-II @ 8776a90 MS-EDEN: with u = 0 every corrected scale not on the E4M3 grid goes
    up, with u just below 1 down (the oracle with forced uniforms brackets fp4lab's draw)."""
    x = CASES["normal"]
    up, s_up = ro.eden(x, np.zeros((4, 16, 1), F32), ftz=FTZ)
    down, s_down = ro.eden(x, np.full((4, 16, 1), 1 - 2.0 ** -24, F32), ftz=FTZ)
    assert (s_up >= s_down).all() and (s_up > s_down).any()
    s = np.asarray(quantize(_x("normal"), "nvfp4_eden", rounding="stochastic",
                            key=jax.random.key(5)).scale).astype(F32)
    assert ((s == s_up) | (s == s_down)).all()


@pytest.mark.parametrize("fmt", ["quest_mxfp4", "nvfp4_double", "nvfp4_quartet2", "nvfp4_atw"])
def test_axis_0(fmt):
    """Blocks along axis 0: the oracle of x.T, transposed back (Quartet @ 00ccd38, TetraJet-v2
    @ ca5953f, Quartet-II @ 8776a90, FP4 All the Way)."""
    for name in ("student_t", "ties"):
        x = CASES[name].T.copy()  # (256, 4): blocks of 32 / 128 along axis 0
        want = oracle(fmt, x.T)[0].T
        assert_bits(fake_quant(jnp.asarray(x), fmt, axis=0), want, f"{fmt} {name} axis 0")


def test_shape_3x128():
    """A (3, 128) tensor: one 128-block per row for MS-EDEN (Quartet-II @ 8776a90) and
    TetraJet-v2 (@ ca5953f), four QuEST blocks (Quartet @ 00ccd38)."""
    x = np.random.default_rng(7).standard_t(3.0, (3, 128)).astype(F32)
    for fmt in FORMATS:
        assert_bits(fake_quant(jnp.asarray(x), fmt), oracle(fmt, x)[0], f"{fmt} (3, 128)")


# ----------------------------------------------------------------------------- rewrite contexts


@pytest.mark.parametrize("fmt", FORMATS)
def test_rewrite_contexts(fmt):
    """The contexts of tests/fp4lab/test_rewrites.py where XLA's rewrites bite: a caller's jit
    that holds the QArray as a constant, and a consumer that adds to the dequantized values
    (oracle values + r, float32). Oracles: Quartet @ 00ccd38, Quartet-II @ 8776a90,
    TetraJet-v2 @ ca5953f, FP4 All the Way."""
    r = np.random.default_rng(1).standard_normal((4, 256)).astype(F32)
    add = jax.jit(lambda x, r: fake_quant(x, fmt) + r)
    add_q = jax.jit(lambda q, r: dequantize(q) + r)
    for name in ("student_t", "thresholds"):
        want = oracle(fmt, CASES[name])[0]
        assert_bits(add(_x(name), r), want + r, f"{fmt} {name} fake_quant(x) + r")
        assert_bits(add_q(quantize(_x(name), fmt), r), want + r, f"{fmt} {name} dequantize + r")
    q = quantize(_x("student_t"), fmt)
    assert_bits(jax.jit(lambda: dequantize(q))(), oracle(fmt, CASES["student_t"])[0],
                f"{fmt} dequantize(constant QArray)")


# ----------------------------------------------------------------------------- NaN and Inf


def _with(x, i, j, v):
    x = x.copy()
    x[i, j] = v
    return x


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("special", [np.nan, np.inf, -np.inf])
def test_nan_and_inf(fmt, special):
    """What each class docstring promises for NaN and Inf, and the oracle's values (Quartet @
    00ccd38: the group's std, hence its scale and values, NaN; Tseng: NaN scale, NaN values;
    Quartet-II @ 8776a90: the tensor amax NaN/Inf makes the whole tensor NaN; TetraJet-v2 @
    ca5953f: the 128-block NaN (fp4lab's choice for NaN); FP4 All the Way: the tensor NaN)."""
    x = _with(CASES["normal"], 1, 40, special)
    y = np.asarray(fake_quant(jnp.asarray(x), fmt))
    yq = np.asarray(dequantize(quantize(jnp.asarray(x), fmt)))
    assert_bits(yq, y, f"{fmt} {special} dequantize(quantize) vs fake_quant")
    nan = np.isnan(y)
    if fmt in ("quest_mxfp4", "tseng_mxfp4"):
        assert nan[1, 32:64].all() and nan.sum() == 32
    elif fmt == "nvfp4_double":
        assert nan[1, 0:128].all() and nan.sum() == 128
    else:  # a per-tensor amax
        assert nan.all()
    assert_bits(y, oracle(fmt, x)[0], f"{fmt} {special} oracle")


# ----------------------------------------------------------------------------- documented deviations


def test_double_block_nan_makes_its_128_block_nan():
    """Deviation from TetraJet-v2 @ ca5953f (quant_fp4.cu quant_fp4_from_reg): the kernel's
    fmaxf drops NaN from its maxima, so only the NaN element is NaN there; fp4lab makes the
    whole 128-block NaN. The other 128-blocks agree with the authors' arithmetic."""
    x = _with(CASES["normal"], 1, 40, np.nan)
    y = np.asarray(fake_quant(jnp.asarray(x), "nvfp4_double"))
    authors, _ = ro.double_block(x, nan_propagates=False, ftz=FTZ)
    assert np.isnan(y[1, :128]).all()
    assert np.isnan(authors).sum() == 1 and np.isnan(authors[1, 40])
    keep = np.ones(x.shape, bool)
    keep[1, :128] = False
    assert_bits(y[keep], authors[keep], "nvfp4_double outside the NaN block")


def test_atw_saturates_where_the_authors_give_8():
    """FP4 All the Way example 4 (experimental/fp4.py, FP8 max 448): [2688, 0... | 1800, 1790,
    0...]: block 1's sb = E4M3(6/1800) = 2**-8, t = [7.03, 6.99]; the authors' R gives
    [8, 6] -> y = [2048, 1536]; fp4lab saturates the 8 to 6 -> [1536, 1536]."""
    x = np.zeros((1, 32), F32)
    x[0, 0], x[0, 16], x[0, 17] = 2688.0, 1800.0, 1790.0
    authors, sb = ro.atw_nvfp4(x, saturate=False)
    assert sb[0, 1] == 2.0 ** -8
    np.testing.assert_array_equal(authors[0, 16:18], [2048.0, 1536.0])
    y = np.asarray(fake_quant(jnp.asarray(x), "nvfp4_atw"))
    np.testing.assert_array_equal(y[0, 16:18], [1536.0, 1536.0])
    assert_bits(y, ro.atw_nvfp4(x)[0], "nvfp4_atw saturating oracle")
    # the larger case: every 8 of the authors' is a 6 here, nothing else moves
    x = CASES["atw_subnormal_sb"]
    authors = ro.atw_nvfp4(x, saturate=False, ftz=FTZ)[0]
    y = np.asarray(fake_quant(_x("atw_subnormal_sb"), "nvfp4_atw"))
    assert_bits(y, ro.atw_nvfp4(x, ftz=FTZ)[0], "nvfp4_atw saturating oracle (4, 256)")
    moved = y != authors
    assert moved.any() and (np.abs(authors[moved]) > np.abs(y[moved])).all()


def test_atw_all_zero_tensor_gives_zeros():
    """FP4 All the Way (experimental/fp4.py): an all-zero tensor is 0/0 = NaN there; fp4lab
    gives zeros (+0: the authors' sign(0) = 0)."""
    x = np.zeros((4, 256), F32)
    assert np.isnan(ro.atw_nvfp4(x, guard_zero_tensor=False)[0]).all()
    y = np.asarray(fake_quant(jnp.asarray(x), "nvfp4_atw"))
    assert (y.view(np.uint32) == 0).all()


def test_atw_e4m3_cast_before_and_from_pytorch_2_13():
    """A block far below the tensor's amax: its encode factor 6/max|xs| exceeds 464. PyTorch's
    cast before 2.13 gave NaN there, the authors' code falls back to sb = 1 and the block
    flushes to zero (nvfp4_atw); PyTorch 2.13 saturates to 448 and the block keeps its values
    (nvfp4_atw_sat: -1 -> -0.98, -0.3 -> -0.33, -0.7 -> -0.65, by hand: st = 786432/2688,
    v = |x| * 448 / st)."""
    x = np.zeros((2, 32), F32)
    x[0, 0] = 786432.0
    x[0, 16:19] = [-1.0, -0.3, -0.7]
    x[0, 19] = 0.9
    st = F32(786432.0) * (F32(1) / F32(2688))
    want = [-F32(1.5) / F32(448) * st, -F32(0.5) / F32(448) * st, -F32(1) / F32(448) * st]
    old = np.asarray(fake_quant(jnp.asarray(x), "nvfp4_atw"))
    new = np.asarray(fake_quant(jnp.asarray(x), "nvfp4_atw_sat"))
    assert (old[0, 16:] == 0).all() and (old[1] == 0).all()
    np.testing.assert_array_equal(new[0, 16:19], want)
    np.testing.assert_allclose(new[0, 16:19], [-0.98, -0.33, -0.65], atol=0.005)
    s_old, s_new = (np.asarray(quantize(jnp.asarray(x), f).scale).astype(F32)
                    for f in ("nvfp4_atw", "nvfp4_atw_sat"))
    assert s_old[0, 1] == 1 and s_new[0, 1] == 448
    assert (s_old[1] == 1).all() and (s_new[1] == 448).all()  # all-zero blocks: 6/0 = inf
    for f, y in (("nvfp4_atw", old), ("nvfp4_atw_sat", new)):
        assert_bits(y, oracle(f, x)[0], f)
    np.testing.assert_array_equal(new[0, :16], old[0, :16])  # the amax block: one rule


def test_the_saturating_oracle_cast_is_pytorch_2_13s():
    """The oracle's two E4M3 casts against PyTorch's own: the consumers' environment holds
    torch 2.13 (or later), whose cast saturates (values around 448/464/480, 1e30, inf, NaN, signed,
    subnormal ties); the NaN rule is c10's conversion before pytorch/pytorch#178817."""
    import json
    import subprocess

    from environments import CONSUMERS, python_of

    v = np.array([448, 449, 463.99, 464, 464.01, 479.9, 480, 1e3, 1e30, np.inf, np.nan,
                  2.0 ** -10, 3 * 2.0 ** -10, 0.0, 1.0625], F32)
    v = np.concatenate([v, -v])
    code = ("import json, sys, torch; v = torch.tensor(json.loads(sys.stdin.read())); "
            "print(torch.__version__); "
            "print(json.dumps(v.to(torch.float8_e4m3fn).float().tolist()))")
    out = subprocess.run([str(python_of(CONSUMERS)), "-c", code], capture_output=True,
                         text=True, check=True,
                         input=json.dumps([float(a) for a in v])).stdout.split("\n")
    assert tuple(map(int, out[0].split(".")[:2])) >= (2, 13), out[0]
    torch_cast = np.asarray(json.loads(out[1]), F32)
    assert_bits(ro.e4m3_torch(v, saturating=True), torch_cast, "torch 2.13 cast")
    nan_rule = ro.e4m3_torch(v)
    assert np.isnan(nan_rule[np.abs(v) > 464]).all()
    assert_bits(nan_rule[np.abs(v) <= 464], torch_cast[np.abs(v) <= 464], "below 464")


# ----------------------------------------------------------------------------- hand-checked examples


def _row(n, head, at=None):
    x = np.zeros((1, n), F32)
    x[0, :len(head)] = head
    for j, v in (at or {}).items():
        x[0, j] = v
    return jnp.asarray(x)


def test_quartet_examples():
    """docs/recipes/quartet.md examples 1-3 (IST-DASLab/Quartet @ 00ccd38, mxfp4_triton.py):
    shared 0.25, ties toward zero, zeros -> -0."""
    y = np.asarray(fake_quant(_row(32, [3, -3, 1, -1, .5, -.5, 2, -2]), "quest_mxfp4"))[0]
    np.testing.assert_array_equal(y[:8], [1.5, -1.5, 1, -1, .5, -.5, 1.5, -1.5])
    assert (y[8:].view(np.uint32) == 0x80000000).all()  # -0.0
    y = np.asarray(fake_quant(_row(32, [8, -8]), "quest_mxfp4"))[0]
    np.testing.assert_array_equal(y[:2], [3, -3])
    q = quantize(_row(32, []), "quest_mxfp4")
    assert int(np.asarray(q.scale)[0, 0]) == 127 - 27  # shared = 2**-27
    assert (np.asarray(dequantize(q)).view(np.uint32) == 0x80000000).all()


def test_tseng_example():
    """docs/recipes/quartet.md example 5 (Quartet @ 00ccd38, AlbertTsengQuantizer SR):
    x[:4] = [1, 0.3, -0.7, 0.05]; u = 0.5 -> [1, 1/3, -2/3, 0], u = 0 -> [1, 1/3, -1, 1/6];
    through the oracle, whose draws are checked against fp4lab's above."""
    x = np.zeros((1, 32), F32)
    x[0, :4] = [1.0, 0.3, -0.7, 0.05]
    y, d = ro.tseng_mxfp4(x, np.full((1, 32), 0.5, F32))
    assert d[0, 0] == F32(0.33333334)
    np.testing.assert_array_equal(y[0, :4], F32([1.0, 0.33333334, -0.6666667, 0]))
    y, _ = ro.tseng_mxfp4(x, np.zeros((1, 32), F32))
    np.testing.assert_array_equal(y[0, :4], F32([1.0, 0.33333334, -1.0, 0.16666667]))


def test_quartet2_examples():
    """docs/recipes/quartet_ii.md examples 1-3 (IST-DASLab/Quartet-II @ 8776a90,
    rtn_1x16s_fp4_kernel): ties away from zero; Four Over Six picks the 4 candidate."""
    x = _row(16, [6, 5, 2.5, 1.25, .25, -.7])
    y = np.asarray(fake_quant(x, "nvfp4_quartet2"))[0]
    np.testing.assert_array_equal(y[:6], [6, 6, 3, 1.5, .5, -.5])
    assert (y[6:].view(np.uint32) == 0x80000000).all()
    y = np.asarray(fake_quant(x, "nvfp4_quartet2_4over6"))[0]
    np.testing.assert_array_equal(y[:6], [6, 4.5, 2.25, 1.5, 0, -.75])
    x = _row(16, [4, 3, 2, 1])
    np.testing.assert_array_equal(np.asarray(fake_quant(x, "nvfp4_quartet2"))[0, :4],
                                  F32([4, 2.6666667, 2, 1]))
    np.testing.assert_array_equal(np.asarray(fake_quant(x, "nvfp4_quartet2_4over6"))[0, :4],
                                  [4, 3, 2, 1])


def test_tetrajet_examples():
    """docs/recipes/tetrajet_v2.md examples 1, 2 (thu-ml/TetraJet-v2-NVFP4Training @ ca5953f,
    quant_fp4_from_reg)."""
    x = _row(128, [6, 3, 1.2, -.4], {16: 0.001})
    q = quantize(x, "nvfp4_double")
    y = np.asarray(dequantize(q))[0]
    np.testing.assert_array_equal(y[:4], [6, 3, 1, -.5])
    s = np.asarray(q.scale).astype(F32)[0]
    assert s[0] == 448 and s[1] == 0.078125 and (s[2:] == 2.0 ** -9).all()
    outer = F32(F32(F32(6) / F32(448)) / F32(6))
    assert y[16] == F32(F32(6) * F32(outer * F32(0.078125)))
    assert abs(y[16] - 0.0010463) < 1e-7
    y = np.asarray(fake_quant(_row(128, []), "nvfp4_double"))
    assert (y == 0).all()


def test_atw_examples():
    """docs/recipes/fp4_all_the_way.md examples 1, 2 (448 variant) and 5 (experimental/fp4.py):
    the encode factor rounded to E4M3 (subnormal 2**-9 for the largest block)."""
    x = _row(32, [2688, 1000, 3, -1, 0], {16: 1.0, 17: 0.3})
    y = np.asarray(fake_quant(x, "nvfp4_atw"))[0]
    np.testing.assert_array_equal(y[:5], [3072, 1024, 0, -0.0, 0])
    assert np.signbit(y[3]) and not np.signbit(y[4])
    np.testing.assert_array_equal(y[16:18], F32([1.0, 0.33333334]))
    # example 5: SR with n = +0.25 on [1.0, 1.3, 2.5, 5] (tensor amax 2688), via the oracle
    x = np.zeros((1, 32), F32)
    x[0, :4] = [1.0, 1.3, 2.5, 5]
    x[0, 16] = 2688.0
    y, sb = ro.atw_nvfp4(x, np.full((1, 32), 0.75, F32))
    assert sb[0, 0] == 1.25
    np.testing.assert_allclose(y[0, :4], [1.2, 1.6, 2.4, 4.8], rtol=1e-6)


def test_stochastic_refused_where_the_recipe_rounds_to_nearest():
    """QuEST (Quartet @ 00ccd38) and Quartet II's forward (@ 8776a90) choose their scales for
    round to nearest: stochastic rounding is refused."""
    for fmt in ("quest_mxfp4", "nvfp4_quartet2"):
        with pytest.raises(ValueError):
            fake_quant(_x("normal"), fmt, rounding="stochastic", key=jax.random.key(0))
