"""NNX layers whose GEMMs follow a recipe, and the hooks ``quantize_model`` installs.

NNX's ``Linear``/``LinearGeneral`` call ``self.dot_general`` and ``Einsum`` calls
``self.einsum_op``; :class:`QuantDot` and :class:`QuantEinsum` are drop-in replacements that
carry a recipe and their own SR rng stream, so quantizing a layer never touches its Params.
"""

from __future__ import annotations

import functools
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


from fp4lab.features.delayed import init_history, update
from fp4lab.flax.internals import OverwriteWithGradient, nnx_calling_module, swap_class
from fp4lab.flax.ops import (CallCounter, OpCalls, device_key, device_mean, expert_count,
                             quantized_call, runs_as_written, trace_abstractly)
from fp4lab.features.probes import probe_table, probe_zeros
from fp4lab.policy.rules import EXPERT_KINDS
from fp4lab.gemm.qdot import qdot_general, qeinsum
from fp4lab.gemm.recipe import Recipe, get_recipe
from fp4lab.gemm.state import GemmState

__all__ = ["QuantDot", "QuantEinsum", "QuantOp", "QuantKey", "QuantCounter", "QLinear",
           "QLinearGeneral", "QEinsum", "HOOKS", "LAYER_TYPES", "LAYER_CALLS", "AmaxHistory",
           "update_amax_history", "QuantProbe", "probe_records", "probe_rows", "block_name",
           "find_op_calls", "intercept_ops", "release_ops", "register_layer", "layer_stack",
           "stacked", "OPS_ATTR"]


class AmaxHistory(nnx.Variable):
    """A layer's FP8 amax history (recipes with delayed scaling; :mod:`fp4lab.features.delayed`)."""


def update_amax_history(model: nnx.Module, grads) -> None:
    """Roll this step's amaxes into every :class:`AmaxHistory` of ``model``, in place.
    ``grads``: the gradient state of a ``nnx.grad`` whose ``argnums`` include the histories,
    e.g. ``nnx.DiffState(0, nnx.Any(nnx.Param, AmaxHistory))``."""
    history = nnx.state(model, AmaxHistory)
    nnx.update(model, update(history, nnx.state(grads, AmaxHistory)))


class QuantKey(nnx.Variable):
    """The base key of a GEMM's stochastic-rounding stream, as raw key data (``uint32``, as
    checkpoints store it). Not RNG state: hosts that drop RNG state keep it."""


class QuantCounter(nnx.Variable):
    """How many keys a GEMM's stochastic-rounding stream has drawn. Not RNG state, so a host
    that writes back only non-RNG state (MaxText's layer scan keeps
    ``nnx.Not(nnx.RngState)``) still advances it from step to step."""


class QuantProbe(OverwriteWithGradient):
    """A GEMM's probe (:mod:`fp4lab.features.probes`): the GEMM ignores its value, and its gradient
    is the numerics of the GEMM's six operands in that step. Of Flax's ``_overwrite_with_gradient``
    collection, so a host that sets those variables to their gradient after each step (MaxText)
    holds the last step's numerics in it; otherwise differentiate with respect to it
    (``nnx.DiffState(0, nnx.Any(nnx.Param, QuantProbe))``). :func:`probe_records` reads it."""


def probe_rows(model: nnx.Module, grads=None) -> dict[str, tuple[Recipe, jax.Array]]:
    """``{GEMM path: (recipe, probe)}`` of every GEMM of ``model`` that has a
    :class:`QuantProbe`, its value taken from ``grads`` (the ``nnx.State`` of a gradient with
    respect to the probes) or, without it, from the model (a host that overwrites probes with
    their gradient). A probe of blocks stacked for a scan has the stack's axes in front. Works
    on traced values (inside ``jit``)."""
    values = dict(nnx.to_flat_state(nnx.state(model if grads is None else grads, QuantProbe)))
    out = {}
    for path, m in nnx.iter_modules(model):
        if isinstance(m, _QuantizedGemm) and isinstance(getattr(m, "probe", None), QuantProbe):
            name = m.path if isinstance(m, QuantOp) else "/".join(map(str, path[:-1]))
            if path + ("probe",) not in values:
                raise ValueError(f"{name}: no probe gradient in the given state; differentiate "
                                 "with respect to nnx.Any(nnx.Param, QuantProbe)")
            out[name] = (m.recipe, values[path + ("probe",)][...])
    return out


