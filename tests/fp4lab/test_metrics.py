"""fp4lab.numerics.metrics: known values on constructed tensors, and the reference figures of
docs/numerics.md."""

import jax
import jax.numpy as jnp
import numpy as np
from oracles import numpy_ref
import pytest

import fp4lab
from fp4lab.numerics.metrics import METRIC_NAMES, quant_metrics


def test_everything_below_the_smallest_value_underflows():
    # one block: amax 1000 sets the scale; the 15 tiny values are far below half the smallest
    # E2M1 step at that scale, so all of them flush to zero
    x = np.full((1, 16), 1e-3, np.float32)
    x[0, 0] = 1000.0
    m = quant_metrics(jnp.asarray(x), "nvfp4")
    assert float(m["underflow"]) == pytest.approx(15 / 16)
    assert float(m["underflow_all"]) == pytest.approx(15 / 16)
    y = np.full((2, 32), 1e-30, np.float32)  # MX: each block has its own scale, none flush
    assert float(quant_metrics(jnp.asarray(y), "mxfp8")["underflow"]) == 0.0


def test_underflow_denominators():
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 1] = 1000.0, 1e-3
    m = quant_metrics(jnp.asarray(x), "nvfp4")
    assert float(m["underflow"]) == pytest.approx(1 / 2)  # of the nonzero inputs
    assert float(m["underflow_all"]) == pytest.approx(1 / 32)  # TE's debug denominator


def test_saturation_with_a_given_amax():
    x = jnp.asarray([[2.0, 0.5, -4.0, 0.25]])
    # scale 448: |x| > 1 saturates (a lagging amax: under jit, eagerly it is refused)
    m = jax.jit(lambda x: quant_metrics(x, "fp8_e4m3", global_amax=1.0))(x)
    assert float(m["saturation"]) == pytest.approx(0.5)
    assert float(quant_metrics(x, "fp8_e4m3")["saturation"]) == 0.0


def test_scale_health():
    x = np.ones((4, 16), np.float32) * 1e-6
    x[0, 0] = 1e4  # the other blocks' E4M3 scales become subnormal or zero
    m = quant_metrics(jnp.asarray(x), "nvfp4")
    assert float(m["bad_scales"]) == pytest.approx(3 / 4)
    mx = quant_metrics(jnp.asarray(np.zeros((2, 32), np.float32)), "mxfp8")
    assert float(mx["bad_scales"]) == 1.0  # amax 0: exponent clamped at 2^-127


def test_exact_format_has_infinite_sqnr_and_padding_is_not_counted():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 20)), jnp.bfloat16)
    m = quant_metrics(x, "bf16")
    assert float(m["rel_mse"]) == 0 and np.isposinf(float(m["sqnr_db"]))
    z = jnp.zeros((3, 20)).at[:, 0].set(1.0)  # 20 is padded to 32 for mxfp4
    assert float(quant_metrics(z, "mxfp4")["underflow_all"]) == 0.0
    assert set(quant_metrics(z, "mxfp4")) == set(METRIC_NAMES)


def test_gaussian_reference_figures():
    """docs/numerics.md: NVFP4 RTN on N(0,1) ~20.4 dB SQNR and ~6.8 % underflow; SR ~17.2 dB."""
    x = jax.random.normal(jax.random.key(0), (256, 1024))
    m = quant_metrics(x, "nvfp4")
    assert 20.0 < float(m["sqnr_db"]) < 20.8
    assert 0.064 < float(m["underflow"]) < 0.072
    sr = quant_metrics(x, "nvfp4", rounding="stochastic", key=jax.random.key(1))
    assert 16.8 < float(sr["sqnr_db"]) < 17.6


def test_metrics_jit_and_match_fake_quant():
    x = jax.random.normal(jax.random.key(2), (8, 64))
    m = jax.jit(lambda t: quant_metrics(t, "mxfp4"))(x)
    y = fp4lab.fake_quant(x, "mxfp4")
    rel = float(jnp.sum((x - y) ** 2) / jnp.sum(x**2))
    assert float(m["rel_mse"]) == pytest.approx(rel, rel=1e-5)
    assert float(m["mse"]) == pytest.approx(float(jnp.mean((x - y) ** 2)), rel=1e-5)


