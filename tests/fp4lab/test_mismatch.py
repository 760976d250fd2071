"""fp4lab.beyond.mismatch against hand computations: plain-Python loops over tokens in float64."""

import math
from decimal import Decimal, localcontext

import jax
import numpy as np
import pytest

from fp4lab.beyond.mismatch import mismatch_metrics, token_mult_prob_error, truncated_is_weights


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(7)
    train = -rng.gamma(2.0, 0.6, (4, 9))
    rollout = train + rng.normal(0, 0.4, train.shape)
    rollout[1, 2] = train[1, 2] + 30.0  # beyond the +-20 clamp
    rollout[2, 5] = train[2, 5] - 1.2  # a weight above the threshold
    mask = np.ones(train.shape, bool)
    mask[0, 6:] = False  # padding
    mask[3, :] = False  # a row with no response token
    return train, rollout, mask


def _by_hand(train, rollout, mask, c=2.0, num=float):
    """Every metric by its formula, token by token, in ``num`` arithmetic: Python floats
    (float64), or ``Decimal`` (exact to the context's 50 digits: the oracle for small
    mismatches)."""
    def exp(v):
        return v.exp() if isinstance(v, Decimal) else math.exp(v)

    toks = [(i, t) for i in range(train.shape[0]) for t in range(train.shape[1]) if mask[i, t]]
    rows = [i for i in range(train.shape[0]) if mask[i].any()]
    n = len(toks)
    train = {k: num(float(train[k])) for k in toks}
    rollout = {k: num(float(rollout[k])) for k in toks}
    c, bound = num(c), num(20)

    def clamp(v):
        return min(max(v, -bound), bound)

    lr = {k: train[k] - rollout[k] for k in toks}
    w = {k: exp(clamp(v)) for k, v in lr.items()}
    wc = {k: min(max(v, 1 / c), c) for k, v in w.items()}
    mc = sum(wc.values()) / n

    def row_mean(x, i):
        vals = [x[k] for k in toks if k[0] == i]
        return sum(vals) / len(vals)

    d = [row_mean(rollout, i) - row_mean(train, i) for i in rows]
    var = sum(v * v for v in wc.values()) / n - mc * mc
    return {
        "kl": sum(rollout[k] - train[k] for k in toks) / n,
        "k3_kl": sum(exp(v) - v - 1 for v in lr.values()) / n,
        "chi2_token": sum(v * v for v in w.values()) / n - 1,
        "chi2_seq": sum(exp(2 * clamp(sum(lr[k] for k in toks if k[0] == i)))
                        for i in rows) / len(rows) - 1,
        "training_ppl": sum(exp(-row_mean(train, i)) for i in rows) / len(rows),
        "rollout_ppl": sum(exp(-row_mean(rollout, i)) for i in rows) / len(rows),
        "log_ppl_diff": sum(d) / len(d),
        "log_ppl_abs_diff": sum(abs(v) for v in d) / len(d),
        "ppl_ratio": sum(exp(v) for v in d) / len(d),
        "is_mean": sum(w.values()) / n,
        "is_min": min(w.values()), "is_max": max(w.values()),
        "is_std": max(var, 0) ** num(0.5),
        "is_ess": 1 / (sum((v / mc) ** 2 for v in wc.values()) / n),
        "is_fraction_high": num(sum(v > c for v in w.values())) / n,
        "is_fraction_low": num(sum(v < 1 / c for v in w.values())) / n,
        "token_mult_prob_error": sum(exp(abs(v)) for v in lr.values()) / n,
    }


def test_metrics_equal_hand_computations(batch):
    train, rollout, mask = batch
    want = _by_hand(train, rollout, mask)
    with jax.enable_x64(True):
        got = jax.jit(mismatch_metrics)(train, rollout, mask)
        assert set(got) == set(want)
        for k, v in want.items():
            assert float(got[k]) == pytest.approx(v, rel=1e-12, abs=1e-12), k
        assert float(token_mult_prob_error(train, rollout, mask)) == pytest.approx(
            want["token_mult_prob_error"], rel=1e-12)
    got32 = mismatch_metrics(train.astype(np.float32), rollout.astype(np.float32), mask)
    assert float(got32["kl"]) == pytest.approx(want["kl"], rel=1e-5)
    assert want["is_max"] == math.exp(20.0) or want["is_min"] == math.exp(-20.0)


