"""The quantized grouped GEMM of Mixture-of-Experts layers: :func:`qragged_dot`.

``qragged_dot(lhs, rhs, group_sizes, recipe)`` is ``jax.lax.ragged_dot`` (tokens ``lhs: (M, K)``
sorted by expert, one weight per expert ``rhs: (G, K, N)``, ``group_sizes: (G,)`` rows per
expert) whose forward and backward GEMMs quantize their six operands as ``recipe`` says. It is
defined as the loop over experts that TransformerEngine's ``GroupedLinear`` runs (each split
quantized as a tensor of its own, with its own quantizer) and is equal to it bit for bit:

    y[rows of expert e] = qdot_general(lhs[rows of e], rhs[e], ((1,), (0,)), recipe,
                                       state of expert e)

with the key of expert ``e`` ``jax.random.fold_in(key, e)`` (its amax history and OutControl
channels the ``e``-th of a stacked state). So each expert's rows and weight have their own
per-tensor scales (NVFP4's FP32 global scale, FP8's current scaling), their own stochastic
rounding stream and Hadamard signs, and the wgrad operands are blocked along the tokens *within*
each expert's rows: a block never holds two experts' tokens, a group whose size is not a
multiple of the block ends in a partial block whose amax is that of its own rows (the zero
padding TE's ``Fp8Padding`` and torchao's ``pad_token_groups`` add before quantizing;
docs/numerics.md, "Grouped GEMMs").

How: each expert's rows are moved into a slot of ``capacity`` rows (``(G, capacity, K)``, zeros
after the expert's rows), and the core GEMM of :func:`fp4lab.qdot_general` (every feature
composed around it) runs once per expert under ``jax.vmap``; the outputs are gathered back to
the token order. Zero rows change no amax, no block and no random bit of an expert's rows
(stochastic rounding counts an element's position within its own expert's operand), so the
quantization is the loop's by construction: the same code, never a copy. The cost is that of
the experts' capacity (``G * capacity`` rows, ``capacity = M`` by default: always dropless),
what JAX's own CPU ``ragged_dot`` also pays (it multiplies every row by every expert).

The products are summed in FP32 by XLA's dot on each slot; where the loop's per-expert dot of
``m_e`` rows sums in another order, the float32 results may differ in the last bits (an
accumulation difference, never a quantization one: the tests check the loop bit for bit where
the sums are exact and the float64 oracle elsewhere).

Rows after ``sum(group_sizes)`` give zeros (as ``ragged_dot``); rows of an expert beyond
``capacity`` give NaN (a capacity too small for the routing is never a silent drop).
Unlike ``jax.lax.ragged_dot`` on CPU (which multiplies the zeros of other experts' weights
into each row), an inf or NaN in one expert's weight never reaches another expert's rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp4lab.gemm import canonical
from fp4lab.gemm.einsum import _expand_ellipses, plan_einsum
from fp4lab.gemm.operand_quant import STACK_AXIS
from fp4lab.gemm.qdot import _check_operand, _composed, planned_gemm
from fp4lab.gemm.recipe import Recipe, get_recipe
from fp4lab.gemm.state import GemmState, as_gemm_state, check_gemm_state

__all__ = ["qragged_dot", "qexpert_einsum", "expert_keys"]


def expert_keys(key, groups: int, first=0):
    """The key of each expert's GEMM: ``jax.random.fold_in(key, e)`` for the experts ``e`` in
    ``first, ..., first + groups - 1``, stacked (None for None)."""
    if key is None:
        return None
    experts = jnp.arange(groups, dtype=jnp.uint32) + jnp.asarray(first, jnp.uint32)
    return jax.vmap(lambda e: jax.random.fold_in(key, e))(experts)


def _slots(group_sizes, m: int, capacity: int):
    """Each row's expert and position within the expert's rows (int32, shape ``(M,)``): the
    expert is ``G`` for rows after ``sum(group_sizes)``, and ``over`` marks rows beyond
    their expert's capacity."""
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    rows = jnp.arange(m, dtype=jnp.int32)
    expert = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    start = (ends - sizes)[jnp.minimum(expert, sizes.shape[0] - 1)]
    pos = rows - start
    over = (expert < sizes.shape[0]) & (pos >= capacity)
    return expert, pos, over


def _dispatch(x, expert, pos, groups: int, capacity: int):
    """Rows into their experts' slots, ``(G, capacity, ...)``, zeros elsewhere (rows without a
    slot dropped). Its gradient is the gather back: no additions, signed zeros kept."""
    slots = jnp.zeros((groups, capacity) + x.shape[1:], x.dtype)
    return slots.at[expert, pos].set(x, mode="drop", unique_indices=True)


@jax.custom_vjp
def _combine(y, expert, pos, over):
    """The slots' rows back in token order: zeros for rows after the last expert's, NaN for
    rows beyond their expert's capacity."""
    out = y.at[expert, pos].get(mode="fill", fill_value=0)
    return jnp.where(over[:, None], jnp.array(jnp.nan, y.dtype), out)


