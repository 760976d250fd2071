"""The per-GEMM state of a Linen GEMM site, found in one lookup (:func:`gemm_state`): its
stochastic-rounding key from the "quant" rng, its probe, its amax history and OutControl's
channel statistics and split, each checked against the Linen transforms around the GEMM
(``nn.scan``, ``nn.vmap``: :func:`lifts_around`, :func:`stack_of`) so that every scanned
block gets its own."""

from __future__ import annotations

import contextvars
import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn

from fp4lab.features import outcontrol
from fp4lab.features.delayed import init_history
from fp4lab.flax.internals import (linen_child, linen_filter_value, linen_lifted,
                                   linen_module_stack)
from fp4lab.features.probes import probe_zeros
from fp4lab.gemm.recipe import Recipe
from fp4lab.gemm.state import GemmState

__all__ = ["gemm_state", "stack_of", "lifts_around", "note_weight", "RECORDING", "CREATING",
           "PASSED"]


@dataclasses.dataclass(frozen=True)
class _Lift:
    """A Linen ``nn.scan`` or ``nn.vmap`` around a running module: the transform, the lifted
    module's path, its arguments (``flax.core.lift``'s signature) and its size (iterations or
    members; ``None`` where neither its arguments nor the variables say)."""

    transform: str  # "nn.scan" / "nn.vmap"
    path: str
    args: dict
    size: int | None

    def axis(self, collection: str) -> int | None:
        """The axis along which it maps ``collection`` (``None``: not mapped)."""
        return linen_filter_value(self.args.get("variable_axes"), collection)

    def split(self, rng: str):
        """What its ``split_rngs`` says of ``rng`` (``None``: not named)."""
        return linen_filter_value(self.args.get("split_rngs"), rng)

    @property
    def stacks(self) -> bool:
        """It maps the parameters along an axis: the blocks it runs are stacked."""
        return self.axis("params") is not None

    def __str__(self):
        return f"{self.transform} at {self.path}"


def lifts_around(module: nn.Module) -> list[_Lift]:
    """The Linen scans and vmaps around the running ``module``, outermost first. Flax runs a
    lifted module's body without putting the lifted module on the module stack: it is the
    child, on the way to ``module``, of a module on the stack."""
    path, stack = module.scope.path, linen_module_stack()
    out: dict[str, _Lift] = {}
    for m in stack:
        outer = m.scope.path
        if not (len(outer) < len(path) and path[:len(outer)] == outer):
            continue
        name = path[len(outer)]
        child = linen_child(m, name)
        found = linen_lifted(child) if isinstance(child, nn.Module) else None
        if found is not None and "/".join(outer + (name,)) not in out:
            kind, args = found
            body = next((b for b in stack if b.scope.path == outer + (name,)), None)
            lifted = "/".join(outer + (name,))
            out[lifted] = _Lift(f"nn.{kind}", lifted, args, _lift_size(kind, args, m, name,
                                                                        body))
    return list(out.values())


def _lift_size(kind: str, args: dict, parent: nn.Module, name: str, body) -> int | None:
    """A lift's iterations (``length``) or members (``axis_size``), else read off a variable
    it maps: its shape outside (``parent``'s, stacked) along the mapped axis."""
    size = args.get("length" if kind == "scan" else "axis_size")
    if size is not None or body is None:
        return size
    for collection, tree in parent.variables.items():
        axis = linen_filter_value(args.get("variable_axes"), collection)
        if axis is None or name not in tree:
            continue
        inner = {k for k, _ in jax.tree_util.tree_leaves_with_path(
            body.variables.get(collection, {}))}
        for k, leaf in jax.tree_util.tree_leaves_with_path(tree[name]):
            if k in inner:
                return int(jnp.shape(leaf)[axis])
    return None


