"""Gradient-reduction precision: the data-parallel sum of the replicas' gradients as a
communication library computes it in each precision, emulated exactly.

Nemotron 3 Ultra diverged after its output layer's gradient reduction moved from FP32 to
BF16: the MTP heads' small contributions to the shared output layer were lost in BF16's 8
significant bits. XLA cannot show that: on CPU it compiles a BF16 ``psum`` as an FP32
all-reduce (convert, add in FP32, convert back), so it rounds once. These modes spell the
reduction out over the ``N`` replicas' contributions ``g_0 ... g_{N-1}``:

* ``"fp32"``: the contributions in FP32, summed in replica order in FP32 (FP32 gradient
  reduction, Megatron's ``grad_reduce_in_fp32``);
* ``"bf16_wire"``: each contribution rounded to BF16 (what travels), summed in replica order
  in FP32 (Megatron's ``reduce_scatter_with_fp32_accumulation``);
* ``"bf16_ring"``: BF16 accumulation in ring order: the flattened gradient is cut into ``N``
  chunks (``numpy.array_split``'s sizes), and chunk ``c`` is accumulated as a ring
  reduce-scatter does, starting at replica ``c``: ``g_c + g_{c+1} + ... + g_{c+N-1}``
  (indices mod ``N``), rounded to BF16 after every add;
* ``"bf16_tree"``: BF16 accumulation in tree order: pairwise, ``(g_0 + g_1) + (g_2 + g_3)``
  and so on level by level (an odd one out waits for the next level), rounded to BF16 after
  every add.

Every BF16 rounding is ``lax.reduce_precision`` (round to nearest even, which XLA keeps even
where it may otherwise keep excess precision) on an FP32 sum of two BF16 values: by the
double-rounding theorem (FP32's 24 bits >= 2 * 8 + 2) that is exactly a BF16 adder's
correctly rounded sum. :func:`reduce_stacked` computes the sum from the stacked contributions
``[N, ...]``; :func:`all_reduce` is the collective inside ``shard_map``/``pmap`` (the
contributions all-gathered, then :func:`reduce_stacked` on every replica, so the replicas
agree bit for bit). Results are FP32 (a BF16 mode's are BF16 values).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from fp4lab.numerics.rounding import round_to_bf16

__all__ = ["MODES", "reduce_stacked", "all_reduce", "surviving_fraction"]

MODES = ("fp32", "bf16_wire", "bf16_ring", "bf16_tree")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown gradient-reduction mode {mode!r}; known: {', '.join(MODES)}")
    return mode


def _ordered_sum(terms, rounding):
    acc = terms[0]
    for t in terms[1:]:
        acc = rounding(acc + t)
    return acc


def _tree_sum(terms):
    while len(terms) > 1:  # an odd count: the last term waits a level (strict=False)
        paired = [round_to_bf16(a + b) for a, b in zip(terms[0::2], terms[1::2], strict=False)]
        terms = paired + ([terms[-1]] if len(terms) % 2 else [])
    return terms[0]


def _ring_sum(xs):
    """Chunk ``c`` of the flattened gradient accumulated from replica ``c`` on."""
    n = xs.shape[0]
    flat = xs.reshape(n, -1)
    size = flat.shape[1]
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(size), n)])
    chunk = np.searchsorted(bounds, np.arange(size), side="right") - 1  # chunk of each element
    start = jnp.asarray(chunk, jnp.int32)
    terms = [jnp.take_along_axis(flat, ((start + k) % n)[None], axis=0)[0] for k in range(n)]
    return _ordered_sum(terms, round_to_bf16).reshape(xs.shape[1:])


def reduce_stacked(xs, mode: str):
    """The sum over the leading axis of ``xs`` (the ``N`` replicas' contributions) as
    ``mode`` computes it, in FP32."""
    check_mode(mode)
    xs = jnp.asarray(xs)
    if xs.ndim < 1 or xs.shape[0] < 1:
        raise ValueError(f"reduce_stacked needs [replicas, ...] contributions, got {xs.shape}")
    if mode == "fp32":
        return _ordered_sum([t for t in xs.astype(jnp.float32)], lambda v: v)
    terms = round_to_bf16(xs.astype(jnp.float32))  # what travels: BF16 values
    if mode == "bf16_wire":
        return _ordered_sum([t for t in terms], lambda v: v)
    if mode == "bf16_tree":
        return _tree_sum([t for t in terms])
    return _ring_sum(terms)


def all_reduce(x, axis_name: str, mode: str):
    """The sum of ``x`` over the replicas along ``axis_name`` (inside ``shard_map`` or
    ``pmap``) as ``mode`` computes it; every replica gets the same bits."""
    check_mode(mode)
    try:
        lax.axis_size(axis_name)
    except NameError:
        raise ValueError(f"all_reduce over {axis_name!r}: no mapped axis of that name here; "
                         "call it inside shard_map or pmap over it (reduce_stacked reduces "
                         "stacked contributions without one)") from None
    wire = x.astype(jnp.float32)
    if mode != "fp32":  # all-gather what travels (BF16 modes: 2 bytes an element)
        wire = round_to_bf16(wire).astype(jnp.bfloat16)
    return reduce_stacked(lax.all_gather(wire, axis_name), mode)


def surviving_fraction(g_main, g_small, mode: str) -> dict:
    """How much of a small gradient contribution survives the reduction, with ``g_main`` and
    ``g_small`` the replicas' stacked contributions ``[N, ...]`` (Nemotron 3 Ultra's main
    loss and MTP-head gradients into a shared output layer), ``R`` :func:`reduce_stacked` in
    ``mode``, ``S`` the exact sum of ``g_small`` and ``K = R(g_main + g_small) - R(g_main)``
    what the reduction kept of it:

    * ``"fraction"``: ``<K, S> / <S, S>``, the share of ``S`` that arrives (1 in FP32; 0 when
      BF16 rounds every partial sum back to the main gradient's value);
    * ``"error"``: ``|K - S| / |S|``, what arrives wrong, as rounding noise or loss (about 0
      in FP32; 1 when it is lost; above 1 when BF16's rounding of the main gradient, flipped
      by the small part near rounding boundaries, is larger than the small part itself).
    """
    main = jnp.asarray(g_main, jnp.float32)
    small = jnp.asarray(g_small, jnp.float32)
    kept = (reduce_stacked(main + small, mode) - reduce_stacked(main, mode)).ravel()
    total = jnp.sum(small, axis=0).ravel()
    return {"fraction": jnp.vdot(kept, total) / jnp.vdot(total, total),
            "error": jnp.linalg.norm(kept - total) / jnp.linalg.norm(total)}
