"""Benchmark: quantize and fake_quant of every format vs a jitted ``x * 2`` of the same tensor.

Every time is reported as a ratio to the copy time measured in the same round (lower is
better), beside the peers that do the same job: JAX's own NVFP4/MXFP8 quantizer
(``jax._src.cudnn.scaled_matmul_stablehlo.quantize``, as used by ``jax.nn.scaled_dot_general``)
and qwix's quantize + dequantize.

Timing. Everything is compiled and warmed up first. Then ``--rounds`` rounds each time every
variant once (the fastest of 3 back-to-back calls), in a fresh random order, each right after
the copy timed the same way, which is its baseline, so a noisy neighbour or a clock change
hits all variants alike. The table gives the min / median / max over the rounds of ``time /
copy``.

``--sr`` adds fp4lab's stochastic rounding (formats that allow it). ``--sizes 256,1024,4096``
instead prints fp4lab's fake_quant in ns per element at each size (the copy's too), to show
whether the cost per element is flat. ``--fusions`` prints, per format, how many loops XLA
compiles fp4lab's fake_quant into, and how many of them touch every element (read or write a
full-size array): the passes over memory.

    python benchmarks/quantize.py [--size 4096] [--rounds 20] [--formats nvfp4,mxfp8] [--sr]
        [--sizes 256,1024,4096] [--fusions] [--smoke]
"""

from __future__ import annotations

import argparse
import math
import random
import re
import statistics
import time

import jax
import jax.numpy as jnp

import fp4lab
from fp4lab.numerics.formats import FORMATS
from fp4lab.numerics.quantize import check_arguments


def peers(x):
    """name -> (format it corresponds to, jitted quantize (+ dequantize))."""
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


def _stochastic_ok(name) -> bool:
    """Whether fp4lab rounds ``name`` stochastically (its own argument check decides)."""
    try:
        check_arguments(jnp.zeros((2, 64)), name, rounding="stochastic", key=jax.random.key(0))
    except ValueError:
        return False
    return True


def fp4lab_variants(formats, sr: bool):
    """(format, label) -> jitted fp4lab function of x (SR with a fixed key)."""
    out = {}
    key = jax.random.key(1)
    for name in formats:
        out[name, "fp4lab quantize"] = jax.jit(lambda x, name=name: fp4lab.quantize(x, name))
        out[name, "fp4lab fake_quant"] = jax.jit(
            lambda x, name=name: fp4lab.fake_quant(x, name))
        if sr and _stochastic_ok(name):
            out[name, "fp4lab fake_quant SR"] = jax.jit(lambda x, name=name: fp4lab.fake_quant(
                x, name, rounding="stochastic", key=key))
    return out


def variants(x, formats, sr: bool = False):
    """(format, label) -> jitted function of x."""
    out = fp4lab_variants(formats, sr)
    for label, (fmt, fn) in peers(x).items():
        if fmt in formats:
            out[fmt, label] = fn
    return out


def _time(fn, x, calls: int = 3) -> float:
    """The fastest of ``calls`` back-to-back synced calls (drops one-off interruptions)."""
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        best = min(best, time.perf_counter() - t0)
    return best


def measure(fns: dict, x, rounds: int, seed: int = 0) -> dict:
    """key -> list of per-round ratios to the copy timed just before it."""
    copy = jax.jit(lambda x: x * 2)
    for fn in (copy, *fns.values()):  # compile and warm up
        jax.block_until_ready(fn(x))
    order = list(fns)
    rng = random.Random(seed)
    ratios = {k: [] for k in fns}
    for _ in range(rounds):
        rng.shuffle(order)
        for k in order:
            base = _time(copy, x)
            ratios[k].append(_time(fns[k], x) / base)
    return ratios


