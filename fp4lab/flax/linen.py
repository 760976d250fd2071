"""Linen layers whose GEMMs follow a recipe, and the interceptor behind ``quantize_model``.

:class:`QDense`, :class:`QDenseGeneral` and :class:`QEinsum` subclass the Flax layers and keep
their parameters. :class:`QuantizedLinen` wraps an unmodified model: its ``apply`` intercepts
every ``nn.Dense`` and ``nn.DenseGeneral`` (through their ``dot_general`` hook) and ``nn.Einsum``
(computed with :func:`~fp4lab.qdot.qeinsum`, which keeps the input as X and the kernel as W;
``jnp.einsum`` may swap its operands, which would swap the recipe's roles).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from fp4lab import outcontrol
from fp4lab.delayed import init_history
from fp4lab.einsum import plan_einsum
from fp4lab.flax.internals import (linen_calling_module, linen_child, linen_einsum_bias_shape,
                                   linen_filter_value, linen_lifted, linen_module_stack)
from fp4lab.flax.ops import (NONE_FOUND, CallCounter, OpCalls, operand_w, operand_x,
                             quantized_call, runs_as_written, trace_abstractly)
from fp4lab.policy import Assignment, ExplainTable, PrecisionPolicy, check_unused
from fp4lab.probes import probe_zeros
from fp4lab.qdot import qdot_general, qeinsum
from fp4lab.recipe import Recipe, get_recipe

__all__ = ["QDense", "QDenseGeneral", "QEinsum", "QuantizedLinen", "param_layers",
           "LAYER_TYPES"]


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


def _lifts_around(module: nn.Module) -> list[_Lift]:
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


def _stack(module: nn.Module) -> tuple[int, ...]:
    """The blocks the running ``module`` is stacked over: the sizes of the lifts around it
    that map the parameters (``()``: not stacked)."""
    lifts = [lift for lift in _lifts_around(module) if lift.stacks]
    if any(lift.size is None for lift in lifts):
        return ()  # (an unknown size: nothing to stack by; the body runs one recipe)
    return tuple(lift.size for lift in lifts)


# while QuantizedLinen.assignments traces apply: {GEMM path: the dtype of its W operand}
_recording: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fp4lab_recording",
                                                                         default=None)


def _note(path: str, w) -> None:
    """Record the dtype W has at the GEMM at ``path`` (only while recording)."""
    seen = _recording.get()
    if seen is not None:
        seen[path] = jnp.result_type(w).name


def _linen_key(module: nn.Module, recipe: Recipe):
    """The layer's stochastic-rounding key (None if its recipe has no SR), from its "quant" rng."""
    if not recipe.needs_key:
        return None
    where = (f"layer {'/'.join(module.scope.path)} uses recipe {recipe.name} with "
             "stochastic rounding")
    if module.has_rng("quant"):
        lifted = next((lift for lift in _lifts_around(module) if lift.split("quant") is False),
                      None)
        if lifted is not None:
            raise ValueError(f"{where}, but {lifted} gives every iteration the same 'quant' "
                             "rng (correlated rounding noise across iterations): pass "
                             "split_rngs={..., 'quant': True}")
        return module.make_rng("quant")
    if module.is_initializing() or _recording.get() is not None:  # shapes only: any key
        return jax.random.key(0)
    if any(m.scope is not None and m.scope.has_rng("quant") for m in linen_module_stack()):
        raise ValueError(f"{where}, but the 'quant' rng given to apply does not reach it: a "
                         "Linen transform around it (nn.scan, nn.vmap) passes only the rngs "
                         "its split_rngs names; add split_rngs={..., 'quant': True} so that "
                         "each scanned block draws its own keys")
    raise ValueError(f"{where}: pass rngs={{'quant': key}} to apply")


# while QuantizedLinen builds a collection of per-GEMM state (probe_zeros, history_init):
# its name; every GEMM then creates its variable there, and Flax stacks it as it stacks params
_creating: contextvars.ContextVar[str | None] = contextvars.ContextVar("fp4lab_creating",
                                                                     default=None)
