"""The weights a model's forward GEMMs multiply, as QArrays (:func:`quantized_weights`)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from fp4lab.export.blocks import F32, blocks, qarray
from fp4lab.policy import get_policy, param_layers
from fp4lab.numerics.qarray import QArray
from fp4lab.numerics.quantize import quantize
from fp4lab.numerics.rounding import abs_max
from fp4lab.gemm.operand_quant import takes_tensor_amax

# GGML's formats whose blocks of zero scale the export takes from GGML's C arithmetic
GGML_FORMATS = ("int4_q4_0", "int8_q8_0")


def _flat_params(params, layers) -> tuple[dict[str, np.ndarray], dict[str, str | None]]:
    """``{path: array}`` of every parameter and ``{layer path: kind}`` of the linear layers
    (``layers``, or every sub-dict with a ``kernel`` of rank >= 2, kind unknown), from a
    parameter tree (Linen variables, ``{"params": ...}`` or not; an NNX model's pure dict)."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params is a {type(params).__name__}, not a parameter tree (a dict "
                        "of arrays); an NNX model exports through "
                        "fp4lab.flax.quantized_weights(model, ...)")
    tree = params.get("params", params)
    layers = dict(param_layers(dict(tree)) if layers is None else layers)
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        flat[jax.tree_util.keystr(path, simple=True, separator="/")] = leaf
    return flat, layers


def quantized_weights(params, how, *, layers: Mapping[str, str | None] | None = None,
                      compute_dtype=None, num_blocks: int | None = None,
                      contracting: Mapping[str, int] | None = None,
                      experts: Mapping[str, str] | None = None
                      ) -> dict[str, QArray | tuple[QArray, ...] | jax.Array]:
    """Every parameter as the forward pass uses it, keyed by path (``"blocks_0/mlp/up/
    kernel"``): a linear layer's kernel whose recipe quantizes the forward weight becomes the
    QArray of its GEMM's weight matrix ``[K, N]`` (the kernel itself for a ``[in, out]``
    kernel; a ``DenseGeneral`` kernel with its contracting axes, then its feature axes,
    flattened, as fp4lab's interception of the layer hands it to the GEMM):
    ``quantize(kernel.astype(compute_dtype), fprop_w.format, axis=0, tile=fprop_w.tile)``;
    a pass-through recipe's kernel is cast to its format (BF16, FP16, FP32); everything else
    (embeddings, norms, convolutions, biases, layers the forward pass never quantized) is
    returned as it is. GGML formats' blocks whose float16 scale is zero hold GGML's own codes
    (:func:`_ggml_reference`).

    ``params`` is a parameter tree (Linen variables; an NNX model goes through
    ``fp4lab.flax.quantized_weights``, which passes its pure dict, its layers and its record).
    ``how`` says what each layer's forward pass did, best from the quantized model's own
    record: ``QuantizedLinen.assignments(variables, x)`` (Linen) or
    ``fp4lab.flax.assignments(model)`` (NNX); each layer's recipe and the dtype its kernel
    had at the GEMM come from there. It may also be a policy (anything
    :func:`fp4lab.policy.get_policy` reads), resolved over ``layers`` (``{path: kind}``;
    default: every sub-dict with a ``kernel`` of rank >= 2, kind unknown); a policy whose
    rules name a layer kind is refused where the layers' kinds are unknown. ``compute_dtype``: the dtype every kernel is cast to before
    quantizing, overriding the record (without a record: the parameters' own dtype).
    ``contracting``: ``{layer path: n}``, the number of leading kernel axes a layer
    contracts, for kernels of rank >= 3 without a bias to read it from.

    ``experts``: ``{stack path: call path}``, the expert stacks ``[E, K, N]`` (parameters a
    grouped GEMM multiplies, not a layer's ``kernel``) and the recorded call that multiplies
    each (``{"blocks_0/moe/experts/up": "blocks_0/moe/experts/ragged_dot_0"}``): a stack whose
    recipe quantizes the forward weight becomes a tuple of ``E`` QArrays, expert ``e``'s
    weight ``[K, N]`` as :func:`fp4lab.qragged_dot` quantizes it (its own tensor amax, or
    the stack's under ``expert_scale="shared"``); a pass-through recipe's stack is cast to
    its format."""
    flat, layers = _flat_params(params, layers)
    experts = dict(experts or {})
    unknown = sorted(set(experts) - set(flat))
    if unknown:
        raise ValueError(f"experts names stacks the parameters do not have: {unknown[:3]}")
    if not any(f"{layer}/kernel" in flat for layer in layers):
        raise ValueError(f"found no linear layer in the parameters (a 'kernel' of rank >= 2 "
                         f"under a layer's path); paths seen: {sorted(flat)[:5]}")
    assigned = _assignments(how, layers | {c: "lax.ragged_dot" for c in experts.values()},
                            num_blocks)
    out = {}
    for path, value in flat.items():
        if path in experts:
            out[path] = _expert_weights(path, value, assigned.get(experts[path]), compute_dtype)
            continue
        layer, _, leaf = path.rpartition("/")
        a = assigned.get(layer) if leaf == "kernel" else None
        if a is None or a.recipe is None:
            out[path] = value
            continue
        out[path] = _forward_weight(path, value, a, compute_dtype or a.compute_dtype,
                                    (contracting or {}).get(layer), flat.get(f"{layer}/bias"))
    return out


