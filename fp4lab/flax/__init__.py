"""Flax integration: quantized layers and ``quantize_model`` for models written without fp4lab.

Layers (each takes a ``recipe``; parameters and their names are those of the Flax layer):

* Linen (:mod:`fp4lab.flax.linen`): ``QDense``, ``QDenseGeneral``, ``QEinsum``.
* NNX (:mod:`fp4lab.flax.nnx`): ``QLinear``, ``QLinearGeneral``, ``QEinsum``, and the hooks
  ``QuantDot`` / ``QuantEinsum`` that any NNX layer with a ``dot_general`` / ``einsum_op``
  attribute accepts.

:func:`quantize_model` applies a :class:`~fp4lab.policy.PrecisionPolicy` to an unmodified
model, leaving its parameters (objects, names, values) untouched, so checkpoints load as before:

* NNX: every ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` gets its ``dot_general``
  (``einsum_op``) hook replaced in place by a ``QuantDot`` (``QuantEinsum``) carrying the
  layer's recipe and its own SR rng stream.
* Linen: returns a :class:`~fp4lab.flax.linen.QuantizedLinen` whose ``apply`` intercepts every
  ``nn.Dense``, ``nn.DenseGeneral`` and ``nn.Einsum`` call.

Rules of an op kind (``jnp.einsum``, ``lax.dot_general``) quantize the calls made inside
modules (attention's products, custom code; :mod:`fp4lab.flax.ops`): Linen finds them at every
``apply``, NNX from example inputs given to ``quantize_model``. Another library's NNX layer
that computes with one ``lax.dot_general`` (MaxText's ``DenseGeneral``) is governed as a layer
once its class is registered (:func:`fp4lab.flax.nnx.register_layer`). :func:`assignments`
reads back what each GEMM of a quantized NNX model got.

Layers that are already fp4lab layers keep their own recipe. Layer kinds for policy rules are
the Flax class names in lower case: ``dense``, ``densegeneral``, ``einsum`` (Linen);
``linear``, ``lineargeneral``, ``einsum`` (NNX).

Randomness for stochastic rounding: Linen draws from the ``"quant"`` rng stream
(``rngs={"quant": key}`` in ``apply``; under ``nn.scan`` add ``split_rngs={"quant": True}``);
each NNX layer has its own stream, seeded from the ``rngs`` given to the layer (its ``quant``
stream if present) or from ``quantize_model``'s ``seed`` and the layer's path. Every layer and
every call gets its own key.

Depth rules need a block index in the path. Blocks stacked for a scan run one traced body:
Linen blocks under ``nn.scan``/``nn.vmap`` whose ``variable_axes`` map ``"params"``, and NNX
layers stacked for a scan (on any axis: ``param_scan_axis`` metadata, else the leading ones),
are the model's blocks; a depth rule that would split them is refused, and per-GEMM state
(probes, amax histories) is stacked with them.

Expert parallelism: a model that computes its experts inside ``jax.shard_map``, each device
on its share of the expert stack, wraps those ``jax.lax.ragged_dot`` calls in
:func:`experts_split_over` (the mesh axis), so that each expert's GEMMs are bit for bit the
ones it runs on one device (its stochastic-rounding bits included).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, NamedTuple

import jax

from flax import linen as nn
from flax import nnx as flax_nnx  # not `nnx`: fp4lab.flax.nnx is this package's submodule

from fp4lab.flax import nnx as _nnx
from fp4lab.flax.linen import QDense, QDenseGeneral, QuantizedLinen
from fp4lab.flax.ops import NONE_FOUND, check_expert_recipe, expert_einsum, experts_split_over
from fp4lab.flax.nnx import (OPS_ATTR, QLinear, QLinearGeneral, QuantDot, QuantEinsum, QuantOp,
                             probe_records)
from fp4lab.policy import (EXPERT_KINDS, OP_KINDS, ExplainTable, PrecisionPolicy, check_unused,
                           get_policy, param_layers)
from fp4lab.policy import explain as _explain

__all__ = ["QDense", "QDenseGeneral", "QuantizedLinen", "QLinear", "QLinearGeneral",
           "QuantDot", "QuantEinsum", "QuantOp", "quantize_model", "linear_layers", "op_calls",
           "explain", "assignments", "probe_records", "quantized_weights",
           "experts_split_over", "expert_einsum"]


def linear_layers(model) -> list[tuple[str, str | None]]:
    """``(path, kind)`` of every layer a policy governs: for an NNX module every
    Linear/LinearGeneral/Einsum (fp4lab's layers included) and every call that
    ``quantize_model`` quantized inside a module (kind ``jnp.einsum`` / ``lax.dot_general``);
    for Linen variables every sub-dict holding a ``kernel`` of rank >= 2, with kind ``None``."""
    if not isinstance(model, flax_nnx.Module):
        return param_layers(model)
    out = []
    for path, m in flax_nnx.iter_modules(model):
        name = "/".join(map(str, path))
        if type(m) in _nnx.LAYER_TYPES:
            out.append((name, _nnx.LAYER_TYPES[type(m)]))
        out += [(op.path, op.kind) for op in getattr(m, _nnx.OPS_ATTR, {}).values()]
    return out


def explain(policy: str | PrecisionPolicy, model, *, num_blocks: int | None = None,
            strict: bool = False, block: str | None = None):
    """:func:`fp4lab.policy.explain` over a model's layers (:func:`linear_layers`: an NNX
    module, or Linen variables), or over paths / ``(path, kind)`` pairs as given. For a
    Linen model's true kinds and its calls inside modules, use
    ``quantize_model(model, policy).explain(variables, x)``. An NNX model quantized under
    ``policy`` answers from its record (:func:`assignments`)."""
    policy = get_policy(policy)
    record = getattr(model, _RECORD, None)
    if record is not None and record.policy == policy and block is None and not strict and (
            num_blocks is None):
        return assignments(model)  # what quantize_model gave each GEMM, as it gave it
    layers = model if isinstance(model, (list, tuple)) else linear_layers(model)
    return _explain(policy, layers, num_blocks=num_blocks, strict=strict, block=block)


def op_calls(model, *inputs, call_kwargs: dict | None = None) -> list[tuple[str, str]]:
    """``(path, kind)`` of every ``jnp.einsum`` / ``lax.dot_general`` call that an NNX
    ``model(*inputs, **call_kwargs)`` makes inside its modules, found by an abstract trace;
    ``explain(policy, linear_layers(m) + op_calls(m, x))`` then lists the calls no rule
    quantizes too. (Linen: :meth:`QuantizedLinen.explain` lists them.)"""
    return [(f"{p}/{n}" if p else n, k)
            for p, n, k, *_ in _nnx.find_op_calls(model, inputs, call_kwargs)]


def quantize_model(model: Any, policy: str | PrecisionPolicy, *inputs,
                   num_blocks: int | None = None, seed: int = 0,
                   rngs: flax_nnx.Rngs | None = None, backend: str = "auto",
                   strict: bool = False, block: str | None = None,
                   call_kwargs: dict | None = None, probes: bool = False):
    """Apply ``policy`` to a model written without fp4lab (see module docstring).

    NNX: installs the quantized hook in every governed layer, in place, and returns the model;
    each layer gets its own SR stream, seeded from the layer's path and ``seed``, or, with
    ``rngs=``, from one draw of its ``quant`` stream (else its default stream): the model's
    ``nnx.Rngs`` then seed SR as they seed everything else. Either way the seeds are stable
    across processes and independent of the order layers are visited in.
    Linen: returns a :class:`QuantizedLinen` wrapper (use its ``init``/``apply``; SR keys come
    from ``apply``'s ``rngs={"quant": key}``).
    ``backend``: which implementation quantizes (:mod:`fp4lab.numerics.backend`).
    ``probes=True`` (NNX): every quantized GEMM gets a :class:`~fp4lab.flax.nnx.QuantProbe`
    whose gradient is its operands' numerics; :func:`probe_records` reads them.

    Calls inside modules (``jnp.einsum``, ``lax.dot_general``) are quantized by rules of an
    op kind. Linen finds them at every ``apply``. NNX needs example ``inputs`` (their values
    do not matter; ``jax.ShapeDtypeStruct`` will do) and ``call_kwargs``: ``model(*inputs,
    **call_kwargs)`` is traced once, abstractly, to find the calls (example inputs are traced
    whatever the policy, and inputs the model cannot take are refused); each quantized call gets
    a :class:`~fp4lab.flax.nnx.QuantOp` (its SR stream and amax history) in its module's
    ``fp4lab_ops``, and every method of the modules that can reach them intercepts them
    from then on (:func:`~fp4lab.flax.nnx.intercept_ops`). Quantizing a model again drops
    what an earlier policy installed.

    A required rule that matches no layer, or a policy that finds no GEMM at all, is a
    :class:`~fp4lab.policy.PolicyWarning` naming the rule (NNX: now; Linen: at the first
    ``apply``), an error with ``strict=True``.
    ``block``: the name of the block modules when the default pattern does not find them
    (``block="Stage"`` for ``Stage_0``, ``Stage_1``, ...; see
    :func:`~fp4lab.policy.block_pattern_for`)."""
    policy = get_policy(policy)
    if block is not None:
        policy = policy.with_block(block)
    if isinstance(model, nn.Module):
        if probes:
            raise ValueError("quantize_model(probes=True) is for NNX models; a Linen model "
                             "takes its probes at apply (QuantizedLinen.probe_zeros)")
        if inputs or call_kwargs:
            raise ValueError("quantize_model: a Linen model finds the calls inside its "
                             "modules at every apply; pass no example inputs")
        return QuantizedLinen(model, policy, num_blocks, backend, strict)
    if not isinstance(model, flax_nnx.Module):
        raise TypeError(f"quantize_model needs a Flax Linen or NNX module, got "
                        f"{type(model).__name__}")
    _nnx.release_ops(model)  # quantized before: its calls are found afresh under this policy
    gemms = _nnx_gemms(model, policy, inputs, call_kwargs)
    num_blocks = num_blocks or _num_blocks(policy, gemms)
    make = _GemmMaker(seed, None if rngs is None else (
        rngs.quant() if "quant" in rngs else rngs()), backend, probes)
    assignments = _install(policy, gemms, num_blocks, make)
    _nnx.intercept_ops(model, guard=not (inputs or call_kwargs))
    unused = check_unused(policy, assignments, strict=strict, stacklevel=2,
                          none_found=NONE_FOUND)
    setattr(model, _RECORD, _Record(policy, tuple(assignments), tuple(unused)))
    return model


@dataclasses.dataclass(frozen=True)
class _GemmMaker:
    """Builds the op of the GEMM at a path, with its own SR stream: seeded from the path and
    ``seed``, or folded from ``base`` (one draw of the model's rngs) with the path."""
    seed: int
    base: jax.Array | None
    backend: str
    probes: bool

    def __call__(self, make, path: str, *args, **kwargs):
        path_hash = zlib.crc32(f"{self.seed}/{path}".encode()) & 0x7FFFFFFF
        kw = dict(backend=self.backend, probe=self.probes, **kwargs)
        if self.base is None:
            return make(*args, seed=path_hash, **kw)
        return make(*args, rngs=flax_nnx.Rngs(quant=jax.random.fold_in(self.base, path_hash)),
                    **kw)


def _install(policy: PrecisionPolicy, gemms: list, num_blocks, make: _GemmMaker) -> list:
    """Give every governed GEMM its op (a layer's hook, or a call's entry in its module's
    ``fp4lab_ops``), stacked as its layer is; the assignments, in order."""
    assignments, ops = [], {}
    for g in gemms:
        a = policy.assign(g.path, g.kind, num_blocks, stack=g.stack)
        if a.recipe is None:
            continue  # a call no op rule quantizes
        assignments.append(a)
        if g.call is None:  # a layer: its hook (a static function) becomes an op with state
            kind, hook, op_type = _nnx.HOOKS[type(g.module)]
            op = _nnx.stacked(make(op_type, g.path, a.recipe), g.stack)
            setattr(g.module, hook, flax_nnx.data(op))
        else:
            check_expert_recipe(g.path, g.call[1], a.recipe)
            op = make(_nnx.QuantOp, g.path, a.recipe, g.kind, g.path, g.call[1],
                      experts=g.experts)
            ops.setdefault(id(g.module), (g.module, {}))[1][g.call[0]] = _nnx.stacked(op,
                                                                                  g.stack)
    for module, calls in ops.values():
        setattr(module, OPS_ATTR, flax_nnx.data(calls))
    return assignments


_RECORD = "fp4lab_assignments"


@dataclasses.dataclass(frozen=True)
class _Record:
    """What quantize_model assigned (a static attribute of the model, as its graph is)."""
    policy: PrecisionPolicy
    rows: tuple
    unused: tuple

    def __repr__(self):
        return f"<policy {self.policy.name}: {len(self.rows)} GEMMs; fp4lab.flax.assignments>"


def assignments(model) -> ExplainTable:
    """What :func:`quantize_model` gave each GEMM of an NNX model (path, kind, block or the
    blocks stacked for a scan, recipe, rule), as it gave it: print it for a table."""
    record = getattr(model, _RECORD, None)
    if record is None:
        raise ValueError(f"{type(model).__name__} was not quantized by "
                         "fp4lab.flax.quantize_model")
    return ExplainTable(record.rows, record.policy, list(record.unused))


def quantized_weights(model, how=None, **kwargs) -> dict:
    """:func:`fp4lab.export.quantized_weights` of an NNX model: its parameters as a pure dict,
    its layers with their kinds (:func:`linear_layers`), and as ``how`` by default the record
    :func:`quantize_model` left on it (:func:`assignments`); ``kwargs`` as there."""
    from fp4lab.export import quantized_weights as export_weights

    if not isinstance(model, flax_nnx.Module):
        raise TypeError(f"model is a {type(model).__name__}, not an NNX module; Linen "
                        "variables go to fp4lab.export.quantized_weights(variables, how)")
    params = flax_nnx.to_pure_dict(flax_nnx.state(model, flax_nnx.Param))
    return export_weights(params, assignments(model) if how is None else how,
                          layers=dict(linear_layers(model)), **kwargs)


class _Gemm(NamedTuple):
    """A GEMM of an NNX model: a governed layer (``call`` None) or a call inside a module
    (``call``: its name there and its op kind), stacked over ``stack`` blocks."""
    path: str
    kind: str
    stack: tuple[int, ...]
    module: flax_nnx.Module
    call: tuple[str, str] | None = None
    experts: int | None = None  # a ragged_dot's experts (its probe is stacked per expert)


def _nnx_gemms(model, policy, inputs, call_kwargs) -> list[_Gemm]:
    """Every GEMM a policy can govern in an NNX model: its Linear/LinearGeneral/Einsum
    layers, the calls of :func:`~fp4lab.flax.nnx.register_layer` types, every
    ``lax.ragged_dot`` call (an expert stack) and, when the policy has op rules, every
    ``jnp.einsum`` / ``lax.dot_general`` call inside its modules (calls found by tracing
    ``model(*inputs, **call_kwargs)`` abstractly)."""
    modules = {"/".join(map(str, p)): m for p, m in flax_nnx.iter_modules(model)}
    gemms = [_Gemm(path, _nnx.HOOKS[type(m)][0], _nnx.layer_stack(m), m)
             for path, m in modules.items() if type(m) in _nnx.HOOKS]
    registered = any(type(m) in _nnx.LAYER_CALLS for m in modules.values())
    needs_calls = policy.governs_ops or registered
    if not inputs and not call_kwargs:
        if not needs_calls:
            return gemms
        what = ", ".join(repr(r.label()) for r in policy.rules if r.kind in OP_KINDS)
        what = f"rules {what}" if what else "layers of registered types"
        raise ValueError(f"policy {policy.name} quantizes calls inside modules ({what}): an "
                         "NNX model needs example inputs to find them, "
                         "quantize_model(model, policy, x)")
    try:  # example inputs are always run (abstractly): inputs the model cannot take are refused
        calls = _nnx.find_op_calls(model, inputs, call_kwargs)
    except Exception as e:
        shapes = ", ".join(str(getattr(a, "shape", type(a).__name__)) for a in inputs)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"quantize_model: {type(model).__name__} does not run on the example "
                         f"inputs (shapes {shapes}): {first}") from e
    for mpath, name, kind, stack, experts in calls:
        module = modules[mpath]
        layer = _nnx.LAYER_CALLS.get(type(module)) if kind == "lax.dot_general" else None
        if layer is not None:
            path = mpath if name == "dot_general_0" else f"{mpath}/{name}"
            gemms.append(_Gemm(path, layer, stack, module, (name, kind)))
        elif policy.governs_ops or kind in EXPERT_KINDS:
            gemms.append(_Gemm(f"{mpath}/{name}" if mpath else name, kind, stack, module,
                               (name, kind), experts))
    return gemms


def _num_blocks(policy: PrecisionPolicy, gemms: list[_Gemm]) -> int | None:
    """One more than the largest block index in the layers' paths, or the number of blocks
    stacked for a scan, whichever is larger."""
    found = policy.infer_num_blocks(g.path for g in gemms if g.kind not in OP_KINDS) or 0
    return max([found] + [math.prod(g.stack) for g in gemms if g.stack]) or None