# the collections the caller of QuantizedLinen.apply passed in its variables or made mutable
_passed: contextvars.ContextVar[frozenset] = contextvars.ContextVar("fp4lab_passed",
                                                                   default=frozenset())


def _where(module: nn.Module, name: str) -> str:
    return "/".join(module.scope.path) + ("" if name == "gemm" else f"/{name}")


def _check_reaches(module: nn.Module, collection: str, name: str, what: str) -> None:
    """Refuse a per-GEMM ``collection`` that the caller uses but a Linen transform around the
    GEMM does not carry into its blocks: a scan that stacks the parameters and not this
    collection hands its blocks none of it (a probe would read zeros, OutControl would never
    split) or one for all of them."""
    if collection not in _passed.get() and _creating.get() != collection:
        return
    lift = next((lift for lift in _lifts_around(module)
                 if lift.stacks and lift.axis(collection) is None), None)
    if lift is not None:
        axis = lift.axis("params")
        raise ValueError(f"{_where(module, name)}'s {what}: {lift} stacks the blocks' "
                         f"parameters (variable_axes 'params': {axis}) but not the "
                         f"'{collection}' collection, so its blocks would not get one each; "
                         f"add '{collection}': {axis} to its variable_axes")


def _gemm_state(module: nn.Module, collection: str, name: str, init, what: str, build: str):
    """The GEMM's variable ``name`` of ``collection`` (a probe, an amax history): created
    with ``init`` while QuantizedLinen builds the collection, read when the caller passed it;
    ``None`` when the caller did not. A collection passed without this GEMM's entry, or with
    one of another shape, is an error (``build``: the QuantizedLinen method that builds
    it)."""
    _check_reaches(module, collection, name, what)
    if _creating.get() == collection:
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
    if collection in _passed.get() and not module.is_initializing():
        raise ValueError(f"{_where(module, name)}: the '{collection}' collection passed to "
                         f"apply has no {what} for it; {fix}")
    return None


def _linen_probe(module: nn.Module, name: str = "gemm"):
    """The GEMM's probe (see :meth:`QuantizedLinen.probe_zeros`), if the caller passed the
    ``"probes"`` collection: variable ``name`` of ``module`` (``"gemm"`` for a layer,
    ``"einsum_0"``... for a call)."""
    return _gemm_state(module, "probes", name, probe_zeros, "probe", "probe_zeros")


def _linen_history(module: nn.Module, recipe: Recipe, name: str = "gemm"):
    """The GEMM's amax history (the ``"amax_history"`` collection; see
    :meth:`QuantizedLinen.history_init`) when its recipe uses delayed scaling."""
    if recipe.delayed is None:
        return None
    history = _gemm_state(module, "amax_history", name, lambda: init_history(recipe.delayed),
                          "amax history", "history_init")
    if history is not None:
        return history
    if module.is_initializing() or _recording.get() is not None:  # shapes only
        return init_history(recipe.delayed)
    raise ValueError(f"{_where(module, name)} uses recipe {recipe.name} with delayed scaling: "
                     "pass its amax history in the 'amax_history' collection "
                     "(QuantizedLinen.history_init gives the first one)")


def _linen_channels(module: nn.Module, recipe: Recipe, lhs, dimension_numbers,
                    name: str = "gemm"):
    """OutControl's state of a GEMM whose recipe has ``outliers``: when the caller made the
    ``"channel_norms"`` collection mutable, this call's per-channel L2 norms of X are added to
    its variable ``name`` (zeros at first); the GEMM's ``"outlier_channels"`` variable, if
    given, is its split (``fp4lab.outcontrol``). ``None``: the recipe without the split."""
    if recipe.outliers is None:
        return None
    _check_reaches(module, "channel_norms", name, "channel norms")
    _check_reaches(module, "outlier_channels", name, "outlier channels")
    if (module.is_mutable_collection("channel_norms") and not module.is_initializing()
            and _recording.get() is None):
        norms = outcontrol.channel_norms(lhs, dimension_numbers)
        v = module.variable("channel_norms", name, jnp.zeros, norms.shape, jnp.float32)
        v.value = v.value + norms
    if module.has_variable("outlier_channels", name):
        return module.get_variable("outlier_channels", name)
    return None


