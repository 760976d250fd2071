"""OutControl: a layer's outlier input channels kept in a higher precision.

TetraJet-v2 (arXiv 2510.27527; thu-ml/TetraJet-v2-NVFP4Training ca5953f,
``olmo2-training/olmo/quantization_real/linear_mix.py`` and ``calibrate.py``) keeps the input
channels (of the reduction axis K) with the largest activations in MXFP8 and the rest in
NVFP4. Each layer chooses its channels once, during training::

    steps [start, start + steps)   norms += ||X[:, k]||_2 over the step's tokens, per channel k
    step start + steps             channels = the channel indices by descending summed norm;
                                   from then on the GEMM splits K (``qdot_general(...,
                                   GemmState(channels=channels))``;
                                   :class:`fp4lab.features.outcontrol.OutControl`)

The authors' configs: ``start`` 501, ``steps`` 50, 10 % of the channels. Their ranks each add
the norm of every microbatch they see and sum over ranks at the end; fp4lab adds the norm of
each step's whole (global) batch, the same statistic up to how the batch is partitioned.
Pure functions, as :mod:`fp4lab.features.delayed`: :func:`channel_norms` (what one call adds) and
:func:`channel_order` (the choice); the training loop keeps the sums. With Linen
(``quantize_model``): ``apply(..., mutable=["channel_norms"])`` adds each OutControl GEMM's
norms to that collection, and ``{"outlier_channels": jax.tree.map(channel_order, sums)}``
among the variables splits the GEMMs (experiments: ``train.outcontrol``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp4lab.features.protocol import Feature, Run, StepContext, Update
from fp4lab.numerics.formats import Format, get_format

__all__ = ["OutControl", "channel_norms", "channel_order", "check_channels", "split_gemm",
           "OutlierChannels"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutControl:
    """TetraJet-v2's OutControl: a layer's outlier input channels (of K) kept in a higher
    precision, chosen once from the input's accumulated per-channel L2 norms
    (:mod:`fp4lab.features.outcontrol` says how; the GEMM takes the channel order in its
    state, ``GemmState(channels=)``).

    With ``channels`` (K indices, most outlying first) the GEMM splits K: the first
    :meth:`count` channels of X and W are quantized in ``format`` (round to nearest, blocks
    along K) and the rest as ``fprop_x``/``fprop_w`` say, each part over its channels in
    that order, and ``Y`` is the FP4 product plus the high-precision one. The wgrad GEMM
    splits the same way (rows of dW: X requantized from the forward's and dY, both in
    ``format`` along the tokens, for the outlier channels); dgrad requantizes the forward W
    (both parts) as ``dgrad_w`` says. Without ``channels`` the GEMM is the recipe without
    the split (the authors' layer before its channels are chosen). The split is two ordinary
    GEMMs, one per part (:meth:`recipes`; :func:`fp4lab.features.outcontrol.split_gemm`): a
    per-tensor scale in ``dgrad_w`` would be per part.

    ``count(K)``: with ``align=1`` (default), ``round(fraction * K)``, what the paper's
    simulated results keep (``linear_mix.py``'s comment); otherwise the authors' kernel
    rule with ``align`` for their 128, ``min(K // align * align, ceil(int(fraction * K) /
    align) * align)`` (``align=128``: whole 128-blocks). A small model keeps about 10 % with
    the first, up to half of K with the second."""

    fraction: float = 0.1
    align: int = 1
    format: str | Format = "mxfp8"

    def __post_init__(self):
        object.__setattr__(self, "format", get_format(self.format))
        if not 0 < self.fraction < 1:
            raise ValueError(f"OutControl fraction={self.fraction} must lie in (0, 1)")
        if self.align < 1:
            raise ValueError(f"OutControl align={self.align} must be >= 1")

    def count(self, k: int) -> int:
        """How many of ``k`` input channels go to ``format`` (0 < count < k, else an error)."""
        if self.align == 1:
            n = round(self.fraction * k)
        else:
            n = min(k // self.align * self.align,
                    -(-int(self.fraction * k) // self.align) * self.align)
        if not 0 < n < k:
            raise ValueError(f"OutControl(fraction={self.fraction}, align={self.align}) keeps "
                             f"{n} of K={k} input channels in {self.format.name}; it needs "
                             "at least one channel in each part")
        return n

    def refusal(self, recipe) -> str | None:
        """Why ``recipe`` cannot split K this way, or None."""
        fx, fw = recipe.fprop_x, recipe.fprop_w
        if (fx.hadamard or fw.tile or recipe.trust or recipe.dgrad_w.source != "forward"
                or recipe.wgrad_x.source != "forward"):
            return ("OutControl splits the forward's K and requantizes the backward from the "
                    "split forward: it needs forward operands without a Hadamard transform "
                    "or 2D tile, no trust mask, and dgrad_w and wgrad_x with "
                    "source='forward'")
        return None

    def recipes(self, recipe) -> tuple:
        """The two GEMMs of the split: the rest channels under ``recipe`` (without the
        split), the outlier channels with X and W in ``format`` (round to nearest, no
        transform) in fprop and wgrad (X requantized from the forward's) and ``recipe``'s
        dgrad operands."""
        return _outcontrol_recipes(recipe)

    def describe(self) -> str:
        return (f"OutControl: splits K, the top {self.fraction:.0%} of it in "
                f"{self.format.name} (fprop, wgrad) once chosen"
                + (f", whole {self.align}s" if self.align > 1 else ""))



@functools.lru_cache(maxsize=None)
def _outcontrol_recipes(recipe):
    high = type(recipe.fprop_x)(format=recipe.outliers.format)  # an OperandQuant
    rest = dataclasses.replace(recipe, outliers=None)
    outliers = dataclasses.replace(
        rest, name=f"{recipe.name}:outliers", fprop_x=high, fprop_w=high,
        wgrad_x=dataclasses.replace(high, source="forward"), wgrad_dy=high)
    return rest, outliers



def channel_norms(lhs, dimension_numbers) -> jax.Array:
    """``||X[:, k]||_2`` for every channel ``k`` of a GEMM's reduction axis: ``lhs`` (the
    operand playing X in ``qdot_general(lhs, rhs, dimension_numbers)``) with its contracting
    dims flattened to K (in order), the norm over every other element, in float32."""
    (lc, _), _ = dimension_numbers
    lc = tuple(int(a) % jnp.ndim(lhs) for a in lc)
    rest = tuple(a for a in range(jnp.ndim(lhs)) if a not in lc)
    x = jnp.transpose(jnp.asarray(lhs), rest + lc).astype(jnp.float32)
    x = x.reshape(-1, math.prod(jnp.shape(lhs)[a] for a in lc))
    return jnp.sqrt(jnp.sum(jnp.square(x), axis=0))


def channel_order(norms) -> jax.Array:
    """The channels by descending ``norms`` (ties: the lower index first), as int32: the
    ``channels`` argument of :func:`fp4lab.qdot_general`. A NaN sum (a step whose input
    held NaN) ranks last, as ``jnp.argsort`` orders NaN last."""
    norms = jnp.asarray(norms, jnp.float32)
    if norms.ndim != 1:
        raise ValueError(f"channel_order takes one layer's K norms; got shape {norms.shape}")
    return jnp.argsort(-norms, stable=True).astype(jnp.int32)


def check_channels(channels, k: int) -> jax.Array:
    """``channels`` as int32 of shape ``(k,)``, or an error naming its shape, dtype or (when
    concrete) the values that make it no permutation of ``range(k)`` (traced under jit they
    cannot be checked: :func:`channel_order` gives a permutation)."""
    if not jnp.issubdtype(jnp.result_type(channels), jnp.integer):
        raise TypeError(f"channels has dtype {jnp.result_type(channels)}; it is K channel "
                        "indices (fp4lab.features.outcontrol.channel_order)")
    if jnp.shape(channels) != (k,):
        raise ValueError(f"channels has shape {jnp.shape(channels)}; the GEMM's reduction "
                         f"axis has K={k} channels")
    if not isinstance(channels, jax.core.Tracer):
        c = np.asarray(channels)
        missing = np.setdiff1d(np.arange(k), c)
        if missing.size:
            raise ValueError(f"channels is not a permutation of range({k}): it lacks "
                             f"{missing[:5].tolist()} (values {c[:8].tolist()}...)")
    return lax.convert_element_type(channels, jnp.int32)


def split_gemm(gemm, x, w, recipe, channels, probe=None):
    """OutControl as a composition of two ordinary quantized GEMMs (TetraJet-v2's
    ``linear_mix.py``): canonical ``X: (B, M, K)`` and ``W: (B, K, N)`` gathered in
    ``channels`` order and cut after the outliers; ``gemm(x, w, recipe, probe)`` (the
    quantized GEMM, float32 out) on each part under :meth:`OutControl.recipes
    <fp4lab.features.outcontrol.OutControl.recipes>`, summed in float32. Autodiff assembles dX and
    dW; the gather's gradient is the inverse gather, so every element (signed zeros included) comes
    back as its part's GEMM gave it. ``probe`` measures the rest (the recipe's) part."""
    n = recipe.outliers.count(x.shape[-1])
    rest, outliers = recipe.outliers.recipes(recipe)
    x_hi, x_lo = _split(x, channels, n, 2)
    w_hi, w_lo = _split(w, channels, n, 1)
    return gemm(x_lo, w_lo, rest, probe) + gemm(x_hi, w_hi, outliers, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _split(t, channels, n: int, axis: int):
    """``t``'s ``axis`` in ``channels`` order, cut after the first ``n``: (outliers, rest)."""
    t = jnp.take(t, channels, axis=axis)
    return lax.slice_in_dim(t, 0, n, axis=axis), lax.slice_in_dim(t, n, None, axis=axis)