def block_name(path: str, index: tuple[int, ...]) -> str:
    """The name of one block of a GEMM stacked for a scan: ``path[i]`` (``path[i,j]``), or
    ``path`` for a GEMM that is not stacked (``index == ()``)."""
    return f"{path}[{','.join(map(str, index))}]" if index else path


def probe_records(model: nnx.Module, grads=None) -> dict[str, dict[str, dict[str, float]]]:
    """``{GEMM path: {operand: {metric: value}}}`` (host values) from the probes of
    :func:`probe_rows`; each block stacked for a scan is its own entry, ``path[i]``, and each
    expert of an expert stack (an intercepted ``ragged_dot``) too, ``path/expert_e``. Operands
    the GEMM's recipe does not quantize, and all of a probe whose gradient is zero (nothing was
    measured: the GEMM did not run, or ran as written, exactly, as an identity recipe on
    operands already of its dtype does), are NaN; a measured row is never all zeros
    (``sqnr_db`` is then inf, NaN or ``underflow`` is 1)."""
    experts = {m.path for _, m in nnx.iter_modules(model)
               if isinstance(m, QuantOp) and m.call in EXPERT_KINDS}
    out = {}
    for name, (recipe, rows) in probe_rows(model, grads).items():
        rows = np.asarray(rows)
        for index in np.ndindex(rows.shape[:-2]):
            table = probe_table(rows[index])
            for op in table:
                if op not in recipe.quantized_operands or not rows[index].any():
                    table[op] = dict.fromkeys(table[op], float("nan"))
            if name in experts:
                out[f"{block_name(name, index[:-1])}/expert_{index[-1]}"] = table
            else:
                out[block_name(name, index)] = table
    return out


class _QuantizedGemm(nnx.Module):
    """What every quantized NNX GEMM carries: a recipe, a backend, its own SR stream (a base
    key from ``rngs.quant`` if given, else ``seed``, and a counter folded into it at every
    call), for delayed scaling an :class:`AmaxHistory` (``amax_history``) and, with
    ``probe=True``, a :class:`QuantProbe` (``probe``)."""

    def __init__(self, recipe: str | Recipe, *, rngs: nnx.Rngs | None = None, seed: int = 0,
                 backend: str = "auto", probe: bool = False, experts: int | None = None):
        self.recipe = get_recipe(recipe)
        if self.recipe.outliers is not None:  # it would run without its split, silently
            raise ValueError(
                f"recipe {self.recipe.name} has OutControl, whose per-layer channel state the "
                "NNX integration (and MaxText through it) does not carry: use the Linen "
                "integration (QuantizedLinen, experiments/) or qdot_general with "
                "GemmState(channels=...)")
        self.backend = backend
        key = rngs.quant() if rngs is not None and "quant" in rngs else jax.random.key(seed)
        self.sr_key = QuantKey(jax.random.key_data(key))
        self.sr_count = QuantCounter(jnp.zeros((), jnp.uint32))
        if self.recipe.delayed is not None:
            self.amax_history = AmaxHistory(init_history(self.recipe.delayed))
        if probe:  # an expert stack's (``experts``): one per expert
            self.probe = QuantProbe(probe_zeros(experts))

    def _key(self):
        """This call's SR key: the base key folded with the counter, which then advances (a
        rematerialized forward reads the counter it was given, so it draws the same key).
        Inside a JAX transform that NNX state cannot be written from (MaxText computes its
        experts under ``jax.shard_map``), the draw is deferred: the key folds the counter
        plus the draws deferred so far, and the counter advances by them when the trace
        returns to the module method that entered the transform (:func:`_advance_deferred`).
        Inside ``shard_map`` the key is also each device's own (:func:`device_key`)."""
        if not self.recipe.needs_key:
            return None
        n = self.sr_count[...]
        deferred = getattr(_state, "deferred", None)
        if self.sr_count._can_update and (deferred is None or id(self) not in deferred):
            self.sr_count[...] = n + 1
        elif deferred is None:
            raise ValueError(f"{type(self).__name__}: {_NO_ADVANCE}")
        else:
            _, k = deferred.get(id(self), (self, 0))
            deferred[id(self)] = (self, k + 1)
            n = n + k
        return device_key(jax.random.fold_in(jax.random.wrap_key_data(self.sr_key[...]), n))

    def _history(self):
        return self.amax_history[...] if self.recipe.delayed is not None else None

    def _state(self) -> GemmState:
        """The SR key, probe and amax history of this call (a probe read inside
        ``shard_map`` as :func:`device_mean` says)."""
        probe = getattr(self, "probe", None)
        return GemmState(key=self._key(), probe=None if probe is None else device_mean(
            probe[...]), amax_history=self._history())