def _te_max_blockwise_dynamic_range(x: np.ndarray, block: tuple[int, int]) -> float:
    """Transformer Engine's ``compute_max_blockwise_dynamic_range`` (debug/features/utils/
    stats_computation.py at d0067d0), rowwise, in NumPy: per block ``log2(amax) - log2(min
    nonzero)``, 0 for a zero block, the max over blocks."""
    a = np.abs(x.astype(np.float32))
    b0, b1 = block
    t = a.reshape(a.shape[0] // b0, b0, a.shape[1] // b1, b1).transpose(0, 2, 1, 3)
    t = t.reshape(-1, b0 * b1)
    amax = t.max(1)
    amin = np.where(t == 0, np.inf, t).min(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        per = np.where(amax != 0, np.log2(amax) - np.log2(amin), 0.0)
    return float(per.max())


@pytest.mark.parametrize("fmt, tile, block", [
    ("nvfp4", None, (1, 16)), ("nvfp4", (16, 16), (16, 16)), ("mxfp8", None, (1, 32)),
    ("bf16", None, (32, 64))])
def test_block_dynamic_range_is_transformer_engines_statistic(fmt, tile, block):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((32, 64)) * np.exp2(rng.integers(-12, 12, (32, 64)))).astype(
        np.float32)
    x[:16, :16] = 0  # a zero block (and zeros inside others)
    x[20, 3:9] = 0
    got = float(quant_metrics(jnp.asarray(x), fmt, tile=tile)["block_dynamic_range"])
    np.testing.assert_allclose(got, _te_max_blockwise_dynamic_range(x, block), rtol=1e-6)
    assert float(quant_metrics(jnp.zeros((2, 32)), fmt)["block_dynamic_range"]) == 0.0


def test_map4_share_counts_the_blocks_four_over_six_maps_to_4():
    """Against the ported TE kernel (tests/oracles/numpy_ref.py): a block is mapped to 4 where its
    stored scale differs from the map-to-6 scale."""
    x = np.asarray(jax.random.normal(jax.random.key(0), (64, 64)), np.float32)
    _, sb, amax = numpy_ref.nvfp4_4over6_quantize(x)
    six = numpy_ref.e4m3_byte(np.minimum(
        (numpy_ref._block_reduce_absmax(x, (1, 16)) / np.float32(6))
        * (np.float32(1536) / amax), np.float32(448)))
    want = float((sb != six).mean())
    assert 0.2 < want < 0.5
    got = quant_metrics(jnp.asarray(x), "nvfp4_4over6")["map4_share"]
    assert float(got) == want
    assert float(quant_metrics(jnp.asarray(x), "nvfp4")["map4_share"]) == 0.0


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nvfp4_double", "tseng_mxfp4", "mxfp8"])
def test_noise_ratio_is_the_norm_over_the_stochastic_rounding_noise(fmt):
    """``noise_ratio`` (FP4 All the Way's gradient-to-noise criterion) against a Monte Carlo
    estimate: the mean squared error of 200 stochastically rounded copies (fake_quant), whose
    standard error at this size is well under 1 %."""
    x = jnp.asarray(np.random.default_rng(3).standard_t(4, (32, 256)).astype(np.float32))
    ratio = float(fp4lab.quant_metrics(x, fmt)["noise_ratio"])
    sr = jax.jit(lambda k: jnp.sum(jnp.square(
        fp4lab.fake_quant(x, fmt, rounding="stochastic", key=k) - x)))
    noise = np.mean([float(sr(jax.random.key(i))) for i in range(200)])
    assert ratio == pytest.approx(float(np.sqrt(np.sum(np.square(np.asarray(x))) / noise)),
                                  rel=0.01)


def test_noise_ratio_of_exact_and_halfway_values():
    """Values on the grid add no noise (infinite ratio); an E2M1 value halfway between 4 and 6
    of an MXFP4 block (scale 1: amax 6) has variance (6 - 5)(5 - 4) = 1, so the ratio is
    ``||x|| / 1``."""
    on_grid = jnp.asarray([[6.0, 4.0, 3.0, 0.5] + [0.0] * 28])
    assert float(fp4lab.quant_metrics(on_grid, "mxfp4")["noise_ratio"]) == np.inf
    half = on_grid.at[0, 1].set(5.0)
    assert float(fp4lab.quant_metrics(half, "mxfp4")["noise_ratio"]) == pytest.approx(
        float(jnp.linalg.norm(half)), rel=1e-6)


def test_map4_share_counts_quartet_ii_blocks_mapped_to_4():
    """Quartet II's forward with Four Over Six (tests/oracles/papers.py, IST-DASLab/Quartet-II
    8776a90): the share of blocks whose chosen scale is not the map-to-6 one (S 256, 1 where
    the E4M3 scale is 0)."""
    from oracles.papers import e4m3_rne_sat, quartet2_rtn

    x = np.asarray(jax.random.normal(jax.random.key(1), (64, 64)), np.float32)
    _, chosen = quartet2_rtn(x, four_over_six=True, ftz=True)
    amax = np.float32(np.abs(x).max())
    s_dec = np.float32(np.float32(amax / np.float32(256)) / np.float32(6))
    bamax = np.abs(x.reshape(-1, 16)).max(axis=1).astype(np.float32)
    six = e4m3_rne_sat(np.float32(bamax / np.float32(6)) / s_dec)
    six = np.where(six == 0, np.float32(1), six)
    want = float(np.mean(np.asarray(chosen, np.float32).reshape(-1) != six))
    got = float(quant_metrics(jnp.asarray(x), "nvfp4_quartet2_4over6")["map4_share"])
    assert 0.2 < want < 0.6 and got == want
    assert float(quant_metrics(jnp.asarray(x), "nvfp4_quartet2")["map4_share"]) == 0.0


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_4over6"])
def test_a_huge_finite_amax_overflows_nvfp4s_decode_as_te_and_is_reported(fmt):
    """amax >= FLT_MAX / 448 (~7.6e35): TE's decode multiplier ``fl(s_b * amax)`` overflows, the
    top block's nonzero values dequantize to +-inf and its zeros to NaN; blocks with a small
    enough scale stay finite. fp4lab follows TE bit for bit (the oracle is TE's formula) and
    ``overflow`` counts the finite inputs that came back non-finite."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    x[0, :16] *= 1e36  # the first block reaches amax ~2e36
    x[0, 3] = 0.0
    x[0, 5] = -0.0
    x[1, :16] = 0.0  # a zero block: scale byte 0, stays 0
    quantize, dequantize = {
        "nvfp4": (numpy_ref.nvfp4_quantize, numpy_ref.nvfp4_dequantize),
        "nvfp4_4over6": (numpy_ref.nvfp4_4over6_quantize, numpy_ref.nvfp4_4over6_dequantize),
    }[fmt]
    want = dequantize(*quantize(x, ftz=True), ftz=True)
    got = np.asarray(fp4lab.fake_quant(jnp.asarray(x), fmt))
    np.testing.assert_array_equal(got.view(np.uint32) | (np.isnan(got) * 0xFFFFFFFF),
                                  want.view(np.uint32) | (np.isnan(want) * 0xFFFFFFFF))
    assert np.isinf(got[0, 0]) and np.isnan(got[0, 3]) and np.isnan(got[0, 5])
    assert np.isfinite(got[1:]).all()  # other blocks' scales are small enough
    m = quant_metrics(jnp.asarray(x), fmt)
    assert float(m["overflow"]) == pytest.approx(np.mean(~np.isfinite(want)))
    assert float(m["overflow"]) > 0 and not np.isfinite(float(m["mse"]))
    for finite in ("mxfp4", "fp8_e4m3", "mxfp8"):  # their scales stay in range
        assert float(quant_metrics(jnp.asarray(x), finite)["overflow"]) == 0.0
    assert float(quant_metrics(jnp.asarray(x / 1e12), fmt)["overflow"]) == 0.0


def test_overflow_counts_only_finite_inputs():
    x = jnp.asarray([[np.inf, 1.0, np.nan, 3.4e38]], jnp.float32)
    # bf16: inf and NaN are not counted; 3.4e38 rounds past BF16's largest value to inf
    assert float(quant_metrics(x, "bf16")["overflow"]) == pytest.approx(1 / 2)
    assert float(quant_metrics(jnp.ones((2, 16)), "nvfp4")["overflow"]) == 0.0
