"""Benchmark: one training step of a stack of quantized linear layers, per recipe vs ``bf16``.

The model is ``--layers`` residual MLP blocks (``d -> 4d -> d``, GELU) on ``--tokens`` tokens;
one step is forward, the three GEMMs' backward and an SGD update, jitted with donated
parameters. Every recipe's median step time is reported as a ratio to ``bf16`` measured in the
same run (lower is better).

The overhead must come from quantization itself, so the script checks:

* no retracing: the step function is wrapped in ``chex.assert_max_traces(n=1)`` and called
  ``--reps`` times with a new SR key each step (a retrace would raise);
* no host round-trips: the steps of one timing run are dispatched back to back and synced once
  at the end (``--reps`` steps per sync), with ``jax.transfer_guard("disallow")`` active so an
  implicit host transfer inside the loop raises.

    python benchmarks/train_step.py [--recipes bf16,nvfp4,...] [--dim 512] [--layers 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import chex
import jax
import jax.numpy as jnp

from fp4lab.gemm.qdot import qdot_general
from fp4lab.gemm.recipe import RECIPES, get_recipe
from fp4lab import GemmState

DN = (((1,), (0,)), ((), ()))
DEFAULT = "bf16,fp32,fp8_hybrid,fp8_blockwise,mxfp8,mxfp4,nvfp4,nvfp4_no_rht,nvfp4_no_sr,fp4_qat"


def init(key, layers: int, dim: int):
    keys = jax.random.split(key, 2 * layers)
    scale = lambda fan_in: fan_in ** -0.5  # noqa: E731
    return [{"up": jax.random.normal(keys[2 * i], (dim, 4 * dim)) * scale(dim),
             "down": jax.random.normal(keys[2 * i + 1], (4 * dim, dim)) * scale(4 * dim)}
            for i in range(layers)]


def make_step(recipe, lr=1e-2, backend="auto"):
    recipe = get_recipe(recipe)

    def loss_fn(params, x, key):
        h = x
        for i, p in enumerate(params):
            k = jax.random.fold_in(key, i)
            u = qdot_general(h.astype(jnp.bfloat16), p["up"].astype(jnp.bfloat16), DN, recipe,
                             GemmState(key=jax.random.fold_in(k, 0)),
                             preferred_element_type=jnp.float32, backend=backend)
            h = h + qdot_general(jax.nn.gelu(u).astype(jnp.bfloat16),
                                 p["down"].astype(jnp.bfloat16), DN, recipe,
                                 GemmState(key=jax.random.fold_in(k, 1)),
                                 preferred_element_type=jnp.float32, backend=backend)
        return jnp.mean(jnp.square(h))

    chex.clear_trace_counter()  # counts are per code object: start each recipe at zero

    @chex.assert_max_traces(n=1)
    def step(params, x, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, key)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss

    return jax.jit(step, donate_argnums=0)


def time_recipe(recipe, params, x, reps: int, runs: int, backend: str = "auto") -> float:
    step = make_step(recipe, backend=backend)
    keys = list(jax.random.split(jax.random.key(1), reps * (runs + 1)))  # sliced before the guard
    params, loss = step(params, x, keys[0])  # compile
    jax.block_until_ready(loss)
    times = []
    with jax.transfer_guard("disallow"):
        for r in range(runs):
            t0 = time.perf_counter()
            for i in range(reps):
                params, loss = step(params, x, keys[(r + 1) * reps + i])
            jax.block_until_ready(loss)
            times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", default=DEFAULT, help=f"comma list (known: {', '.join(RECIPES)})")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5, help="steps per sync")
    ap.add_argument("--runs", type=int, default=3, help="timed runs (median reported)")
    ap.add_argument("--backend", default="auto", help="auto, xla or pallas (quantizers)")
    args = ap.parse_args(argv)
    recipes = [get_recipe(r) for r in args.recipes.split(",")]
    x = jax.random.normal(jax.random.key(0), (args.tokens, args.dim))
    print(f"{args.layers} blocks of {args.dim} -> {4 * args.dim} -> {args.dim}, "
          f"{args.tokens} tokens, {jax.devices()[0].platform}, quantizer backend "
          f"{args.backend}; median of {args.runs} runs of {args.reps} steps")
    base = None
    print(f"{'recipe':22s} {'ms/step':>9s} {'vs bf16':>8s}")
    for r in [get_recipe("bf16")] + [r for r in recipes if r.name != "bf16"]:
        t = time_recipe(r, init(jax.random.key(2), args.layers, args.dim), x, args.reps,
                        args.runs, backend="xla" if r.name == "bf16" else args.backend)
        base = base or t
        print(f"{r.name:22s} {t * 1e3:9.2f} {t / base:7.2f}x", flush=True)


if __name__ == "__main__":
    main()