class QuantDot(_QuantizedGemm):
    """A drop-in ``dot_general`` for NNX layers whose GEMMs follow ``recipe``."""

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, out_sharding=None):
        return qdot_general(lhs, rhs, dimension_numbers, self.recipe, self._state(),
                            backend=self.backend,
                            preferred_element_type=preferred_element_type,
                            out_sharding=out_sharding)


class QuantEinsum(_QuantizedGemm):
    """A drop-in ``einsum_op`` for ``nnx.Einsum`` (the input plays X, the kernel W)."""

    def __call__(self, spec, a, b, precision=None, preferred_element_type=None,
                 out_sharding=None):
        return qeinsum(spec, a, b, self.recipe, self._state(), backend=self.backend,
                       preferred_element_type=preferred_element_type, out_sharding=out_sharding)


class QuantOp(_QuantizedGemm):
    """The quantized form of one intercepted ``jnp.einsum`` / ``lax.dot_general`` call
    (``call``), kept in its module's ``fp4lab_ops`` dict under the call's name: the GEMM at
    ``path`` of ``kind`` (the op kind, or the layer kind of a :func:`register_layer` type)."""

    def __init__(self, recipe: str | Recipe, kind: str, path: str, call: str | None = None,
                 **kwargs):
        super().__init__(recipe, **kwargs)  # experts=: a ragged_dot's (its probe per expert)
        self.kind, self.path, self.call = kind, path, call or kind

    def __call__(self, args, kwargs):
        return quantized_call(self.path, self.call, self.recipe, args, kwargs, self._state(),
                              backend=self.backend)


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
LAYER_TYPES = {QLinear: "linear", QLinearGeneral: "lineargeneral", QEinsum: "einsum",
         **{cls: v[0] for cls, v in HOOKS.items()}}
# module types whose lax.dot_general call is their layer's GEMM (register_layer) -> kind
LAYER_CALLS: dict[type, str] = {}


def register_layer(cls: type, kind: str) -> None:
    """Govern the modules of ``cls`` (an NNX layer of another library, such as MaxText's
    ``DenseGeneral``, that computes its GEMM with one ``jax.lax.dot_general`` call) as
    layers of ``kind``: layer rules and the policy's default apply to the call, named by the
    module's path."""
    from fp4lab.policy import LAYER_KINDS, OP_KINDS

    if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
        raise TypeError(f"register_layer takes an nnx.Module class, not {cls!r}")
    if kind not in LAYER_KINDS or kind in OP_KINDS:
        raise ValueError(f"register_layer: kind={kind!r} is not a layer kind; use one of "
                         f"{', '.join(k for k in LAYER_KINDS if k not in OP_KINDS)}")
    LAYER_CALLS[cls] = kind




# ----------------------------------------------------------------------------- op interception

OPS_ATTR = "fp4lab_ops"  # a module's quantized calls: {call name: QuantOp}
_state = threading.local()  # .active: an intercepting model call is running in this thread


def _handler(record=None):
    """The op handler of one model call: ``record(module, name, kind)`` when finding calls,
    else each module's ``fp4lab_ops`` quantizes the calls it names."""
    counter = CallCounter()

    def op(kind, original, args, kwargs):
        m = nnx_calling_module()
        if m is None or type(m) in LAYER_TYPES or isinstance(m, _QuantizedGemm):
            return original(*args, **kwargs)  # outside modules, or inside a governed layer
        name = counter(m, getattr(m, _PATH_ATTR, id(m)), kind)
        if record is not None:
            record(m, name, kind, expert_count(kind, args, kwargs))
            return original(*args, **kwargs)
        q = getattr(m, OPS_ATTR, {}).get(name)
        if q is None and kind in EXPERT_KINDS:
            raise ValueError(f"{type(m).__name__} calls {kind} ({name}), an expert stack "
                             "that quantize_model did not see: an NNX model's calls inside its "
                             "modules are found by running it on example inputs, "
                             "quantize_model(model, policy, x)")
        if q is None or runs_as_written(q.recipe, q.call, args, kwargs):
            return original(*args, **kwargs)
        return q(args, kwargs)

    return op


