"""Flax integration: quantized layers and ``quantize_model`` for models written without fp4lab.

* Linen: :class:`QDense` (``nn.Dense`` with a recipe; same parameter names).
* NNX: :class:`QLinear` (an ``nnx.Linear`` whose GEMMs follow a recipe).
* :func:`quantize_model` applies a :class:`~fp4lab.policy.PrecisionPolicy` to an unmodified
  model: NNX models get their ``nnx.Linear`` layers swapped for ``QLinear`` sharing the same
  ``Param`` objects; Linen models are wrapped so that ``apply`` intercepts every ``nn.Dense``
  call. Parameters and their names are unchanged, so existing checkpoints load as they are.

Randomness for stochastic rounding comes from the ``"quant"`` rng stream (Linen:
``rngs={"quant": key}`` in ``apply``; NNX: the ``rngs`` given to ``quantize_model``), which
gives every layer and every call its own key.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from fp4lab.policy import PrecisionPolicy, get_policy
from fp4lab.qdot import qdot_general
from fp4lab.recipe import Recipe, get_recipe

__all__ = ["QDense", "QLinear", "quantize_model", "QuantizedLinen", "linear_layers"]

_DN = lambda x: (((x.ndim - 1,), (0,)), ((), ()))  # noqa: E731


def _linen_key(module: nn.Module, recipe: Recipe):
    if not recipe.needs_key:
        return None
    if not module.has_rng("quant"):
        if module.is_initializing():  # init's outputs only fix shapes; any key will do
            return jax.random.key(0)
        raise ValueError(f"layer {'/'.join(module.scope.path)} uses recipe {recipe.name} with "
                         "stochastic rounding: pass rngs={'quant': key} to apply")
    return module.make_rng("quant")


def _dense(module, x, kernel, bias, recipe: Recipe):
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=module.dtype)
    y = qdot_general(x, kernel, _DN(x), recipe, key=_linen_key(module, recipe))
    if bias is not None:
        y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


class QDense(nn.Dense):
    """``nn.Dense`` whose three GEMMs follow ``recipe`` (parameters ``kernel``, ``bias``)."""

    recipe: str | Recipe = "bf16"

    @nn.compact
    def __call__(self, inputs):
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features),
                            self.param_dtype)
        bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
                if self.use_bias else None)
        return _dense(self, inputs, kernel, bias, get_recipe(self.recipe))


class QLinear(nnx.Linear):
    """``nnx.Linear`` whose three GEMMs follow ``recipe``; SR keys from ``rngs.quant``."""

    def __init__(self, in_features, out_features, *, recipe: str | Recipe = "bf16",
                 rngs: nnx.Rngs, **kwargs):
        super().__init__(in_features, out_features, rngs=rngs, **kwargs)
        self.recipe = get_recipe(recipe)
        self.quant_rngs = nnx.Rngs(quant=rngs.quant() if "quant" in rngs else 0)

    @classmethod
    def from_linear(cls, linear: nnx.Linear, recipe: Recipe, seed: int) -> QLinear:
        """A QLinear that shares ``linear``'s Params (same objects, same names)."""
        q = object.__new__(cls)
        vars(q).update(vars(linear))
        q.recipe = recipe
        q.quant_rngs = nnx.Rngs(quant=seed)
        return q

    def __call__(self, inputs, out_sharding=None):
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        key = self.quant_rngs.quant() if self.recipe.needs_key else None
        y = qdot_general(inputs, kernel, _DN(inputs), self.recipe, key=key)
        if bias is not None:
            y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y


def linear_layers(model) -> list[tuple[str, str]]:
    """``(path, kind)`` of every linear layer: NNX ``Linear`` modules, or for a Linen params
    pytree every sub-dict holding a 2D ``kernel``."""
    if isinstance(model, nnx.Module):
        return [("/".join(map(str, path)), type(m).__name__.lower())
                for path, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear)]
    params = model.get("params", model) if isinstance(model, dict) else model
    out = []

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                if "kernel" in v and getattr(v["kernel"], "ndim", 0) == 2:
                    out.append(("/".join(prefix + [k]), "dense"))
                walk(v, prefix + [k])

    walk(params, [])
    return out


@dataclasses.dataclass
class QuantizedLinen:
    """A Linen model whose ``nn.Dense`` calls follow a policy; ``init``/``apply`` as the
    model's. ``num_blocks`` feeds depth rules (default: inferred from the param paths)."""

    model: nn.Module
    policy: PrecisionPolicy
    num_blocks: int | None = None

    def init(self, *args, **kwargs):
        return self.model.init(*args, **kwargs)

    def _interceptor(self, num_blocks):
        def intercept(next_fun, args, kwargs, context):
            m = context.module
            if (context.method_name != "__call__" or type(m) is not nn.Dense
                    or not m.has_variable("params", "kernel")):
                return next_fun(*args, **kwargs)
            recipe = self.policy.recipe_for("/".join(m.scope.path), "dense", num_blocks)
            bias = m.get_variable("params", "bias") if m.use_bias else None
            return _dense(m, args[0], m.get_variable("params", "kernel"), bias, recipe)

        return intercept

    def apply(self, variables, *args, **kwargs):
        num_blocks = self.num_blocks or self.policy.infer_num_blocks(
            p for p, _ in linear_layers(variables))
        with nn.intercept_methods(self._interceptor(num_blocks)):
            return self.model.apply(variables, *args, **kwargs)


def quantize_model(model: Any, policy: str | PrecisionPolicy, *, num_blocks: int | None = None,
                   seed: int = 0):
    """Apply ``policy`` to a model written without fp4lab (see module docstring).

    NNX: swaps every ``nnx.Linear`` in place for a :class:`QLinear` sharing its Params and
    returns the model; each layer's SR stream is seeded from ``seed`` and its path. Linen:
    returns a :class:`QuantizedLinen` wrapper."""
    policy = get_policy(policy)
    if isinstance(model, nn.Module):
        return QuantizedLinen(model, policy, num_blocks)
    if not isinstance(model, nnx.Module):
        raise TypeError(f"quantize_model needs a Flax Linen or NNX module, got "
                        f"{type(model).__name__}")
    layers = linear_layers(model)
    num_blocks = num_blocks or policy.infer_num_blocks(p for p, _ in layers)
    for i, (path, m) in enumerate(list(nnx.iter_modules(model))):
        if type(m) is not nnx.Linear or not path:
            continue
        recipe = policy.recipe_for("/".join(map(str, path)), "linear", num_blocks)
        parent = model
        for p in path[:-1]:
            parent = parent[p] if isinstance(p, int) else getattr(parent, p)
        # a stable per-layer seed (Python's hash() of strings changes between processes)
        layer_seed = zlib.crc32(f"{seed}/{'/'.join(map(str, path))}".encode()) & 0x7FFFFFFF
        q = QLinear.from_linear(m, recipe, seed=layer_seed)
        if isinstance(path[-1], int):
            parent[path[-1]] = q
        else:
            setattr(parent, path[-1], q)
    return model