def test_equal_models_have_no_mismatch(batch):
    train, _, mask = batch
    m = mismatch_metrics(train, train, mask)
    for k in ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "is_std",
              "is_fraction_high"):
        assert float(m[k]) == 0.0, k
    for k in ("is_mean", "is_ess", "token_mult_prob_error", "ppl_ratio"):
        assert float(m[k]) == 1.0, k


def test_truncated_weights_by_level(batch):
    train, rollout, mask = batch
    with jax.enable_x64(True):
        tok = np.asarray(truncated_is_weights(train, rollout, mask, threshold=2.0))
        seq = np.asarray(truncated_is_weights(train, rollout, mask, level="sequence"))
        geo = np.asarray(truncated_is_weights(train, rollout, mask, level="geometric",
                                              threshold=5.0))
    for i in range(train.shape[0]):
        valid = [t for t in range(train.shape[1]) if mask[i, t]]
        total = sum(train[i, t] - rollout[i, t] for t in valid)
        for t in range(train.shape[1]):
            if not mask[i, t]:
                assert tok[i, t] == seq[i, t] == geo[i, t] == 0.0
                continue
            lr = min(max(train[i, t] - rollout[i, t], -20), 20)
            assert tok[i, t] == pytest.approx(min(math.exp(lr), 2.0), rel=1e-12)
            assert seq[i, t] == pytest.approx(min(math.exp(min(max(total, -20), 20)), 2.0),
                                              rel=1e-12)
            assert geo[i, t] == pytest.approx(min(math.exp(total / len(valid)), 5.0),
                                              rel=1e-12)
    assert tok.max() == 2.0  # truncated


def test_bad_inputs_are_named():
    a = np.zeros((2, 3))
    with pytest.raises(ValueError, match="same"):
        mismatch_metrics(a, np.zeros((2, 4)))
    with pytest.raises(ValueError, match="threshold=1"):
        mismatch_metrics(a, a, threshold=1)
    with pytest.raises(ValueError, match="level='row'"):
        truncated_is_weights(a, a, level="row")


@pytest.mark.parametrize("junk", [-np.inf, np.inf, np.nan])
def test_masked_positions_are_never_read(batch, junk):
    """Serving engines return -inf log-probs at padding: the metrics and the weights equal
    those of the same data with finite junk there (``inf * 0`` would make them NaN)."""
    train, rollout, mask = batch
    finite_t, finite_r = train.copy(), rollout.copy()
    finite_t[~mask], finite_r[~mask] = 123.0, -7.0
    bad_t, bad_r = train.copy(), rollout.copy()
    bad_t[~mask], bad_r[~mask] = junk, -np.inf
    want = mismatch_metrics(finite_t, finite_r, mask)
    got = mismatch_metrics(bad_t, bad_r, mask)
    for k in want:
        assert np.isfinite(float(got[k])) and float(got[k]) == float(want[k]), k
    assert float(token_mult_prob_error(bad_t, bad_r, mask)) == float(
        token_mult_prob_error(finite_t, finite_r, mask))
    for level in ("token", "sequence", "geometric"):
        np.testing.assert_array_equal(truncated_is_weights(bad_t, bad_r, mask, level=level),
                                      truncated_is_weights(finite_t, finite_r, mask,
                                                           level=level))


SMALL = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7)


def _small_mismatch(scale, seed=0):
    """float32 log-probs from -1e-6 to -3 and rollouts that differ by ``scale`` x N(0, 1)."""
    rng = np.random.default_rng(seed)
    train = (-10.0 ** rng.uniform(-6, 0.5, (4, 64))).astype(np.float32)
    rollout = (train - scale * rng.normal(0, 1, train.shape)).astype(np.float32)
    mask = np.ones(train.shape, bool)
    mask[0, 40:] = False
    return train, rollout, mask


