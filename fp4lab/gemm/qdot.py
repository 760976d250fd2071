"""Quantized GEMMs for training: ``qdot_general`` and ``qeinsum`` as ``jax.custom_vjp``.

The forward GEMM and the two backward GEMMs each quantize their operands as a
:class:`~fp4lab.gemm.recipe.Recipe` says (see ``fp4lab.gemm.recipe`` for the three GEMMs and their
quantization axes), from the high-precision values, and accumulate in float32. They multiply
what a block-scaled tensor core multiplies: the elements times their block scales (in BF16
where those are BF16 numbers, else float32 at ``Precision.HIGHEST``), accumulated in float32,
then scaled once by the per-tensor factors (NVFP4's ``alpha``, FP8's ``scale_inv``;
docs/numerics.md, "The GEMM"). The products are exact; only the summation order may differ
from a hardware kernel. Pass-through formats (``bf16``) are plain casts, so the ``bf16``
recipe equals a plain BF16 dot exactly.

Any ``dimension_numbers`` are supported: operands are canonicalized to ``X: (B, M, K)`` and
``W: (B, K, N)`` (batch, free and contracting dims each flattened, as TE does), so the
quantization blocks run over the flattened contracting dims in fprop, over the flattened free
dims of W in dgrad, and over the flattened token (free) dims of X in wgrad. ``lhs`` plays the
activation X and ``rhs`` the weight W.

Features compose around one core custom_vjp, as optax's transformations do: OutControl's
split of K is two ordinary GEMMs (:func:`fp4lab.features.outcontrol.split_gemm`), a forward Hadamard
transform a change of basis outside the custom_vjp (:func:`fp4lab.numerics.hadamard.rotate`); only
backward semantics (the trust mask, requantizing the forward's operands, QAT's straight-through
backward, delayed scaling's observed amaxes) live inside it. Operand quantization (keys, signs,
``quantize_operand``) is :mod:`fp4lab.gemm.operand_quant`'s.

The operands are those of :data:`fp4lab.gemm.recipe.OPERAND_TABLE` (name, GEMM, role, axis);
probes (:mod:`fp4lab.features.probes`) measure them through one hook, and kernels serve their
quantizers through :mod:`fp4lab.numerics.backend`'s table. The tests' oracle is the same GEMMs
written out with ``fake_quant`` and ``jnp.dot`` (tests/fp4lab/test_qdot.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fp4lab.gemm import canonical
from fp4lab.gemm import saved as _saved
from fp4lab.gemm.canonical import BMK_BKN, BMK_BMN, BMN_BKN, varying_alike
from fp4lab.gemm.einsum import plan_einsum
from fp4lab.numerics.hadamard import rotate
from fp4lab.gemm.operand_quant import (AXIS, OperandContext, observed_amax, operand_scope,
                                      operand_signs)
from fp4lab.features.outcontrol import split_gemm
from fp4lab.features.probes import measure
from fp4lab.gemm.state import GemmState, check_gemm_state
from fp4lab.numerics import rounding as rnd
from fp4lab.numerics.gemm_operands import GemmOperand, split_dequantize
from fp4lab.numerics.quantize import quantize, trust_mask
from fp4lab.numerics.scaling import Outer
from fp4lab.gemm.recipe import OPERAND_TABLE, Recipe, get_recipe

__all__ = ["qdot_general", "qeinsum", "saved_bytes"]

def _dot(a, b, dn):
    """``dot_general`` with float32 accumulation; float32 operands use full float32 precision."""
    dt = jnp.promote_types(a.dtype, b.dtype)
    precision = lax.Precision.HIGHEST if dt == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(a.astype(dt), b.astype(dt), dn, precision=precision,
                           preferred_element_type=jnp.float32)


def _on_output(outer: Outer | None, dn, lhs: bool) -> tuple | None:
    """An operand's outer factor and divisor laid out for the GEMM's output
    ``(B, lhs free, rhs free)`` (size 1 along the other operand's free axis)."""
    if outer is None:
        return None
    contracting = dn[0][0 if lhs else 1][0]

    def place(t):
        if t.ndim == 0:
            return t
        t = jnp.squeeze(t, contracting)
        return t[:, :, None] if lhs else t[:, None, :]
    return place(outer.factor), place(outer.divisor)


def _folded(t: GemmOperand, contracting: int) -> GemmOperand:
    """``t`` with its outer factor multiplied into the values where it varies along this
    GEMM's reduction (QAT's backward reuses the forward's per-channel W along the other axis):
    ``fl(v * fl(factor * fl(1 / divisor)))``, float32."""
    if t.outer is None or all(a.ndim == 0 or a.shape[contracting] == 1 for a in t.outer):
        return t
    m = t.outer.factor * rnd.div(jnp.float32(1), t.outer.divisor)
    return GemmOperand(rnd.opaque(t.values.astype(jnp.float32) * m))


def _alpha(a: GemmOperand, b: GemmOperand, dn):
    """``fl(fl(factor_a * factor_b) * fl(1 / (divisor_a * divisor_b)))``: the scale the
    hardware applies to the product (TE's NVFP4 ``alpha``), None where neither has one."""
    parts = [p for p in (_on_output(a.outer, dn, True), _on_output(b.outer, dn, False)) if p]
    if not parts:
        return None
    (factor, divisor), *other = parts
    for f, d in other:
        factor, divisor = factor * f, divisor * d
    # rounding.div's quotient is opaque: no constant for XLA to reassociate the product with
    return factor * rnd.div(jnp.float32(1), divisor)


def _mm(a, b, dn):
    """The GEMM of two operands (:class:`~fp4lab.numerics.gemm_operands.GemmOperand`, or arrays
    taken as they are) as the hardware computes it: the products of the values, in BF16 where
    both are BF16 numbers, accumulated in float32, then scaled by the outer factors
    (docs/numerics.md, "The GEMM")."""
    a, b = (t if isinstance(t, GemmOperand) else GemmOperand(t) for t in (a, b))
    with jax.named_scope("fp4lab.gemm"):
        a, b = _folded(a, dn[0][0][0]), _folded(b, dn[0][1][0])
        y = _dot(a.values, b.values, dn)
        alpha = _alpha(a, b, dn)
        # behind a barrier: a consumer's addition must not contract with the scaling into an FMA
        return y if alpha is None else rnd.opaque(y * alpha)


# ----------------------------------------------------------------------------- the core GEMM


class _Residuals(NamedTuple):
    """What the core GEMM's forward keeps for its backward (None where a recipe needs none)."""

    x: jax.Array  # X as saved (recipe.saved_x), or a zero-size stand-in of its dtype
    w: jax.Array  # W, or a stand-in
    key: jax.Array | None
    xq: GemmOperand | None  # the forward's quantized X and W: QAT and requantizing recipes
    wq: GemmOperand | None
    qw: object  # the forward's tiled QArray weight, reused by dgrad
    masks: tuple | None  # the trust masks of X and W
    fwd_probes: jax.Array | None
    history: jax.Array | None
    rows: jax.Array | None  # the probes' count of X's and dY's own rows (None: all)


def _weight(w, recipe: Recipe, ctx: OperandContext, backend):
    """fprop W, and a QArray to reuse in dgrad when both GEMMs use the same tiled spec."""
    op = recipe.fprop_w
    outer = not recipe.requantizes
    if op.tile and op == recipe.dgrad_w and not op.format.is_passthrough and not op.hadamard:
        with operand_scope("fprop_w"):
            qw = quantize(w.astype(jnp.float32), op.format, tile=op.tile, rounding=op.rounding,
                          key=ctx.keys["fprop_w"], backend=backend,
                          global_amax=ctx.amax["fprop_w"])
            return split_dequantize(qw, outer), qw
    return ctx.quantize("fprop_w", w, recipe, backend, outer), None


def _dequantized(t: GemmOperand) -> jax.Array:
    """The values the forward multiplied, every multiplier applied (the forward quantizes with
    ``outer=False`` where the recipe requantizes), in float32 for the backward to requantize."""
    assert t.outer is None, "requantized operands are quantized with outer=False"
    return t.values.astype(jnp.float32)


def _trust_masks(x, w, recipe: Recipe):
    """Where the forward quantizers did not clip X and W (Quartet's trust estimator);
    ``None`` unless the recipe asks for it."""
    if not recipe.trust:
        return None
    return tuple(trust_mask(t.astype(jnp.float32), recipe.operands[name].format,
                            axis=AXIS[name]) for name, t in (("fprop_x", x), ("fprop_w", w)))


def _masked(g, mask):
    return g if mask is None else jnp.where(mask, g, jnp.zeros_like(g))


def _backward(res: _Residuals, x, dy, recipe: Recipe, ctx: OperandContext, backend):
    """dX and dW from the residuals (``x`` restored from what was saved)."""
    if recipe.backward == "ste":  # QAT: differentiate straight through the forward quantizers
        return _mm(dy, res.wq, BMN_BKN), _mm(res.xq, dy, BMK_BMN)
    q = functools.partial(ctx.quantize, recipe=recipe, backend=backend)
    if recipe.dgrad_w.source == "forward":
        wq = q("dgrad_w", _dequantized(res.wq))
    else:
        wq = split_dequantize(res.qw) if res.qw is not None else q("dgrad_w", res.w)
    x_src = _dequantized(res.xq) if recipe.wgrad_x.source == "forward" else x
    dx = _mm(q("dgrad_dy", dy), wq, BMN_BKN)
    dw = _mm(q("wgrad_x", x_src), q("wgrad_dy", dy), BMK_BMN)
    masks = res.masks or (None, None)
    return _masked(dx, masks[0]), _masked(dw, masks[1])


def _history_grad(history, recipe: Recipe, tensors: dict) -> jax.Array | None:
    """The history's "gradient": this step's amaxes in column 0 (see fp4lab.features.delayed);
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
            seen[k] = observed_amax(tensors[o.role], op, o.axis, recipe.signs(op))  # fixed signs
        observed.append(seen[k])
    return jnp.zeros_like(history).at[:, 0].set(jnp.stack(observed))


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _gemm(recipe: Recipe, out_dtype, dy_dtype, backend, x, w, key, probe, history, rows):
    """The core GEMM on canonical ``X: (B, M, K)``, ``W: (B, K, N)``: ``(B, M, N)`` in
    ``out_dtype``; its backward quantizes the gradient from ``dy_dtype`` (the output dtype
    of the layer's GEMM, also when a composition sums parts in float32). ``rows``: how many
    of the M rows the probes count (the rest are zeros: an expert's slot), None for all."""
    return _gemm_fwd(recipe, out_dtype, dy_dtype, backend, x, w, key, probe, history,
                     rows)[0]


def _gemm_fwd(recipe, out_dtype, dy_dtype, backend, x, w, key, probe, history, rows):
    ctx = OperandContext.of(recipe, key, history, {"x": x, "w": w}, ("fprop",))
    wq, qw = _weight(w, recipe, ctx, backend)
    xq = ctx.quantize("fprop_x", x, recipe, backend, not recipe.requantizes)
    y = _mm(xq, wq, BMK_BKN)
    keep = recipe.backward == "ste" or recipe.requantizes
    res = _Residuals(
        x=_saved.store(x, recipe.saved_x) if _uses_input(recipe, "x") else _stand_in(x),
        w=w if _uses_input(recipe, "w") else _stand_in(w), key=key,
        xq=xq if keep else None, wq=wq if keep else None, qw=qw,
        masks=_trust_masks(x, w, recipe), history=history,
        fwd_probes=None if probe is None else measure(recipe, {"x": x, "w": w}, *ctx,
                                                      ("fprop",), rows),
        rows=None if probe is None else rows)
    return y.astype(out_dtype), res


def _gemm_bwd(recipe, out_dtype, dy_dtype, backend, res: _Residuals, g):
    x = _saved.restore(res.x, recipe.saved_x)
    # a constant cotangent (``loss = y.sum()``) would otherwise be quantized by XLA's
    # constant folder at compile time: tens of seconds at 2048^2, the same bits at run time
    dy = lax.optimization_barrier(g.astype(dy_dtype))
    tensors = {"x": x, "w": res.w, "dy": dy}
    if recipe.requantizes:
        tensors.update(fwd_x=_dequantized(res.xq), fwd_w=_dequantized(res.wq))
    ctx = OperandContext.of(recipe, res.key, res.history, tensors,
                            () if recipe.backward == "ste" else ("dgrad", "wgrad"))
    dx, dw = _backward(res, x, dy, recipe, ctx, backend)
    probes = None if res.fwd_probes is None else jnp.concatenate(
        [res.fwd_probes, measure(recipe, tensors, *ctx, ("dgrad", "wgrad"), res.rows)])
    return (dx.astype(x.dtype), dw.astype(res.w.dtype), None, probes,
            _history_grad(res.history, recipe, tensors), None)


_gemm.defvjp(_gemm_fwd, _gemm_bwd)


# ----------------------------------------------------------------------------- composition


@functools.lru_cache(maxsize=None)
def _without_forward_transform(recipe: Recipe) -> Recipe:
    plain = {n: dataclasses.replace(recipe.operands[n], hadamard=0)
             for n in ("fprop_x", "fprop_w")}
    return dataclasses.replace(recipe, **plain)


def _composed(x, w, recipe: Recipe, out_dtype, backend, state: GemmState, dy_dtype=None,
              rows=None):
    """The core GEMM with the features that wrap it, outermost first: OutControl's split of
    K into two GEMMs (:func:`fp4lab.features.outcontrol.split_gemm`), then a forward Hadamard
    transform as a change of basis (:func:`fp4lab.numerics.hadamard.rotate`). Autodiff carries
    the gradients through both; only backward semantics live inside the custom_vjp. ``rows``:
    as :func:`_gemm`'s."""
    key, probe, history, channels = state
    if channels is not None:
        def part(a, b, r, p):
            return _composed(a, b, r, jnp.float32, backend,
                             GemmState(key, p, history), out_dtype, rows)
        return split_gemm(part, x, w, recipe, channels, probe).astype(out_dtype)
    if recipe.fprop_x.hadamard:
        signs = operand_signs(recipe, key, ("fprop_x", "fprop_w"))
        x = rotate(x, AXIS["fprop_x"], recipe.fprop_x.hadamard, signs["fprop_x"])
        w = rotate(w, AXIS["fprop_w"], recipe.fprop_w.hadamard, signs["fprop_w"])
        recipe = _without_forward_transform(recipe)
    x, w, probe, history = varying_alike(x, w, probe, history)
    return _gemm(recipe, out_dtype, dy_dtype or out_dtype, backend, x, w, key, probe, history,
                 rows)


def saved_bytes(lhs, rhs, dimension_numbers, recipe: str | Recipe = "bf16") -> dict[str, int]:
    """What :func:`qdot_general` keeps for its backward pass, in bytes (from the shapes and
    dtypes of ``lhs`` and ``rhs``, arrays or ``jax.ShapeDtypeStruct``): ``x`` (the saved
    input: as it came, or ``recipe.saved_x``'s codes and scales), ``w``, ``other`` (keys,
    a reused quantized weight, probes), ``total``, and ``host`` (the part offloaded)."""
    recipe = get_recipe(recipe)
    p = canonical.plan(jnp.shape(lhs), jnp.shape(rhs), dimension_numbers)
    b, m, k, n = p.bmkn
    x = jax.ShapeDtypeStruct((b, m, k), jnp.result_type(lhs))
    w = jax.ShapeDtypeStruct((b, k, n), jnp.result_type(rhs))
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype) if recipe.needs_key else None
    f32 = jnp.float32
    res = jax.eval_shape(lambda a, c, kk: _gemm_fwd(recipe, f32, f32, "xla", a, c, kk, None,
                                                    None, None)[1], x, w, key)
    size = lambda t: sum(math.prod(a.shape) * a.dtype.itemsize  # noqa: E731 (keys: 8 B)
                         for a in jax.tree.leaves(t))
    xs, ws = size(res.x), size(res.w)
    total = size(res)
    return {"x": xs, "w": ws, "other": total - xs - ws, "total": total,
            "host": xs if recipe.saved_x is not None and recipe.saved_x.offload else 0}


def _check_operand(name, x, caller="qdot_general"):
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(f"{caller} needs floating-point operands; {name} has dtype "
                        f"{jnp.result_type(x)}")


def qdot_general(lhs, rhs, dimension_numbers, recipe: str | Recipe = "bf16", state=None, *,
                 backend: str = "auto", precision=None, preferred_element_type=None,
                 out_sharding=None):
    """``lax.dot_general`` whose three training GEMMs follow ``recipe``.

    Args:
      lhs, rhs: the activation-like and the weight-like operand.
      dimension_numbers: as ``lax.dot_general``.
      recipe: a :class:`~fp4lab.gemm.recipe.Recipe` or registry name.
      state: the call's :class:`~fp4lab.gemm.state.GemmState` (its stochastic-rounding
        ``key``, a ``probe``, delayed scaling's ``amax_history``, OutControl's
        ``channels``), or a PRNG key alone (``GemmState(key=...)``); ``None``: none, which
        a recipe with stochastic rounding or delayed scaling refuses.
      backend: ``"auto"``, ``"xla"`` or ``"pallas"`` for the operand quantizers (see
        :mod:`fp4lab.numerics.backend`); the kernels give the same bits, stochastic
        rounding included (one random stream, :mod:`fp4lab.numerics.random_bits`).
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
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    plan = canonical.plan(jnp.shape(lhs), jnp.shape(rhs), dimension_numbers)
    state = check_gemm_state(recipe, plan.bmkn[2], state, backend)
    if recipe.expert_scale != "expert":  # one GEMM: its own tensor is the whole stack
        recipe = dataclasses.replace(recipe, expert_scale="expert")
    y = planned_gemm(lhs, rhs, plan, recipe, out_dtype, backend, state)
    return y if out_sharding is None else jax.lax.with_sharding_constraint(y, out_sharding)


def planned_gemm(lhs, rhs, plan: canonical.Plan, recipe: Recipe, out_dtype, backend: str,
                 state: GemmState):
    """The GEMM of ``plan`` (``canonical.plan`` of the operands' shapes) with a checked
    ``state``: the operands in canonical form through the composed core, the output in the
    plan's shape."""
    x, w = canonical.to_canonical(jnp.asarray(lhs), jnp.asarray(rhs), plan)
    return _composed(x, w, recipe, out_dtype, backend, state).reshape(plan.out_shape)


def qeinsum(spec: str, a, b, recipe: str | Recipe = "bf16", state=None, *,
            backend: str = "auto", preferred_element_type=None, precision=None,
            out_sharding=None):
    """Two-operand ``einsum`` through :func:`qdot_general` (``a`` plays X, ``b`` plays W).

    ``state`` as :func:`qdot_general`'s. Letters in both inputs and the output are batch
    dims, letters in both inputs only are contracted; ellipses stand for the same dims in
    every term (no size-1 broadcasting).
    ``precision`` and ``out_sharding`` are accepted so this can serve as a Flax
    ``einsum_op``; any other keyword is an error (spec rules: :mod:`fp4lab.gemm.einsum`)."""
    del precision
    plan = plan_einsum(spec, jnp.shape(a), jnp.shape(b))
    y = qdot_general(a, b, plan.dimension_numbers, recipe, state, backend=backend,
                     preferred_element_type=preferred_element_type)
    y = jnp.transpose(y, plan.out_perm)
    return y if out_sharding is None else jax.lax.with_sharding_constraint(y, out_sharding)
