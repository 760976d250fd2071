"""OsciReset: master weights that oscillate between FP4 grid points are reset to the grid.

TetraJet-v2 (arXiv 2510.27527; thu-ml/TetraJet-v2-NVFP4Training ca5953f,
``olmo2-training/olmo/quantization_real/calibrate.py:36-98`` and ``oscillation_reset.py``,
its ``distance_ratio`` detector) observes that a master weight near a rounding boundary of the
forward quantizer flips between two grid points from step to step while barely moving. After
every optimizer step ``t`` (the authors' ``global_step - 1``), from ``start`` on::

    t % period == 0                 snapshot: prev = W, DQ = 0, DFP = 0
    1 <= t % period <= window       DQ += |Q(W) - Q(prev)|,  DFP += |W - prev|,  prev = W
    t % period == window + 1        reset where DQ / DFP >= threshold (0 where DFP == 0):
                                    W = Q(W) there (its current grid point); optimizer state
                                    untouched

``Q`` is the forward weight quantizer, ``dequantize(quantize(W, format, axis))`` (the
authors: their RTN double-block NVFP4 along the weight's input axis, ``nvfp4_double``; a Flax
kernel ``(in, out)`` has it on axis 0). The authors' configs: window 50, threshold 8, period
200 (400 for 370M), start 8000-35000 steps. Pure functions of explicit state, as
:mod:`fp4lab.features.delayed`: :func:`init` and :func:`step` (jit-compatible; ``t`` may be traced).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fp4lab.features.protocol import Feature, Run, StepContext, Update
from fp4lab.numerics.formats import Format, get_format
from fp4lab.numerics.quantize import fake_quant

__all__ = ["OsciReset", "OsciState", "init", "step", "Oscillations"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OsciReset:
    """OsciReset's schedule and quantizer (see the module docstring); frozen, jit-static."""

    period: int = 200
    window: int = 50
    threshold: float = 8.0
    start: int = 0
    format: str | Format = "nvfp4_double"
    axis: int = 0

    def __post_init__(self):
        object.__setattr__(self, "format", get_format(self.format))
        if self.window < 1 or self.period < self.window + 2:
            raise ValueError(f"OsciReset needs 1 <= window and window + 2 <= period; got "
                             f"window={self.window}, period={self.period}")
        if self.threshold <= 0 or self.start < 0:
            raise ValueError(f"OsciReset: threshold={self.threshold} must be > 0 and "
                             f"start={self.start} >= 0")

    def quantize(self, w: jax.Array) -> jax.Array:
        """``Q(W)``: the weight as the forward GEMM sees it, in W's dtype."""
        return fake_quant(w, self.format, axis=self.axis)


class OsciState(NamedTuple):
    """Per tracked weight: the last weight seen (``prev``), the summed grid moves (``dq``) and
    weight moves (``dfp``) of this window; ``armed``: a snapshot was taken this period."""

    prev: list
    dq: list
    dfp: list
    armed: jax.Array


def init(weights: list[jax.Array]) -> OsciState:
    """The state for ``weights`` (the tracked master weights, in a fixed order)."""
    def zeros():  # distinct buffers (a training step donates its state)
        return [jnp.zeros(w.shape, jnp.float32) for w in weights]

    return OsciState(zeros(), zeros(), zeros(), jnp.bool_(False))


def step(cfg: OsciReset, weights: list[jax.Array], state: OsciState, t
         ) -> tuple[list[jax.Array], OsciState, jax.Array]:
    """After the optimizer step ``t``: ``(weights, state, resets)``, the weights with the
    oscillating entries reset at the end of a window, and how many were reset."""
    phase = jnp.asarray(t) % cfg.period
    on = jnp.asarray(t) >= cfg.start
    f32 = [w.astype(jnp.float32) for w in weights]

    def idle(_):
        return list(weights), state, jnp.int32(0)

    def snapshot(_):
        zeros = [jnp.zeros_like(w) for w in f32]
        return list(weights), OsciState(f32, zeros, list(zeros), jnp.bool_(True)), jnp.int32(0)

    def track(_):
        dq = [d + jnp.abs(cfg.quantize(w) - cfg.quantize(p)).astype(jnp.float32)
              for d, w, p in zip(state.dq, weights, state.prev, strict=True)]
        dfp = [d + jnp.abs(w - p) for d, w, p in zip(state.dfp, f32, state.prev, strict=True)]
        return list(weights), OsciState(f32, dq, dfp, state.armed), jnp.int32(0)

    def reset(_):
        out, count = [], jnp.int32(0)
        for w, dq, dfp in zip(weights, state.dq, state.dfp, strict=True):
            ratio = jnp.where(dfp == 0, 0.0, dq / jnp.where(dfp == 0, 1.0, dfp))
            mask = ratio >= cfg.threshold
            out.append(jnp.where(mask, cfg.quantize(w), w))
            count = count + jnp.sum(mask, dtype=jnp.int32)
        return out, init(weights), count

    branch = jnp.where(~on, 0, jnp.where(phase == 0, 1, jnp.where(
        ~state.armed, 0, jnp.where(phase <= cfg.window, 2,
                                   jnp.where(phase == cfg.window + 1, 3, 0)))))
    return jax.lax.switch(branch, [idle, snapshot, track, reset], None)


class Oscillations(Feature):
    """OsciReset in a training run (config section ``train.osci_reset``; ``period`` 0: off):
    :func:`step` after every optimizer step on the kernels whose layer's forward weight the
    policy puts in its ``format``; logs ``osci_resets``, how many entries it reset."""

    name = "osci_reset"
    OPTIONS = "train.osci_reset"

    def __init__(self, cfg: OsciReset, paths: list[str], state: OsciState):
        self.cfg, self.paths, self.state = cfg, paths, state

    @classmethod
    def build(cls, run: Run) -> Oscillations | None:
        o = run.options
        if not o.period:
            return None
        cfg = OsciReset(period=o.period, window=o.window, threshold=o.threshold,
                        start=o.start, format=o.format)
        paths = [f"{a.path}/kernel" for a in run.assignments if a.recipe is not None
                 and not a.stack and a.recipe.fprop_w.format == cfg.format]
        if not paths:
            raise ValueError(f"train.osci_reset: no layer's forward weight is in format "
                             f"{cfg.format.name} under policy {run.policy!r}")
        flat = _flat(run.params)
        return cls(cfg, paths, init([flat[p] for p in paths]))

    def init(self) -> OsciState:
        return self.state

    def update(self, state, params: dict, mode: str, ctx: StepContext) -> Update:
        from flax import traverse_util

        flat = _flat(params)
        weights, new, count = step(self.cfg, [flat[p] for p in self.paths], state, ctx.step)
        flat.update(zip(self.paths, weights, strict=True))
        return Update(new, traverse_util.unflatten_dict(flat, sep="/"),
                      {"osci_resets": count})


def _flat(params: dict) -> dict:
    from flax import traverse_util

    return traverse_util.flatten_dict(params, sep="/")
