"""Quantized GEMMs for training: ``qdot_general`` and ``qeinsum`` as ``jax.custom_vjp``.

The forward GEMM and the two backward GEMMs each quantize their operands as a
:class:`~fp4lab.recipe.Recipe` says (see ``fp4lab.recipe`` for the three GEMMs and their
quantization axes), from the high-precision values, and accumulate in float32. Quantized
operands are dequantized to float32 and multiplied with ``Precision.HIGHEST``: on hardware
without FP4/FP8 tensor cores this emulates a block-scaled GEMM with FP32 accumulation (the
products are exact; only the summation order may differ from a hardware kernel). Pass-through
formats (``bf16``) are plain casts, so the ``bf16`` recipe equals a plain BF16 dot exactly.

Any ``dimension_numbers`` are supported: operands are canonicalized to ``X: (B, M, K)`` and
``W: (B, K, N)`` (batch, free and contracting dims each flattened, as TE does), so the
quantization blocks run over the flattened contracting dims in fprop, over the flattened free
dims of W in dgrad, and over the flattened token (free) dims of X in wgrad. ``lhs`` plays the
activation X and ``rhs`` the weight W.

Randomness: ``key`` is folded in per operand (6 streams), so the two stochastically rounded
gradient operands never share bits; callers fold in the layer (Flax rng streams do this).

The operands are those of :data:`fp4lab.recipe.OPERAND_TABLE` (name, GEMM, role, axis);
probes (:mod:`fp4lab.probes`) measure them through one hook, and kernels serve their
quantizers through :mod:`fp4lab.backend`'s table. The tests' oracle is the same GEMMs written
out with ``fake_quant`` and ``jnp.dot`` (tests/fp4lab/test_qdot.py).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp4lab import backend as _backend
from fp4lab import saved as _saved
from fp4lab.delayed import history_amax
from fp4lab.hadamard import random_signs, rht, rht_transpose
from fp4lab.einsum import plan_einsum
from fp4lab.outcontrol import check_channels
from fp4lab.probes import PROBE_SHAPE, measure
from fp4lab.quantize import check_key, dequantize, fake_quant_operand, quantize, trust_mask
from fp4lab.rounding import abs_max
from fp4lab.recipe import OPERAND_TABLE, OPERANDS, OperandQuant, Recipe, get_recipe

__all__ = ["qdot_general", "qeinsum", "quantize_operand", "operand_keys", "operand_signs",
           "saved_bytes"]

AXIS = {o.name: o.axis for o in OPERAND_TABLE}  # the quantization axis of each operand
_BMK_BKN = (((2,), (1,)), ((0,), (0,)))  # (B,M,K) x (B,K,N) -> (B,M,N)
_BMN_BKN = (((2,), (2,)), ((0,), (0,)))  # (B,M,N) x (B,K,N) -> (B,M,K)
_BMK_BMN = (((1,), (1,)), ((0,), (0,)))  # (B,M,K) x (B,M,N) -> (B,K,N)


def operand_keys(key) -> dict[str, jax.Array | None]:
    """One independent key per GEMM operand, derived deterministically from ``key``."""
    if key is None:
        return dict.fromkeys(OPERANDS)
    return {name: jax.random.fold_in(key, i) for i, name in enumerate(OPERANDS)}


_GEMM_INDEX = {"fprop": 0, "dgrad": 1, "wgrad": 2}


def operand_signs(recipe: Recipe, key) -> dict:
    """Each operand's Hadamard sign vector: the recipe's fixed one (``"te"``, ``"none"``, a
    seed), or for ``"random"`` a vector drawn from ``key`` per GEMM and call, shared by the
    GEMM's two operands so that the transform cancels (the authors of Quartet, Quartet II and
    TetraJet-v2 redraw theirs at every call)."""
    out = {}
    for o in OPERAND_TABLE:
        op = recipe.operands[o.name]
        s = recipe.signs(op)
        if s == "random" and op.hadamard:
            s = random_signs(jax.random.fold_in(key, len(OPERANDS) + _GEMM_INDEX[o.gemm]),
                             op.hadamard)
        out[o.name] = s
    return out


def quantize_operand(x, op: OperandQuant, axis: int, key, signs="te",
                     backend: str = "auto", global_amax=None) -> jax.Array:
    """One GEMM operand as the recipe says: optional RHT along ``axis``, then a pass-through
    cast (BF16/FP16/FP32) or fake quantization to float32 (exact dequantized values).

    On the kernel backend, an NVFP4 operand with a 16-point RHT blocked along the token axis
    of a ``(1, M, K)`` canonical operand (the wgrad operands of one linear layer) goes through
    the fused RHT + quantize (+ SR) kernel of ``pallas_kernels.rht``. ``global_amax``: the
    per-tensor amax to scale for (delayed scaling), instead of the operand's own."""
    if (op.hadamard and axis == 1 and x.ndim == 3 and not op.tile and global_amax is None
            and not isinstance(signs, jax.Array)):
        tokens_first = x[0] if x.shape[0] == 1 else x  # the kernel takes one matrix
        kernel = _backend.decide(backend, _backend.Request(
            op="rht_quantize", format=op.format, shape=tokens_first.shape, axis=-2,
            rounding=op.rounding, transform=op.hadamard), strict=True)
        if kernel is not None:
            q = kernel.fn(tokens_first, op.format, key, rounding=op.rounding, signs=signs)
            return dequantize(q, jnp.float32, backend=backend).T[None]
    if op.hadamard:
        x = rht(x, axis, op.hadamard, signs)
    if op.format.is_passthrough:
        if op.rounding == "stochastic":  # SR onto the BF16/FP16 grid
            return fake_quant_operand(x.astype(jnp.float32), op.format, rounding="stochastic",
                                      key=key).astype(op.format.element.storage)
        return x.astype(op.format.element.storage)
    axis = -1 if op.tile else axis % x.ndim - x.ndim
    # in a GEMM, "pallas" means kernels where they exist: an operand without one falls back
    # to XLA with a KernelFallback warning instead of failing the whole GEMM
    return fake_quant_operand(x.astype(jnp.float32), op.format, axis=axis, tile=op.tile,
                              rounding=op.rounding, key=key, backend=backend,
                              global_amax=global_amax, strict=True)


