"""Numerics probes of the six GEMM operands, reached from the quantized GEMM through one hook.

A probe is a zeros array of shape (6 operands, metrics) passed as ``qdot_general(...,
probe=probe_zeros())``; the GEMM's output does not depend on it, and its "gradient" is the
numerics of every operand of that step: row ``i`` holds :data:`fp4lab.metrics.METRIC_NAMES`
for operand ``OPERANDS[i]`` (the gradient operands measured on the step's real gradients). NaN
rows are operands the recipe does not quantize (the backward of QAT recipes). The GEMM calls
:func:`measure` (its only use of this module) in its forward and backward passes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fp4lab.hadamard import rht
from fp4lab.metrics import METRIC_NAMES, operand_metrics
from fp4lab.recipe import OPERAND_TABLE, OPERANDS, OperandQuant, Recipe

__all__ = ["probe_zeros", "probe_table", "measure", "PROBE_SHAPE"]

PROBE_SHAPE = (len(OPERANDS), len(METRIC_NAMES))


def probe_zeros() -> jax.Array:
    """The ``probe`` argument of :func:`fp4lab.qdot_general`: zeros of :data:`PROBE_SHAPE`."""
    return jnp.zeros(PROBE_SHAPE, jnp.float32)


def probe_table(probe_grad) -> dict[str, dict[str, float]]:
    """``{operand: {metric: value}}`` from a probe's gradient (host values)."""
    a = np.asarray(probe_grad)
    return {op: dict(zip(METRIC_NAMES, map(float, a[i]), strict=True)) for i, op in enumerate(OPERANDS)}


def _operand_metrics(x, op: OperandQuant, axis: int, key, signs, global_amax=None
                     ) -> jax.Array:
    """The metrics row of one operand, quantized exactly as the GEMM quantizes it (with the
    delayed amax, if any: a scale that lags the data shows as saturation)."""
    if op.hadamard:
        x = rht(x, axis, op.hadamard, signs)
    m = operand_metrics(x.astype(jnp.float32), op.format, axis=-1 if op.tile else axis,
                      tile=op.tile, rounding=op.rounding, key=key, global_amax=global_amax)
    return jnp.stack([m[k] for k in METRIC_NAMES])


def measure(recipe: Recipe, tensors: dict[str, jax.Array], keys: dict, amaxes: dict,
            signs: dict, gemms: tuple[str, ...]) -> jax.Array:
    """The metrics rows of the operands of ``gemms`` (table order), from the canonical
    ``tensors`` by role (``x``, ``w``, ``dy``; ``fwd_x``, ``fwd_w``: the forward's quantized
    X and W, for operands requantized from them), with each operand's key, delayed amax and
    Hadamard signs (``fp4lab.operand_quant.operand_signs``)."""
    quantized = recipe.quantized_operands
    rows = []
    for o in OPERAND_TABLE:
        if o.gemm not in gemms:
            continue
        if o.name not in quantized:
            rows.append(jnp.full((len(METRIC_NAMES),), jnp.nan, jnp.float32))
            continue
        op = quantized[o.name]
        src = tensors["fwd_" + o.role] if op.source == "forward" else tensors[o.role]
        rows.append(_operand_metrics(src, op, o.axis, keys[o.name],
                                     signs[o.name], amaxes[o.name]))
    return jnp.stack(rows)
