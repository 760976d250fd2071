"""A GEMM call's state: everything ``qdot_general`` takes besides its operands and recipe,
as one value (:class:`GemmState`), and its checks (:func:`check_gemm_state`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from fp4lab.features.outcontrol import check_channels
from fp4lab.features.probes import PROBE_SHAPE
from fp4lab.gemm.recipe import OPERANDS, Recipe
from fp4lab.numerics import backend as _backend
from fp4lab.numerics.quantize import check_key

__all__ = ["GemmState", "as_gemm_state", "check_gemm_state"]


class GemmState(NamedTuple):
    """The per-call state of one quantized GEMM (a pytree; ``None`` where unused):

    * ``key``: the PRNG key of its stochastic rounding and redrawn Hadamard signs (required
      when the recipe has either);
    * ``probe``: :func:`fp4lab.features.probes.probe_zeros` to measure the numerics of all
      six operands: its gradient is the metrics table (the output does not depend on it);
    * ``amax_history``: delayed scaling's history of this GEMM,
      ``fp4lab.features.delayed.init_history(recipe.delayed)`` at first; its gradient holds
      the step's amaxes for :func:`fp4lab.features.delayed.update`;
    * ``channels``: OutControl's K channels of the reduction axis, outliers first
      (:func:`fp4lab.features.outcontrol.channel_order` of their summed norms); the GEMM
      then splits K. ``None``: the recipe without the split.
    """

    key: Any = None
    probe: Any = None
    amax_history: Any = None
    channels: Any = None


def as_gemm_state(state) -> GemmState:
    """``state`` as a :class:`GemmState`: ``None`` (no state), a GemmState, or a PRNG key
    alone (``GemmState(key=state)``)."""
    if state is None:
        return GemmState()
    if isinstance(state, GemmState):
        return state
    return GemmState(key=check_key(state, "state"))


def check_gemm_state(recipe: Recipe, k: int, state, backend: str) -> GemmState:
    """``state`` (see :func:`as_gemm_state`) checked against ``recipe`` for a reduction axis
    of ``k`` (and ``backend``): an error names what is missing, misshapen or given to a
    recipe without the feature. Returns it with the history as float32 and the channels as
    int32."""
    key, probe, amax_history, channels = as_gemm_state(state)
    if recipe.needs_key and key is None:
        raise ValueError(f"recipe {recipe.name} uses stochastic rounding: pass a key "
                         "(GemmState(key=...), or the key alone; in Flax an rng stream)")
    if key is not None:
        check_key(key)
    if recipe.delayed is not None:
        want = (len(OPERANDS), recipe.delayed.history_len)
        if amax_history is None:
            raise ValueError(f"recipe {recipe.name} uses delayed scaling: pass its amax_history "
                             "(fp4lab.features.delayed.init_history(recipe.delayed) at the first "
                             "step, then fp4lab.features.delayed.update each step; "
                             "docs/gemms_and_policies.md)")
        if jnp.shape(amax_history) != want:
            raise ValueError(f"amax_history has shape {jnp.shape(amax_history)}; recipe "
                             f"{recipe.name} needs {want}")
        amax_history = jnp.asarray(amax_history, jnp.float32)
    elif amax_history is not None:
        raise ValueError(f"amax_history given, but recipe {recipe.name} has no delayed scaling")
    if probe is not None and jnp.shape(probe) != PROBE_SHAPE:
        raise ValueError(f"probe has shape {jnp.shape(probe)}; use "
                         f"fp4lab.features.probes.probe_zeros() (shape {PROBE_SHAPE})")
    if backend not in _backend.BACKENDS:
        raise ValueError(f"backend={backend!r}; use one of {', '.join(_backend.BACKENDS)}")
    if channels is not None:
        if recipe.outliers is None:
            raise ValueError(f"channels given, but recipe {recipe.name} has no OutControl")
        channels = check_channels(channels, k)
        recipe.outliers.count(k)  # both parts non-empty, else an error here
    return GemmState(key, probe, amax_history, channels)