def _mm(a, b, dn):
    """A GEMM with float32 accumulation; float32 operands use full float32 precision."""
    dt = jnp.promote_types(a.dtype, b.dtype)
    precision = lax.Precision.HIGHEST if dt == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(a.astype(dt), b.astype(dt), dn, precision=precision,
                           preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- canonical form


class _Plan(NamedTuple):
    lhs_perm: tuple[int, ...]
    rhs_perm: tuple[int, ...]
    lhs_canon: tuple[int, ...]  # permuted lhs shape
    rhs_canon: tuple[int, ...]
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


def _plan(lhs_shape, rhs_shape, dimension_numbers) -> _Plan:
    lc, rc, lb, rb = _check_dimension_numbers(lhs_shape, rhs_shape, dimension_numbers)
    for a, b in zip(lc + lb, rc + rb, strict=True):
        if lhs_shape[a] != rhs_shape[b]:
            raise ValueError(f"lhs axis {a} (size {lhs_shape[a]}) and rhs axis {b} (size "
                             f"{rhs_shape[b]}) are paired but differ")
    lf = tuple(a for a in range(len(lhs_shape)) if a not in lc + lb)
    rf = tuple(a for a in range(len(rhs_shape)) if a not in rc + rb)
    size = lambda shape, axes: math.prod(shape[a] for a in axes)  # noqa: E731
    bmkn = (size(lhs_shape, lb), size(lhs_shape, lf), size(lhs_shape, lc), size(rhs_shape, rf))
    lhs_perm, rhs_perm = lb + lf + lc, rb + rc + rf
    out_shape = tuple(lhs_shape[a] for a in lb + lf) + tuple(rhs_shape[a] for a in rf)
    return _Plan(lhs_perm, rhs_perm, tuple(lhs_shape[a] for a in lhs_perm),
                 tuple(rhs_shape[a] for a in rhs_perm), bmkn, out_shape)


def _to_canon(lhs, rhs, p: _Plan):
    b, m, k, n = p.bmkn
    return (jnp.transpose(lhs, p.lhs_perm).reshape(b, m, k),
            jnp.transpose(rhs, p.rhs_perm).reshape(b, k, n))


def _from_canon(x, canon_shape, perm, dtype):
    inv = [0] * len(perm)
    for i, a in enumerate(perm):
        inv[a] = i
    return jnp.transpose(x.reshape(canon_shape), inv).astype(dtype)


# ----------------------------------------------------------------------------- custom_vjp


def _delayed_amaxes(recipe: Recipe, history) -> dict[str, jax.Array | None]:
    """Per operand: the amax its scale is computed from (delayed scaling), else None."""
    out = dict.fromkeys(OPERANDS)
    for name in recipe.delayed_operands:
        out[name] = history_amax(history[OPERANDS.index(name)], recipe.delayed)
    return out


def _observed(x, op: OperandQuant, axis: int, signs) -> jax.Array:
    """The amax of what a per-tensor operand quantizes (after its RHT, if it has one)."""
    if op.hadamard:
        x = rht(x, axis, op.hadamard, signs)
    return abs_max(x)


def _weight(w, recipe: Recipe, key, backend, amax, signs):
    """fprop W, and a QArray to reuse in dgrad when both GEMMs use the same tiled spec."""
    op = recipe.fprop_w
    if op.tile and op == recipe.dgrad_w and not op.format.is_passthrough and not op.hadamard:
        qw = quantize(w.astype(jnp.float32), op.format, tile=op.tile, rounding=op.rounding,
                      key=key, backend=backend)
        return dequantize(qw), qw
    return quantize_operand(w, op, AXIS["fprop_w"], key, signs["fprop_w"], backend,
                            amax["fprop_w"]), None


def _forward(x, w, keys, recipe: Recipe, backend, amax, signs, channels=None):
    """``(Y, xq, wq, qw)``: the forward GEMM and its quantized operands (in the rotated
    domain when the forward has a Hadamard transform; ``qw`` the reusable tiled weight).
    With OutControl ``channels``: K split, ``xq`` and ``wq`` both parts in K's order."""
    if channels is not None:
        return _forward_split(x, w, keys, recipe, backend, signs, channels)
    wq, qw = _weight(w, recipe, keys["fprop_w"], backend, amax, signs)
    xq = quantize_operand(x, recipe.fprop_x, AXIS["fprop_x"], keys["fprop_x"],
                          signs["fprop_x"], backend, amax["fprop_x"])
    return _mm(xq, wq, _BMK_BKN), xq, wq, qw


# ----------------------------------------------------------------------------- OutControl


def _split(t, channels, n: int, axis: int):
    """``t``'s K axis in ``channels`` order, cut after the first ``n``: (outliers, rest)."""
    t = jnp.take(t, channels, axis=axis)
    return lax.slice_in_dim(t, 0, n, axis=axis), lax.slice_in_dim(t, n, None, axis=axis)


def _merge(hi, lo, channels, axis: int):
    """The inverse of :func:`_split`: both parts back in K's order."""
    return jnp.take(jnp.concatenate([hi, lo], axis), jnp.argsort(channels), axis=axis)


def _high(recipe: Recipe, source="input") -> OperandQuant:
    return OperandQuant(format=recipe.outliers.format, source=source)


def _forward_split(x, w, keys, recipe: Recipe, backend, signs, channels):
    """OutControl's forward (``linear_mix.py``): the outlier channels of X and W in the
    high-precision format, the rest as the recipe says, each part quantized along K over
    its channels in ``channels`` order; the FP4 product plus the high-precision one."""
    n = recipe.outliers.count(x.shape[-1])
    x_hi, x_lo = _split(x, channels, n, 2)
    w_hi, w_lo = _split(w, channels, n, 1)
    hi = _high(recipe)
    xq_lo = quantize_operand(x_lo, recipe.fprop_x, -1, keys["fprop_x"], signs["fprop_x"],
                             backend)
    wq_lo = quantize_operand(w_lo, recipe.fprop_w, 1, keys["fprop_w"], signs["fprop_w"],
                             backend)
    xq_hi = quantize_operand(x_hi, hi, -1, None, "none", backend)
    wq_hi = quantize_operand(w_hi, hi, 1, None, "none", backend)
    y = _mm(xq_lo, wq_lo, _BMK_BKN) + _mm(xq_hi, wq_hi, _BMK_BKN)
    return y, _merge(xq_hi, xq_lo, channels, 2), _merge(wq_hi, wq_lo, channels, 1), None


def _wgrad_split(xq, dy, q, recipe: Recipe, channels, backend):
    """OutControl's wgrad (rows of dW, one per channel of K): the forward's X requantized
    along the tokens, its rest channels as ``wgrad_x`` says with dY as ``wgrad_dy``, its
    outlier channels and dY in the outlier format."""
    x_hi, x_lo = _split(xq, channels, recipe.outliers.count(xq.shape[-1]), 2)
    dw_lo = _mm(q("wgrad_x", x_lo), q("wgrad_dy", dy), _BMK_BMN)
    dw_hi = _mm(quantize_operand(x_hi, _high(recipe, "forward"), AXIS["wgrad_x"], None,
                                 "none", backend),
                quantize_operand(dy, _high(recipe), AXIS["wgrad_dy"], None, "none", backend),
                _BMK_BMN)
    return _merge(dw_hi, dw_lo, channels, 1)


def _trust_masks(x, w, recipe: Recipe, signs):
    """Where the forward quantizers did not clip X and W (Quartet's trust estimator), in the
    forward's (rotated) domain; ``None`` unless the recipe asks for it."""
    if not recipe.trust:
        return None
    out = []
    for name, t in (("fprop_x", x), ("fprop_w", w)):
        op = recipe.operands[name]
        if op.hadamard:
            t = rht(t, AXIS[name], op.hadamard, signs[name])
        out.append(trust_mask(t.astype(jnp.float32), op.format, axis=AXIS[name]))
    return tuple(out)


def _to_input_domain(g, name, recipe: Recipe, mask, length, signs):
    """A gradient with respect to the forward's quantized operand ``name`` (rotated domain
    when the forward has a transform) as one with respect to the input: zero where the trust
    mask says the forward clipped, then the transform's transpose, cut to ``length``."""
    op = recipe.operands[name]
    if mask is not None:
        g = jnp.where(mask, g, jnp.zeros_like(g))
    if op.hadamard:
        g = rht_transpose(g, AXIS[name], length, op.hadamard, signs[name])
    return g


def _backward(x, w, dy, keys, recipe: Recipe, xq, wq, qw, masks, backend, amax, signs, k,
              channels=None):
    """dX and dW; ``k`` the length of K (``x`` and ``w`` are zero-size stand-ins where the
    backward reads only the forward's quantized tensors: :func:`_uses_input`)."""
    if recipe.backward == "ste":  # QAT: differentiate straight through the forward quantizers
        return _mm(dy, wq, _BMN_BKN), _mm(xq, dy, _BMK_BMN)

    def q(name, t):
        op = recipe.operands[name]
        return quantize_operand(t, op, AXIS[name], keys[name], signs[name], backend,
                                amax[name])

    # a backward operand requantized from the forward's lives in the forward's domain, and so
    # does the gradient it gives; the trust mask is applied there too
    x_dom = recipe.wgrad_x.source == "forward" or recipe.trust
    w_dom = recipe.dgrad_w.source == "forward" or recipe.trust
    if recipe.dgrad_w.source == "forward":
        wq2 = q("dgrad_w", wq)
    else:
        wq2 = dequantize(qw) if qw is not None else q("dgrad_w", w)
        if w_dom and recipe.fprop_x.hadamard:  # dX in the rotated domain, for the mask
            wq2 = rht(wq2, AXIS["fprop_w"], recipe.fprop_x.hadamard, signs["fprop_w"])
    dx = _mm(q("dgrad_dy", dy), wq2, _BMN_BKN)
    if w_dom:
        dx = _to_input_domain(dx, "fprop_x", recipe, masks and masks[0], k, signs)
    if channels is not None:
        return dx, _wgrad_split(xq, dy, q, recipe, channels, backend)
    x_src = xq if recipe.wgrad_x.source == "forward" else x
    dw = _mm(q("wgrad_x", x_src), q("wgrad_dy", dy), _BMK_BMN)
    if x_dom:
        if recipe.wgrad_x.source != "forward" and recipe.fprop_w.hadamard:
            dw = rht(dw, AXIS["fprop_w"], recipe.fprop_w.hadamard, signs["fprop_w"])
        dw = _to_input_domain(dw, "fprop_w", recipe, masks and masks[1], k, signs)
    return dx, dw


def _history_grad(history, recipe: Recipe, tensors: dict) -> jax.Array | None:
    """The history's "gradient": this step's amaxes in column 0 (see fp4lab.delayed);
    ``tensors`` by role (x, w and dy each serve two operands: one amax per tensor and
    transform)."""
    if history is None:
        return None
    seen: dict = {}
    observed = []
    for o in OPERAND_TABLE:
        if o.name not in recipe.delayed_operands:
            observed.append(jnp.float32(0))
            continue
        op = recipe.operands[o.name]
        k = (o.role, op.hadamard, o.axis if op.hadamard else None)
        if k not in seen:
            seen[k] = _observed(tensors[o.role], op, o.axis, recipe.signs(op))  # fixed signs
        observed.append(seen[k])
    return jnp.zeros_like(history).at[:, 0].set(jnp.stack(observed))


def saved_bytes(lhs, rhs, dimension_numbers, recipe: str | Recipe = "bf16") -> dict[str, int]:
    """What :func:`qdot_general` keeps for its backward pass, in bytes (from the shapes and
    dtypes of ``lhs`` and ``rhs``, arrays or ``jax.ShapeDtypeStruct``): ``x`` (the saved
    input: as it came, or ``recipe.saved_x``'s codes and scales), ``w``, ``other`` (keys,
    a reused quantized weight, probes), ``total``, and ``host`` (the part offloaded)."""
    recipe = get_recipe(recipe)
    plan = _plan(jnp.shape(lhs), jnp.shape(rhs), dimension_numbers)
    out_dtype = jnp.result_type(lhs, rhs)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype) if recipe.needs_key else None
    res = jax.eval_shape(lambda a, b, k: _qdot_fwd(plan, recipe, out_dtype, "xla", a, b, k,
                                                   None, None, None)[1], lhs, rhs, key)
    size = lambda t: sum(math.prod(a.shape) * a.dtype.itemsize  # noqa: E731 (keys: 8 B)
                         for a in jax.tree.leaves(t))
    x, w = size(res[0]), size(res[1])
    total = size(res)
    return {"x": x, "w": w, "other": total - x - w, "total": total,
            "host": x if recipe.saved_x is not None and recipe.saved_x.offload else 0}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _qdot(plan: _Plan, recipe: Recipe, out_dtype, backend, lhs, rhs, key, probe, history,
          channels):
    x, w = _to_canon(lhs, rhs, plan)
    amax = _delayed_amaxes(recipe, history)
    y = _forward(x, w, operand_keys(key), recipe, backend, amax, operand_signs(recipe, key),
                 channels)[0]
    return y.reshape(plan.out_shape).astype(out_dtype)