def _assignments(how, layers: dict, num_blocks) -> dict:
    """``{layer path: Assignment}``: the model's record (``how``), or ``how`` as a policy
    resolved over ``layers`` (``{path: kind}``)."""
    from fp4lab.policy import Assignment

    if how is None:
        raise ValueError("say how the forward pass quantized each layer: the model's record "
                         "(QuantizedLinen.assignments(variables, x), "
                         "fp4lab.flax.assignments(model)) or a policy")
    if isinstance(how, (list, tuple)) and all(isinstance(a, Assignment) for a in how):
        return {a.path: a for a in how}
    policy = get_policy(how)
    kinds = [r for r in policy.rules if r.kind is not None]
    if kinds and not any(layers.values()):
        raise ValueError(f"policy {policy.name}: rule {kinds[0].label()!r} names a layer kind "
                         f"(kind={kinds[0].kind!r}) that these parameters do not record; "
                         "export from the model's record: quantized_weights(params, "
                         "quantize_model(model, policy).assignments(variables, x))")
    num_blocks = num_blocks or policy.infer_num_blocks(layers)
    return {layer: policy.assign(layer, kind, num_blocks) for layer, kind in layers.items()}


def _forward_weight(path: str, value, a, compute_dtype, contracting: int | None, bias):
    """The kernel at ``path`` as ``a``'s forward GEMM uses it (see
    :func:`quantized_weights`)."""
    recipe = a.recipe
    if a.stack:
        raise ValueError(f"{path}: a kernel stacked for a scan ({a.stack} blocks); export "
                         "unstacked layers (scan_layers=False)")
    w = jnp.asarray(value)
    if compute_dtype is not None:
        w = w.astype(compute_dtype)
    if recipe.fprop_w.format.is_passthrough:
        return w.astype(recipe.fprop_w.format.element.storage)
    _check_fixed(path, recipe)
    n = contracting or _contracting_axes(path, w, bias)
    w = w.reshape(math.prod(w.shape[:n]), -1).astype(jnp.float32)
    return _quantize_weight(path, w, recipe.fprop_w)


def _expert_weights(path: str, value, a, compute_dtype):
    """The expert stack ``[E, K, N]`` at ``path`` as ``a``'s grouped GEMM uses it (see
    :func:`quantized_weights`)."""
    if a is None:
        raise ValueError(f"{path}: its grouped GEMM is not in the record; name the call that "
                         "multiplies it (experts={stack path: call path})")
    if a.recipe is None:
        return value
    w = jnp.asarray(value)
    if w.ndim != 3:
        raise ValueError(f"{path}: an expert stack of shape {w.shape}; one is [E, K, N]")
    w = w.astype(compute_dtype or a.compute_dtype or w.dtype)
    op = a.recipe.fprop_w
    if op.format.is_passthrough:
        return w.astype(op.format.element.storage)
    _check_fixed(path, a.recipe)
    w = w.astype(jnp.float32)
    shared = a.recipe.expert_scale == "shared" and takes_tensor_amax(op)
    amax = abs_max(w) if shared else None  # the stack's, as the grouped GEMM's pmax
    return tuple(_quantize_weight(f"{path}[{e}]", w[e], op, amax) for e in range(w.shape[0]))


