"""Numerics probes of the six GEMM operands, reached from the quantized GEMM through one hook.

A probe is a zeros array of shape (6 operands, metrics) passed in the GEMM's state,
``qdot_general(..., GemmState(probe=probe_zeros()))``; the GEMM's output does not depend on it, and its "gradient" is the
numerics of every operand of that step: row ``i`` holds :data:`fp4lab.numerics.metrics.METRIC_NAMES`
for operand ``OPERANDS[i]`` (the gradient operands measured on the step's real gradients). NaN
rows are operands the recipe does not quantize (the backward of QAT recipes). The GEMM calls
:func:`measure` (its only use of this module) in its forward and backward passes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fp4lab.features.protocol import Feature, Run, StepContext, Update
from fp4lab.numerics.hadamard import rht
from fp4lab.numerics.metrics import METRIC_NAMES, operand_metrics
from fp4lab.gemm.recipe import OPERAND_TABLE, OPERANDS, OperandQuant, Recipe

__all__ = ["probe_zeros", "probe_table", "measure", "PROBE_SHAPE", "Probes"]

PROBE_SHAPE = (len(OPERANDS), len(METRIC_NAMES))


def probe_zeros(experts: int | None = None) -> jax.Array:
    """The ``probe`` argument of :func:`fp4lab.qdot_general`: zeros of :data:`PROBE_SHAPE`;
    with ``experts``, one per expert (``fp4lab.qragged_dot``'s), stacked."""
    return jnp.zeros(PROBE_SHAPE if experts is None else (experts, *PROBE_SHAPE), jnp.float32)


def probe_table(probe_grad) -> dict[str, dict[str, float]]:
    """``{operand: {metric: value}}`` from a probe's gradient (host values)."""
    a = np.asarray(probe_grad)
    return {op: dict(zip(METRIC_NAMES, map(float, a[i]), strict=True)) for i, op in enumerate(OPERANDS)}


def _operand_metrics(x, op: OperandQuant, axis: int, key, signs, global_amax=None,
                     rows=None) -> jax.Array:
    """The metrics row of one operand, quantized exactly as the GEMM quantizes it (with the
    delayed amax, if any: a scale that lags the data shows as saturation); ``rows``: how many
    of its tokens (canonical axis 1) count, or None for all."""
    along_tokens = op.hadamard and axis % x.ndim == 1
    if op.hadamard:
        x = rht(x, axis, op.hadamard, signs)
    valid = None
    if rows is not None:  # the RHT's last group of tokens, zero-padded, is the operand's
        rows = -(-rows // op.hadamard) * op.hadamard if along_tokens else rows
        valid = (jnp.arange(x.shape[1]) < rows)[:, None]
    m = operand_metrics(x.astype(jnp.float32), op.format, axis=-1 if op.tile else axis,
                        tile=op.tile, rounding=op.rounding, key=key, global_amax=global_amax,
                        valid=valid)
    return jnp.stack([m[k] for k in METRIC_NAMES])


def measure(recipe: Recipe, tensors: dict[str, jax.Array], keys: dict, amaxes: dict,
            signs: dict, gemms: tuple[str, ...], rows=None) -> jax.Array:
    """The metrics rows of the operands of ``gemms`` (table order), from the canonical
    ``tensors`` by role (``x``, ``w``, ``dy``; ``fwd_x``, ``fwd_w``: the forward's quantized
    X and W, for operands requantized from them), with each operand's key, delayed amax and
    Hadamard signs (``fp4lab.gemm.operand_quant.operand_signs``). ``rows``: how many of the
    tokens (X's and dY's axis M) are the operand's own, the rest zeros that no metric counts
    (an expert's slot in ``fp4lab.qragged_dot``); None: all."""
    quantized = recipe.quantized_operands
    table = []
    for o in OPERAND_TABLE:
        if o.gemm not in gemms:
            continue
        if o.name not in quantized:
            table.append(jnp.full((len(METRIC_NAMES),), jnp.nan, jnp.float32))
            continue
        op = quantized[o.name]
        src = tensors["fwd_" + o.role] if op.source == "forward" else tensors[o.role]
        with jax.named_scope("fp4lab.probes"):
            table.append(_operand_metrics(src, op, o.axis, keys[o.name], signs[o.name],
                                          amaxes[o.name], None if o.role == "w" else rows))
    return jnp.stack(table)


class Probes(Feature):
    """The probes in a training run (config section ``probes``: ``every`` steps, ``fused``):
    the ``"probes"`` collection's zeros (``QuantizedLinen.probe_zeros``) given to the
    quantized model's forward, and the loss's gradient with respect to them reported, every
    ``every`` steps and at the last. ``fused``: every step of the quantized model computes
    them (one compiled program, about 10 % slower per step on CPU); otherwise a second
    program probes on the probe steps only. Stateless: nothing in the train state."""

    name = "probes"
    OPTIONS = "probes"
    observes = True

    def __init__(self, shapes: dict, every: int, fused: bool, last: int):
        self.shapes, self.every, self.fused, self.last = shapes, every, fused, last

    @classmethod
    def build(cls, run: Run) -> Probes | None:
        o = run.options
        if not o.every:
            return None
        zeros = run.qmodel.probe_zeros({"params": run.params}, run.sample)
        return cls(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), zeros),
                   o.every, bool(o.fused), run.steps - 1)

    def check(self, per_replica: bool) -> None:
        if per_replica:
            raise ValueError("train.grad_reduce computes per-replica gradients; the probes "
                             "measure the global step: set probes.every=0")

    def reported(self, step: int, quantized: bool) -> bool:
        """Whether ``step``'s probes are recorded."""
        return quantized and (step % self.every == 0 or step == self.last)

    def mode(self, step: int, quantized: bool) -> str:
        return "on" if quantized and (self.fused or self.reported(step, quantized)) else "off"

    def variables(self, state, mode: str, training: bool) -> dict:
        if mode == "off" or not training:
            return {}
        return {"probes": jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.shapes)}

    def update(self, state, params: dict, mode: str, ctx: StepContext) -> Update:
        return Update(state, params, report=ctx.observed.get("probes"))