def _fp4_part(t, recipe: Recipe, channels, axis):
    """What the probes measure of a split tensor (OutControl): its recipe-quantized part."""
    if channels is None:
        return t
    return _split(t, channels, recipe.outliers.count(t.shape[axis]), axis)[1]


def _uses_input(recipe: Recipe, role: str) -> bool:
    """Whether the backward pass reads X (``"x"``) or W as they came into the GEMM: not for
    QAT (it differentiates through the forward's quantized operands) nor where the operand's
    backward GEMM requantizes the forward's; then only its dtype is saved. (Delayed scaling
    observes the inputs' amaxes in the backward pass: it keeps them.)"""
    if recipe.delayed is not None:
        return True
    if recipe.backward == "ste":
        return False
    return (recipe.wgrad_x if role == "x" else recipe.dgrad_w).source != "forward"


def _stand_in(t):
    """A zero-size array of ``t``'s dtype: what is saved of an input the backward does not
    read (the gradient takes its dtype)."""
    return jnp.zeros((0,), t.dtype)


def _qdot_fwd(plan, recipe, out_dtype, backend, lhs, rhs, key, probe, history, channels):
    x, w = _to_canon(lhs, rhs, plan)
    keys = operand_keys(key)
    amax = _delayed_amaxes(recipe, history)
    signs = operand_signs(recipe, key)
    y, xq, wq, qw = _forward(x, w, keys, recipe, backend, amax, signs, channels)
    fwd_probes = None if probe is None else measure(
        recipe, {"x": _fp4_part(x, recipe, channels, 2), "w": _fp4_part(w, recipe, channels, 1)},
        keys, amax, signs, ("fprop",))
    keep = recipe.backward == "ste" or recipe.requantizes
    x_res = _saved.store(x, recipe.saved_x) if _uses_input(recipe, "x") else _stand_in(x)
    w_res = w if _uses_input(recipe, "w") else _stand_in(w)
    res = (x_res, w_res, key) + ((xq, wq) if keep else (None, None)) + (
        qw, _trust_masks(x, w, recipe, signs), fwd_probes, history, channels)
    return y.reshape(plan.out_shape).astype(out_dtype), res