def stack_of(module: nn.Module) -> tuple[int, ...]:
    """The blocks the running ``module`` is stacked over: the sizes of the lifts around it
    that map the parameters (``()``: not stacked)."""
    lifts = [lift for lift in lifts_around(module) if lift.stacks]
    if any(lift.size is None for lift in lifts):
        return ()  # (an unknown size: nothing to stack by; the body runs one recipe)
    return tuple(lift.size for lift in lifts)


# while QuantizedLinen.assignments traces apply: {GEMM path: the dtype of its W operand}
RECORDING: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fp4lab_recording",
                                                                         default=None)


def note_weight(path: str, w) -> None:
    """Record the dtype W has at the GEMM at ``path`` (only while recording)."""
    seen = RECORDING.get()
    if seen is not None:
        seen[path] = jnp.result_type(w).name


def _linen_key(module: nn.Module, recipe: Recipe):
    """The layer's stochastic-rounding key (None if its recipe has no SR), from its "quant" rng."""
    if not recipe.needs_key:
        return None
    where = (f"layer {'/'.join(module.scope.path)} uses recipe {recipe.name} with "
             "stochastic rounding")
    if module.has_rng("quant"):
        lifted = next((lift for lift in lifts_around(module) if lift.split("quant") is False),
                      None)
        if lifted is not None:
            raise ValueError(f"{where}, but {lifted} gives every iteration the same 'quant' "
                             "rng (correlated rounding noise across iterations): pass "
                             "split_rngs={..., 'quant': True}")
        return module.make_rng("quant")
    if module.is_initializing() or RECORDING.get() is not None:  # shapes only: any key
        return jax.random.key(0)
    if any(m.scope is not None and m.scope.has_rng("quant") for m in linen_module_stack()):
        raise ValueError(f"{where}, but the 'quant' rng given to apply does not reach it: a "
                         "Linen transform around it (nn.scan, nn.vmap) passes only the rngs "
                         "its split_rngs names; add split_rngs={..., 'quant': True} so that "
                         "each scanned block draws its own keys")
    raise ValueError(f"{where}: pass rngs={{'quant': key}} to apply")


# while QuantizedLinen builds a collection of per-GEMM state (probe_zeros, history_init):
# its name; every GEMM then creates its variable there, and Flax stacks it as it stacks params
CREATING: contextvars.ContextVar[str | None] = contextvars.ContextVar("fp4lab_creating",
                                                                     default=None)
# the collections the caller of QuantizedLinen.apply passed in its variables or made mutable
PASSED: contextvars.ContextVar[frozenset] = contextvars.ContextVar("fp4lab_passed",
                                                                   default=frozenset())


def _where(module: nn.Module, name: str) -> str:
    return "/".join(module.scope.path) + ("" if name == "gemm" else f"/{name}")


def _check_reaches(module: nn.Module, collection: str, name: str, what: str) -> None:
    """Refuse a per-GEMM ``collection`` that the caller uses but a Linen transform around the
    GEMM does not carry into its blocks: a scan that stacks the parameters and not this
    collection hands its blocks none of it (a probe would read zeros, OutControl would never
    split) or one for all of them."""
    if collection not in PASSED.get() and CREATING.get() != collection:
        return
    lift = next((lift for lift in lifts_around(module)
                 if lift.stacks and lift.axis(collection) is None), None)
    if lift is not None:
        axis = lift.axis("params")
        raise ValueError(f"{_where(module, name)}'s {what}: {lift} stacks the blocks' "
                         f"parameters (variable_axes 'params': {axis}) but not the "
                         f"'{collection}' collection, so its blocks would not get one each; "
                         f"add '{collection}': {axis} to its variable_axes")


