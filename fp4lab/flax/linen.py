"""Linen layers whose GEMMs follow a recipe, and the interceptor behind ``quantize_model``.

:class:`QDense`, :class:`QDenseGeneral` and :class:`QEinsum` subclass the Flax layers and keep
their parameters. :class:`QuantizedLinen` wraps an unmodified model: its ``apply`` intercepts
every ``nn.Dense`` and ``nn.DenseGeneral`` (through their ``dot_general`` hook) and ``nn.Einsum``
(computed with :func:`~fp4lab.gemm.qdot.qeinsum`, which keeps the input as X and the kernel as W;
``jnp.einsum`` may swap its operands, which would swap the recipe's roles).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from fp4lab.gemm.einsum import plan_einsum
from fp4lab.flax.internals import linen_calling_module, linen_einsum_bias_shape
from fp4lab.flax.linen_state import (CREATING, PASSED, RECORDING, gemm_state, note_weight,
                                     stack_of)
from fp4lab.flax.ops import (NONE_FOUND, CallCounter, OpCalls, check_expert_recipe, expert_count,
                             operand_x, operands, quantized_call, runs_as_written,
                             trace_abstractly)
from fp4lab.policy import (OP_KINDS, Assignment, ExplainTable, PrecisionPolicy, check_unused,
                           param_layers)
from fp4lab.gemm.qdot import qdot_general, qeinsum
from fp4lab.gemm.recipe import Recipe, get_recipe

__all__ = ["QDense", "QDenseGeneral", "QEinsum", "QuantizedLinen", "LAYER_TYPES"]


@contextlib.contextmanager
def _dot_general_hook(module: nn.Module, recipe: Recipe, backend: str = "auto"):
    """Route a Linen ``Dense``/``DenseGeneral``'s ``dot_general`` through ``qdot_general`` for
    the duration of one call (Linen modules are frozen dataclasses; the hook is restored)."""

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                    out_sharding=None):
        note_weight("/".join(module.scope.path), rhs)
        state = gemm_state(module, recipe, operand_x=lambda: (lhs, dimension_numbers))
        return qdot_general(lhs, rhs, dimension_numbers, recipe, state, backend=backend,
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
    note_weight("/".join(module.scope.path), kernel)
    state = gemm_state(module, recipe, operand_x=lambda: (
        inputs, plan_einsum(spec, inputs.shape, kernel.shape).dimension_numbers))
    y = qeinsum(spec, inputs, kernel, recipe, state, backend=backend,
                preferred_element_type=module.preferred_element_type)
    return y if bias is None else y + jnp.reshape(bias, broadcast_shape)


class QDense(nn.Dense):
    """``nn.Dense`` whose three GEMMs follow ``recipe`` (parameters ``kernel``, ``bias``)."""

    recipe: str | Recipe = "bf16"
    backend: str = "auto"  # fp4lab.numerics.backend: which implementation quantizes

    def __call__(self, inputs):
        with _dot_general_hook(self, get_recipe(self.recipe), self.backend):
            return super().__call__(inputs)


class QDenseGeneral(nn.DenseGeneral):
    """``nn.DenseGeneral`` (any contracting axes, batch dims) whose GEMMs follow ``recipe``."""

    recipe: str | Recipe = "bf16"
    backend: str = "auto"  # fp4lab.numerics.backend: which implementation quantizes

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
    check_expert_recipe(op_path, kind, recipe)
    state = gemm_state(module, recipe, name, lambda: operand_x(op_path, kind, args, kwargs),
                       expert_count(kind, args, kwargs))
    return quantized_call(op_path, kind, recipe, args, kwargs, state, backend=backend)


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
    backend: str = "auto"  # fp4lab.numerics.backend: which implementation quantizes
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
            met[path] = a = self.policy.assign(path, kind, num_blocks, stack=stack_of(m))
            if a.recipe is None:  # a router no rule names
                return next_fun(*args, **kwargs)
            return call(m, a.recipe, self.backend, next_fun, args, kwargs)

        namer = _OpNamer()
        governs_ops = self.policy.governs_ops

        def op(kind, original, args, kwargs):
            if kind in OP_KINDS and not governs_ops:
                return original(*args, **kwargs)  # only rules of an op's kind govern it
            found = namer(kind, args, kwargs)
            if found is None or found[0].is_initializing():
                return original(*args, **kwargs)
            module, name, op_path = found
            met[op_path] = a = self.policy.assign(op_path, kind, num_blocks,
                                                  stack=stack_of(module))
            note_weight(op_path, operands(kind, args, kwargs)[1])
            if a.recipe is None or runs_as_written(a.recipe, kind, args, kwargs):
                return original(*args, **kwargs)
            return _quantized_op(module, name, op_path, kind, a.recipe, self.backend, args,
                                 kwargs)

        mutable = kwargs.get("mutable", False)
        passed = set(variables) | (set(mutable) if isinstance(mutable, (list, tuple)) else
                                   {mutable} if isinstance(mutable, str) else set())
        with contextlib.ExitStack() as stack:
            stack.enter_context(nn.intercept_methods(intercept))
            stack.enter_context(OpCalls.intercepted(op))  # ragged_dot: always governed
            token = PASSED.set(frozenset(passed))
            stack.callback(PASSED.reset, token)
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

        tokens = RECORDING.set(seen), CREATING.set(creating)
        try:
            state = trace_abstractly(run, (variables, *args), kwargs)
        finally:
            CREATING.reset(tokens[1])
            RECORDING.reset(tokens[0])
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
        """A ``"probes"`` collection for :meth:`apply`: a
        :func:`~fp4lab.features.probes.probe_zeros` per quantized GEMM, nested like the parameters
        (``<path>/gemm`` for a layer, ``<module path>/einsum_0`` for a call) and stacked as they
        are: under a Linen ``nn.scan`` add ``"probes": 0`` to its ``variable_axes`` (as for
        ``"params"``) and each block gets its own. Pass ``{**variables, "probes": probes}`` and
        differentiate the loss with respect to ``probes``: its gradient holds every layer's
        GEMM-operand numerics (rows: ``fp4lab.gemm.recipe.OPERANDS``; columns:
        ``fp4lab.numerics.metrics.METRIC_NAMES``; a stacked GEMM's blocks along the scan's axis)."""
        return self._state_zeros("probes", variables, args, kwargs)

    def history_init(self, variables, *args, **kwargs) -> dict:
        """The first ``"amax_history"`` collection for :meth:`apply`: for every GEMM whose
        recipe uses delayed scaling (``fp8_delayed``), its ``fp4lab.features.delayed.init_history``
        (zeros), nested and stacked like the parameters (under ``nn.scan``, add
        ``"amax_history": 0`` to its ``variable_axes``). Pass ``{**variables,
        "amax_history": h}``, differentiate the loss with respect to ``h`` too, and
        ``fp4lab.features.delayed.update(h, grad)`` gives the next step's."""
        if not any(a.recipe is not None and a.recipe.delayed is not None
                   for a in self.assignments(variables, *args, **kwargs)):
            return {}  # (the record is cached: no second trace of the model)
        return self._state_zeros("amax_history", variables, args, kwargs)

    def explain(self, variables, *args, strict: bool | None = None, **kwargs) -> ExplainTable:
        """:meth:`assignments`; with ``strict`` (default: the wrapper's) a required rule that
        matched nothing is an error."""
        table = self.assignments(variables, *args, **kwargs)
        if self.strict if strict is None else strict:
            check_unused(self.policy, [a for a in table if a.recipe is not None], strict=True)
        return table