def _qdot_bwd(plan, recipe, out_dtype, backend, res, g):
    x, w, key, xq, wq, qw, masks, fwd_probes, history, channels = res
    x = _saved.restore(x, recipe.saved_x)
    b, m, _, n = plan.bmkn
    # a constant cotangent (``loss = y.sum()``) would otherwise be quantized by XLA's
    # constant folder at compile time: tens of seconds at 2048^2, the same bits at run time
    dy = lax.optimization_barrier(g.reshape(b, m, n))
    keys = operand_keys(key)
    amax = _delayed_amaxes(recipe, history)
    signs = operand_signs(recipe, key)
    dx, dw = _backward(x, w, dy, keys, recipe, xq, wq, qw, masks, backend, amax, signs,
                       plan.bmkn[2], channels)
    tensors = {"x": x, "w": w, "dy": dy, "fwd_x": _fp4_part(xq, recipe, channels, 2),
               "fwd_w": wq}
    probes = None if fwd_probes is None else jnp.concatenate(
        [fwd_probes, measure(recipe, tensors, keys, amax, signs, ("dgrad", "wgrad"))])
    seen = _history_grad(history, recipe, tensors)
    return (_from_canon(dx, plan.lhs_canon, plan.lhs_perm, x.dtype),
            _from_canon(dw, plan.rhs_canon, plan.rhs_perm, w.dtype), None, probes, seen, None)


