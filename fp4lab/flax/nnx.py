"""NNX layers whose GEMMs follow a recipe, and the hooks ``quantize_model`` installs.

NNX's ``Linear``/``LinearGeneral`` call ``self.dot_general`` and ``Einsum`` calls
``self.einsum_op``; :class:`QuantDot` and :class:`QuantEinsum` are drop-in replacements that
carry a recipe and their own SR rng stream, so quantizing a layer never touches its Params.
"""

from __future__ import annotations

from flax import nnx

from fp4lab.delayed import init_history, update
from fp4lab.qdot import qdot_general, qeinsum
from fp4lab.recipe import Recipe, get_recipe

__all__ = ["QuantDot", "QuantEinsum", "QLinear", "QLinearGeneral", "QEinsum", "HOOKS", "KINDS",
           "AmaxHistory", "update_amax_history"]



class AmaxHistory(nnx.Variable):
    """A layer's FP8 amax history (recipes with delayed scaling; :mod:`fp4lab.delayed`)."""


def update_amax_history(model: nnx.Module, grads) -> None:
    """Roll this step's amaxes into every :class:`AmaxHistory` of ``model``, in place.
    ``grads``: the gradient state of a ``nnx.grad`` whose ``argnums`` include the histories,
    e.g. ``nnx.DiffState(0, nnx.Any(nnx.Param, AmaxHistory))``."""
    history = nnx.state(model, AmaxHistory)
    nnx.update(model, update(history, nnx.state(grads, AmaxHistory)))


class QuantDot(nnx.Module):
    """A drop-in ``dot_general`` for NNX layers whose GEMMs follow ``recipe``; stochastic
    rounding draws from its own ``quant`` stream (from ``rngs.quant`` if given, else ``seed``).
    A recipe with delayed scaling gets an :class:`AmaxHistory` (``amax_history``)."""

    def __init__(self, recipe: str | Recipe, *, rngs: nnx.Rngs | None = None, seed: int = 0,
                 backend: str = "auto"):
        self.recipe = get_recipe(recipe)
        self.backend = backend
        self.rngs = nnx.Rngs(quant=rngs.quant() if rngs is not None and "quant" in rngs
                             else seed)
        if self.recipe.delayed is not None:
            self.amax_history = AmaxHistory(init_history(self.recipe.delayed))

    def _key(self):
        return self.rngs.quant() if self.recipe.needs_key else None

    def _history(self):
        return self.amax_history[...] if self.recipe.delayed is not None else None

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, out_sharding=None):
        return qdot_general(lhs, rhs, dimension_numbers, self.recipe, key=self._key(),
                            amax_history=self._history(), backend=self.backend,
                            preferred_element_type=preferred_element_type,
                            out_sharding=out_sharding)


class QuantEinsum(QuantDot):
    """A drop-in ``einsum_op`` for ``nnx.Einsum`` (the input plays X, the kernel W)."""

    def __call__(self, spec, a, b, precision=None, preferred_element_type=None,
                 out_sharding=None):
        return qeinsum(spec, a, b, self.recipe, key=self._key(), amax_history=self._history(),
                       backend=self.backend, preferred_element_type=preferred_element_type,
                       out_sharding=out_sharding)


class QLinear(nnx.Linear):
    """``nnx.Linear`` whose three GEMMs follow ``recipe``; SR keys from ``rngs.quant``."""

    def __init__(self, in_features, out_features, *, recipe: str | Recipe = "bf16",
                 rngs: nnx.Rngs, backend: str = "auto", **kwargs):
        super().__init__(in_features, out_features, rngs=rngs, **kwargs)
        self.dot_general = nnx.data(QuantDot(recipe, rngs=rngs, backend=backend))


class QLinearGeneral(nnx.LinearGeneral):
    """``nnx.LinearGeneral`` whose GEMMs follow ``recipe``."""

    def __init__(self, in_features, out_features, *, recipe: str | Recipe = "bf16",
                 rngs: nnx.Rngs, backend: str = "auto", **kwargs):
        super().__init__(in_features, out_features, rngs=rngs, **kwargs)
        self.dot_general = nnx.data(QuantDot(recipe, rngs=rngs, backend=backend))


class QEinsum(nnx.Einsum):
    """``nnx.Einsum`` whose GEMMs follow ``recipe`` (the input plays X, the kernel W)."""

    def __init__(self, einsum_str, kernel_shape, bias_shape=None, *,
                 recipe: str | Recipe = "bf16", rngs: nnx.Rngs, backend: str = "auto",
                 **kwargs):
        super().__init__(einsum_str, kernel_shape, bias_shape, rngs=rngs, **kwargs)
        self.einsum_op = nnx.data(QuantEinsum(recipe, rngs=rngs, backend=backend))


# NNX layer type (exact) -> (kind, the hook attribute it calls, the op that replaces it)
HOOKS = {nnx.Linear: ("linear", "dot_general", QuantDot),
        nnx.LinearGeneral: ("lineargeneral", "dot_general", QuantDot),
        nnx.Einsum: ("einsum", "einsum_op", QuantEinsum)}
# every layer type a policy governs (fp4lab's own layers included) -> kind
KINDS = {QLinear: "linear", QLinearGeneral: "lineargeneral", QEinsum: "einsum",
         **{cls: v[0] for cls, v in HOOKS.items()}}


