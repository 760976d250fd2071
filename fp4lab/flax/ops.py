"""Intercepting the ``jnp.einsum`` / ``jax.lax.dot_general`` / ``jax.lax.ragged_dot`` calls made
inside modules, as qwix does: the machinery that Linen's
:class:`~fp4lab.flax.linen.QuantizedLinen` and NNX's :func:`~fp4lab.flax.quantize_model` share.

A call is named ``<module path>/einsum_<n>`` (``dot_general_<n>``, ``ragged_dot_<n>``,
``expert_einsum_<n>``): ``n`` counts the calls of that kind the module made so far in one
invocation of it (:class:`CallCounter`), so the names are places in the module's code, whichever
transform traces it and however often it is called. The first operand plays X and the second W
(an expert stack of a ``ragged_dot`` or :func:`expert_einsum`, quantized expert by expert by
:func:`fp4lab.qragged_dot` / :func:`fp4lab.qexpert_einsum`).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

from fp4lab.gemm.einsum import plan_einsum
from fp4lab.gemm.grouped import qexpert_einsum, qragged_dot
from fp4lab.gemm.qdot import qdot_general, qeinsum
from fp4lab.gemm.recipe import Recipe
from fp4lab.gemm.state import as_gemm_state
from fp4lab.policy.rules import EXPERT_KINDS

__all__ = ["OpCalls", "CallCounter", "quantized_call", "runs_as_written", "NONE_FOUND",
           "trace_abstractly", "operands", "expert_count", "check_expert_recipe",
           "experts_split_over", "device_key", "device_mean", "expert_einsum"]

# why a policy can find no GEMM in a model (the end of its PolicyWarning)
NONE_FOUND = (": it has no Dense/DenseGeneral/Einsum (Linen) or Linear/LinearGeneral/Einsum "
              "(NNX) layer and no jax.lax.ragged_dot call, and jnp.einsum / lax.dot_general "
              "calls are intercepted only by rules of those op kinds (x @ w, jnp.matmul and "
              "jnp.dot never are)")
# the intercepted functions: kind -> (module, attribute)
_TARGETS = {"lax.dot_general": (jax.lax, "dot_general"), "jnp.einsum": (jnp, "einsum"),
            "lax.ragged_dot": (jax.lax, "ragged_dot")}


def _is_array(v) -> bool:
    return isinstance(v, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def trace_abstractly(fn, args=(), kwargs=None, *, nodes=(), eval_shape=jax.eval_shape):
    """``eval_shape(fn, *nodes, *args, **kwargs)`` with only the array leaves of ``args`` and
    ``kwargs`` (``jax.ShapeDtypeStruct`` too) traced; other leaves (flags, strings,
    ``mutable=``) pass as they are. ``nodes`` go first, as ``eval_shape`` takes them (an NNX
    model with ``nnx.eval_shape``). ``fn`` runs once, abstractly: no computation."""
    leaves, treedef = jax.tree.flatten((tuple(args), kwargs or {}))
    arrays = [v for v in leaves if _is_array(v)]

    def run(*nodes_and_arrays):
        *nodes, arrays = nodes_and_arrays
        it = iter(arrays)
        a, k = jax.tree.unflatten(treedef, [next(it) if _is_array(v) else v for v in leaves])
        return fn(*nodes, *a, **k)

    return eval_shape(run, *nodes, arrays)


class OpCalls:
    """While active (in this thread), ``jax.lax.dot_general``, ``jnp.einsum`` and
    ``jax.lax.ragged_dot`` calls go to a handler: ``handler(kind, original, args, kwargs)``
    (and :func:`expert_einsum` calls, which ask for it through :meth:`call`).
    The names are patched only while some thread has a handler; calls from other threads, and
    the calls the handler itself makes (fp4lab's own GEMMs use ``lax.dot_general``), go to
    the originals. Only calls through these attributes are seen: ``x @ w`` and
    ``jnp.matmul`` are not."""

    _local = threading.local()
    _lock = threading.Lock()
    _active = 0
    _originals: dict = {}

    @classmethod
    def _wrapper(cls, kind):
        def call(*args, **kwargs):
            return cls.call(kind, cls._originals[kind], args, kwargs)

        return call

    @classmethod
    def call(cls, kind, original, args, kwargs):
        """``original(*args, **kwargs)``, a call of ``kind``, through this thread's handler
        when one is active (and not already handling a call)."""
        handler = getattr(cls._local, "handler", None)
        if handler is None or getattr(cls._local, "busy", False):
            return original(*args, **kwargs)
        cls._local.busy = True
        try:
            return handler(kind, original, args, kwargs)
        finally:
            cls._local.busy = False

    @classmethod
    @contextlib.contextmanager
    def intercepted(cls, handler):
        with cls._lock:
            if cls._active == 0:
                cls._originals = {k: getattr(*t) for k, t in _TARGETS.items()}
                for kind, (where, name) in _TARGETS.items():
                    setattr(where, name, cls._wrapper(kind))
            cls._active += 1
        previous = getattr(cls._local, "handler", None)
        cls._local.handler = handler
        try:
            yield
        finally:
            cls._local.handler = previous
            with cls._lock:
                cls._active -= 1
                if cls._active == 0:
                    for kind, (where, name) in _TARGETS.items():
                        setattr(where, name, cls._originals[kind])


def _einsum(spec, x, w, **kwargs):
    return jnp.einsum(spec, x, w, **kwargs)


def expert_einsum(spec: str, x, w, **kwargs):
    """``jnp.einsum(spec, x, w, **kwargs)`` over a stack of experts (``w``'s first letter is
    the expert axis, which the output keeps): what a model calls where it computes its
    experts as an einsum, so that fp4lab governs the call as an expert stack (kind
    ``fp4lab.expert_einsum``, named ``expert_einsum_<n>``) as it governs ``jax.lax.ragged_dot``:
    the policy's expert rules and default, quantized expert by expert
    (:func:`fp4lab.qexpert_einsum`). Outside a quantized model it is that einsum."""
    return OpCalls.call("fp4lab.expert_einsum", _einsum, (spec, x, w), kwargs)


class CallCounter:
    """Names a module's calls ``einsum_<n>`` / ``dot_general_<n>`` / ``ragged_dot_<n>``: ``n``
    counts the calls of that kind made so far in the same invocation of the module (the
    outermost of its methods that is running), in call order. A name is thus a place in the module's code, as a
    parameter's name is: a transform that traces the module's body again (Linen's ``nn.scan``
    traces it twice, once for the shapes of its outputs) and a second call of a shared module
    meet the same names, never ``einsum_2`` for the first einsum. One counter serves one
    model call."""

    def __init__(self):
        self.counts: dict[tuple[object, str, object], int] = {}

    def __call__(self, module, owner, kind: str) -> str:
        """The name of ``module``'s call of ``kind`` now running (``owner``: the module's
        path, which names it in the model)."""
        short = kind.split(".")[-1]
        key = (owner, short, _invocation(module))
        n = self.counts.get(key, 0)
        self.counts[key] = n + 1
        return f"{short}_{n}"


def _invocation(module):
    """The frame of the outermost method of ``module`` that is running (its ``self`` is
    ``module``): it identifies this invocation of the module while it runs (the counter keeps
    the frame alive, so no other frame takes its identity). ``None`` outside any."""
    found, frame = None, sys._getframe(2)
    while frame is not None:
        if frame.f_locals.get("self") is module:
            found = frame
        frame = frame.f_back
    return found


def runs_as_written(recipe: Recipe, kind: str, args, kwargs) -> bool:
    """True when ``recipe`` changes nothing of this call: every operand a plain cast to the
    dtype both operands already have (no rounding, transform, stored copy or history). The
    call then runs as the model wrote it, gradients included: an ``all:bf16`` policy on a
    model computing in BF16 is that model, bit for bit (MaxText's unquantized losses)."""
    if not recipe.is_identity or recipe.needs_key or recipe.delayed is not None:
        return False
    dtypes = {jnp.dtype(o.format.element.storage) for o in recipe.operands.values()}
    return len(dtypes) == 1 and all(jnp.result_type(a) in dtypes
                                    for a in operands(kind, args, kwargs))


def _einsum_operands(op_path: str, args) -> tuple:
    """``(spec, a, b)`` of an intercepted ``jnp.einsum``, or an error naming the op."""
    spec, *operands = args
    if len(operands) != 2 or not isinstance(spec, str) or "->" not in spec:
        raise ValueError(f"op {op_path}: a policy rule quantizes it, but "
                         f"jnp.einsum({spec!r}, ...) with {len(operands)} operands is not a "
                         "two-operand einsum with an explicit '->' output")
    return spec, *operands


def _dot_operands(args, kwargs) -> tuple:
    """``(lhs, rhs, dimension_numbers)`` of an intercepted ``lax.dot_general``, passed by
    position or by keyword."""
    bound = dict(zip(("lhs", "rhs", "dimension_numbers"), args, strict=False)) | kwargs
    return bound["lhs"], bound["rhs"], bound["dimension_numbers"]


def operands(kind: str, args, kwargs) -> tuple:
    """``(X, W)``: the operands of an intercepted call, the first playing X and the second W
    (passed by position or, ``lax.dot_general`` and ``lax.ragged_dot``, by keyword)."""
    if kind in ("jnp.einsum", "fp4lab.expert_einsum"):
        return tuple(args[1:3])
    if kind == "lax.ragged_dot":
        return _ragged_operands(kind, args, kwargs)[:2]
    return _dot_operands(args, kwargs)[:2]


def operand_x(op_path: str, kind: str, args, kwargs) -> tuple:
    """``(X, dimension_numbers)`` of an intercepted two-operand call, as ``qdot_general``
    sees them (what OutControl measures)."""
    if kind == "jnp.einsum":
        spec, a, b = _einsum_operands(op_path, args)
        return a, plan_einsum(spec, jnp.shape(a), jnp.shape(b)).dimension_numbers
    lhs, _, dims = _dot_operands(args, kwargs)
    return lhs, dims


def _ragged_operands(op_path: str, args, kwargs) -> tuple:
    """``(lhs, rhs, group_sizes, preferred_element_type)`` of an intercepted
    ``lax.ragged_dot``, or an error naming the op (``group_offset``: sharded groups, which
    ``qragged_dot`` does not take)."""
    names = ("lhs", "rhs", "group_sizes", "precision", "preferred_element_type",
             "group_offset")
    bound = dict(zip(names, args, strict=False)) | kwargs
    if bound.get("group_offset") is not None:
        raise ValueError(f"op {op_path}: a policy quantizes this jax.lax.ragged_dot, but it "
                         "passes group_offset (groups sharded away), which "
                         "fp4lab.qragged_dot does not take")
    return bound["lhs"], bound["rhs"], bound["group_sizes"], bound.get(
        "preferred_element_type")


def expert_count(kind: str, args, kwargs) -> int | None:
    """The number of experts (``rhs``'s leading axis) of an intercepted ``ragged_dot``; None
    for every other kind of call. An expert stack's probe is stacked per expert."""
    if kind not in EXPERT_KINDS:
        return None
    return int(jnp.shape(operands(kind, args, kwargs)[1])[0])


def check_expert_recipe(op_path: str, kind: str, recipe: Recipe) -> None:
    """Refuse, by name, what an intercepted ``ragged_dot`` cannot take yet: per-expert state
    that a model's collections would have to hold stacked (delayed scaling's amax histories,
    OutControl's channels)."""
    if kind not in EXPERT_KINDS:
        return
    for feature, on in (("delayed scaling's amax history", recipe.delayed is not None),
                        ("OutControl's channel split", recipe.outliers is not None)):
        if on:
            raise ValueError(f"op {op_path}: recipe {recipe.name} uses {feature}, which "
                             "fp4lab does not yet keep per expert for an intercepted "
                             f"{kind} (fp4lab.qragged_dot and qexpert_einsum take it "
                             "stacked); use a rule with another recipe for this expert stack")


_EXPERT_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "fp4lab_expert_axis", default=None)