_qdot.defvjp(_qdot_fwd, _qdot_bwd)


def _check_operand(name, x):
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(f"qdot_general needs floating-point operands; {name} has dtype "
                        f"{jnp.result_type(x)}")


def qdot_general(lhs, rhs, dimension_numbers, recipe: str | Recipe = "bf16", *, key=None,
                 probe=None, amax_history=None, channels=None, backend: str = "auto",
                 precision=None, preferred_element_type=None, out_sharding=None):
    """``lax.dot_general`` whose three training GEMMs follow ``recipe``.

    Args:
      lhs, rhs: the activation-like and the weight-like operand.
      dimension_numbers: as ``lax.dot_general``.
      recipe: a :class:`~fp4lab.recipe.Recipe` or registry name.
      key: PRNG key; required when the recipe uses stochastic rounding.
      probe: ``None``, or :func:`fp4lab.probes.probe_zeros` to measure the numerics of all six GEMM
        operands: its gradient is the metrics table (the output does not depend on it).
      amax_history: for recipes with delayed scaling (``fp8_delayed``): this GEMM's history,
        ``fp4lab.delayed.init_history(recipe.delayed)`` at first; its gradient holds the
        step's amaxes for :func:`fp4lab.delayed.update`.
      channels: for recipes with OutControl (``tetrajet_v2_outcontrol``): the K channels of
        the reduction axis, outliers first (:func:`fp4lab.outcontrol.channel_order` of
        their summed :func:`~fp4lab.outcontrol.channel_norms`); the GEMM then splits K as
        :class:`fp4lab.recipe.OutControl` says. ``None``: the recipe without the split.
      backend: ``"auto"``, ``"xla"`` or ``"pallas"`` for the operand quantizers (see
        :mod:`fp4lab.backend`); round-to-nearest kernels give the same bits, stochastic
        rounding kernels other (equally unbiased) random bits.
      precision: accepted for drop-in compatibility (the recipe decides the arithmetic).
      preferred_element_type: output dtype (default: the operands' result type).
      out_sharding: as ``lax.dot_general`` (Flax layers pass it): the output is constrained
        to it when given; by default it follows the inputs' sharding under jit.
    Any other keyword is an error (a misspelt ``backend=`` must not pass silently).
    """
    del precision
    recipe = get_recipe(recipe)
    _check_operand("lhs", lhs)
    _check_operand("rhs", rhs)
    if recipe.needs_key and key is None:
        raise ValueError(f"recipe {recipe.name} uses stochastic rounding: pass key=... (a "
                         "jax.random key, or an rng stream in Flax)")
    if key is not None:
        check_key(key)
    if recipe.delayed is not None:
        want = (len(OPERANDS), recipe.delayed.history_len)
        if amax_history is None:
            raise ValueError(f"recipe {recipe.name} uses delayed scaling: pass amax_history= "
                             "(fp4lab.delayed.init_history(recipe.delayed) at the first step, "
                             "then fp4lab.delayed.update each step; docs/gemms_and_policies.md)")
        if jnp.shape(amax_history) != want:
            raise ValueError(f"amax_history has shape {jnp.shape(amax_history)}; recipe "
                             f"{recipe.name} needs {want}")
        amax_history = jnp.asarray(amax_history, jnp.float32)
    elif amax_history is not None:
        raise ValueError(f"amax_history given, but recipe {recipe.name} has no delayed scaling")
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    plan = _plan(jnp.shape(lhs), jnp.shape(rhs), dimension_numbers)
    if probe is not None and jnp.shape(probe) != PROBE_SHAPE:
        raise ValueError(f"probe has shape {jnp.shape(probe)}; use fp4lab.probes.probe_zeros() "
                         f"(shape {PROBE_SHAPE})")
    if backend not in _backend.BACKENDS:
        raise ValueError(f"backend={backend!r}; use one of {', '.join(_backend.BACKENDS)}")
    if channels is not None:
        if recipe.outliers is None:
            raise ValueError(f"channels given, but recipe {recipe.name} has no OutControl")
        channels = check_channels(channels, plan.bmkn[2])
        recipe.outliers.count(plan.bmkn[2])  # both parts non-empty, else an error here
    y = _qdot(plan, recipe, out_dtype, backend, jnp.asarray(lhs), jnp.asarray(rhs), key, probe,
              amax_history, channels)
    return y if out_sharding is None else jax.lax.with_sharding_constraint(y, out_sharding)


def qeinsum(spec: str, a, b, recipe: str | Recipe = "bf16", key=None, *, probe=None,
            amax_history=None, channels=None, backend: str = "auto",
            preferred_element_type=None,
            precision=None, out_sharding=None):
    """Two-operand ``einsum`` through :func:`qdot_general` (``a`` plays X, ``b`` plays W).

    Letters in both inputs and the output are batch dims, letters in both inputs only are
    contracted; ellipses stand for the same dims in every term (no size-1 broadcasting).
    ``precision`` and ``out_sharding`` are accepted so this can serve as a Flax
    ``einsum_op``; any other keyword is an error (spec rules: :mod:`fp4lab.einsum`)."""
    del precision
    plan = plan_einsum(spec, jnp.shape(a), jnp.shape(b))
    y = qdot_general(a, b, plan.dimension_numbers, recipe, key=key, probe=probe,
                     amax_history=amax_history, channels=channels, backend=backend,
                     preferred_element_type=preferred_element_type)
    y = jnp.transpose(y, plan.out_perm)
    return y if out_sharding is None else jax.lax.with_sharding_constraint(y, out_sharding)
