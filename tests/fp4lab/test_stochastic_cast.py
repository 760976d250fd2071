"""Stochastic rounding to BF16 and FP16 (pass-through formats): each result is one of the two
neighbours, rounded up with probability equal to the distance (NumPy oracle), and it removes
the drift that round-to-nearest accumulates in a recurrence (the SSM-state argument)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp4lab

DRAWS = 4000


def _neighbours(v, fmt):
    """The grid points ``lo <= |v| < hi`` of bf16/fp16 around ``|v|`` (NumPy)."""
    a = np.abs(v).astype(np.float32)
    if fmt == "bf16":
        lo = (a.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        hi = (lo.view(np.uint32) + np.uint32(0x10000)).view(np.float32)
        return lo, hi
    lo16 = a.astype(np.float16)  # RNE; step down where it rounded up
    lo16 = np.where(lo16.astype(np.float32) > a, np.nextafter(lo16, np.float16(0)), lo16)
    hi16 = np.where(lo16.astype(np.float32) == a, lo16, np.nextafter(lo16, np.float16(np.inf)))
    return lo16.astype(np.float32), hi16.astype(np.float32)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_results_are_neighbours_with_probability_equal_to_the_distance(fmt):
    rng = np.random.default_rng(1)
    v = (rng.standard_normal(64) * 10.0 ** rng.integers(-3, 3, 64)).astype(np.float32)
    v[:4] = [1.0, -2.5, 1.0 + 2.0 ** -9, 6e-5]  # exact, exact, a quarter, an FP16 subnormal
    lo, hi = _neighbours(v, fmt)
    keys = jax.random.split(jax.random.key(0), DRAWS)
    draw = jax.jit(jax.vmap(lambda k: fp4lab.fake_quant(v, fmt, rounding="stochastic", key=k)))
    ys = np.abs(np.asarray(draw(keys)))
    assert np.all((ys == lo) | (ys == hi))
    assert np.all(np.sign(np.asarray(draw(keys[:1])))[0] == np.sign(v))
    p = np.where(hi > lo, (np.abs(v) - lo) / np.where(hi > lo, hi - lo, 1), 0.0)
    freq = (ys == hi).mean(0) * (hi > lo)
    sd = np.sqrt(p * (1 - p) / DRAWS) + 1e-9
    assert np.all(np.abs(freq - p) < 5 * sd + 1e-12)
    assert freq[0] == 0 and freq[1] == 0  # grid values stay
    q = fp4lab.quantize(v, fmt, rounding="stochastic", key=keys[0])
    assert q.data.dtype == jnp.dtype(ml_dtypes.bfloat16 if fmt == "bf16" else np.float16)


def test_specials_and_saturation():
    x = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 3.4e38, -1e6, 0.0], jnp.float32)
    bf = np.asarray(fp4lab.fake_quant(x, "bf16", rounding="stochastic", key=jax.random.key(3)))
    fp = np.asarray(fp4lab.fake_quant(x, "fp16", rounding="stochastic", key=jax.random.key(3)))
    assert np.isinf(bf[0]) and bf[0] > 0 and np.isinf(bf[1]) and bf[1] < 0 and np.isnan(bf[2])
    assert bf[3] == float(ml_dtypes.finfo(ml_dtypes.bfloat16).max) and bf[5] == 0
    assert fp[3] == 65504.0 and fp[4] == -65504.0 and np.isnan(fp[2])
    with pytest.raises(ValueError, match="only bf16 and fp16"):
        fp4lab.fake_quant(x, "fp32", rounding="stochastic", key=jax.random.key(0))


def test_stochastic_rounding_removes_the_drift_of_a_rounded_recurrence():
    """h <- a h + b kept in BF16 for 8192 steps (a = 0.999): round to nearest loses the small
    increments coherently, stochastic rounding keeps them on average."""
    a, b, steps = 0.999, 0.01, 8192
    exact = b * (1 - a ** steps) / (1 - a)

    def run(rounding, key):
        def body(i, h):
            v = a * h + b
            if rounding == "nearest":
                return v.astype(jnp.bfloat16).astype(jnp.float32)
            return fp4lab.fake_quant(v, "bf16", rounding="stochastic",
                                     key=jax.random.fold_in(key, i))
        return jax.lax.fori_loop(0, steps, body, jnp.zeros((256,), jnp.float32))

    rtn = float(jnp.mean(jax.jit(run, static_argnums=0)("nearest", jax.random.key(0))))
    sr = float(jnp.mean(jax.jit(run, static_argnums=0)("stochastic", jax.random.key(0))))
    drift_rtn, drift_sr = rtn / exact - 1, sr / exact - 1
    assert abs(drift_rtn) > 0.01
    assert abs(drift_sr) < 0.1 * abs(drift_rtn)


def test_a_recipe_operand_can_round_stochastically_to_bf16():
    import dataclasses

    from fp4lab.gemm.operand_quant import quantize_operand
    from fp4lab.gemm.recipe import OperandQuant

    x = jax.random.normal(jax.random.key(0), (1, 8, 64)) * (1 + 2.0 ** -10)
    op = OperandQuant(format="bf16", rounding="stochastic")
    keys = jax.random.split(jax.random.key(1), 2)
    a, b = (np.asarray(quantize_operand(x, op, 2, k).values, np.float32) for k in keys)
    assert a.dtype == np.float32 and not np.array_equal(a, b)  # the key decides
    nearest = np.asarray(quantize_operand(x, dataclasses.replace(op, rounding="nearest"), 2,
                                          keys[0]).values, np.float32)
    lo, hi = _neighbours(np.asarray(x), "bf16")
    assert np.all((np.abs(a) == lo) | (np.abs(a) == hi)) and not np.array_equal(a, nearest)
