"""fp4lab.numerics.rounding.div: correctly rounded float32 division on every platform, so the XLA
reference's scales are bit-exact on GPUs too (whose XLA division is approximate)."""

import re

import jax
import jax.numpy as jnp
import numpy as np

import fp4lab
from fp4lab.numerics.rounding import div_rn_bits, div

SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1.1754942e-38,
                     1.17549435e-38, 3.4028235e38, 1.0, 3.0, 6.0, 448.0, 2688.0, 1 / 6],
                    np.float32)


def ieee(a, b):
    with np.errstate(all="ignore"):
        return (a / b).view(np.uint32)  # numpy: IEEE division, no flush to zero


def assert_ieee(a, b):
    got = np.asarray(jax.jit(div_rn_bits)(jnp.asarray(a), jnp.asarray(b)))
    want = ieee(a, b)
    nan = np.isnan(want.view(np.float32))
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.all(np.isnan(got[nan].view(np.float32)))


def test_integer_long_division_is_ieee_on_every_class_of_input():
    rng = np.random.default_rng(0)
    n = 200_000
    rand_bits = lambda: rng.integers(0, 2**32, n, dtype=np.uint32).view(np.float32)  # noqa
    assert_ieee(rand_bits(), rand_bits())  # every exponent, subnormals, inf, NaN
    def normal(scale):
        with np.errstate(over="ignore"):  # some products overflow float32: inf inputs too
            return (rng.standard_normal(n) * scale).astype(np.float32)

    assert_ieee(normal(1), normal(1))
    assert_ieee(normal(1e-38), normal(10))  # subnormal quotients (rounded with sticky bits)
    assert_ieee(normal(1e38), normal(1e-3))  # overflow to inf
    ints = rng.integers(1, 2**24, n).astype(np.float32)  # exact quotients and ties
    assert_ieee(ints, rng.integers(1, 2**12, n).astype(np.float32))
    a, b = np.meshgrid(SPECIALS, SPECIALS)
    assert_ieee(a.ravel(), b.ravel())


def float_divides(text: str) -> list[str]:
    """The floating-point divisions of a StableHLO module (integer ones are exact)."""
    return [line for line in text.splitlines() if "stablehlo.divide" in line
            and not re.search(r": tensor<(\d+x)*u?i\d+>$", line.strip())]


def test_div_is_plain_division_on_cpu_and_integer_arithmetic_on_gpu():
    a, b = jnp.float32(1.0), jnp.float32(3.0)
    assert float(div(a, b)) == np.float32(1) / np.float32(3)

    def lowered(platform, f, *args):
        return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()

    x = jax.ShapeDtypeStruct((64,), jnp.float32)
    assert float_divides(lowered("cpu", div, x, x))
    gpu = lowered("cuda", div, x, x)
    assert "stablehlo.divide" in gpu and not float_divides(gpu)  # the long division's digits
    # the whole reference quantizer lowered for a GPU divides nowhere in floating point
    # (the quantize tests check its bits against the NumPy oracle through the same code)
    for fmt, kw in (("nvfp4", {}), ("nvfp4", {"tile": (16, 16)}), ("fp8_e4m3", {}),
                    ("int4_q4_0", {}), ("fp8_block128", {})):
        text = lowered("cuda", lambda t: fp4lab.quantize(t, fmt, backend="xla", **kw),
                       jax.ShapeDtypeStruct((64, 256), jnp.bfloat16))
        assert not float_divides(text), fmt


def test_div_stays_ieee_under_vmap_with_a_constant_or_unbatched_operand():
    """Batched by JAX's own rule, a constant divisor stayed a scalar behind div's barrier and
    XLA rewrote ``x / 6`` into ``x * fl(1/6)`` (one ulp off for 1/3 of the inputs): a grouped
    GEMM vmaps every quantizer over the experts."""
    x = np.random.default_rng(0).uniform(1, 1000, (4, 256)).astype(np.float32)
    want = x / np.float32(6)
    cases = {
        "constant divisor": (jax.vmap(lambda a: div(a, np.float32(6)))(x), want),
        "constant dividend": (jax.vmap(lambda a: div(np.float32(6), a))(x), np.float32(6) / x),
        "nested, unbatched array": (jax.vmap(jax.vmap(div, (0, None)), (0, None))(
            x[:, :, None], np.full(3, 6, np.float32)), np.repeat(want[:, :, None], 3, 2)),
        "batched scalar per example": (jax.vmap(div)(x, np.full((4, 1), 6, np.float32)), want),
    }
    for what, (got, ref) in cases.items():
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), ref.view(np.uint32),
                                      err_msg=what)