@contextlib.contextmanager
def experts_split_over(axis: str):
    """Inside ``jax.shard_map``, while tracing: every intercepted ``jax.lax.ragged_dot``'s
    expert stack (``rhs``) is this device's share of the whole stack, split over mesh axis
    ``axis`` in order (device ``p`` holds experts ``p * G`` to ``(p + 1) * G - 1``). Its
    experts then draw the stochastic-rounding bits they draw on one device
    (:func:`fp4lab.qragged_dot`'s ``first_expert``), so expert parallelism changes no bit of
    an expert's GEMMs. Probes of such a stack are refused: a probe is stacked over the whole
    stack, outside the ``shard_map``."""
    token = _EXPERT_AXIS.set(axis)
    try:
        yield
    finally:
        _EXPERT_AXIS.reset(token)


def device_key(key):
    """``key`` folded with this device's index along every manual mesh axis of the
    ``jax.shard_map`` being traced, except the axis the experts are split over
    (:func:`experts_split_over`, whose experts already draw their own bits): devices holding
    different tokens then round them with independent bits, as one device would draw for the
    whole batch. Outside ``shard_map`` (and on axes of one device), ``key`` itself."""
    split, mesh = _EXPERT_AXIS.get(), jax.sharding.get_abstract_mesh()
    for axis in mesh.manual_axes:
        if axis != split and mesh.shape[axis] > 1:
            key = jax.random.fold_in(key, jax.lax.axis_index(axis))
    return key


