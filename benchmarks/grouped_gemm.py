"""Benchmark: the quantized grouped GEMM (``fp4lab.qragged_dot``) of an MoE expert stack, one
training step (forward, dX and dW), against BF16 ``jax.lax.ragged_dot`` and against the loop
of per-expert ``qdot_general`` calls that defines it.

Tokens ``--tokens`` are routed top-``--top-k`` to ``--experts`` experts with a skewed routing
(group sizes drawn from a Dirichlet, one expert empty, none a multiple of 16), rows sorted by
expert; the step is the gradient of ``sum(y * c)`` with respect to the rows and the weights,
jitted. The loop slices the rows by the (host-known) group sizes, so it is compiled for one
routing: the best case for it. Variants are timed in ``--runs`` interleaved rounds (shuffled
order), and each round's ratio to BF16 ``ragged_dot`` is taken in that round: the table gives
ms/step min / median / max and the ratio's median [min, max].

    python benchmarks/grouped_gemm.py [--recipes mxfp8,nvfp4] [--experts 8] [--dim 256]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import fp4lab
from fp4lab.gemm.grouped import expert_keys
from train_step import interleaved, report  # benchmarks/: the same rounds and table

DN = (((1,), (0,)), ((), ()))


def routing(tokens: int, top_k: int, experts: int, seed: int = 0) -> np.ndarray:
    """Skewed group sizes summing to ``tokens * top_k``: one expert empty, none a multiple
    of 16 where avoidable, each at most ``tokens`` (one row per token and expert)."""
    rng = np.random.default_rng(seed)
    rows = tokens * top_k
    share = rng.dirichlet(np.full(experts - 1, 0.7))
    sizes = np.minimum(np.floor(share * rows).astype(int), tokens)
    sizes[np.argmax(sizes)] += rows - sizes.sum()
    sizes = np.concatenate([[0], sizes])
    for i in range(1, experts):  # move a row from the largest where a size is a multiple of 16
        if sizes[i] % 16 == 0 and sizes[i] > 0:
            j = int(np.argmax(sizes))
            sizes[i] += 1
            sizes[j] -= 1
    return sizes.astype(np.int32)


def variants(recipes, sizes, capacity):
    """name -> ``f(x, w, c, key) -> (dx, dw)``."""
    gs = jnp.asarray(sizes)

    def grads(f):
        return jax.jit(jax.grad(lambda x, w, c, key: jnp.sum(f(x, w, key) * c), (0, 1)))

    out = {"ragged_dot bf16": grads(lambda x, w, key: jax.lax.ragged_dot(
        x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), gs,
        preferred_element_type=jnp.float32))}
    ends = np.cumsum(sizes)
    for r in recipes:
        recipe = fp4lab.get_recipe(r)

        def grouped(x, w, key, recipe=recipe):
            return fp4lab.qragged_dot(x, w, gs, recipe, key if recipe.needs_key else None,
                                      capacity=capacity, preferred_element_type=jnp.float32)

        def loop(x, w, key, recipe=recipe):
            keys = expert_keys(key, len(sizes)) if recipe.needs_key else [None] * len(sizes)
            return jnp.concatenate([fp4lab.qdot_general(
                x[e - n:e], w[i], DN, recipe, keys[i], preferred_element_type=jnp.float32)
                for i, (n, e) in enumerate(zip(sizes, ends, strict=True))])

        out[f"qragged_dot {recipe.name}"] = grads(grouped)
        out[f"loop of qdot_general {recipe.name}"] = grads(loop)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", default="bf16,mxfp8,nvfp4")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=256, help="K (the model width)")
    ap.add_argument("--hidden", type=int, default=512, help="N (the expert width)")
    ap.add_argument("--reps", type=int, default=3, help="steps per timing")
    ap.add_argument("--runs", type=int, default=5, help="interleaved rounds")
    args = ap.parse_args(argv)
    sizes = routing(args.tokens, args.top_k, args.experts)
    m = int(sizes.sum())
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, args.dim))
    w = jax.random.normal(kw, (args.experts, args.dim, args.hidden)) * args.dim ** -0.5
    c = jax.random.normal(kc, (m, args.hidden))
    fns = variants(args.recipes.split(","), sizes, capacity=args.tokens)
    print(f"{args.experts} experts, top-{args.top_k} of {args.tokens} tokens ({m} rows, "
          f"group sizes {sizes.tolist()}), K={args.dim}, N={args.hidden}, "
          f"{jax.devices()[0].platform}; {args.runs} interleaved rounds of {args.reps} steps")
    keys = iter(jax.random.split(jax.random.key(1), args.reps * (args.runs + 1) * len(fns)))
    for f in fns.values():  # compile
        jax.block_until_ready(f(x, w, c, next(keys)))

    def timed(f):
        t0 = time.perf_counter()
        for _ in range(args.reps):
            out = f(x, w, c, next(keys))
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / args.reps

    times = interleaved({name: functools.partial(timed, f) for name, f in fns.items()},
                        args.runs)
    report(times, "ragged_dot bf16", "variant", 34)


if __name__ == "__main__":
    main()
