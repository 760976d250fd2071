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

Layers that are already fp4lab layers keep their own recipe. Layer kinds for policy rules are
the Flax class names in lower case: ``dense``, ``densegeneral``, ``einsum`` (Linen);
``linear``, ``lineargeneral``, ``einsum`` (NNX).

Randomness for stochastic rounding: Linen draws from the ``"quant"`` rng stream
(``rngs={"quant": key}`` in ``apply``; under ``nn.scan`` add ``split_rngs={"quant": True}``);
each NNX layer has its own stream, seeded from the ``rngs`` given to the layer (its ``quant``
stream if present) or from ``quantize_model``'s ``seed`` and the layer's path. Every layer and
every call gets its own key.

Depth rules need a block index in the path: under ``nn.scan`` over layers all blocks share one
module (one traced body), so a depth rule cannot give scanned blocks different recipes.
"""

from __future__ import annotations

import zlib
from typing import Any

import jax

from flax import linen as nn
from flax import nnx as flax_nnx  # not `nnx`: fp4lab.flax.nnx is this package's submodule

from fp4lab.flax import linen as _linen
from fp4lab.flax import nnx as _nnx
from fp4lab.flax.linen import QDense, QDenseGeneral, QuantizedLinen
from fp4lab.flax.nnx import QLinear, QLinearGeneral, QuantDot, QuantEinsum
from fp4lab.policy import PrecisionPolicy, check_unused, get_policy

__all__ = ["QDense", "QDenseGeneral", "QuantizedLinen", "QLinear", "QLinearGeneral",
           "QuantDot", "QuantEinsum", "quantize_model", "linear_layers"]


def linear_layers(model) -> list[tuple[str, str | None]]:
    """``(path, kind)`` of every layer a policy governs: for an NNX module every
    Linear/LinearGeneral/Einsum (fp4lab's layers included); for Linen variables every
    sub-dict holding a ``kernel`` of rank >= 2, with kind ``None``."""
    if isinstance(model, flax_nnx.Module):
        return [("/".join(map(str, path)), _nnx.KINDS[type(m)])
                for path, m in flax_nnx.iter_modules(model) if type(m) in _nnx.KINDS]
    return _linen.param_layers(model)


def quantize_model(model: Any, policy: str | PrecisionPolicy, *, num_blocks: int | None = None,
                   seed: int = 0, rngs: flax_nnx.Rngs | None = None, backend: str = "auto",
                   strict: bool = False, block: str | None = None):
    """Apply ``policy`` to a model written without fp4lab (see module docstring).

    NNX: installs the quantized hook in every governed layer, in place, and returns the model;
    each layer gets its own SR stream, seeded from the layer's path and ``seed``, or, with
    ``rngs=``, from one draw of its ``quant`` stream (else its default stream): the model's
    ``nnx.Rngs`` then seed SR as they seed everything else. Either way the seeds are stable
    across processes and independent of the order layers are visited in.
    Linen: returns a :class:`QuantizedLinen` wrapper (use its ``init``/``apply``; SR keys come
    from ``apply``'s ``rngs={"quant": key}``).
    ``backend``: which implementation quantizes (:mod:`fp4lab.backend`).

    A required rule that matches no layer is a :class:`~fp4lab.policy.PolicyWarning` naming
    the rule (NNX: now; Linen: at the first ``apply``), an error with ``strict=True``.
    ``block``: the name of the block modules when the default pattern does not find them
    (``block="Stage"`` for ``Stage_0``, ``Stage_1``, ...; see
    :func:`~fp4lab.policy.block_pattern_for`)."""
    policy = get_policy(policy)
    if block is not None:
        policy = policy.with_block(block)
    if isinstance(model, nn.Module):
        return QuantizedLinen(model, policy, num_blocks, backend, strict)
    if not isinstance(model, flax_nnx.Module):
        raise TypeError(f"quantize_model needs a Flax Linen or NNX module, got "
                        f"{type(model).__name__}")
    num_blocks = num_blocks or policy.infer_num_blocks(p for p, _ in linear_layers(model))
    base = None
    if rngs is not None:
        base = rngs.quant() if "quant" in rngs else rngs()
    assignments = []
    for path, m in list(flax_nnx.iter_modules(model)):
        if type(m) not in _nnx.HOOKS:
            continue
        kind, hook, op = _nnx.HOOKS[type(m)]
        name = "/".join(map(str, path))
        path_hash = zlib.crc32(f"{seed}/{name}".encode()) & 0x7FFFFFFF
        assignments.append(a := policy.assign(name, kind, num_blocks))
        if base is None:
            layer = op(a.recipe, seed=path_hash, backend=backend)
        else:
            key = jax.random.fold_in(base, path_hash)
            layer = op(a.recipe, rngs=flax_nnx.Rngs(quant=key), backend=backend)
        # nnx.data: the hook was a static attribute (a function); the op carries rng state
        setattr(m, hook, flax_nnx.data(layer))
    if assignments:
        check_unused(policy, assignments, strict=strict, stacklevel=2)
    return model
