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

import jax
import jax.numpy as jnp
from flax import linen as nn

from fp4lab import outcontrol
from fp4lab.delayed import init_history
from fp4lab.einsum import plan_einsum
from fp4lab.flax.internals import (linen_calling_module, linen_child, linen_einsum_bias_shape,
                                   linen_lifted_rng_split, linen_module_stack)
from fp4lab.flax.ops import (NONE_FOUND, CallCounter, OpCalls, operand_w, operand_x,
                             quantized_call, runs_as_written, trace_abstractly)
from fp4lab.policy import OP_KINDS, Assignment, ExplainTable, PrecisionPolicy, check_unused
from fp4lab.probes import probe_zeros
from fp4lab.qdot import qdot_general, qeinsum
from fp4lab.recipe import Recipe, get_recipe

__all__ = ["QDense", "QDenseGeneral", "QEinsum", "QuantizedLinen", "param_layers",
           "LAYER_TYPES"]


def _quant_broadcast_by(module: nn.Module) -> str | None:
    """``"nn.scan"`` or ``"nn.vmap"`` if ``module`` is a Linen scan or vmap of a module class
    whose ``split_rngs`` broadcasts the "quant" rng."""
    lifted = linen_lifted_rng_split(module, "quant")
    return f"nn.{lifted[0]}" if lifted is not None and lifted[1] is False else None


def _broadcast_around(module: nn.Module) -> str | None:
    """The Linen scan or vmap around the running ``module`` that broadcasts the "quant" rng
    (``"nn.scan at blocks"``), if any. Flax runs a lifted module's body without putting the
    lifted module on the module stack: it is the child, on the way to ``module``, of a module
    on the stack."""
    path = module.scope.path
    for m in linen_module_stack():
        outer = m.scope.path
        if len(outer) < len(path) and path[:len(outer)] == outer:
            child = linen_child(m, path[len(outer)])
            lifted = isinstance(child, nn.Module) and _quant_broadcast_by(child)
            if lifted:
                return f"{lifted} at {'/'.join(path[:len(outer) + 1])}"
    return None


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
        lifted = _broadcast_around(module)
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


def _linen_probe(module: nn.Module, name: str = "gemm"):
    """The GEMM's probe (see :meth:`QuantizedLinen.probe_zeros`), if the caller passed one:
    variable ``name`` of ``module`` (``"gemm"`` for a layer, ``"einsum_0"``... for a call)."""
    if module.has_variable("probes", name):
        return module.get_variable("probes", name)
    return None


def _linen_history(module: nn.Module, recipe: Recipe, name: str = "gemm"):
    """The GEMM's amax history (the ``"amax_history"`` collection; see
    :meth:`QuantizedLinen.history_init`) when its recipe uses delayed scaling."""
    if recipe.delayed is None:
        return None
    if module.has_variable("amax_history", name):
        return module.get_variable("amax_history", name)
    if module.is_initializing() or _recording.get() is not None:  # shapes only
        return init_history(recipe.delayed)
    where = "/".join(module.scope.path) + ("" if name == "gemm" else f"/{name}")
    raise ValueError(f"{where} uses recipe {recipe.name} with delayed scaling: pass its amax "
                     "history in the 'amax_history' collection (QuantizedLinen.history_init "
                     "gives the first one)")


