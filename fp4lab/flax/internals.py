"""Everything fp4lab relies on in Flax beyond its public API, in one place.

Which module is calling, a Linen transform's arguments, a Linen einsum's bias shape, the
Flax collection whose variables a trainer overwrites with their gradient, and swapping an NNX
module's class. ``tests/fp4lab/test_flax_internals.py`` pins each behaviour on plain Flax
models, so a Flax upgrade that changes one fails there (pinned: Flax 0.12).
"""

from __future__ import annotations

import inspect
import sys

from flax import linen as nn
from flax import nnx
from flax.core import lift
from flax.core.scope import in_filter
from flax.nnx import variablelib

__all__ = ["linen_module_stack", "linen_calling_module", "linen_child", "linen_lifted",
           "linen_filter_value", "linen_einsum_bias_shape", "nnx_calling_module",
           "swap_class", "OverwriteWithGradient"]


def linen_module_stack() -> list[nn.Module]:
    """The Linen modules whose methods are running in this thread, outermost first."""
    from flax.linen.module import _context

    return [m for m in _context.module_stack if m is not None]


def linen_calling_module() -> nn.Module | None:
    """The Linen module whose method is running (``None`` outside any)."""
    stack = linen_module_stack()
    return stack[-1] if stack else None


def linen_child(module: nn.Module, name: str):
    """``module``'s child ``name`` as set up so far (a lifted module, which Flax runs without
    putting it on the module stack, included), or ``None``."""
    return module._state.children.get(name)


def linen_lifted(module: nn.Module) -> tuple[str, dict] | None:
    """For ``module`` an instance of ``nn.scan`` or ``nn.vmap`` of a module class: the
    transform's name (``"scan"``, ``"vmap"``) and its arguments as bound to the signature of
    ``flax.core.lift.scan`` / ``vmap`` (``variable_axes``, ``split_rngs``, ``length``,
    ``axis_size``, ...; defaults filled in). ``None`` for any other module. Read off the lifted
    ``__call__``'s closure, where Flax keeps the transform and its arguments."""
    call = getattr(type(module), "__call__", None)  # noqa: B004 (its closure is read)
    names = getattr(getattr(call, "__code__", None), "co_freevars", ())
    lifted = ("transform", "trafo_args", "trafo_kwargs")
    if not set(lifted) <= set(names):
        return None
    cells = {n: c.cell_contents for n, c in zip(names, call.__closure__, strict=True)
             if n in lifted}
    transform = cells["transform"]
    if transform not in (lift.scan, lift.vmap):
        return None
    bound = inspect.signature(transform).bind_partial(
        None, *cells["trafo_args"], **cells["trafo_kwargs"])
    bound.apply_defaults()
    return transform.__name__, dict(bound.arguments)


def linen_filter_value(mapping, name: str):
    """The value a Linen transform's filter mapping (``split_rngs``, ``variable_axes``) gives
    collection or rng ``name``: the first filter that matches it, as Flax groups them;
    ``None`` when none does. An axis given as ``flax.typing.In``/``Out`` is its axis."""
    for f, value in (mapping or {}).items():
        if in_filter(f, name):
            return getattr(value, "axis", value)
    return None


def linen_einsum_bias_shape(module: nn.Einsum, spec: str, inputs, kernel):
    """``nn.Einsum``'s ``(bias shape, broadcast shape)`` for ``spec``, as its ``__call__``
    computes them."""
    return module._get_bias_shape(spec, inputs, kernel)


def nnx_calling_module() -> nnx.Module | None:
    """The NNX module whose method is running: the nearest caller frame whose ``self`` is an
    ``nnx.Module`` (NNX keeps no module stack; qwix finds the module the same way)."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_locals.get("self")
        if isinstance(module, nnx.Module):
            return module
        frame = frame.f_back
    return None


def swap_class(module: nnx.Module, cls: type) -> None:
    """Make ``module`` an instance of ``cls`` (a subclass of its class, or its class back),
    in place, its state untouched (as qwix swaps classes)."""
    module.__class__ = cls


# Flax's collection of variables whose gradient is their next value (Linen's FP8 layers;
# MaxText's train step sets every variable of this type to its gradient after each step)
OverwriteWithGradient = variablelib.variable_type_from_name("_overwrite_with_gradient",
                                                            allow_register=True)
