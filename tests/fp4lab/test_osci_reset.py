"""fp4lab.features.osci_reset (TetraJet-v2's OsciReset, thu-ml/TetraJet-v2-NVFP4Training ca5953f,
calibrate.py:36-98, oscillation_reset.py distance_ratio) against a NumPy oracle of the same
schedule, with the double-block quantizer's oracle (tests/oracles/papers.py) as ``Q``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles.papers import double_block

from fp4lab.features import osci_reset


def q_oracle(w):
    """Q(W) of a Flax kernel (in, out): the double-block RTN quantizer along axis 0."""
    return double_block(np.asarray(w, np.float32).T, ftz=True)[0].T


def oracle(ws, cfg):
    """Run the schedule over the master weights ``ws[t]`` (after optimizer step t): the
    weights actually kept after each step (a reset replaces the weight) and the reset count."""
    kept, resets, prev, dq, dfp, armed = [], 0, None, None, None, False
    for t, w in enumerate(ws):
        w = np.array(w, np.float32)
        phase = t % cfg.period
        if t >= cfg.start:
            if phase == 0:
                prev, dq, dfp, armed = w.copy(), np.zeros_like(w), np.zeros_like(w), True
            elif armed and phase <= cfg.window:
                dq += np.abs(q_oracle(w) - q_oracle(prev))
                dfp += np.abs(w - prev)
                prev = w.copy()
            elif armed and phase == cfg.window + 1:
                with np.errstate(invalid="ignore", divide="ignore"):
                    ratio = np.where(dfp == 0, 0, dq / dfp)
                mask = ratio >= cfg.threshold
                w = np.where(mask, q_oracle(w), w)
                resets += int(mask.sum())
                armed = False
        kept.append(w)
    return kept, resets


def test_osci_reset_matches_the_schedule_oracle():
    """Weights of which a quarter oscillate across a rounding boundary of their grid (tiny
    moves, a grid move every step) and the rest drift: two periods, the first starting before
    ``start`` (no snapshot yet: nothing tracked), bit for bit and the same reset count."""
    cfg = osci_reset.OsciReset(period=6, window=3, threshold=4.0, start=4)
    rng = np.random.default_rng(0)
    base = rng.standard_normal((256, 8)).astype(np.float32)
    grid = q_oracle(base)
    osc = rng.random(base.shape) < 0.25
    ws = []
    for t in range(16):
        drift = base + 0.02 * t * rng.standard_normal(base.shape).astype(np.float32)
        # oscillating entries sit just around the midpoint between their grid value and the
        # next one up, alternating sides
        mid = grid + 0.5 * (q_oracle(grid * 1.3) - grid)
        wiggle = (mid * (1 + (-1) ** t * 1e-3)).astype(np.float32)
        ws.append(np.where(osc, wiggle, drift).astype(np.float32))
    want, want_resets = oracle(ws, cfg)

    state = osci_reset.init([jnp.asarray(ws[0])])
    run = jax.jit(lambda w, s, t: osci_reset.step(cfg, w, s, t))
    total = 0
    for t, w in enumerate(ws):
        (got,), state, n = run([jnp.asarray(w)], state, t)
        total += int(n)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                      want[t].view(np.uint32), err_msg=f"step {t}")
    assert total == want_resets > 0


def test_osci_reset_rejects_bad_schedules():
    with pytest.raises(ValueError, match="window=5, period=6"):
        osci_reset.OsciReset(period=6, window=5)
    with pytest.raises(ValueError, match="threshold=0"):
        osci_reset.OsciReset(threshold=0)