def fusions(fn, x) -> tuple[int, int]:
    """(loops, full-size loops) of ``fn``'s compiled program on ``x``: XLA:CPU's fusions (a
    loop each) and those with a ``x.size``-element operand or result."""
    text = fn.lower(x).compile().as_text()
    entry = text[text.index("\nENTRY"):].splitlines()[1:]
    size = {}  # instruction -> elements of its (first) result
    for line in entry:
        m = re.match(r"\s*(?:ROOT )?(%[\w.-]+) = \(?[a-z0-9]+\[([\d,]*)\]", line)
        if m:
            size[m[1]] = math.prod(int(d) for d in m[2].split(",") if d)
    loops = full = 0
    for line in entry:
        m = re.match(r"\s*(?:ROOT )?(%[\w.-]+) = .* fusion\(([^)]*)\)", line)
        if m:
            loops += 1
            names = [m[1], *re.findall(r"%[\w.-]+", m[2])]
            full += any(size.get(n) == x.size for n in names)
    return loops, full


def per_element(formats, sr, sizes, rounds):
    """fp4lab's fake_quant (and the copy) in ns per element at each size."""
    print(f"{jax.devices()[0].device_kind}; ns per element (median of {rounds} interleaved "
          "rounds, each the fastest of 3 calls)")
    print("\n| variant | " + " | ".join(f"{n}^2" for n in sizes) + " |\n|---|"
          + "---:|" * len(sizes))
    rows = {}
    for n in sizes:
        x = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
        fns = {k: f for k, f in fp4lab_variants(formats, sr).items() if "fake_quant" in k[1]}
        fns["copy", "x * 2"] = jax.jit(lambda x: x * 2)
        for fn in fns.values():
            jax.block_until_ready(fn(x))
        times = {k: [] for k in fns}
        order = list(fns)
        for _ in range(rounds):
            random.shuffle(order)
            for k in order:
                times[k].append(_time(fns[k], x))
        for k, t in times.items():
            rows.setdefault(k, []).append(statistics.median(t) / x.size * 1e9)
    for (fmt, label), r in sorted(rows.items()):
        print(f"| {fmt} {label} | " + " | ".join(f"{v:.2f}" for v in r) + " |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--sr", action="store_true", help="add fp4lab's stochastic rounding")
    p.add_argument("--sizes", default="", help="e.g. 256,1024,4096: ns/element per size")
    p.add_argument("--fusions", action="store_true", help="loops per format, then exit")
    p.add_argument("--smoke", action="store_true", help="tiny size and 2 rounds (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.size, args.rounds = 64, 2

    x = jax.random.normal(jax.random.key(0), (args.size, args.size), jnp.bfloat16)
    formats = args.formats.split(",")
    for f in formats:
        fp4lab.get_format(f)  # a clear error for an unknown name
    if args.fusions:
        print(f"{args.size}x{args.size} bf16: XLA:CPU loops of fp4lab's fake_quant (full size: "
              "those reading or writing every element)\n\n| format | variant | loops | "
              "full size |\n|---|---|---:|---:|")
        for (fmt, label), fn in fp4lab_variants(formats, sr=True).items():
            if "fake_quant" in label:
                loops, full = fusions(fn, x)
                print(f"| {fmt} | {label} | {loops} | {full} |")
        return
    if args.sizes:
        per_element(formats, args.sr, [int(n) for n in args.sizes.split(",")], args.rounds)
        return
    ratios = measure(variants(x, formats, args.sr), x, args.rounds)
    print(f"{jax.devices()[0].device_kind}, {args.size}x{args.size} bf16, {args.rounds} "
          "interleaved rounds; time / copy (jit x*2 timed just before each call)")
    print("\n| format | implementation | min | median | max |\n|---|---|---|---|---|")
    rows = sorted(ratios.items(), key=lambda kv: (kv[0][0], statistics.median(kv[1])))
    for (fmt, label), r in rows:
        print(f"| {fmt} | {label} | {min(r):.2f}x | {statistics.median(r):.2f}x "
              f"| {max(r):.2f}x |")


if __name__ == "__main__":
    main()