def _split_fwd(t, channels, n, axis):
    return _split(t, channels, n, axis), channels


def _split_bwd(n, axis, channels, g):
    hi, lo = g
    return jnp.take(jnp.concatenate([hi, lo], axis), jnp.argsort(channels), axis=axis), None


_split.defvjp(_split_fwd, _split_bwd)


class OutlierChannels(Feature):
    """OutControl in a training run (config section ``train.outcontrol``: ``start``,
    ``steps``): the ``"channel_norms"`` collection, zeros of every OutControl GEMM's K at
    first; steps ``[start, start + steps)`` of the quantized model add their input-channel
    norms (a forward pass of the step's own inputs, key and collections: the activations it
    trains on), and from then on the GEMMs split K by their order (``"outlier_channels"``).
    Each K is checked against its recipe's channel count when the feature is built."""

    name = "channel_norms"
    OPTIONS = "train.outcontrol"

    def __init__(self, zeros: dict, start: int, steps: int):
        self.zeros, self.start, self.steps = zeros, start, steps

    @classmethod
    def build(cls, run: Run) -> OutlierChannels | None:
        recipes = {a.path: a.recipe for a in run.assignments
                   if a.recipe is not None and a.recipe.outliers}
        if not recipes:
            return None
        o = run.options
        if o.start + o.steps >= run.quantized_steps:
            raise ValueError(f"train.outcontrol: the channels are chosen after step "
                             f"{o.start + o.steps - 1} (start={o.start}, steps={o.steps}), but "
                             f"the quantized model trains only steps 0-"
                             f"{run.quantized_steps - 1}: policy {run.policy!r} would never "
                             "split")
        rngs = {"quant": jax.random.key(0)}
        shapes = jax.eval_shape(lambda v: run.qmodel.apply(v, run.sample, rngs=rngs,
                                                           mutable=["channel_norms"])[1],
                                run.variables)["channel_norms"]
        for path, s in jax.tree_util.tree_leaves_with_path(shapes):
            layer = "/".join(k.key for k in path[:-1])
            recipes[layer].outliers.count(s.shape[0])  # an error naming K
        return cls(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), o.start,
                   o.steps)

    def init(self) -> dict:
        return self.zeros

    def check(self, per_replica: bool) -> None:
        if per_replica:
            raise ValueError("the policy has OutControl layers, whose channel norms are "
                             "measured on the global batch: train.grad_reduce (per-replica "
                             "gradients) is not supported with them")

    def mode(self, step: int, quantized: bool) -> str:
        if not quantized or step < self.start:
            return "plain"  # the recipe without the split
        return "record" if step < self.start + self.steps else "split"

    def variables(self, state, mode: str, training: bool) -> dict:
        if mode != "split":
            return {}
        return {"outlier_channels": jax.tree.map(channel_order, state)}

    def update(self, state, params: dict, mode: str, ctx: StepContext) -> Update:
        if mode == "record":
            state = record(ctx.qmodel, {"params": ctx.params, **ctx.variables}, state,
                           ctx.tokens[:, :-1], ctx.key)
        return Update(state, params)


def record(qmodel, variables: dict, norms: dict, inputs, key) -> dict:
    """``norms`` plus the input-channel norms of every OutControl GEMM of ``qmodel``'s
    forward on ``inputs`` (``variables``: its parameters and collections)."""
    from flax.core import unfreeze

    _, updates = qmodel.apply({**variables, "channel_norms": norms}, inputs,
                              rngs={"quant": key}, mutable=["channel_norms"])
    return unfreeze(updates)["channel_norms"]
