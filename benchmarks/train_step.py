"""Benchmark: one training step of a stack of quantized linear layers, per recipe vs ``bf16``.

The model is ``--layers`` residual MLP blocks (``d -> 4d -> d``, GELU) on ``--tokens`` tokens;
one step is forward, the three GEMMs' backward and an SGD update, jitted with donated
parameters. Every recipe's median step time is reported as a ratio to ``bf16`` measured in the
same run (lower is better).

The overhead must come from quantization itself, so the script checks:

* no retracing: each recipe's step counts its traces and raises on a second one, called with
  a new SR key each step;
* no host round-trips: the steps of one timing are dispatched back to back and synced once
  at the end (``--reps`` steps per sync), with ``jax.transfer_guard("disallow")`` active so an
  implicit host transfer inside the loop raises.

The recipes are timed in ``--runs`` rounds, each timing every recipe once in a shuffled order
(interleaved, as ``benchmarks/maxtext_step.py``), and each round's ratio to ``bf16`` is taken
in that round: the table gives ms/step min / median / max and the ratio's median [min, max].

    python benchmarks/train_step.py [--recipes bf16,nvfp4,...] [--dim 512] [--layers 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

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

    traces = []

    def step(params, x, key):
        traces.append(1)  # runs once per trace: a second trace is a retrace
        if len(traces) > 1:
            raise RuntimeError(f"{recipe.name}: the step was traced {len(traces)} times")
        loss, grads = jax.value_and_grad(loss_fn)(params, x, key)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss

    return jax.jit(step, donate_argnums=0)


class Timer:
    """One recipe's compiled step, its own parameters (donated) and keys, timed ``reps`` steps
    at a time."""

    def __init__(self, recipe, params, x, reps: int, runs: int, backend: str):
        self.step, self.x, self.reps = make_step(recipe, backend=backend), x, reps
        # the keys are sliced before the transfer guard
        self.keys = iter(jax.random.split(jax.random.key(1), reps * (runs + 1)))
        self.params, loss = self.step(params, x, next(self.keys))  # compile
        jax.block_until_ready(loss)

    def time(self) -> float:
        with jax.transfer_guard("disallow"):
            t0 = time.perf_counter()
            for _ in range(self.reps):
                self.params, loss = self.step(self.params, self.x, next(self.keys))
            jax.block_until_ready(loss)
        return (time.perf_counter() - t0) / self.reps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", default=DEFAULT, help=f"comma list (known: {', '.join(RECIPES)})")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5, help="steps per timing")
    ap.add_argument("--runs", type=int, default=3, help="rounds (each times every recipe once)")
    ap.add_argument("--backend", default="auto", help="auto, xla or pallas (quantizers)")
    args = ap.parse_args(argv)
    recipes = [get_recipe("bf16")] + [get_recipe(r) for r in args.recipes.split(",")
                                      if r != "bf16"]
    x = jax.random.normal(jax.random.key(0), (args.tokens, args.dim))
    print(f"{args.layers} blocks of {args.dim} -> {4 * args.dim} -> {args.dim}, "
          f"{args.tokens} tokens, {jax.devices()[0].platform}, quantizer backend "
          f"{args.backend}; {args.runs} interleaved rounds of {args.reps} steps")
    timers = {r.name: Timer(r, init(jax.random.key(2), args.layers, args.dim), x, args.reps,
                            args.runs, "xla" if r.name == "bf16" else args.backend)
              for r in recipes}
    times = interleaved({name: t.time for name, t in timers.items()}, args.runs)
    report(times, "bf16", "recipe", 22)


def interleaved(timers: dict, runs: int) -> dict[str, list[float]]:
    """``runs`` rounds, each calling every timer (name -> function returning seconds) once in
    a freshly shuffled order, so that a noisy neighbour hits every variant alike."""
    times = {name: [] for name in timers}
    order = list(timers)
    for round_ in range(runs):
        random.Random(round_).shuffle(order)
        for name in order:
            times[name].append(timers[name]())
    return times


def report(times: dict[str, list[float]], base: str, what: str, width: int) -> None:
    """The table: ms/step min / median / max of each variant, and its ratio to ``base``
    taken round by round, median [min, max]."""
    print(f"{what:{width}s} {'ms/step min / median / max':>28s}  vs {base} median [min, max]")
    for name, ts in times.items():
        ratio = sorted(t / b for t, b in zip(ts, times[base], strict=True))
        ms = sorted(t * 1e3 for t in ts)
        print(f"{name:{width}s} {ms[0]:8.2f} / {statistics.median(ms):8.2f} / {ms[-1]:8.2f}  "
              f"{statistics.median(ratio):.2f}x [{ratio[0]:.2f}, {ratio[-1]:.2f}]", flush=True)


if __name__ == "__main__":
    main()
