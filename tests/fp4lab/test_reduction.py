"""fp4lab.beyond.reduction against NumPy oracles (ml_dtypes BF16 adds, explicit orders) on 8
simulated devices; replicas agree bit for bit; the MTP-gradient survival measurement."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from fp4lab.beyond.reduction import MODES, all_reduce, reduce_stacked, surviving_fraction

N = 8
BF16 = ml_dtypes.bfloat16
# XLA:CPU flushes float32 subnormal inputs and results of arithmetic to zero (an add; not a
# convert or reduce_precision: one replica's value passes unchanged; docs/numerics.md); GPUs
# keep them: the oracle follows the backend
FTZ = jax.default_backend() == "cpu"


def _ftz(x):
    x = np.asarray(x)
    if not FTZ:
        return x
    return np.where(np.abs(x.astype(np.float32)) < np.finfo(np.float32).tiny,
                    np.zeros_like(x), x)


def _bf16_add(a, b):  # a BF16 adder: the exact sum rounded once (float64 holds it exactly)
    return _ftz(np.asarray(np.float64(_ftz(a)) + np.float64(_ftz(b))).astype(BF16))


def oracle(xs, mode):
    """Plain loops over the replicas and elements, in NumPy."""
    xs = np.asarray(xs, np.float32)
    n, flat = xs.shape[0], xs.reshape(xs.shape[0], -1)
    if mode == "fp32":
        out = flat[0].copy()
        for t in flat[1:]:
            out = _ftz((_ftz(out) + _ftz(t)).astype(np.float32))
        return out.reshape(xs.shape[1:])
    terms = flat.astype(BF16)
    if mode == "bf16_wire":
        out = terms[0].astype(np.float32)
        for t in terms[1:]:
            out = _ftz(_ftz(out) + _ftz(t.astype(np.float32)))
        return out.reshape(xs.shape[1:])
    out = np.empty(flat.shape[1], BF16)
    if mode == "bf16_tree":
        for e in range(flat.shape[1]):
            level = list(terms[:, e])
            while len(level) > 1:
                nxt = [_bf16_add(a, b) for a, b in zip(level[0::2], level[1::2], strict=False)]
                level = nxt + ([level[-1]] if len(level) % 2 else [])
            out[e] = level[0]
    else:  # ring: chunk c from replica c on
        chunks = np.array_split(np.arange(flat.shape[1]), n)
        for c, idx in enumerate(chunks):
            for e in idx:
                acc = terms[c % n, e]
                for k in range(1, n):
                    acc = _bf16_add(acc, terms[(c + k) % n, e])
                out[e] = acc
    return out.astype(np.float32).reshape(xs.shape[1:])


def _contributions(shape, seed=0):
    """Replicas' gradients with the values that expose each order: wide magnitudes, ties of
    BF16, cancellation, zeros and subnormals."""
    rng = np.random.default_rng(seed)
    xs = (rng.standard_normal((N,) + shape) * 10.0 ** rng.integers(-6, 4, (N,) + shape))
    xs = xs.astype(np.float32)
    flat = xs.reshape(N, -1)
    flat[:, 0] = [1.0, 2.0 ** -8, 2.0 ** -8, 2.0 ** -8, 2.0 ** -8, 0, 0, 0]  # order matters
    flat[:, 1] = [3.0, -3.0, 1e-3, 0, 0, 0, 0, 0]  # cancellation
    flat[:, 2] = 1e-40  # subnormal in FP32 and BF16 (flushed on CPU)
    flat[:, 5] = [2e-38, -1.9e-38, 0, 0, 0, 0, 0, 0]  # a subnormal result
    flat[:, 3] = 0.0
    flat[:, 4] = [1.0 + 2.0 ** -8] + [0.0] * 7  # a BF16 tie on the wire
    return xs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("replicas", [N, 6, 3, 1])  # odd ones out in the tree, uneven chunks
def test_each_mode_equals_its_oracle(mode, replicas):
    xs = _contributions((5, 7))[:replicas]  # 35 elements: 8 chunks of 5 or 4
    got = np.asarray(jax.jit(reduce_stacked, static_argnums=1)(xs, mode))
    np.testing.assert_array_equal(got, oracle(xs, mode))
    assert got.dtype == np.float32


def test_the_orders_differ_where_they_should():
    xs = _contributions((5, 7))
    r = {m: oracle(xs, m).ravel() for m in MODES}
    assert r["fp32"][0] == 1.0 + 4 * 2.0 ** -8  # FP32 keeps the small terms
    assert r["bf16_wire"][0] == 1.0 + 4 * 2.0 ** -8  # they travel exactly, add in FP32
    assert r["bf16_ring"][0] == 1.0  # 1 + 2^-8 is a BF16 tie: rounds to 1, every time
    assert r["bf16_tree"][0] == 1.0 + 4 * 2.0 ** -8  # the small ones add up first
    assert r["bf16_wire"][4] == 1.0 and r["fp32"][4] == 1.0 + 2.0 ** -8
    assert not np.array_equal(r["bf16_ring"], r["bf16_tree"])
    assert not np.array_equal(r["bf16_wire"], r["fp32"])


@pytest.mark.parametrize("mode", MODES)
def test_all_reduce_on_8_devices_equals_the_oracle_on_every_replica(mode):
    devices = jax.devices()[:N]
    assert len(devices) == N, "tests/conftest.py asks XLA for 8 CPU devices"
    mesh = Mesh(np.array(devices), ("data",))
    xs = _contributions((6, 5), seed=3)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    def reduce(x):
        return all_reduce(x[0], "data", mode)[None]

    out = np.asarray(reduce(jnp.asarray(xs)))  # [replica, ...]: each replica's result
    want = oracle(xs, mode)
    for replica in out:
        np.testing.assert_array_equal(replica, want)


def test_a_small_gradient_survives_fp32_and_is_lost_or_noise_in_bf16():
    rng = np.random.default_rng(5)
    main = np.ones((N, 256), np.float32)  # partial sums 1 ... 8: BF16 values
    small = (2.0 ** -12 * rng.uniform(0.5, 1.0, (N, 256))).astype(np.float32)
    s = {m: {k: float(v) for k, v in surviving_fraction(main, small, m).items()}
         for m in MODES}
    assert s["fp32"]["fraction"] == pytest.approx(1.0, abs=1e-3) and s["fp32"]["error"] < 0.05
    for m in ("bf16_wire", "bf16_ring", "bf16_tree"):  # every add rounds back to main's value
        assert s[m] == {"fraction": 0.0, "error": 1.0}, m
    # realistic main gradients: BF16 turns the small part into rounding noise larger than it
    main = rng.standard_normal((N, 4096)).astype(np.float32)
    small = (1e-4 * rng.standard_normal((N, 4096))).astype(np.float32)
    noisy = surviving_fraction(main, small, "bf16_ring")
    assert float(noisy["error"]) > 1.0
    assert float(surviving_fraction(main, small, "fp32")["error"]) < 0.05


def test_bad_modes_are_named():
    with pytest.raises(ValueError, match="unknown gradient-reduction mode 'fp16'"):
        reduce_stacked(np.zeros((2, 3)), "fp16")
    with pytest.raises(ValueError, match="replicas"):
        reduce_stacked(np.float32(1.0), "fp32")
    with pytest.raises(ValueError, match="all_reduce over 'data': no mapped axis"):
        jax.jit(lambda x: all_reduce(x, "data", "bf16_ring"))(np.zeros(4, np.float32))