@contextlib.contextmanager
def _dot_general_hook(module: nn.Module, recipe: Recipe, backend: str = "auto"):
    """Route a Linen ``Dense``/``DenseGeneral``'s ``dot_general`` through ``qdot_general`` for
    the duration of one call (Linen modules are frozen dataclasses; the hook is restored)."""

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                    out_sharding=None):
        _note("/".join(module.scope.path), rhs)
        return qdot_general(lhs, rhs, dimension_numbers, recipe,
                            key=_linen_key(module, recipe), probe=_linen_probe(module),
                            amax_history=_linen_history(module, recipe),
                            channels=_linen_channels(module, recipe, lhs, dimension_numbers),
                            backend=backend,
                            preferred_element_type=preferred_element_type,
                            out_sharding=out_sharding)

    saved = module.dot_general, module.dot_general_cls
    object.__setattr__(module, "dot_general", dot_general)
    object.__setattr__(module, "dot_general_cls", None)
    try:
        yield
    finally:
        object.__setattr__(module, "dot_general", saved[0])
        object.__setattr__(module, "dot_general_cls", saved[1])


def _linen_einsum(module: nn.Einsum, recipe: Recipe, inputs, einsum_str=None,
                  backend: str = "auto"):
    """``nn.Einsum.__call__`` with the product through ``qeinsum`` (inputs = X, kernel = W)."""
    spec = nn.module.merge_param("einsum_str", module.einsum_str, einsum_str).replace(" ", "")
    kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
    bias = None
    if module.use_bias:
        bias_shape, broadcast_shape = linen_einsum_bias_shape(module, spec, inputs,
                                                             kernel)
        bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
    inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
    _note("/".join(module.scope.path), kernel)
    channels = None if recipe.outliers is None else _linen_channels(
        module, recipe, inputs, plan_einsum(spec, inputs.shape, kernel.shape).dimension_numbers)
    y = qeinsum(spec, inputs, kernel, recipe, key=_linen_key(module, recipe),
                probe=_linen_probe(module), amax_history=_linen_history(module, recipe),
                channels=channels, backend=backend,
                preferred_element_type=module.preferred_element_type)
    return y if bias is None else y + jnp.reshape(bias, broadcast_shape)


class QDense(nn.Dense):
    """``nn.Dense`` whose three GEMMs follow ``recipe`` (parameters ``kernel``, ``bias``)."""

    recipe: str | Recipe = "bf16"
    backend: str = "auto"  # fp4lab.backend: which implementation quantizes

    def __call__(self, inputs):
        with _dot_general_hook(self, get_recipe(self.recipe), self.backend):
            return super().__call__(inputs)


class QDenseGeneral(nn.DenseGeneral):
    """``nn.DenseGeneral`` (any contracting axes, batch dims) whose GEMMs follow ``recipe``."""

    recipe: str | Recipe = "bf16"
    backend: str = "auto"  # fp4lab.backend: which implementation quantizes

    def __call__(self, inputs):
        with _dot_general_hook(self, get_recipe(self.recipe), self.backend):
            return super().__call__(inputs)


class QEinsum(nn.Einsum):
    """``nn.Einsum`` whose GEMMs follow ``recipe``; the input plays X, the kernel W."""

    recipe: str | Recipe = "bf16"
    backend: str = "auto"

    @nn.compact
    def __call__(self, inputs, einsum_str: str | None = None):
        return _linen_einsum(self, get_recipe(self.recipe), inputs, einsum_str, self.backend)


# ----------------------------------------------------------------------------- op interception


class _OpNamer(CallCounter):
    """Names intercepted calls ``<module path>/einsum_<n>`` / ``.../dot_general_<n>``, n
    counting that module's calls of that kind in one apply (call order)."""

    def __call__(self, kind, args, kwargs):
        m = linen_calling_module()
        if m is None or type(m) in LAYER_TYPES or isinstance(m, (QDense, QDenseGeneral,
                                                                 QEinsum)):
            return None  # outside modules, or inside a layer its own hook quantizes
        path = "/".join(m.scope.path)
        name = super().__call__(m, path, kind)
        return m, name, f"{path}/{name}" if path else name


