"""Benchmark: quantize and fake_quant of every format vs a jitted ``x * 2`` of the same tensor.

Every time is reported as a ratio to the copy time measured in the same run (lower is
better), beside the peers that do the same job: JAX's own NVFP4/MXFP8 quantizer
(``jax._src.cudnn.scaled_matmul_stablehlo.quantize``, as used by ``jax.nn.scaled_dot_general``)
and qwix's quantize + dequantize. Timing: median of ``--reps`` calls, each synced with
``block_until_ready``, after a warm-up call (compilation excluded).

    python benchmarks/quantize.py [--size 4096] [--reps 15] [--formats nvfp4,mxfp8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import fp4lab
from fp4lab.formats import FORMATS


def timeit(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peers(x):
    """name -> (format it corresponds to, jitted quantize+dequantize)."""
    out = {}
    try:
        from jax._src.cudnn import scaled_matmul_stablehlo as sms

        for mode in ("nvfp4", "mxfp8"):
            cfg = jax.nn.get_scaled_dot_general_config(mode)

            def qdq(x, cfg=cfg):
                q, s = sms.quantize(x, cfg)
                b = cfg.block_size
                deq = q.astype(jnp.float32).reshape(*q.shape[:-1], -1, b)
                scale = s.astype(jnp.float32)[..., None]
                if cfg.global_scale is not None:
                    scale = scale * cfg.global_scale.astype(jnp.float32)
                return (deq * scale).reshape(x.shape).astype(x.dtype)

            def q_only(x, cfg=cfg):
                return sms.quantize(x, cfg)

            out[f"jax.nn {mode} quantize"] = (mode, jax.jit(q_only))
            out[f"jax.nn {mode} q+dq"] = (mode, jax.jit(qdq))
    except Exception as e:  # pragma: no cover - peers are optional
        print(f"(jax.nn quantizer unavailable: {e})")
    try:
        from qwix._src.core import qarray

        for mode, block in (("nvfp4", 16), ("mxfp8", 32), ("mxfp4", 32)):
            how = qarray.HowToQuantize(qtype=mode, tiled_axes={x.ndim - 1: block})

            def qdq(x, how=how):
                return qarray.dequantize(qarray.quantize(x, how)).astype(x.dtype)

            out[f"qwix {mode} q+dq"] = (mode, jax.jit(qdq))
    except Exception as e:  # pragma: no cover
        print(f"(qwix unavailable: {e})")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--formats", default=",".join(FORMATS))
    args = p.parse_args(argv)

    x = jax.random.normal(jax.random.key(0), (args.size, args.size), jnp.bfloat16)
    copy = timeit(jax.jit(lambda x: x * 2), x, reps=args.reps)
    print(f"{jax.devices()[0].device_kind}, {args.size}x{args.size} bf16; "
          f"copy (jit x*2): {copy * 1e3:.2f} ms = 1.00x")
    rows = []
    for name in args.formats.split(","):
        q = jax.jit(lambda x, name=name: fp4lab.quantize(x, name))
        fq = jax.jit(lambda x, name=name: fp4lab.fake_quant(x, name))
        rows.append((name, "fp4lab quantize", timeit(q, x, reps=args.reps) / copy))
        rows.append((name, "fp4lab fake_quant", timeit(fq, x, reps=args.reps) / copy))
    for label, (fmt, fn) in peers(x).items():
        rows.append((fmt, label, timeit(fn, x, reps=args.reps) / copy))
    rows.sort(key=lambda r: (r[0], r[2]))
    print("\n| format | implementation | time / copy |\n|---|---|---|")
    for fmt, label, r in rows:
        print(f"| {fmt} | {label} | {r:.2f}x |")


if __name__ == "__main__":
    main()