def _exact(train, rollout, mask):
    with localcontext() as ctx:
        ctx.prec = 50
        return {k: float(v) for k, v in _by_hand(train, rollout, mask, num=Decimal).items()}


@pytest.mark.parametrize("scale", SMALL)
def test_small_mismatches_keep_their_digits_in_float32(scale):
    """Against the exact (50-digit) values of the same float32 inputs: k3_kl, is_std,
    log_ppl_abs_diff within 1e-6 relative, is_ess within 1e-7; the signed means (chi2_*,
    log_ppl_diff) within 5e-6 of the mean of their terms' magnitudes. verl's direct forms in
    float32 are 0.3 % (k3_kl) and 6 % (is_std) off at 1e-3, 63 % and 100 % at 1e-4."""
    train, rollout, mask = _small_mismatch(scale)
    exact = _exact(train, rollout, mask)
    got = {k: float(v) for k, v in mismatch_metrics(train, rollout, mask).items()}
    for k in ("k3_kl", "is_std", "log_ppl_abs_diff"):
        assert got[k] == pytest.approx(exact[k], rel=1e-6), k
    assert got["is_ess"] == pytest.approx(exact["is_ess"], rel=1e-7)
    lr = np.where(mask, train.astype(np.float64) - rollout.astype(np.float64), 0.0)
    sums = lr.sum(-1)[mask.any(-1)]
    magnitude = {"chi2_token": np.abs(np.expm1(2 * lr[mask])).mean(),
                 "chi2_seq": np.abs(np.expm1(2 * sums)).mean(),
                 "log_ppl_diff": exact["log_ppl_abs_diff"]}
    for k, size in magnitude.items():
        assert abs(got[k] - exact[k]) <= 5e-6 * size, k


def _verl(train, rollout, mask, dtype, c=2.0):
    """verl's formulas (rollout_corr_helper.compute_offpolicy_metrics / compute_is_metrics,
    masked_mean with its 1e-8) in NumPy, in ``dtype``."""
    t, r, m = train.astype(dtype), rollout.astype(dtype), mask.astype(dtype)

    def masked_mean(v, axis=None):
        return (v * m).sum(axis) / (m.sum(axis) + dtype(1e-8))

    lr = t - r
    rho = np.exp(np.clip(lr, -20, 20))
    wc = np.clip(rho, dtype(1 / c), dtype(c))
    mean_c = masked_mean(wc)
    return {"k3_kl": masked_mean(np.exp(lr) - lr - 1),
            "chi2_token": masked_mean(rho * rho) - 1,
            "is_std": np.sqrt(max(masked_mean(wc * wc) - mean_c ** 2, 0)),
            "is_ess": 1 / masked_mean((wc / (mean_c + dtype(1e-8))) ** 2),
            "log_ppl_diff": (masked_mean(r, -1) - masked_mean(t, -1)).mean()}


# where verl's formulas in float64 are within 1e-6 of the exact values
VERL_EXACT = {"k3_kl": SMALL[:4], "chi2_token": SMALL[:2], "is_std": SMALL[:1],
              "is_ess": SMALL, "log_ppl_diff": SMALL}


@pytest.mark.parametrize("scale", SMALL)
def test_small_mismatches_equal_verls_formulas_in_float64(scale):
    train, rollout, mask = _small_mismatch(scale)
    exact = _exact(train, rollout, mask)
    verl64 = _verl(train, rollout, mask, np.float64)
    got = mismatch_metrics(train, rollout, mask)
    for k, scales in VERL_EXACT.items():
        if scale in scales:
            assert verl64[k] == pytest.approx(exact[k], rel=1e-6), k
            assert float(got[k]) == pytest.approx(verl64[k], rel=2e-6), k
    if scale == 1e-4:  # what float32 does to verl's forms (and did to fp4lab's)
        verl32 = _verl(train, rollout, mask, np.float32)
        assert abs(verl32["k3_kl"] / exact["k3_kl"] - 1) > 0.1