def _call(call, model, args, kwargs, record=None):
    """``call(model, *args, **kwargs)`` with its calls intercepted (the outermost of nested
    intercepting calls counts and quantizes; the inner ones run inside it). Every call
    advances the SR counters whose draws were deferred inside it (:meth:`_QuantizedGemm._key`)
    and can be written where it returns."""
    if getattr(_state, "active", False):
        out = call(model, *args, **kwargs)
        _advance_deferred()
        return out
    _state.active, _state.deferred = True, {}
    try:
        with OpCalls.intercepted(_handler(record)):
            out = call(model, *args, **kwargs)
        _advance_deferred()
        if _state.deferred:
            op = next(iter(_state.deferred.values()))[0]
            where = op.path if isinstance(op, QuantOp) else type(op).__name__
            raise ValueError(f"op {where}: {_NO_ADVANCE}")
        return out
    finally:
        _state.active, _state.deferred = False, None


# why an SR draw inside a JAX transform is refused: no model method returns outside it
_NO_ADVANCE = ("its SR counter cannot advance inside a JAX transform entered outside the "
               "model's methods; call the model inside it, or use NNX's lifted transform "
               "(nnx.shard_map)")


def _advance_deferred() -> None:
    """Advance each SR counter by the draws deferred for it, where it can now be written."""
    deferred = getattr(_state, "deferred", None) or {}
    for i, (op, k) in list(deferred.items()):
        if op.sr_count._can_update:
            op.sr_count[...] = op.sr_count[...] + k
            del deferred[i]


_INTERCEPTING: dict[type, type] = {}


def _entry_points(cls: type) -> list[str]:
    """The methods through which ``cls``'s modules run: ``__call__`` and every other plain
    function its classes below ``nnx.Module`` define (not dunders, static or class methods,
    properties)."""
    own = cls.__mro__[:cls.__mro__.index(nnx.Module)]
    return sorted({name for base in own for name, v in vars(base).items()
                   if isinstance(v, types.FunctionType)
                   and (name == "__call__" or not (name.startswith("__") and name.endswith("__")))})


def _intercepting(cls: type) -> type:
    """``cls``'s subclass, of the same name, whose entry points intercept the calls made
    inside them (as qwix swaps classes); one per class."""
    if cls not in _INTERCEPTING:
        def entry(name):
            original = getattr(cls, name)

            @functools.wraps(original)
            def method(self, *args, **kwargs):
                return _call(original, self, args, kwargs)

            return method

        _INTERCEPTING[cls] = type(cls.__name__, (cls,), {
            **{name: entry(name) for name in _entry_points(cls)}, "_fp4lab_intercepts": True,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__})
    return _INTERCEPTING[cls]


def intercept_ops(model: nnx.Module, *, guard: bool = False) -> None:
    """Make every module of ``model`` through which a quantized call can be reached (the
    modules holding ``fp4lab_ops`` and those above them; with ``guard``, the model itself)
    intercept the calls made inside any of its methods, in place: ``model(x)``, ``model.forward(x)`` and ``model.blocks[0](x)``
    quantize the same calls."""
    modules = list(nnx.iter_modules(model))
    holders = [path for path, m in modules if OPS_ATTR in vars(m)]
    if guard:  # calls not searched for (no example inputs): the model itself intercepts, so
        holders.append(())  # a ragged_dot call is refused when it runs, never run unquantized
    for path, m in modules:
        if not getattr(type(m), "_fp4lab_intercepts", False) and any(
                tuple(h[:len(path)]) == tuple(path) for h in holders):
            swap_class(m, _intercepting(type(m)))


def release_ops(model: nnx.Module) -> None:
    """Undo :func:`intercept_ops` and drop every quantized call of ``model``, in place (a
    model quantized again starts from its own classes and finds its calls afresh)."""
    for _, m in nnx.iter_modules(model):
        if OPS_ATTR in vars(m):
            delattr(m, OPS_ATTR)
        if getattr(type(m), "_fp4lab_intercepts", False):
            swap_class(m, type(m).__bases__[0])


