"""fp4lab.mismatch against hand computations: plain-Python loops over tokens in float64."""

import math

import jax
import numpy as np
import pytest

from fp4lab.mismatch import mismatch_metrics, token_mult_prob_error, truncated_is_weights


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


def _by_hand(train, rollout, mask, c=2.0):
    toks = [(i, t) for i in range(train.shape[0]) for t in range(train.shape[1]) if mask[i, t]]
    rows = [i for i in range(train.shape[0]) if mask[i].any()]
    n = len(toks)

    def clamp(v):
        return min(max(v, -20.0), 20.0)

    lr = {(i, t): train[i, t] - rollout[i, t] for i, t in toks}
    w = {k: math.exp(clamp(v)) for k, v in lr.items()}
    wc = {k: min(max(v, 1 / c), c) for k, v in w.items()}
    mc = sum(wc.values()) / n

    def row_mean(x, i):
        vals = [x[i, t] for t in range(x.shape[1]) if mask[i, t]]
        return sum(vals) / len(vals)

    d = [row_mean(rollout, i) - row_mean(train, i) for i in rows]
    return {
        "kl": sum(rollout[k] - train[k] for k in toks) / n,
        "k3_kl": sum(math.exp(v) - v - 1 for v in lr.values()) / n,
        "chi2_token": sum(v * v for v in w.values()) / n - 1,
        "chi2_seq": sum(math.exp(2 * clamp(sum(lr[i, t] for t in range(train.shape[1])
                                               if mask[i, t]))) for i in rows) / len(rows) - 1,
        "training_ppl": sum(math.exp(-row_mean(train, i)) for i in rows) / len(rows),
        "rollout_ppl": sum(math.exp(-row_mean(rollout, i)) for i in rows) / len(rows),
        "log_ppl_diff": sum(d) / len(d),
        "log_ppl_abs_diff": sum(abs(v) for v in d) / len(d),
        "ppl_ratio": sum(math.exp(v) for v in d) / len(d),
        "is_mean": sum(w.values()) / n,
        "is_min": min(w.values()), "is_max": max(w.values()),
        "is_std": math.sqrt(max(sum(v * v for v in wc.values()) / n - mc * mc, 0)),
        "is_ess": 1 / (sum((v / mc) ** 2 for v in wc.values()) / n),
        "is_fraction_high": sum(v > c for v in w.values()) / n,
        "is_fraction_low": sum(v < 1 / c for v in w.values()) / n,
        "token_mult_prob_error": sum(math.exp(abs(v)) for v in lr.values()) / n,
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