def _linen_channels(module: nn.Module, recipe: Recipe, lhs, dimension_numbers,
                    name: str = "gemm"):
    """OutControl's state of a GEMM whose recipe has ``outliers``: when the caller made the
    ``"channel_norms"`` collection mutable, this call's per-channel L2 norms of X are added to
    its variable ``name`` (zeros at first); the GEMM's ``"outlier_channels"`` variable, if
    given, is its split (``fp4lab.outcontrol``). ``None``: the recipe without the split."""
    if recipe.outliers is None:
        return None
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
        name = super().__call__(path, kind)
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

    def _num_blocks(self, variables):
        return self.num_blocks or self.policy.infer_num_blocks(
            p for p, _ in param_layers(variables))

    def apply(self, variables, *args, **kwargs):
        out, met = self._apply(variables, args, kwargs)
        if self.strict or not self._checked:
            self._checked = True
            check_unused(self.policy, [a for a in met.values() if a.recipe is not None],
                         strict=self.strict, stacklevel=2, none_found=NONE_FOUND)
        return out

    def _apply(self, variables, args, kwargs) -> tuple[object, dict[str, Assignment]]:
        """``model.apply`` with every governed call quantized, and what each GEMM it met got
        (in call order; an intercepted call no op rule quantizes: recipe ``None``)."""
        num_blocks = self._num_blocks(variables)
        met: dict[str, Assignment] = {}

        def intercept(next_fun, args, kwargs, context):
            m = context.module
            kind, call = HANDLERS.get(type(m), (None, None))
            if context.method_name != "__call__" or kind is None or m.is_initializing():
                return next_fun(*args, **kwargs)
            path = "/".join(m.scope.path)
            met[path] = a = self.policy.assign(path, kind, num_blocks)
            return call(m, a.recipe, self.backend, next_fun, args, kwargs)

        namer = _OpNamer()

        def op(kind, original, args, kwargs):
            found = namer(kind, args, kwargs)
            if found is None or found[0].is_initializing():
                return original(*args, **kwargs)
            module, name, op_path = found
            a = self.policy.assign_op(op_path, kind, num_blocks)
            met[op_path] = a or Assignment(op_path, kind, self.policy.block_of(op_path),
                                           None, None)
            _note(op_path, operand_w(kind, args))
            if a is None or runs_as_written(a.recipe, kind, args):
                return original(*args, **kwargs)
            return _quantized_op(module, name, op_path, kind, a.recipe, self.backend, args,
                                 kwargs)

        with contextlib.ExitStack() as stack:
            stack.enter_context(nn.intercept_methods(intercept))
            if self.policy.governs_ops:
                stack.enter_context(OpCalls.intercepted(op))
            return self.model.apply(variables, *args, **kwargs), met

    def assignments(self, variables, *args, **kwargs) -> ExplainTable:
        """What each GEMM of ``apply(variables, *args, **kwargs)`` gets, in call order, as
        ``apply`` assigns it (path, kind, block, recipe, rule, and the dtype its W operand
        has there): ``apply`` traced once, abstractly, per shape of its inputs. Print it for
        a table. Probes, amax histories, ``explain`` and export read this record."""
        leaves, treedef = jax.tree.flatten((variables, args, kwargs))
        key = (treedef, tuple((v.shape, str(v.dtype)) if hasattr(v, "shape") else repr(v)
                              for v in leaves))
        if key not in self._records:
            seen: dict[str, str] = {}
            met: dict[str, Assignment] = {}

            def run(variables, *args, **kwargs):
                out, found = self._apply(variables, args, kwargs)
                met.update(found)
                return out

            token = _recording.set(seen)
            try:
                trace_abstractly(run, (variables, *args), kwargs)
            finally:
                _recording.reset(token)
            rows = [dataclasses.replace(a, compute_dtype=seen.get(p)) for p, a in met.items()]
            used = {a.rule for a in rows if a.recipe is not None}
            self._records[key] = ExplainTable(
                rows, self.policy, [i for i in range(len(self.policy.rules)) if i not in used])
        return self._records[key]

    def layers(self, variables, *args, **kwargs) -> list[tuple[str, str]]:
        """``(path, kind)`` of every layer the policy governs, and every intercepted call
        (with op rules), in call order (:meth:`assignments`)."""
        return [(a.path, a.kind) for a in self.assignments(variables, *args, **kwargs)]

    def probe_zeros(self, variables, *args, **kwargs) -> dict:
        """A ``"probes"`` collection for :meth:`apply`: a :func:`~fp4lab.probes.probe_zeros`
        per quantized GEMM. Pass ``{**variables, "probes": probes}`` and differentiate the loss
        with respect to ``probes``: its gradient holds every layer's GEMM-operand numerics
        (rows: ``fp4lab.recipe.OPERANDS``; columns: ``fp4lab.metrics.METRIC_NAMES``)."""
        out: dict = {}
        for a in self.assignments(variables, *args, **kwargs):
            if a.recipe is not None:
                _put(out, a.path, a.kind, probe_zeros())
        return out

    def history_init(self, variables, *args, **kwargs) -> dict:
        """The first ``"amax_history"`` collection for :meth:`apply`: for every GEMM whose
        recipe uses delayed scaling (``fp8_delayed``), its ``fp4lab.delayed.init_history``,
        nested like the parameters. Pass ``{**variables, "amax_history": h}``, differentiate
        the loss with respect to ``h`` too, and ``fp4lab.delayed.update(h, grad)`` gives the
        next step's."""
        out: dict = {}
        for a in self.assignments(variables, *args, **kwargs):
            if a.recipe is not None and a.recipe.delayed is not None:
                _put(out, a.path, a.kind, init_history(a.recipe.delayed))
        return out

    def explain(self, variables, *args, strict: bool | None = None, **kwargs) -> ExplainTable:
        """:meth:`assignments`; with ``strict`` (default: the wrapper's) a required rule that
        matched nothing is an error."""
        table = self.assignments(variables, *args, **kwargs)
        if self.strict if strict is None else strict:
            check_unused(self.policy, [a for a in table if a.recipe is not None], strict=True)
        return table


def _put(tree: dict, path: str, kind: str, value) -> None:
    """A layer's variable goes to ``<path>/gemm``; an intercepted op's to its module as the
    op's name (``<module path>/einsum_0``)."""
    parts = path.split("/")
    if kind not in OP_KINDS:
        parts.append("gemm")
    d = tree
    for part in parts[:-1]:
        d = d.setdefault(part, {})
    d[parts[-1]] = value


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
