"""How a quantized GEMM quantizes each of its six operands: one key and one Hadamard sign
vector per operand and call, the delayed-scaling amax, and :func:`quantize_operand` (an
optional RHT, then a cast or fake quantization). Every core GEMM (``qdot_general``'s, and a
grouped GEMM's) quantizes through this module, so a recipe means the same in each.

Randomness: ``key`` is folded in per operand (6 streams), so the two stochastically rounded
gradient operands never share bits; callers fold in the layer (Flax rng streams do this)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fp4lab.numerics import backend as _backend
from fp4lab.features.delayed import history_amax
from fp4lab.numerics.hadamard import random_signs, rht
from fp4lab.numerics.rounding import abs_max
from fp4lab.numerics.gemm_operands import GemmOperand, gemm_operand, split_dequantize
from fp4lab.gemm.recipe import OPERAND_TABLE, OPERANDS, OperandQuant, Recipe

__all__ = ["AXIS", "STACK_AXIS", "OperandContext", "operand_keys", "operand_scope",
           "operand_signs", "quantize_operand", "observed_amax"]

AXIS = {o.name: o.axis for o in OPERAND_TABLE}  # the quantization axis of each operand
# the vmapped axis of a grouped GEMM's experts (fp4lab.qragged_dot), over which a recipe with
# expert_scale="shared" takes its per-tensor amaxes
STACK_AXIS = "fp4lab_expert_stack"


def operand_keys(key) -> dict[str, jax.Array | None]:
    """One independent key per GEMM operand, derived deterministically from ``key``."""
    if key is None:
        return dict.fromkeys(OPERANDS)
    return {name: jax.random.fold_in(key, i) for i, name in enumerate(OPERANDS)}


def operand_scope(name: str):
    """The name scope of one operand's quantization, ``fp4lab.<operand>`` (e.g.
    ``fp4lab.wgrad_dy``): compiled programs carry it in their ops' metadata, so a profile can
    attribute a quantizer's loops to its operand (``benchmarks/profile_step.py``)."""
    return jax.named_scope(f"fp4lab.{name}")


_GEMM_INDEX = {"fprop": 0, "dgrad": 1, "wgrad": 2}


def operand_signs(recipe: Recipe, key, names=None) -> dict:
    """Each operand's Hadamard sign vector (``names``: those operands only): the recipe's
    fixed one (``"te"``, ``"none"``, a seed), or for ``"random"`` a vector drawn from ``key``
    per GEMM and call, shared by the GEMM's two operands so that the transform cancels (the
    authors of Quartet, Quartet II and TetraJet-v2 redraw theirs at every call)."""
    out = {}
    for o in OPERAND_TABLE:
        if names is not None and o.name not in names:
            continue
        op = recipe.operands[o.name]
        s = recipe.signs(op)
        if s == "random" and op.hadamard:
            s = random_signs(jax.random.fold_in(key, len(OPERANDS) + _GEMM_INDEX[o.gemm]),
                             op.hadamard)
        out[o.name] = s
    return out


def quantize_operand(x, op: OperandQuant, axis: int, key, signs="te",
                     backend: str = "auto", global_amax=None, outer: bool = True
                     ) -> GemmOperand:
    """One GEMM operand as the recipe says: optional RHT along ``axis``, then a pass-through
    cast (BF16/FP16/FP32, or stochastic rounding onto BF16/FP16) or quantization, as the GEMM
    multiplies it (:class:`~fp4lab.numerics.gemm_operands.GemmOperand`: the values, the factor
    applied after the product; ``outer=False``: none, every multiplier on the values).

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
            q = split_dequantize(kernel.fn(tokens_first, op.format, key, rounding=op.rounding,
                                           signs=signs), outer)
            # the outer factor of a per-tensor scheme is a scalar
            return q._replace(values=q.values.T[None])
    if op.hadamard:
        x = rht(x, axis, op.hadamard, signs)
    return gemm_operand(x.astype(jnp.float32), op.format, axis=-1 if op.tile else axis,
                        tile=op.tile, rounding=op.rounding, key=key, backend=backend,
                        global_amax=global_amax, outer=outer)


def observed_amax(x, op: OperandQuant, axis: int, signs) -> jax.Array:
    """The amax of what a per-tensor operand quantizes (after its RHT, if it has one)."""
    if op.hadamard:
        x = rht(x, axis, op.hadamard, signs)
    return abs_max(x)


def takes_tensor_amax(op: OperandQuant) -> bool:
    """Whether ``op`` quantizes with a per-tensor amax (NVFP4's global scale, or a
    per-tensor format's): what an expert stack shares under ``expert_scale="shared"``."""
    return not op.format.is_passthrough and (op.format.has_global_scale
                                             or op.format.granularity == "tensor")


class OperandContext(NamedTuple):
    """Per call: each operand's key, per-tensor amax where it is not the operand's own
    (delayed scaling's, or an expert stack's shared one) and Hadamard signs."""

    keys: dict
    amax: dict
    signs: dict

    @classmethod
    def of(cls, recipe: Recipe, key, history, tensors=None, gemms=()) -> OperandContext:
        """``tensors`` by role (as :func:`fp4lab.features.probes.measure` takes them): under
        ``recipe.expert_scale == "shared"``, each per-tensor operand of ``gemms`` takes the
        amax of its tensor over the whole expert stack (the grouped GEMM's vmapped
        :data:`STACK_AXIS`)."""
        amax = dict.fromkeys(OPERANDS)
        for name in recipe.delayed_operands:
            amax[name] = history_amax(history[OPERANDS.index(name)], recipe.delayed)
        signs = operand_signs(recipe, key)
        if recipe.expert_scale == "shared":
            for o in OPERAND_TABLE:
                op = recipe.operands[o.name]
                if o.gemm in gemms and takes_tensor_amax(op):
                    src = tensors["fwd_" + o.role] if op.source == "forward" else tensors[
                        o.role]
                    amax[o.name] = jax.lax.pmax(observed_amax(
                        src.astype(jnp.float32), op, o.axis, signs[o.name]), STACK_AXIS)
        return cls(operand_keys(key), amax, signs)

    def quantize(self, name: str, t, recipe: Recipe, backend, outer: bool = True):
        with operand_scope(name):
            return quantize_operand(t, recipe.operands[name], AXIS[name], self.keys[name],
                                    self.signs[name], backend, self.amax[name], outer)
