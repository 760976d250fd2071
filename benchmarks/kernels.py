"""Benchmark: the Pallas quantization kernels against the plain-XLA reference path and a copy.

For each shape (1024^2 to 16384^2 BF16 by default) and each kernel, the script times

* ``kernel``: the Pallas kernel (``pallas_kernels``, what ``backend="pallas"`` calls),
* ``xla``: the reference path (``backend="xla"``): the same bits, except for stochastic
  rounding (other random bits),
* ``copy``: ``x * 2`` of the same tensor (read + write of the input; the practical ceiling),

each as ``--reps`` calls inside one jitted ``fori_loop`` and one sync (launch overhead does
not dominate even at 1024^2), median of ``--runs``. It prints GB/s (bytes read + written),
the kernel's speed-up over XLA and its fraction of the copy's bandwidth; then one training
step of the ``nvfp4`` recipe on a model-sized stack of layers, with and without kernels, as a
ratio to ``bf16`` (``benchmarks/train_step.py``). ``--config ROWSxCOLSxWARPS`` runs every
kernel with that tile and warp count instead of its default, to tune the defaults.

On a machine without a GPU the kernels run in interpret mode, which measures nothing useful;
``--smoke`` runs tiny shapes there to check that the script works
(``tests/test_benchmarks.py`` does, in CI).

    python benchmarks/kernels.py [--sizes 1024,4096] [--reps 20] [--config 16x256x4] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

import fp4lab
from fp4lab.numerics.hadamard import rht
from pallas_kernels import quantize as kq
from pallas_kernels import rht as kr


def cases(config=None):
    """name -> (kernel fn, reference fn, bytes written per input element); ``config`` (a
    KernelConfig) overrides the kernels' default tiles and warps."""
    cfg = {} if config is None else {"config": config}
    key = jax.random.key(0)
    out = {}
    for fmt in ("nvfp4", "mxfp8", "mxfp8_e5m2", "mxfp4"):
        f = fp4lab.get_format(fmt)
        per = (0.5 if f.element.packed else 1.0) + 1.0 / f.block
        out[f"quantize {fmt}"] = (
            lambda x, fmt=fmt: kq.quantize(x, fmt, **cfg),
            lambda x, fmt=fmt: fp4lab.quantize(x, fmt, backend="xla"), per)
        if f.element.packed:
            out[f"quantize {fmt} + SR"] = (
                lambda x, fmt=fmt: kq.quantize(x, fmt, rounding="stochastic", key=key, **cfg),
                lambda x, fmt=fmt: fp4lab.quantize(x, fmt, rounding="stochastic", key=key,
                                                   backend="xla"), per)
    out["quantize nvfp4 16x16 (+transposed)"] = (
        lambda x: kq.quantize_weight_nvfp4(x, **cfg),
        lambda x: (fp4lab.quantize(x, "nvfp4", tile=(16, 16), backend="xla"),
                   fp4lab.quantize(x.T, "nvfp4", tile=(16, 16), backend="xla")),
        2 * (0.5 + 1 / 256))
    out["rht + nvfp4 + SR (wgrad)"] = (
        lambda x: kr.rht_quantize_nvfp4(x, key, **cfg),
        lambda x: fp4lab.quantize(rht(x, 0).T, "nvfp4", rounding="stochastic", key=key,
                                  backend="xla"),
        0.5 + 1 / 16)
    out["dequantize nvfp4 -> bf16"] = (
        lambda q: kq.dequantize(q, jnp.bfloat16, **cfg),
        lambda q: fp4lab.dequantize(q, jnp.bfloat16, backend="xla"), None)
    return out


def parse_config(text: str):
    """``ROWSxCOLSxWARPS`` (e.g. ``32x256x4``) -> KernelConfig; empty -> None (defaults)."""
    if not text:
        return None
    try:
        rows, cols, warps = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--config {text!r}: expected ROWSxCOLSxWARPS, e.g. 32x256x4") \
            from None
    return kq.KernelConfig(block_rows=rows, block_cols=cols, num_warps=warps)


def looped(fn, reps):
    """``reps`` calls of ``fn`` in one program; the input is tied to the loop counter so XLA
    cannot hoist the work out of the loop."""

    @jax.jit
    def run(x):
        out0 = jax.eval_shape(fn, x)
        init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out0)

        def body(i, carry):
            xi, _ = lax.optimization_barrier((x, i))
            return fn(xi)

        return lax.fori_loop(0, reps, body, init)

    return run


def timeit(fn, x, reps, runs) -> float:
    run = looped(fn, reps)
    jax.block_until_ready(run(x))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(run(x))
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1024,4096,8192,16384")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script)")
    ap.add_argument("--no-step", action="store_true", help="skip the training-step part")
    ap.add_argument("--config", default="", help="ROWSxCOLSxWARPS for every kernel (tuning; "
                    "default: each kernel's own)")
    args = ap.parse_args(argv)
    config = parse_config(args.config)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.smoke:
        raise SystemExit("no GPU: kernels would run in interpret mode; use --smoke to check "
                         "the script, or run this on a GPU")
    sizes = [256] if args.smoke else [int(s) for s in args.sizes.split(",")]
    reps, runs = (2, 1) if args.smoke else (args.reps, args.runs)
    print(f"{jax.devices()[0].device_kind}; {reps} calls per sync, median of {runs}; "
          f"kernel config {config or 'default'}")
    print(f"{'kernel':38s} {'size':>6s} {'kernel GB/s':>11s} {'xla GB/s':>9s} "
          f"{'copy GB/s':>9s} {'vs xla':>7s} {'of copy':>8s}")
    for n in sizes:
        x = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
        t_copy = timeit(lambda x: x * 2, x, reps, runs)
        copy_gbs = 2 * x.nbytes / t_copy / 1e9
        q = fp4lab.quantize(x, "nvfp4", backend="xla")
        for name, (kern, ref, per) in cases(config).items():
            arg = q if per is None else x
            moved = (x.size * (0.5 + 1 / 16) + x.size * 2 if per is None
                     else x.nbytes + x.size * per)
            tk, tx = timeit(kern, arg, reps, runs), timeit(ref, arg, reps, runs)
            print(f"{name:38s} {n:6d} {moved / tk / 1e9:11.0f} {moved / tx / 1e9:9.0f} "
                  f"{copy_gbs:9.0f} {tx / tk:6.2f}x {(moved / tk / 1e9) / copy_gbs:7.0%}",
                  flush=True)
    if not args.no_step:
        import train_step  # benchmarks/train_step.py (this script's folder is on sys.path)

        size = ["--dim", "64", "--layers", "1", "--tokens", "64", "--reps", "1", "--runs", "1"]
        model = size if args.smoke else ["--dim", "4096", "--layers", "4", "--tokens", "8192"]
        for backend in ("xla", "pallas"):
            print(f"\ntraining step, nvfp4 vs bf16, quantizers on {backend}:")
            train_step.main(["--recipes", "bf16,nvfp4", "--backend", backend] + model)


if __name__ == "__main__":
    main()