def _quantized_op(module, name, op_path, kind, recipe, backend, args, kwargs):
    """An intercepted call with its module's key, probe, amax history and OutControl."""
    channels = None if recipe.outliers is None else _linen_channels(
        module, recipe, *operand_x(op_path, kind, args, kwargs), name)
    return quantized_call(op_path, kind, recipe, args, kwargs,
                          key=_linen_key(module, recipe), probe=_linen_probe(module, name),
                          amax_history=_linen_history(module, recipe, name), channels=channels,
                          backend=backend)


def _hooked_call(module, recipe, backend, next_fun, args, kwargs):
    with _dot_general_hook(module, recipe, backend):
        return next_fun(*args, **kwargs)


def _einsum_call(module, recipe, backend, next_fun, args, kwargs):
    return _linen_einsum(module, recipe, *args, **kwargs, backend=backend)


# Linen layer type (exact: subclasses, fp4lab's Q-layers included, are left alone)
# -> (kind, how an intercepted call is quantized)
HANDLERS = {nn.Dense: ("dense", _hooked_call), nn.DenseGeneral: ("densegeneral", _hooked_call),
            nn.Einsum: ("einsum", _einsum_call)}
# every Linen layer type whose GEMMs a policy governs (fp4lab's own layers included) -> kind
LAYER_TYPES = {QDense: "dense", QDenseGeneral: "densegeneral", QEinsum: "einsum",
               **{cls: kind for cls, (kind, _) in HANDLERS.items()}}