def find_op_calls(model: nnx.Module, args=(), kwargs=None
                  ) -> list[tuple[str, str, str, tuple[int, ...], int | None]]:
    """``(module path, call name, kind, stack shape, experts)`` of every ``jnp.einsum`` /
    ``lax.dot_general`` / ``lax.ragged_dot`` call (``experts``: a ragged_dot's number of
    experts, else None) that ``model(*args, **kwargs)`` makes inside its modules (the
    governed layers' own GEMMs excepted), in call order, found by tracing the call abstractly
    (no computation on the model's state). A module stacked by ``nnx.vmap`` and run under
    ``nnx.scan`` makes its calls once, from one slice: the stack shape is the leading axes its
    variables have outside the scan. Array leaves of the inputs (or ``jax.ShapeDtypeStruct``)
    are traced; other leaves (flags, strings) pass as they are."""
    modules = {"/".join(map(str, p)): m for p, m in nnx.iter_modules(model)}
    found: list[tuple[str, str, str, tuple[int, ...], int | None]] = []

    def record(sub, name, kind, experts):
        path = getattr(sub, _PATH_ATTR, None)  # static: it survives the transforms' copies
        if path is not None and not any(f[:2] == (path, name) for f in found):
            found.append((path, name, kind, _stacked_by(modules[path], sub), experts))

    def run(m, *a, **k):
        return _call(type(m).__call__, m, a, k, record)

    for path, m in modules.items():
        setattr(m, _PATH_ATTR, path)
    try:
        trace_abstractly(run, args, kwargs, nodes=(model,), eval_shape=nnx.eval_shape)
    finally:
        for m in modules.values():
            delattr(m, _PATH_ATTR)
    return found


_PATH_ATTR = "_fp4lab_path"


def _stacked_by(module: nnx.Module, seen: nnx.Module) -> tuple[int, ...]:
    """The axes by which ``module``'s variables are stacked that the copy ``seen`` inside a
    call lacks (``nnx.scan`` over stacked blocks); ``()`` when it is not stacked. The stack
    axis is each variable's ``param_scan_axis`` metadata (as MaxText records it), else the
    leading axes (``nnx.vmap``'s default)."""
    full = nnx.to_flat_state(nnx.state(module))
    part = dict(nnx.to_flat_state(nnx.state(seen)))
    for path, var in full:
        if path in part and var[...].ndim > part[path][...].ndim:
            return _stack_of(var, part[path][...].shape, "/".join(map(str, path)))
    return ()


def _stack_of(var: nnx.Variable, own: tuple[int, ...], name: str) -> tuple[int, ...]:
    """The stack axes of ``var``, whose unstacked shape is ``own``: one axis at the
    variable's ``param_scan_axis`` metadata, else the leading axes. Refused when the rest is
    not ``own`` (the stack axis is not where the metadata, or its absence, says)."""
    shape = tuple(var[...].shape)
    own = tuple(own)
    axis = var.get_metadata().get("param_scan_axis")
    if axis is not None and len(shape) == len(own) + 1:
        stack, rest = (shape[axis],), shape[:axis] + shape[axis + 1:]
    else:
        stack, rest = shape[:len(shape) - len(own)], shape[len(shape) - len(own):]
    if rest != own:
        where = "leading axes" if axis is None else f"param_scan_axis={axis}"
        raise ValueError(f"{name}: shape {shape} is not a stack of {own} along its {where}; "
                         "record the scan axis of stacked variables in their metadata "
                         "(param_scan_axis=<axis>, as MaxText does)")
    return stack


def layer_stack(layer: nnx.Module) -> tuple[int, ...]:
    """The axes by which a governed layer's kernel is stacked (blocks built with
    ``nnx.vmap`` or MaxText's scanned layers, for a scan over them): the kernel's
    ``param_scan_axis`` metadata, else the leading axes beyond the layer's own kernel
    shape; ``()`` for a plain layer."""
    if isinstance(layer, nnx.LinearGeneral):
        own = tuple(layer.in_features) + tuple(layer.out_features)
    elif isinstance(layer, nnx.Einsum):
        own = tuple(layer.kernel_shape)
    else:
        own = (layer.in_features, layer.out_features)
    return _stack_of(layer.kernel, own, type(layer).__name__ + ".kernel")


def stacked(op: nnx.Module, shape: tuple[int, ...]) -> nnx.Module:
    """``op`` with its state stacked along ``shape``, in place, leading (as MaxText stacks
    state other than parameters): each slice gets its own SR base key (split from the
    op's) and the same counter and initial amax history."""
    if shape:
        def grow(path, var):
            v = var[...]
            if isinstance(var, QuantKey):
                keys = jax.random.split(jax.random.wrap_key_data(v), shape)
                return path, var.replace(jax.random.key_data(keys))
            return path, var.replace(jnp.broadcast_to(v, shape + v.shape))

        flat = nnx.to_flat_state(nnx.state(op))
        nnx.update(op, nnx.from_flat_state([grow(p, v) for p, v in flat]))
    return op
