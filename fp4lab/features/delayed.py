"""FP8 delayed scaling (Transformer Engine's ``DelayedScaling``), as explicit state.

With current scaling an operand's per-tensor scale comes from its own amax; with delayed
scaling it comes from an *amax history* of the previous steps, so the quantizer never waits
for a reduction over the tensor it is quantizing (what TE's classic FP8 recipe does). At a
step, every per-tensor operand of a GEMM is quantized with

    amax  = max(history)        (amax_compute_algo="max")  or  history[0]  ("most_recent")
    scale = fp8_max / (amax * 2**margin)          (1 while the amax is 0: the first step)

and the step's own amaxes enter the history for the next step. The history is a pytree the
training step carries, as optax carries optimizer state: for each GEMM a float32 array of
shape ``(6, history_len)``, one row per operand in ``fp4lab.gemm.recipe.OPERANDS`` order (most
recent first; rows of operands that are not per-tensor stay zero).

How the step's amaxes come back (the backward operands' only exist in the backward pass):
differentiate the loss with respect to the history as well; its "gradient" holds the step's
amaxes in column 0 (the probes use the same device), and :func:`update` rolls them in::

    loss, (g_params, g_hist) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, hist)
    hist = fp4lab.features.delayed.update(hist, g_hist)

A GEMM called more than once per step (shared weights) would add its amaxes: give each call
its own history. The scale lag shows in the probes: they measure each operand quantized with
the scale it really got, so an amax that outgrows its history shows up as saturation.

Differences from TE, documented: TE keeps the previous scale when the history's amax is 0 or
non-finite; here an amax of 0 gives scale 1 (which is TE's initial scale, so the two agree
until a tensor's whole history is zero again), and a non-finite one follows fp4lab's current
scaling (scale 1, NaN stays NaN, docs/numerics.md).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from fp4lab.features.protocol import Feature, Run, StepContext, Update
from fp4lab.gemm.operands import OPERANDS

__all__ = ["DelayedScaling", "init_history", "history_amax", "update", "AmaxHistories"]



@dataclasses.dataclass(frozen=True, kw_only=True)
class DelayedScaling:
    """TE's ``DelayedScaling`` parameters (its defaults): ``history_len`` steps of amax,
    reduced by ``amax_compute_algo`` (``"max"`` or ``"most_recent"``), and ``margin``: the
    scale is divided by ``2**margin`` (headroom against growth)."""

    history_len: int = 1024
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    margin: int = 0

    def __post_init__(self):
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(f"history_len={self.history_len!r} must be a positive int")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo={self.amax_compute_algo!r}: use 'max' or "
                             "'most_recent'")
        if not isinstance(self.margin, int) or not 0 <= self.margin <= 64:
            raise ValueError(f"margin={self.margin!r} must be an int in [0, 64]")

    def refusal(self, recipe) -> str | None:
        """Why ``recipe`` cannot scale from an amax history, or None. The history records
        each per-tensor operand's amax as the GEMM receives it, after a fixed transform."""
        if "random" in (recipe.signs(o) for o in recipe.operands.values()):
            return ("delayed scaling observes each operand's amax after a fixed transform; "
                    "hadamard_signs='random' is not supported with it")
        if recipe.requantizes or recipe.trust:
            return ("delayed scaling observes the operands as they come into the GEMM: "
                    "requantizing the forward's operands and the trust mask are not "
                    "supported with it")
        if not recipe.delayed_operands:
            return ("delayed scaling needs a per-tensor operand format (fp8_e4m3, fp8_e5m2, "
                    "...); none of its operands has one")
        return None


def init_history(scaling: DelayedScaling) -> jax.Array:
    """The history of one GEMM before its first step: zeros ``(6, history_len)``."""
    return jnp.zeros((len(OPERANDS), scaling.history_len), jnp.float32)


def history_amax(row: jax.Array, scaling: DelayedScaling) -> jax.Array:
    """The amax an operand is scaled for this step: ``max(row)`` or ``row[0]``, times
    ``2**margin`` (exact: a power of two), so that ``fp8_max / amax`` is TE's
    ``fp8_max / amax / 2**margin``."""
    amax = jnp.max(row) if scaling.amax_compute_algo == "max" else row[0]
    return amax * np.float32(2.0**scaling.margin)


def update(history, observed):
    """The histories for the next step: each ``(6, L)`` array with the step's amaxes (column
    0 of ``observed``, the history's gradient) in front and its oldest column dropped. Works
    on any pytree of histories (a Flax collection); ``observed`` has the same structure."""
    def roll(h, g):
        if h.shape != g.shape:
            raise ValueError(f"amax history of shape {h.shape} and its gradient of shape "
                             f"{g.shape} differ")
        return jnp.concatenate([g[..., :1].astype(h.dtype), h[..., :-1]], axis=-1)

    return jax.tree.map(roll, history, observed)


class AmaxHistories(Feature):
    """Delayed scaling in a training run: the ``"amax_history"`` collection of every GEMM
    whose recipe has ``delayed`` (``QuantizedLinen.history_init``), given to each step's
    forward and rolled with the amaxes it observed (the maximum over replicas)."""

    name = "amax_history"
    observes = True

    def __init__(self, histories: dict):
        self.histories = histories

    @classmethod
    def build(cls, run: Run) -> AmaxHistories | None:
        histories = run.qmodel.history_init({"params": run.params}, run.sample)
        return cls(histories) if histories else None

    def init(self) -> dict:
        return self.histories

    def variables(self, state, mode: str, training: bool) -> dict:
        return {"amax_history": state}

    def combine_replicas(self, observed: dict, axis: str) -> dict:
        return jax.tree.map(lambda a: jax.lax.pmax(a, axis), observed)

    def update(self, state, params: dict, mode: str, ctx: StepContext) -> Update:
        return Update(update(state, ctx.observed["amax_history"]), params)