def _collection_variable(module: nn.Module, collection: str, name: str, init, what: str,
                         build: str):
    """The GEMM's variable ``name`` of ``collection`` (a probe, an amax history): created
    with ``init`` while QuantizedLinen builds the collection, read when the caller passed it;
    ``None`` when the caller did not. A collection passed without this GEMM's entry, or with
    one of another shape, is an error (``build``: the QuantizedLinen method that builds
    it)."""
    _check_reaches(module, collection, name, what)
    if CREATING.get() == collection:
        return module.variable(collection, name, init).value
    fix = (f"build the '{collection}' collection with QuantizedLinen.{build}(variables, "
           "*inputs) for these inputs")
    if module.has_variable(collection, name):
        value = module.get_variable(collection, name)
        if value is None:  # a caller's way of switching one off
            return None
        want = jnp.shape(jax.eval_shape(init))
        if jnp.shape(value) != want:
            raise ValueError(f"{_where(module, name)}'s {what} has shape {jnp.shape(value)} "
                             f"here, not {want}: {fix} (under nn.scan it is stacked along the "
                             "scan's axis)")
        return value
    if collection in PASSED.get() and not module.is_initializing():
        raise ValueError(f"{_where(module, name)}: the '{collection}' collection passed to "
                         f"apply has no {what} for it; {fix}")
    return None


def _linen_probe(module: nn.Module, name: str = "gemm", experts: int | None = None):
    """The GEMM's probe (see :meth:`QuantizedLinen.probe_zeros`), if the caller passed the
    ``"probes"`` collection: variable ``name`` of ``module`` (``"gemm"`` for a layer,
    ``"einsum_0"``... for a call); an expert stack's (``experts``) is stacked per expert."""
    return _collection_variable(module, "probes", name, lambda: probe_zeros(experts), "probe",
                                "probe_zeros")


def _linen_history(module: nn.Module, recipe: Recipe, name: str = "gemm"):
    """The GEMM's amax history (the ``"amax_history"`` collection; see
    :meth:`QuantizedLinen.history_init`) when its recipe uses delayed scaling."""
    if recipe.delayed is None:
        return None
    history = _collection_variable(module, "amax_history", name,
                                   lambda: init_history(recipe.delayed),
                          "amax history", "history_init")
    if history is not None:
        return history
    if module.is_initializing() or RECORDING.get() is not None:  # shapes only
        return init_history(recipe.delayed)
    raise ValueError(f"{_where(module, name)} uses recipe {recipe.name} with delayed scaling: "
                     "pass its amax history in the 'amax_history' collection "
                     "(QuantizedLinen.history_init gives the first one)")


def _linen_channels(module: nn.Module, recipe: Recipe, lhs, dimension_numbers,
                    name: str = "gemm"):
    """OutControl's state of a GEMM whose recipe has ``outliers``: when the caller made the
    ``"channel_norms"`` collection mutable, this call's per-channel L2 norms of X are added to
    its variable ``name`` (zeros at first); the GEMM's ``"outlier_channels"`` variable, if
    given, is its split (``fp4lab.features.outcontrol``). ``None``: the recipe without the split."""
    if recipe.outliers is None:
        return None
    _check_reaches(module, "channel_norms", name, "channel norms")
    _check_reaches(module, "outlier_channels", name, "outlier channels")
    if (module.is_mutable_collection("channel_norms") and not module.is_initializing()
            and RECORDING.get() is None):
        norms = outcontrol.channel_norms(lhs, dimension_numbers)
        v = module.variable("channel_norms", name, jnp.zeros, norms.shape, jnp.float32)
        v.value = v.value + norms
    if module.has_variable("outlier_channels", name):
        return module.get_variable("outlier_channels", name)
    return None


def gemm_state(module: nn.Module, recipe: Recipe, name: str = "gemm",
               operand_x=None, experts: int | None = None) -> GemmState:
    """Everything a GEMM site's call takes besides its operands, in one lookup: the
    stochastic-rounding key, the probe, the amax history and OutControl's channels
    (``operand_x()``: the call's ``(X, dimension_numbers)``, read only for OutControl);
    ``experts``: an expert stack's number of experts (its probe is stacked per expert)."""
    channels = None
    if recipe.outliers is not None:
        channels = _linen_channels(module, recipe, *operand_x(), name)
    return GemmState(key=_linen_key(module, recipe), probe=_linen_probe(module, name, experts),
                     amax_history=_linen_history(module, recipe, name), channels=channels)