def device_mean(probe):
    """A probe read inside the ``jax.shard_map`` being traced: scaled by one over its number
    of devices. A value the ``shard_map`` closes over gets the sum of the devices'
    gradients, so the probe's gradient (each device's metrics of its own share) becomes
    their mean, not their sum. Outside ``shard_map``, ``probe`` itself."""
    mesh = jax.sharding.get_abstract_mesh()
    n = int(np.prod([mesh.shape[a] for a in mesh.manual_axes]))
    return probe if n == 1 else probe * jnp.asarray(1 / n, probe.dtype)


def _first_expert(op_path: str, recipe: Recipe, rhs, state):
    """The index in the whole stack of the first expert of ``rhs``: 0, or this device's
    first under :func:`experts_split_over` (whose refusals are here)."""
    axis, first = _EXPERT_AXIS.get(), 0
    if axis is not None:
        if as_gemm_state(state).probe is not None:
            raise ValueError(f"op {op_path}: its expert stack is split over mesh axis "
                             f"{axis!r} (expert parallelism), where fp4lab collects no "
                             "probes; apply without the 'probes' collection")
        if recipe.expert_scale == "shared":
            raise ValueError(f"op {op_path}: recipe {recipe.name} shares one scale over the "
                             f"expert stack, which is split over mesh axis {axis!r} "
                             "(expert parallelism): each device would share its own")
        first = jax.lax.axis_index(axis) * jnp.shape(rhs)[0]
    return first