def _check_fixed(path: str, recipe) -> None:
    if recipe.fprop_w.hadamard or recipe.fprop_w.rounding != "nearest":
        raise ValueError(f"{path}: recipe {recipe.name!r} transforms or stochastically "
                         "rounds the forward weight; a checkpoint holds one fixed weight")


def _contracting_axes(path: str, kernel, bias) -> int:
    """How many leading axes of a kernel its layer contracts: 1 for ``[in, out]``; for a
    ``DenseGeneral`` kernel ``[*in, *features]``, the axes its bias (``[*features]``) lacks."""
    if kernel.ndim == 2:
        return 1
    n = None if bias is None else kernel.ndim - np.ndim(bias)
    if n is None or n < 1 or tuple(kernel.shape[n:]) != tuple(np.shape(bias)):
        raise ValueError(f"{path}: a kernel of shape {kernel.shape} whose contracting axes "
                         "its bias does not tell; pass contracting={layer path: the number "
                         "of leading axes the layer contracts}")
    return n


def _quantize_weight(path: str, w: jax.Array, op, amax=None) -> QArray:
    """The forward weight ``[K, N]`` (float32) quantized as ``op`` does, blocks along K
    (NVFP4's tensor amax ``amax`` when given); GGML's zero-scale blocks as GGML's C code
    writes them."""
    q = quantize(w, op.format, axis=-1 if op.tile else 0, tile=op.tile, global_amax=amax)
    if op.format.name not in GGML_FORMATS or w.shape[0] % op.format.block:
        return q  # a K the GGUF layout cannot hold is refused by save, naming the tensor
    b = blocks(path, q)
    zero = b.scales == 0
    if not zero.any():
        return q
    x = np.asarray(w).T.reshape(b.scales.shape + (b.block,))
    codes, scales = b.codes.reshape(x.shape).copy(), b.scales.copy()
    codes[zero], scales[zero] = _ggml_reference(x[zero], q.format.name)
    return qarray(codes.reshape(b.codes.shape), scales, q.format.name)


def _ggml_reference(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """GGML's ``quantize_row_q4_0_ref`` / ``quantize_row_q8_0_ref`` (ggml-quants.c) of
    float32 blocks ``[n, 32]`` in NumPy's IEEE float32, subnormals included: the codes as
    :class:`~fp4lab.export.blocks.Blocks` holds them and the float16 scales.

    fp4lab's quantizer computes the same, except where XLA:CPU flushes subnormals (a block
    maximum below ~2**-122): those blocks' float16 scale is zero and so are their values,
    but their bytes differ from GGML's, so the export takes them from here. The Q4_0 maximum
    is the first of largest magnitude, +0 when all are zero (C starts from ``max = 0.0f``);
    ``d = max / -8`` (Q8_0: ``amax / 127``), ``id = d ? 1/d : 0``. A subnormal ``d`` makes
    ``id`` infinite and the float-to-int8 conversion of ``inf`` or ``NaN`` undefined in C:
    x86-64 gives 0, which is what llama.cpp's builds write there."""
    q4 = fmt == "int4_q4_0"
    a = np.abs(x)
    with np.errstate(all="ignore"):
        if q4:
            m = np.take_along_axis(x, np.argmax(a, axis=-1)[:, None], -1)
            d = np.where(m != 0, m, F32(0)) / F32(-8)
        else:
            d = np.max(a, axis=-1, keepdims=True) / F32(127)
        v = x * np.where(d != 0, F32(1) / d, F32(0))
        if q4:
            c = np.trunc(v + F32(8.5))
        else:  # roundf: half away from zero (v - trunc(v) is exact)
            c = np.trunc(v) + np.where(np.abs(v - np.trunc(v)) >= 0.5, np.sign(v), 0)
    c = np.where(np.isfinite(c), c, 0).astype(np.int8)
    codes = (np.minimum(c, 15) - 8).astype(np.uint8) & 0x0F if q4 else c
    return codes, d[:, 0].astype(np.float16)


