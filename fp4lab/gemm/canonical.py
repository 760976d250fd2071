"""A GEMM's dimension numbers as one canonical form: ``X: (B, M, K)``, ``W: (B, K, N)``.

Batch, free and contracting dims are each flattened (as Transformer Engine does), so every
quantized GEMM (``qdot_general`` and the composed features around it) blocks along the same
three axes whatever the caller's layout: K in fprop, N in dgrad, the tokens M in wgrad.
Transposes and reshapes run outside the custom_vjp, so autodiff maps gradients back exactly.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Plan", "plan", "to_canonical", "varying_alike", "BMK_BKN", "BMN_BKN", "BMK_BMN"]

BMK_BKN = (((2,), (1,)), ((0,), (0,)))  # (B,M,K) x (B,K,N) -> (B,M,N): fprop
BMN_BKN = (((2,), (2,)), ((0,), (0,)))  # (B,M,N) x (B,K,N) -> (B,M,K): dgrad
BMK_BMN = (((1,), (1,)), ((0,), (0,)))  # (B,M,K) x (B,M,N) -> (B,K,N): wgrad


class Plan(NamedTuple):
    lhs_perm: tuple[int, ...]
    rhs_perm: tuple[int, ...]
    bmkn: tuple[int, int, int, int]
    out_shape: tuple[int, ...]


def _check_dimension_numbers(lhs_shape, rhs_shape, dimension_numbers) -> tuple:
    """``(lc, rc, lb, rb)`` as tuples of ints, checked as ``lax.dot_general`` checks them:
    axes in ``[0, ndim)`` (no negative axes), each operand's contracting and batch axes
    distinct, and the same number on both sides. An error names the value."""
    dn = f"dimension_numbers={dimension_numbers!r}"
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(ax) for ax in (lc, rc, lb, rb))
    except (TypeError, ValueError):
        raise ValueError(f"{dn} is not ((lhs_contracting, rhs_contracting), (lhs_batch, "
                         "rhs_batch)), each a tuple of axes") from None
    for side, shape, axes in (("lhs", lhs_shape, lc + lb), ("rhs", rhs_shape, rc + rb)):
        for a in axes:
            if isinstance(a, bool) or not isinstance(a, (int, np.integer)) or not (
                    0 <= a < len(shape)):
                raise ValueError(f"{dn}: {side} axis {a!r} is not an axis of the {side} of "
                                 f"shape {tuple(shape)} (axes are 0..{len(shape) - 1}; "
                                 "negative axes are refused, as lax.dot_general refuses them)")
        if len(set(axes)) != len(axes):
            raise ValueError(f"{dn}: the {side}'s contracting and batch axes {axes} repeat an "
                             "axis")
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(f"{dn} pair up unequal axis counts")
    return tuple(tuple(int(a) for a in ax) for ax in (lc, rc, lb, rb))


def plan(lhs_shape, rhs_shape, dimension_numbers) -> Plan:
    """How ``lax.dot_general(lhs, rhs, dimension_numbers)`` maps onto the canonical form."""
    lc, rc, lb, rb = _check_dimension_numbers(lhs_shape, rhs_shape, dimension_numbers)
    for a, b in zip(lc + lb, rc + rb, strict=True):
        if lhs_shape[a] != rhs_shape[b]:
            raise ValueError(f"lhs axis {a} (size {lhs_shape[a]}) and rhs axis {b} (size "
                             f"{rhs_shape[b]}) are paired but differ")
    lf = tuple(a for a in range(len(lhs_shape)) if a not in lc + lb)
    rf = tuple(a for a in range(len(rhs_shape)) if a not in rc + rb)
    size = lambda shape, axes: math.prod(shape[a] for a in axes)  # noqa: E731
    bmkn = (size(lhs_shape, lb), size(lhs_shape, lf), size(lhs_shape, lc), size(rhs_shape, rf))
    out_shape = tuple(lhs_shape[a] for a in lb + lf) + tuple(rhs_shape[a] for a in rf)
    return Plan(lb + lf + lc, rb + rc + rf, bmkn, out_shape)


def to_canonical(lhs, rhs, p: Plan):
    """``(X, W)`` of shapes ``(B, M, K)`` and ``(B, K, N)``."""
    b, m, k, n = p.bmkn
    return (jnp.transpose(lhs, p.lhs_perm).reshape(b, m, k),
            jnp.transpose(rhs, p.rhs_perm).reshape(b, k, n))


def varying_alike(*arrays):
    """``arrays`` (``None`` passes) made to vary over the same mesh axes inside
    ``jax.shard_map``: each one replicated over an axis that another varies over is cast to
    varying there (``jax.lax.pcast``), as JAX does for the operands of its own primitives. A
    ``custom_vjp`` GEMM then returns each input's cotangent with the input's own type, and
    the cast's transpose sums a replicated operand's gradient over the devices. Outside
    ``shard_map`` (or with ``check_vma=False``) nothing varies: ``arrays`` as they are."""
    vma = [None if a is None else jax.typeof(a).manual_axis_type.varying for a in arrays]
    axes = frozenset().union(*(v for v in vma if v is not None))
    return tuple(a if v is None or v == axes else
                 jax.lax.pcast(a, tuple(sorted(axes - v)), to="varying")
                 for a, v in zip(arrays, vma, strict=True))