def _combine_fwd(y, expert, pos, over):
    return _combine(y, expert, pos, over), (expert, pos, y.shape[:2])


def _combine_bwd(res, g):
    expert, pos, (groups, capacity) = res
    # the gather's transpose as a scatter that sets (JAX's adds to zeros: -0 would become +0)
    return _dispatch(g, expert, pos, groups, capacity), None, None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def _check(lhs, rhs, group_sizes, capacity):
    for name, t in (("lhs", lhs), ("rhs", rhs)):
        _check_operand(name, t, "qragged_dot")
    ls, rs, gs = jnp.shape(lhs), jnp.shape(rhs), jnp.shape(group_sizes)
    if len(ls) != 2 or len(rs) != 3 or ls[1] != rs[1]:
        raise ValueError(f"qragged_dot takes lhs (M, K) and rhs (G, K, N), as "
                         f"jax.lax.ragged_dot; got lhs {ls} and rhs {rs}")
    if gs != (rs[0],) or not jnp.issubdtype(jnp.result_type(group_sizes), jnp.integer):
        raise ValueError(f"group_sizes must be integers of shape ({rs[0]},), one per expert of "
                         f"rhs {rs}; got shape {gs}, dtype {jnp.result_type(group_sizes)}")
    if not isinstance(group_sizes, jax.core.Tracer):
        sizes = np.asarray(group_sizes)
        if (sizes < 0).any():
            raise ValueError(f"group_sizes={sizes.tolist()} has a negative size")
    m = ls[0]
    if capacity is None:
        return max(m, 1)
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or not (
            1 <= capacity <= max(m, 1)):
        raise ValueError(f"capacity={capacity!r} must be an int in [1, {max(m, 1)}] (rows "
                         "one expert can receive; None: all M rows, always dropless)")
    return int(capacity)


def _expert_state(recipe: Recipe, state, groups: int, k: int, backend: str,
                  first=0) -> GemmState:
    """``state`` with the key split per expert, each stacked field checked per expert."""
    key, probe, history, channels = as_gemm_state(state)
    for name, t in (("probe", probe), ("amax_history", history), ("channels", channels)):
        if t is not None and (jnp.ndim(t) < 1 or jnp.shape(t)[0] != groups):
            raise ValueError(f"{name} has shape {jnp.shape(t)}; qragged_dot takes one per "
                             f"expert, stacked along a leading axis of {groups}")
    each = lambda t, e: None if t is None else t[e]  # noqa: E731
    checked = [check_gemm_state(recipe, k, GemmState(
        key, each(probe, e), each(history, e), each(channels, e)), backend)
        for e in range(groups)]
    stack = lambda *a: None if a[0] is None else jnp.stack(a)  # noqa: E731
    return GemmState(expert_keys(key, groups, first), probe,
                     stack(*(c.amax_history for c in checked)),
                     stack(*(c.channels for c in checked)))


@functools.partial(jax.jit, static_argnames=("recipe", "out_dtype", "backend", "capacity"))
def _grouped(lhs, rhs, group_sizes, state, *, recipe, out_dtype, backend, capacity):
    groups = rhs.shape[0]
    expert, pos, over = _slots(group_sizes, lhs.shape[0], capacity)
    slots = _dispatch(lhs, expert, pos, groups, capacity)

    def one(x, w, s, rows):
        return _composed(x[None], w[None], recipe, out_dtype, backend, s, rows=rows)[0]

    # each expert's own rows, for the probes (a slot's zeros are not the expert's)
    rows = jnp.minimum(group_sizes.astype(jnp.int32), capacity)
    y = jax.vmap(one, axis_name=STACK_AXIS)(slots, rhs, state, rows)
    return _combine(y, expert, pos, over)


def qragged_dot(lhs, rhs, group_sizes, recipe: str | Recipe = "bf16", state=None, *,
                capacity: int | None = None, first_expert=0, backend: str = "auto",
                precision=None, preferred_element_type=None):
    """``jax.lax.ragged_dot`` whose training GEMMs follow ``recipe``, expert by expert.

    Args:
      lhs: ``(M, K)`` rows sorted by expert (the activation X).
      rhs: ``(G, K, N)``, one weight per expert (W).
      group_sizes: ``(G,)`` integers, rows per expert (rows after their sum give zeros).
      recipe: a :class:`~fp4lab.gemm.recipe.Recipe` or registry name.
      state: as :func:`fp4lab.qdot_general`'s (a key alone, or a
        :class:`~fp4lab.gemm.state.GemmState`); expert ``e`` draws with
        ``jax.random.fold_in(key, e)``; ``probe``, ``amax_history`` and ``channels`` are
        stacked per expert (leading axis ``G``): the probe's gradient is each expert's
        metrics table, measured on its own rows as the loop's ``qdot_general`` would.
      capacity: the most rows one expert receives (static; default ``M``). Rows beyond it
        give NaN. Memory and time grow with ``G * capacity``; a top-k router over ``T``
        tokens sends at most ``T`` rows to an expert.
      first_expert: the index of ``rhs[0]`` in the whole expert stack (an int or a traced
        scalar), where ``rhs`` is one device's share of it (expert parallelism): expert ``e``
        here draws with ``fold_in(key, first_expert + e)``, the bits it draws on one device.
      backend: as :func:`fp4lab.qdot_general`'s.
      precision: accepted for drop-in compatibility (the recipe decides the arithmetic).
      preferred_element_type: output dtype (default: the operands' result type).
    Returns ``(M, N)``.
    """
    del precision
    recipe = get_recipe(recipe)
    capacity = _check(lhs, rhs, group_sizes, capacity)
    groups, k = jnp.shape(rhs)[0], jnp.shape(rhs)[1]
    state = _expert_state(recipe, state, groups, k, backend, first_expert)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    return _grouped(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes), state,
                    recipe=recipe, out_dtype=out_dtype, backend=backend, capacity=capacity)