def _ragged_call(op_path: str, recipe: Recipe, args, kwargs, state, backend: str):
    lhs, rhs, sizes, out = _ragged_operands(op_path, args, kwargs)
    return qragged_dot(lhs, rhs, sizes, recipe, state,
                       first_expert=_first_expert(op_path, recipe, rhs, state),
                       backend=backend, preferred_element_type=out)


def _expert_einsum_call(op_path: str, recipe: Recipe, args, kwargs, state, backend: str):
    spec, x, w = _einsum_operands(op_path, args)
    return qexpert_einsum(spec, x, w, recipe, state,
                          first_expert=_first_expert(op_path, recipe, w, state),
                          backend=backend,
                          preferred_element_type=kwargs.get("preferred_element_type"))


def quantized_call(op_path: str, kind: str, recipe: Recipe, args, kwargs, state=None, *,
                   backend: str = "auto"):
    """An intercepted call through ``qeinsum`` / ``qdot_general`` / ``qragged_dot`` (first
    operand X, second W) with the GEMM's ``state`` (a
    :class:`~fp4lab.gemm.state.GemmState`); ``op_path`` names it in errors."""
    if kind == "lax.ragged_dot":
        return _ragged_call(op_path, recipe, args, kwargs, state, backend)
    if kind == "fp4lab.expert_einsum":
        return _expert_einsum_call(op_path, recipe, args, kwargs, state, backend)
    kw = {k: v for k, v in kwargs.items() if k in ("preferred_element_type", "out_sharding")}
    if kind == "jnp.einsum":
        return qeinsum(*_einsum_operands(op_path, args), recipe, state, backend=backend, **kw)
    return qdot_general(*_dot_operands(args, kwargs), recipe, state, backend=backend, **kw)