@dataclasses.dataclass
class QuantizedLinen:
    """A Linen model whose ``Dense``/``DenseGeneral``/``Einsum`` calls follow a policy;
    ``init``/``apply`` as the model's. ``num_blocks`` feeds depth rules (default: inferred
    from the parameter paths).

    The first ``apply`` checks the policy against the layers it met: a required rule that
    matched none of them is a :class:`~fp4lab.policy.PolicyWarning` (an error with
    ``strict=True``, at every apply until fixed). Stochastic rounding draws its keys from the
    ``quant`` rng (``apply(..., rngs={"quant": key})``); an ``nn.scan`` over blocks must split
    it (``split_rngs={..., "quant": True}``), and one that does not is refused."""

    model: nn.Module
    policy: PrecisionPolicy
    num_blocks: int | None = None
    backend: str = "auto"  # fp4lab.backend: which implementation quantizes
    strict: bool = False
    _checked: bool = dataclasses.field(default=False, repr=False, compare=False)
    _records: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def init(self, *args, **kwargs):
        return self.model.init(*args, **kwargs)

    def apply(self, variables, *args, **kwargs):
        out, met = self._apply(variables, args, kwargs, self._num_blocks(variables, args,
                                                                          kwargs))
        if self.strict or not self._checked:
            self._checked = True
            check_unused(self.policy, [a for a in met.values() if a.recipe is not None],
                         strict=self.strict, stacklevel=2, none_found=NONE_FOUND)
        return out

    def _num_blocks(self, variables, args, kwargs) -> int | None:
        """The model's number of blocks for depth and outside-the-blocks rules: the wrapper's
        ``num_blocks``, else one more than the largest block index in the parameter paths,
        else (blocks stacked by ``nn.scan``, whose paths have no index) the largest stack
        :meth:`assignments` met."""
        found = self.num_blocks or self.policy.infer_num_blocks(
            p for p, _ in param_layers(variables))
        if found or not self.policy.uses_blocks:
            return found
        return self._record(variables, args, kwargs)[1]

    def _assign(self, module: nn.Module, path: str, kind: str, num_blocks: int | None,
                op: bool = False) -> Assignment | None:
        """The assignment of a GEMM met while ``module`` runs; blocks stacked by a Linen
        scan (or vmap) run one traced body, so they get one recipe, or are refused where the
        rules would give them different ones. ``None``: a call no op rule quantizes."""
        stack = _stack(module)
        if stack and self.policy.block_of(path) is None:
            return self.policy.assign_stacked(path, kind, num_blocks or math.prod(stack), stack)
        if op:
            return self.policy.assign_op(path, kind, num_blocks)
        return self.policy.assign(path, kind, num_blocks)

    def _apply(self, variables, args, kwargs, num_blocks: int | None
               ) -> tuple[object, dict[str, Assignment]]:
        """``model.apply`` with every governed call quantized, and what each GEMM it met got
        (in call order; an intercepted call no op rule quantizes: recipe ``None``)."""
        met: dict[str, Assignment] = {}

        def intercept(next_fun, args, kwargs, context):
            m = context.module
            kind, call = HANDLERS.get(type(m), (None, None))
            if context.method_name != "__call__" or kind is None or m.is_initializing():
                return next_fun(*args, **kwargs)
            path = "/".join(m.scope.path)
            met[path] = a = self._assign(m, path, kind, num_blocks)
            return call(m, a.recipe, self.backend, next_fun, args, kwargs)

        namer = _OpNamer()

        def op(kind, original, args, kwargs):
            found = namer(kind, args, kwargs)
            if found is None or found[0].is_initializing():
                return original(*args, **kwargs)
            module, name, op_path = found
            a = self._assign(module, op_path, kind, num_blocks, op=True)
            met[op_path] = a or Assignment(op_path, kind, self.policy.block_of(op_path),
                                           None, None, _stack(module))
            _note(op_path, operand_w(kind, args))
            if a is None or runs_as_written(a.recipe, kind, args):
                return original(*args, **kwargs)
            return _quantized_op(module, name, op_path, kind, a.recipe, self.backend, args,
                                 kwargs)

        mutable = kwargs.get("mutable", False)
        passed = set(variables) | (set(mutable) if isinstance(mutable, (list, tuple)) else
                                   {mutable} if isinstance(mutable, str) else set())
        with contextlib.ExitStack() as stack:
            stack.enter_context(nn.intercept_methods(intercept))
            if self.policy.governs_ops:
                stack.enter_context(OpCalls.intercepted(op))
            token = _passed.set(frozenset(passed))
            stack.callback(_passed.reset, token)
            return self.model.apply(variables, *args, **kwargs), met

    def _trace(self, variables, args, kwargs, num_blocks, creating: str | None = None):
        """``_apply`` traced once, abstractly, recording: what each GEMM got and the dtype of
        its W, and (``creating``) the shapes of a per-GEMM state collection it creates."""
        seen: dict[str, str] = {}
        met: dict[str, Assignment] = {}
        if creating is not None:
            mutable = kwargs.get("mutable", False)
            mutable = [] if mutable is False else [mutable] if isinstance(mutable, str) else (
                mutable)
            kwargs = {**kwargs, "mutable": mutable if mutable is True else [*mutable,
                                                                              creating]}

        def run(variables, *args, **kwargs):
            out, found = self._apply(variables, args, kwargs, num_blocks)
            met.update(found)
            return out[1].get(creating, {}) if creating is not None else out

        tokens = _recording.set(seen), _creating.set(creating)
        try:
            state = trace_abstractly(run, (variables, *args), kwargs)
        finally:
            _creating.reset(tokens[1])
            _recording.reset(tokens[0])
        return [dataclasses.replace(a, compute_dtype=seen.get(p)) for p, a in met.items()], state

    def _record(self, variables, args, kwargs) -> tuple[ExplainTable, int | None]:
        """The :meth:`assignments` of these inputs and the number of blocks they were made
        with, traced once per shape of the inputs."""
        leaves, treedef = jax.tree.flatten((variables, args, kwargs))
        key = (treedef, tuple((v.shape, str(v.dtype)) if hasattr(v, "shape") else repr(v)
                              for v in leaves))
        if key not in self._records:
            num_blocks = self.num_blocks or self.policy.infer_num_blocks(
                p for p, _ in param_layers(variables))
            rows, _ = self._trace(variables, args, kwargs, num_blocks)
            stacked = max((math.prod(a.stack) for a in rows if a.stack), default=None)
            if num_blocks is None and stacked is not None and self.policy.uses_blocks:
                num_blocks = stacked  # the blocks are stacked: assign again, knowing them
                rows, _ = self._trace(variables, args, kwargs, num_blocks)
            used = {a.rule for a in rows if a.recipe is not None}
            self._records[key] = (ExplainTable(rows, self.policy, [
                i for i in range(len(self.policy.rules)) if i not in used]), num_blocks)
        return self._records[key]

    def assignments(self, variables, *args, **kwargs) -> ExplainTable:
        """What each GEMM of ``apply(variables, *args, **kwargs)`` gets, in call order, as
        ``apply`` assigns it (path, kind, block, or the blocks stacked by a Linen scan,
        recipe, rule, and the dtype its W operand has there): ``apply`` traced once,
        abstractly, per shape of its inputs. Print it for a table. Probes, amax histories,
        ``explain`` and export read this record."""
        return self._record(variables, args, kwargs)[0]

    def layers(self, variables, *args, **kwargs) -> list[tuple[str, str]]:
        """``(path, kind)`` of every layer the policy governs, and every intercepted call
        (with op rules), in call order (:meth:`assignments`)."""
        return [(a.path, a.kind) for a in self.assignments(variables, *args, **kwargs)]

    def _state_zeros(self, collection: str, variables, args, kwargs) -> dict:
        """The per-GEMM ``collection`` (all zeros) that ``apply(variables, *args,
        **kwargs)`` reads: every GEMM creates its variable in an abstract trace, and Flax
        nests and stacks them as it does the parameters (a Linen scan must map the
        collection as it maps ``"params"``; it is refused otherwise)."""
        _, num_blocks = self._record(variables, args, kwargs)
        _, shapes = self._trace(variables, args, kwargs, num_blocks, creating=collection)
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def probe_zeros(self, variables, *args, **kwargs) -> dict:
        """A ``"probes"`` collection for :meth:`apply`: a :func:`~fp4lab.probes.probe_zeros`
        per quantized GEMM, nested like the parameters (``<path>/gemm`` for a layer,
        ``<module path>/einsum_0`` for a call) and stacked as they are: under a Linen
        ``nn.scan`` add ``"probes": 0`` to its ``variable_axes`` (as for ``"params"``) and
        each block gets its own. Pass ``{**variables, "probes": probes}`` and differentiate
        the loss with respect to ``probes``: its gradient holds every layer's GEMM-operand
        numerics (rows: ``fp4lab.recipe.OPERANDS``; columns: ``fp4lab.metrics.METRIC_NAMES``;
        a stacked GEMM's blocks along the scan's axis)."""
        return self._state_zeros("probes", variables, args, kwargs)

    def history_init(self, variables, *args, **kwargs) -> dict:
        """The first ``"amax_history"`` collection for :meth:`apply`: for every GEMM whose
        recipe uses delayed scaling (``fp8_delayed``), its ``fp4lab.delayed.init_history``
        (zeros), nested and stacked like the parameters (under ``nn.scan``, add
        ``"amax_history": 0`` to its ``variable_axes``). Pass ``{**variables,
        "amax_history": h}``, differentiate the loss with respect to ``h`` too, and
        ``fp4lab.delayed.update(h, grad)`` gives the next step's."""
        return self._state_zeros("amax_history", variables, args, kwargs)

    def explain(self, variables, *args, strict: bool | None = None, **kwargs) -> ExplainTable:
        """:meth:`assignments`; with ``strict`` (default: the wrapper's) a required rule that
        matched nothing is an error."""
        table = self.assignments(variables, *args, **kwargs)
        if self.strict if strict is None else strict:
            check_unused(self.policy, [a for a in table if a.recipe is not None], strict=True)
        return table


def param_layers(variables) -> list[tuple[str, None]]:
    """``(path, None)`` for every sub-dict of Linen variables holding a ``kernel`` of rank >= 2
    (the module types are not in the params: :meth:`QuantizedLinen.layers` finds them)."""
    params = variables.get("params", variables)
    out = []

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                if "kernel" in v and getattr(v["kernel"], "ndim", 0) >= 2:
                    out.append(("/".join(prefix + [k]), None))
                walk(v, prefix + [k])

    walk(params, [])
    return out