class _ExpertSpec(NamedTuple):
    """An expert einsum split into one expert's: ``spec`` without the expert letter, where
    the expert axis is in X (None: X is every expert's) and in the output."""
    spec: str
    x_axis: int | None
    out_axis: int


def _expert_spec(spec: str, x_shape, w_shape) -> _ExpertSpec:
    sx, sw, out = _expand_ellipses(spec, len(x_shape), len(w_shape))
    e = sw[:1]
    if not e or e not in out or (len(w_shape) and len(sw) != len(w_shape)):
        raise ValueError(f"qexpert_einsum spec {spec!r}: the weight's first letter is the "
                         f"expert axis and the output keeps it (as in 'EBCM,EMH->EBCH' or "
                         f"'BSM,EMH->BSEH'), for weights of shape {tuple(w_shape)}")
    drop = lambda term: term.replace(e, "")  # noqa: E731
    return _ExpertSpec(f"{drop(sx)},{drop(sw)}->{drop(out)}",
                       sx.index(e) if e in sx else None, out.index(e))


@functools.partial(jax.jit, static_argnames=("split", "recipe", "out_dtype", "backend"))
def _expert_einsum(x, w, state, *, split: _ExpertSpec, recipe, out_dtype, backend):
    def one(xe, we, s):
        plan = plan_einsum(split.spec, xe.shape, we.shape)
        dot = canonical.plan(xe.shape, we.shape, plan.dimension_numbers)
        return jnp.transpose(planned_gemm(xe, we, dot, recipe, out_dtype, backend, s),
                             plan.out_perm)

    return jax.vmap(one, in_axes=(split.x_axis, 0, 0), out_axes=split.out_axis,
                    axis_name=STACK_AXIS)(x, w, state)


def qexpert_einsum(spec: str, x, w, recipe: str | Recipe = "bf16", state=None, *,
                   first_expert=0, backend: str = "auto", precision=None,
                   preferred_element_type=None):
    """``jnp.einsum(spec, x, w)`` over a stack of experts whose training GEMMs follow
    ``recipe`` expert by expert: the einsum form of :func:`qragged_dot`, for MoE layers that
    compute their experts as einsums (MaxText's dense path: ``'EBCM,EMH->EBCH'`` over each
    expert's capacity slots, ``'BSM,EMH->BSEH'`` with every token through every expert).

    The weight's first letter is the expert axis; the output keeps it and X may (each
    expert's own rows) or may not (the same X for every expert). It is the loop over experts
    ``e`` of ``qeinsum(spec without the expert letter, x[e] or x, w[e], recipe, state of e)``
    with expert ``e``'s key ``fold_in(key, first_expert + e)``, bit for bit (where every
    expert reads the same X, its gradient is the experts' summed in XLA's order): each expert's
    operands are tensors of their own (per-tensor scales, stochastic rounding, Hadamard signs),
    or share the stack's scale under ``expert_scale="shared"``, as in :func:`qragged_dot`.
    ``state``, ``first_expert``, ``backend``, ``precision`` and ``preferred_element_type``
    as there (probes, amax histories and channels stacked per expert, measured on all of an
    expert's rows: a capacity slot's zeros count)."""
    del precision
    recipe = get_recipe(recipe)
    for name, t in (("x", x), ("w", w)):
        _check_operand(name, t, "qexpert_einsum")
    split = _expert_spec(spec, jnp.shape(x), jnp.shape(w))
    groups = jnp.shape(w)[0]
    x_shape = list(jnp.shape(x))
    if split.x_axis is not None:
        if x_shape[split.x_axis] != groups:
            raise ValueError(f"qexpert_einsum spec {spec!r}: x's expert axis has "
                             f"{x_shape[split.x_axis]} experts, w {groups}")
        del x_shape[split.x_axis]
    plan = plan_einsum(split.spec, tuple(x_shape), jnp.shape(w)[1:])
    k = canonical.plan(tuple(x_shape), jnp.shape(w)[1:], plan.dimension_numbers).bmkn[2]
    state = _expert_state(recipe, state, groups, k, backend, first_expert)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(x, w))
    return _expert_einsum(jnp.asarray(x), jnp.asarray(w), state, split=split, recipe=recipe,
                          out_dtype=out_dtype, backend=backend)
