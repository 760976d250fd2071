"""Export quantized weights to the checkpoint formats inference engines load, and read them back.

From a parameter tree (Linen variables or an NNX model) and a policy (or a recipe for every
layer), :func:`quantized_weights` quantizes each linear layer's kernel exactly as its forward
GEMM does: the kernel cast to the layer's compute dtype (by default: as stored), then
``recipe.fprop_w``'s format and tile, in blocks along the kernel's input axis K (a
``DenseGeneral`` kernel's contracting axes, flattened into K, as the GEMM sees it; GGML's
blocks of zero scale hold the bytes of llama.cpp's C quantizer, subnormals included).
:func:`save` writes such tensors in one of four layouts (docs/export.md has every byte):

* ``gguf`` (llama.cpp): ``int4_q4_0`` weights as GGML Q4_0, ``int8_q8_0`` as Q8_0, through
  the ``gguf`` package's writer: per block of 32 along K, the float16 scale, then 16 bytes
  (Q4_0: byte j holds element j in the low nibble and element j + 16 in the high one, codes
  offset by 8) or 32 int8 codes (Q8_0). Kernels are stored ``[out, in]`` (GGML's ``ne0`` is
  K); the rest as F32/F16/BF16. Tensor names are the parameter paths with ``.`` for ``/`` and
  ``weight`` for ``kernel`` (no llama.cpp architecture fits fp4lab's models; pass ``names``
  to map onto one), and ``fp4lab.tensors`` (JSON) maps them back.
* ``mxfp4`` (gpt-oss, transformers): safetensors ``<name>_blocks`` (uint8 ``[..., out, in/32,
  16]``, two E2M1 codes per byte, element 2i in the low nibble) and ``<name>_scales`` (uint8
  E8M0 ``[..., out, in/32]``); ``config.json`` holds ``quantization_config``.
* ``nvfp4`` (compressed-tensors, vLLM): ``<module>.weight_packed`` (uint8 ``[out, in/2]``),
  ``<module>.weight_scale`` (float8_e4m3fn ``[out, in/16]``) and ``<module>.weight_global_scale``
  (float32 ``[1]``, ``2688 / amax``, Transformer Engine's encode factor), with the
  ``nvfp4-pack-quantized`` config.
* ``nvfp4_modelopt`` (TensorRT-LLM, ModelOpt): ``<module>.weight`` (uint8), ``weight_scale``
  (float8_e4m3fn), ``weight_scale_2`` (float32, ``amax / 2688``) and, where given, the
  static ``input_scale``; ``hf_quant_config.json``.

What a layout cannot hold is refused, naming the tensor: a weight format it has no type for,
a K that is not a whole number of blocks, a GGUF block whose float16 scale is not finite (a
NaN or infinite weight), an MXFP4 block whose scale is NaN (E8M0 0xFF, which transformers
reads as 2^128), an NVFP4 tensor whose amax is not finite. 2D weight tiles (NVFP4's 16x16)
are written as the 1D groups the consumers know, each group carrying its tile's scale: the
values are the same, and :func:`load` returns the 1D form. Files are written whole or not
at all (a temporary file renamed), with the ordinary file mode; the optional packages
(``gguf``, ``safetensors``) missing is an error naming the ``export`` extra.

:func:`load` reads any of them back into QArrays (kernels in their ``[in, out]`` layout,
blocks along ``in``) and arrays, keyed by parameter path. It also reads checkpoints made
elsewhere in these layouts (a GGUF file; gpt-oss, compressed-tensors or ModelOpt safetensors,
recognized by their tensor names and keyed by them), so they can be studied with fp4lab's
probes. A truncated or corrupt file is an error naming the file (and the tensor whose bytes
it lacks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fp4lab.formats import get_format
from fp4lab.policy import PrecisionPolicy, get_policy
from fp4lab.qarray import QArray
from fp4lab.quantize import quantize

__all__ = ["LAYOUTS", "quantized_weights", "save", "export", "load", "tensor_name",
           "read_safetensors"]

LAYOUTS = ("gguf", "mxfp4", "nvfp4", "nvfp4_modelopt")
NVFP4_FACTOR = np.float32(2688.0)  # 6 (E2M1's max) * 448 (E4M3's max)
_FLT_MAX = np.float32(np.finfo(np.float32).max)
F32 = np.float32
_EXTRA = "pip install 'fp4lab[export]'"


# ---------------------------------------------------------------------------- the weights


def _flat_params(params) -> tuple[dict[str, np.ndarray], dict[str, str | None]]:
    """``{path: array}`` of every parameter and ``{layer path: kind}`` of the linear layers,
    from Linen variables (a dict, ``{"params": ...}`` or not) or an NNX model."""
    from flax import nnx

    from fp4lab.flax import linear_layers

    if isinstance(params, nnx.Module):
        layers = dict(linear_layers(params))
        tree = nnx.to_pure_dict(nnx.state(params, nnx.Param))
    else:
        tree = params.get("params", params) if isinstance(params, Mapping) else params
        layers = dict(linear_layers(dict(tree)))
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        flat[jax.tree_util.keystr(path, simple=True, separator="/")] = leaf
    return flat, layers


def quantized_weights(params, how=None, *, compute_dtype=None, num_blocks: int | None = None,
                      contracting: Mapping[str, int] | None = None
                      ) -> dict[str, QArray | jax.Array]:
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

    ``how`` says what each layer's forward pass did, best from the quantized model's own
    record: ``QuantizedLinen.assignments(variables, x)`` (Linen), or nothing for an NNX model
    quantized by ``quantize_model`` (its record, :func:`fp4lab.flax.assignments`); each
    layer's recipe and the dtype its kernel had at the GEMM come from there. It may also be a
    policy (anything :func:`fp4lab.policy.get_policy` reads), resolved over the parameter
    paths; a policy whose rules name a layer kind is refused for Linen variables, which do
    not say their layers' kinds. ``compute_dtype``: the dtype every kernel is cast to before
    quantizing, overriding the record (without a record: the parameters' own dtype).
    ``contracting``: ``{layer path: n}``, the number of leading kernel axes a layer
    contracts, for kernels of rank >= 3 without a bias to read it from."""
    flat, layers = _flat_params(params)
    if not any(f"{layer}/kernel" in flat for layer in layers):
        raise ValueError(f"found no linear layer in the parameters (a 'kernel' of rank >= 2 "
                         f"under a layer's path); paths seen: {sorted(flat)[:5]}")
    assigned = _assignments(params, how, layers, num_blocks)
    out = {}
    for path, value in flat.items():
        layer, _, leaf = path.rpartition("/")
        a = assigned.get(layer) if leaf == "kernel" else None
        if a is None or a.recipe is None:
            out[path] = value
            continue
        out[path] = _forward_weight(path, value, a, compute_dtype or a.compute_dtype,
                                    (contracting or {}).get(layer), flat.get(f"{layer}/bias"))
    return out


def _assignments(params, how, layers: dict, num_blocks) -> dict:
    """``{layer path: Assignment}``: the model's record (``how``, or an NNX model's own), or
    ``how`` as a policy resolved over ``layers`` (``{path: kind}``)."""
    from fp4lab.policy import Assignment

    if how is None:
        from fp4lab.flax import assignments

        how = assignments(params)  # an NNX model's record, or a clear error
    if isinstance(how, (list, tuple)) and all(isinstance(a, Assignment) for a in how):
        return {a.path: a for a in how}
    policy = get_policy(how)
    kinds = [r for r in policy.rules if r.kind is not None]
    if kinds and not any(layers.values()):
        raise ValueError(f"policy {policy.name}: rule {kinds[0].label()!r} names a layer kind "
                         "(kind={kinds[0].kind!r}) that these parameters do not record; "
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
    if recipe.fprop_w.hadamard or recipe.fprop_w.rounding != "nearest":
        raise ValueError(f"{path}: recipe {recipe.name!r} transforms or stochastically "
                         "rounds the forward weight; a checkpoint holds one fixed weight")
    n = contracting or _contracting_axes(path, w, bias)
    w = w.reshape(math.prod(w.shape[:n]), -1).astype(jnp.float32)
    return _quantize_weight(path, w, recipe.fprop_w)


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


def _quantize_weight(path: str, w: jax.Array, op) -> QArray:
    """The forward weight ``[K, N]`` (float32) quantized as ``op`` does, blocks along K;
    GGML's zero-scale blocks as GGML's C code writes them."""
    q = quantize(w, op.format, axis=-1 if op.tile else 0, tile=op.tile)
    if op.format.name not in _GGUF_TYPES or w.shape[0] % op.format.block:
        return q  # a K the GGUF layout cannot hold is refused by save, naming the tensor
    b = _blocks(path, q)
    zero = b.scales == 0
    if not zero.any():
        return q
    x = np.asarray(w).T.reshape(b.scales.shape + (b.block,))
    codes, scales = b.codes.reshape(x.shape).copy(), b.scales.copy()
    codes[zero], scales[zero] = _ggml_reference(x[zero], q.format.name)
    return _qarray(codes.reshape(b.codes.shape), scales, q.format.name)


def _ggml_reference(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """GGML's ``quantize_row_q4_0_ref`` / ``quantize_row_q8_0_ref`` (ggml-quants.c) of
    float32 blocks ``[n, 32]`` in NumPy's IEEE float32, subnormals included: the codes as
    :class:`_Blocks` holds them and the float16 scales.

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


# ---------------------------------------------------------------- QArray <-> block arrays


def _nibbles(data: np.ndarray) -> np.ndarray:
    """Unpack bytes (element 2i low) into 4-bit codes along the last axis."""
    out = np.empty(data.shape[:-1] + (2 * data.shape[-1],), np.uint8)
    out[..., 0::2] = data & 0x0F
    out[..., 1::2] = data >> 4
    return out


def _pack(codes: np.ndarray) -> np.ndarray:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """A quantized kernel in the layouts' common form: ``[..., out, in]`` codes (4-bit codes
    one per byte, or int8), ``[..., out, in / block]`` scales (their stored dtype), the
    format and the per-tensor amax (NVFP4)."""

    codes: np.ndarray
    scales: np.ndarray
    format: str
    block: int
    amax: np.float32 | None


def _blocks(path: str, q: QArray) -> _Blocks:
    """The ``[..., out, in]`` form of a QArray quantized along the input axis ``-2`` of a
    ``[..., in, out]`` kernel (or in 2D tiles of its last two axes)."""
    fmt = q.format
    if fmt.granularity != "block":
        raise ValueError(f"{path}: format {fmt.name!r} is not a block format")
    nd, block = q.ndim, fmt.block
    k = q.shape[-2]
    if k % block:
        raise ValueError(f"{path}: K = {k} is not a whole number of {block}-blocks (a "
                         "checkpoint layout has no padding)")
    data, scale = np.asarray(q.data), np.asarray(q.scale)
    four = fmt.element.bits == 4
    if q.tile:
        # tiles of the last two axes: data is packed along the last axis (out)
        tk, tn = q.tile  # a partial last tile along out is fine: its rows keep its scale
        if tk != block:
            raise ValueError(f"{path}: tile {q.tile} does not have {block} rows along K")
        codes = _nibbles(data) if four else data
        codes = np.swapaxes(codes[..., :k, :q.shape[-1]], -1, -2)
        scales = np.repeat(np.swapaxes(scale, -1, -2), tn, axis=-2)[..., :q.shape[-1], :]
    else:
        if q.axis % nd != nd - 2:
            raise ValueError(f"{path}: blocks along axis {q.axis} of shape {q.shape}; a "
                             "kernel [..., in, out] is quantized along in (axis -2)")
        codes = np.swapaxes(data, -1, -2)
        codes = _nibbles(codes) if four else codes
        scales = np.swapaxes(scale, -1, -2)
    amax = None if q.global_scale is None else np.float32(q.global_scale)
    return _Blocks(np.ascontiguousarray(codes), np.ascontiguousarray(scales), fmt.name,
                   block, amax)


def _qarray(codes_out_in: np.ndarray, scales_out_in: np.ndarray, fmt: str,
            amax=None) -> QArray:
    """The QArray (``[..., in, out]``, blocks along ``in``) of ``[..., out, in]`` codes."""
    f = get_format(fmt)
    codes = np.swapaxes(codes_out_in, -1, -2)
    if f.element.bits == 4:
        codes = np.swapaxes(_pack(np.swapaxes(codes, -1, -2)), -1, -2)
    nd = codes_out_in.ndim
    shape = codes_out_in.shape[:-2] + (codes_out_in.shape[-1], codes_out_in.shape[-2])
    return QArray(data=jnp.asarray(np.ascontiguousarray(codes)),
                  scale=jnp.asarray(np.ascontiguousarray(np.swapaxes(scales_out_in, -1, -2))),
                  global_scale=None if amax is None else jnp.asarray(np.float32(amax)),
                  format=f, axis=nd - 2, tile=None, shape=shape)


# -------------------------------------------------------------------------------- naming


def tensor_name(path: str) -> str:
    """A parameter path's tensor name: ``blocks_0/mlp/up/kernel`` -> ``blocks_0.mlp.up.weight``
    (a kernel is stored transposed, ``[out, in]``, as the engines store weights)."""
    layer, _, leaf = path.rpartition("/")
    return ".".join(p for p in (layer.replace("/", "."), "weight" if leaf == "kernel" else leaf)
                    if p)


def _is_kernel(path: str, value) -> bool:
    return path.rpartition("/")[2] == "kernel" and np.ndim(value) >= 2


def _plain(value) -> np.ndarray:
    a = np.asarray(value)
    if not np.issubdtype(a.dtype, np.floating) and a.dtype not in (ml_dtypes.bfloat16,):
        raise TypeError(f"a parameter of dtype {a.dtype}: only floating-point tensors export")
    return a


def _require(module: str):
    """An optional dependency (the ``export`` extra), or a one-line error naming the extra."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"fp4lab.export needs the {module.partition('.')[0]!r} "
                                  f"package: {_EXTRA}", name=e.name) from None


@contextlib.contextmanager
def _atomic(path: Path):
    """A temporary path beside ``path`` that replaces it once the block succeeds (removed if
    it fails); created by ``open``, so with the ordinary umask-respecting mode."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------- GGUF

_GGUF_TYPES = {"int4_q4_0": "Q4_0", "int8_q8_0": "Q8_0"}


def _q4_0_bytes(b: _Blocks) -> np.ndarray:
    """GGML block_q4_0 bytes ``[..., out, in / 32 * 18]``: the float16 scale, then byte j =
    (q_j + 8) | (q_{j+16} + 8) << 4."""
    q = ((b.codes.astype(np.int16) ^ 8) - 8)  # two's complement nibbles -> [-8, 7]
    u = (q + 8).astype(np.uint8).reshape(b.codes.shape[:-1] + (-1, 32))
    qs = u[..., :16] | (u[..., 16:] << 4)
    d = b.scales.astype(np.float16).view(np.uint8).reshape(u.shape[:-1] + (2,))
    return np.concatenate([d, qs], axis=-1).reshape(b.codes.shape[:-1] + (-1,))


def _q8_0_bytes(b: _Blocks) -> np.ndarray:
    q = b.codes.astype(np.int8).view(np.uint8).reshape(b.codes.shape[:-1] + (-1, 32))
    d = b.scales.astype(np.float16).view(np.uint8).reshape(q.shape[:-1] + (2,))
    return np.concatenate([d, q], axis=-1).reshape(b.codes.shape[:-1] + (-1,))


def _from_ggml(raw: np.ndarray, qtype: str, shape_out_in: tuple[int, ...]) -> QArray:
    size = {"Q4_0": 18, "Q8_0": 34}[qtype]
    blocks = raw.reshape(shape_out_in[:-1] + (-1, size))
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    if qtype == "Q4_0":
        qs = blocks[..., 2:]
        u = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)  # j, j + 16
        codes = ((u - 8) & 0x0F).astype(np.uint8).reshape(shape_out_in)
        return _qarray(codes, d, "int4_q4_0")
    codes = blocks[..., 2:].copy().view(np.int8).reshape(shape_out_in)
    return _qarray(codes, d, "int8_q8_0")


def _ggml_raw(p: str, q: QArray, qtype: str) -> np.ndarray:
    """A quantized kernel's GGML bytes; a block whose float16 scale is not finite (a NaN or
    infinite weight, or a block maximum beyond the float16 scale's range) is refused."""
    b = _blocks(p, q)
    bad = ~np.isfinite(b.scales.astype(np.float32))
    if bad.any():
        raise ValueError(f"{p}: {int(bad.sum())} block(s) of {b.block} have a non-finite "
                         f"{qtype} scale (a NaN or infinite weight, or a block maximum beyond "
                         "the float16 scale's range); llama.cpp would read NaN or infinite "
                         "weights there")
    return _q4_0_bytes(b) if qtype == "Q4_0" else _q8_0_bytes(b)


def _save_gguf(tensors, path: Path, names, metadata, arch: str):
    gguf = _require("gguf")
    with _atomic(path) as tmp:
        _write_gguf(gguf, tensors, tmp, names, metadata, arch)


def _write_gguf(gguf, tensors, path: Path, names, metadata, arch: str):
    writer = gguf.GGUFWriter(str(path), arch)
    index = {}
    for p, value in tensors.items():
        name = names(p)
        if isinstance(value, QArray):
            qtype = _GGUF_TYPES.get(value.format.name)
            if qtype is None:
                known = ", ".join(f"{k} ({v})" for k, v in _GGUF_TYPES.items())
                raise ValueError(f"{p}: format {value.format.name!r} has no GGUF type; GGUF "
                                 f"takes {known} or a pass-through dtype")
            raw = _ggml_raw(p, value, qtype)
            writer.add_tensor(name, raw, raw_dtype=getattr(gguf.GGMLQuantizationType, qtype))
            index[name] = {"path": p, "transposed": True, "format": value.format.name}
            continue
        a = _plain(value)
        kernel = _is_kernel(p, a)
        if kernel:
            a = np.swapaxes(a, -1, -2)
        a = np.ascontiguousarray(a)
        if a.dtype == ml_dtypes.bfloat16:
            writer.add_tensor(name, a.view(np.uint16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
        elif a.dtype in (np.float16, np.float32):
            writer.add_tensor(name, a)
        else:
            raise TypeError(f"{p}: dtype {a.dtype}; GGUF takes float32, float16 or bfloat16")
        index[name] = {"path": p, "transposed": kernel, "format": str(a.dtype)}
    writer.add_string("fp4lab.tensors", json.dumps(index, sort_keys=True))
    writer.add_file_type(_gguf_file_type(gguf, index))
    for key, v in (metadata or {}).items():
        if key.split(".")[0] in (arch, "general", "tokenizer"):  # a key the reader knows
            _add_typed(gguf, writer, key, v)
        else:
            writer.add_string(f"fp4lab.{key}", v if isinstance(v, str) else json.dumps(v))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_typed(gguf, writer, key: str, v) -> None:
    """``key`` written with its value's GGUF type, as llama.cpp reads the keys of an
    architecture (``llama.block_count``: uint32; ``...norm_rms_epsilon``: float32; arrays
    for per-layer values)."""
    T = gguf.GGUFValueType
    if isinstance(v, (list, tuple)):
        kinds = {type(x) for x in v}
        if not v or len(kinds) != 1 or not kinds <= {int, float, str, bool}:
            raise ValueError(f"GGUF key {key!r}: an array needs elements of one type (int, "
                             f"float, str or bool), not {sorted(k.__name__ for k in kinds)}")
        sub = {bool: T.BOOL, int: T.INT32 if min(v) < 0 else T.UINT32, float: T.FLOAT32,
               str: T.STRING}[kinds.pop()]
        writer.add_key_value(key, list(v), T.ARRAY, sub_type=sub)
        return
    if isinstance(v, bool):
        writer.add_bool(key, v)
    elif isinstance(v, int):
        (writer.add_uint32 if 0 <= v < 2 ** 32 else writer.add_int64)(key, v)
    elif isinstance(v, float):
        writer.add_float32(key, v)
    elif isinstance(v, str):
        writer.add_string(key, v)
    else:
        raise ValueError(f"GGUF key {key!r}: a value of type {type(v).__name__}; GGUF keys take "
                         "int, float, str, bool or a list of one of them")


def _gguf_file_type(gguf, index: dict) -> int:
    """llama.cpp's ``general.file_type``: the type of most quantized weights (Q4_0, Q8_0),
    else of the kernels (BF16, F16, F32)."""
    kinds = [v["format"] for v in index.values() if v["transposed"]]
    F = gguf.LlamaFileType
    by_format = {"int4_q4_0": F.MOSTLY_Q4_0, "int8_q8_0": F.MOSTLY_Q8_0,
                 "bfloat16": F.MOSTLY_BF16, "float16": F.MOSTLY_F16, "float32": F.ALL_F32}
    found = [by_format[k] for k in kinds if k in by_format]
    return int(max(set(found), key=found.count)) if found else int(F.ALL_F32)


def _corrupt(path: Path, detail) -> ValueError:
    return ValueError(f"{str(path)!r} is truncated or corrupt: {detail}")


# what a file parser raises on bytes that are not what they should be
_PARSE_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, struct.error)


def _gguf_reader(gguf, path: Path):
    """gguf's reader of ``path``; a truncated or corrupt file is a ValueError naming it, and
    the tensor whose bytes the file lacks."""

    class Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            for f in fields:  # parts: name length, name, n_dims, dims, GGML type, offset
                name, dims, kind, offset = (f.parts[i] for i in (1, 3, 4, 5))
                block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(kind[0]))]
                end = start_offs + int(offset[0]) + math.prod(map(int, dims)) * size // block
                if end > len(self.data):
                    raise _corrupt(path, f"tensor {bytes(name).decode()!r} ends at byte {end}, "
                                         f"past the end of the file ({len(self.data)} bytes)")
            super()._build_tensors(start_offs, fields)

    try:
        reader = Reader(str(path))
        field = reader.fields.get("fp4lab.tensors")
        index = (None if field is None else
                 json.loads(bytes(field.parts[field.data[0]]).decode()))
    except _PARSE_ERRORS as e:
        raise (e if "truncated or corrupt" in str(e) else _corrupt(path, e)) from None
    return reader, index


def _load_gguf(path: Path) -> dict:
    reader, index = _gguf_reader(_require("gguf"), path)
    out = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        # made elsewhere: keyed by tensor name, a quantized weight as its [in, out] kernel
        info = index[t.name] if index else {"path": t.name,
                                             "transposed": kind in ("Q4_0", "Q8_0")}
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists ne0 (the last axis) first
        if kind not in ("Q4_0", "Q8_0", "F32", "F16", "BF16"):
            raise ValueError(f"{str(path)!r}: tensor {t.name!r} is GGML {kind}; fp4lab reads "
                             "Q4_0, Q8_0, F32, F16 and BF16")
        if kind in ("Q4_0", "Q8_0"):
            out[info["path"]] = _from_ggml(np.asarray(t.data), kind, shape)
            continue
        a = np.asarray(t.data)
        if kind == "BF16":
            a = a.view(ml_dtypes.bfloat16)
        a = a.reshape(shape)
        out[info["path"]] = np.swapaxes(a, -1, -2) if info["transposed"] else a
    return out


# ---------------------------------------------------------------------------- safetensors

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F8_E4M3": ml_dtypes.float8_e4m3fn, "U8": np.uint8, "I8": np.int8,
              "I32": np.int32, "F64": np.float64}


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]):
    """safetensors' serialization, written atomically with the ordinary file mode (its own
    ``save_file`` leaves 0600)."""
    data = _require("safetensors.flax").save({k: jnp.asarray(v) for k, v in tensors.items()},
                                             metadata=metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _atomic(path) as tmp:
        tmp.write_bytes(data)


def _st_entry(path: Path, name: str, info) -> tuple[np.dtype, int, int, tuple[int, ...]]:
    """A safetensors header entry: the tensor's dtype, byte range and shape."""
    try:
        kind, (start, end) = info["dtype"], map(int, info["data_offsets"])
        shape = tuple(int(n) for n in info["shape"])
    except (KeyError, TypeError, ValueError):
        raise _corrupt(path, f"tensor {name!r} is described as {info!r}") from None
    if kind not in _ST_DTYPES:
        raise ValueError(f"{str(path)!r}: tensor {name!r} has dtype {kind}")
    return np.dtype(_ST_DTYPES[kind]), start, end, shape


def read_safetensors(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors of a safetensors file as NumPy arrays, by name (float8 included, which the
    ``safetensors`` package cannot hand to NumPy), and its ``__metadata__`` strings. The file
    is an 8-byte little-endian header length, the JSON header, the tensors' bytes at the
    offsets it gives; one that is not (truncated, a bad header, a tensor outside the file)
    raises ValueError naming the file."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little") if len(raw) >= 8 else None
    if n is None or n > len(raw) - 8:
        raise _corrupt(path, f"{len(raw)} bytes, fewer than its header needs")
    try:
        header = json.loads(raw[8:8 + n])
        meta = header.pop("__metadata__", {}) or {}
    except (ValueError, AttributeError) as e:
        raise _corrupt(path, f"its header is not a safetensors header ({e})") from None
    body = memoryview(raw)[8 + n:]
    out = {}
    for name, info in header.items():
        dtype, start, end, shape = _st_entry(path, name, info)
        if not 0 <= start <= end <= len(body) or end - start != math.prod(shape) * dtype.itemsize:
            raise _corrupt(path, f"tensor {name!r} {list(shape)} needs bytes {start}..{end} of "
                                 f"{len(body)}")
        out[name] = np.frombuffer(body[start:end], dtype=dtype).reshape(shape).copy()
    return out, meta


def _plain_tensors(p, value, name, tensors, index) -> str | None:
    """Store an unquantized tensor (a kernel transposed); returns its module's name when it
    is a kernel: a linear layer the checkpoint's config lists as not converted."""
    a = np.ascontiguousarray(_plain(value))
    kernel = _is_kernel(p, a)
    tensors[name] = np.ascontiguousarray(np.swapaxes(a, -1, -2)) if kernel else a
    index[name] = {"path": p, "transposed": kernel}
    return _module(name) if kernel else None


def _module(name: str) -> str:
    return name.rpartition(".")[0] if name.endswith(".weight") else name


def _save_mxfp4(tensors, path: Path, names, metadata):
    out, index, skipped = {}, {}, []
    for p, value in tensors.items():
        name = names(p)
        if not isinstance(value, QArray):
            if module := _plain_tensors(p, value, name, out, index):
                skipped.append(module)
            continue
        if value.format.element.name != "e2m1" or value.format.scaling.scale_name != "e8m0":
            raise ValueError(f"{p}: format {value.format.name!r} is not MXFP4 (E2M1 elements, "
                             "E8M0 scales per 32)")
        b = _blocks(p, value)
        if (b.scales == 255).any():
            raise ValueError(f"{p}: {int((b.scales == 255).sum())} block(s) hold NaN (E8M0 "
                             "0xFF); transformers reads 0xFF as 2^128, so a NaN block cannot "
                             "round-trip")
        lead = b.codes.shape[:-1]
        out[f"{name}_blocks"] = _pack(b.codes).reshape(lead + (-1, 16))
        out[f"{name}_scales"] = b.scales.astype(np.uint8)
        index[f"{name}_blocks"] = {"path": p, "transposed": True, "format": value.format.name}
    _write_safetensors(path / "model.safetensors", out, {"fp4lab.tensors": json.dumps(index)})
    config = {"quantization_config": {"quant_method": "mxfp4",
                                      "modules_to_not_convert": sorted(skipped)},
              "fp4lab": {"layout": "mxfp4", **(metadata or {})}}
    _write_config(path, config)


def _nvfp4_parts(p, q: QArray):
    if q.format.name != "nvfp4":
        raise ValueError(f"{p}: format {q.format.name!r} is not NVFP4")
    b = _blocks(p, q)
    amax = b.amax
    if not np.isfinite(amax):
        raise ValueError(f"{p}: the tensor amax is {amax}; an NVFP4 checkpoint's global scale "
                         "must be finite")
    with np.errstate(divide="ignore", over="ignore"):  # as TE: min(fl(2688 / amax), FLT_MAX)
        s_enc = np.minimum(NVFP4_FACTOR / amax, _FLT_MAX) if amax else np.float32(1)
    if s_enc == 0:
        s_enc = np.float32(1)
    return _pack(b.codes), b.scales, np.float32(s_enc), amax


def _save_nvfp4(tensors, path: Path, names, metadata, modelopt: bool, input_amax):
    stray = sorted(set(input_amax or ()) - {p for p, v in tensors.items()
                                            if isinstance(v, QArray)})
    if stray:
        raise ValueError(f"input_amax names {stray}, which are not quantized weights")
    out, index, ignore, quantized = {}, {}, [], []
    for p, value in tensors.items():
        name = names(p)
        if not isinstance(value, QArray):
            if module := _plain_tensors(p, value, name, out, index):
                ignore.append(module)
            continue
        module = _module(name)
        packed, scales, s_enc, amax = _nvfp4_parts(p, value)
        quantized.append(module)
        if modelopt:
            out[f"{module}.weight"] = packed
            out[f"{module}.weight_scale"] = scales
            out[f"{module}.weight_scale_2"] = np.float32(amax / NVFP4_FACTOR)
            if input_amax and p in input_amax:
                out[f"{module}.input_scale"] = np.float32(np.float32(input_amax[p])
                                                          / NVFP4_FACTOR)
            key = f"{module}.weight"
        else:
            out[f"{module}.weight_packed"] = packed
            out[f"{module}.weight_scale"] = scales
            out[f"{module}.weight_global_scale"] = np.array([s_enc], np.float32)
            key = f"{module}.weight_packed"
        index[key] = {"path": p, "transposed": True, "format": "nvfp4",
                      "amax": float(amax)}
    _write_safetensors(path / "model.safetensors", out, {"fp4lab.tensors": json.dumps(index)})
    extra = {"fp4lab": {"layout": "nvfp4_modelopt" if modelopt else "nvfp4",
                        **(metadata or {})}}
    if modelopt:
        hf = {"producer": {"name": "fp4lab"},
              "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                               "exclude_modules": sorted(ignore)}}
        (path / "hf_quant_config.json").write_text(json.dumps(hf, indent=2) + "\n")
        _write_config(path, extra)
        return
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
               "symmetric": True, "dynamic": False}
    config = {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": sorted(quantized), "weights": weights,
                                      "input_activations": None, "output_activations": None,
                                      "format": "nvfp4-pack-quantized"}},
        "ignore": sorted(ignore)}, **extra}
    _write_config(path, config)


def _write_config(folder: Path, added: dict) -> None:
    """``folder/config.json`` with ``added``'s keys (``quantization_config``, ``fp4lab``)
    set: a model's config already there (``architectures``, ``model_type``, ...) keeps its
    other keys, so an engine can still instantiate the model; written atomically."""
    with _atomic(folder / "config.json") as tmp:
        tmp.write_text(json.dumps({**_model_config(folder), **added}, indent=2) + "\n")


def _model_config(folder: Path) -> dict:
    """The ``config.json`` already in ``folder`` (``{}`` if none); one that is not a JSON
    object is an error (checked before anything is written)."""
    path = folder / "config.json"
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is there but is not JSON ({e}); a model's "
                         "config.json is kept and extended: fix or remove it") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r} holds a {type(config).__name__}, not a model "
                         "config object")
    return config


def _guess_index(tensors: dict[str, np.ndarray]) -> dict:
    """The index of a checkpoint made elsewhere, from its tensor names and dtypes (keys:
    the tensor names, the module's for NVFP4): gpt-oss MXFP4 (``X_blocks`` + ``X_scales``),
    compressed-tensors NVFP4 (``M.weight_packed``, ``M.weight_scale``,
    ``M.weight_global_scale``), ModelOpt NVFP4 (uint8 ``M.weight``, ``M.weight_scale``,
    ``M.weight_scale_2``); every other tensor as it is."""
    index, used = {}, set()
    for name, a in tensors.items():
        module = name.rpartition(".")[0]
        if name.endswith("_blocks") and name[:-7] + "_scales" in tensors:
            index[name] = {"path": name[:-7], "format": "mxfp4"}
            used |= {name, name[:-7] + "_scales"}
        elif name.endswith(".weight_packed"):
            g = tensors[f"{module}.weight_global_scale"].astype(np.float32).reshape(())
            index[name] = {"path": module, "format": "nvfp4", "amax": float(NVFP4_FACTOR / g)}
            used |= {name, f"{module}.weight_scale", f"{module}.weight_global_scale"}
        elif (name.endswith(".weight") and a.dtype == np.uint8
              and f"{module}.weight_scale_2" in tensors):
            s2 = tensors[f"{module}.weight_scale_2"].astype(np.float32).reshape(())
            index[name] = {"path": module, "format": "nvfp4", "amax": float(s2 * NVFP4_FACTOR)}
            used |= {name, f"{module}.weight_scale", f"{module}.weight_scale_2"}
    for name in tensors:
        if name not in used:
            index[name] = {"path": name, "transposed": False}
    return index


def _load_safetensors_dir(path: Path) -> dict:
    tensors, index = {}, {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{str(path)!r} holds no .safetensors file")
    for f in files:  # one file, or a sharded checkpoint's shards
        t, meta = read_safetensors(f)
        tensors.update(t)
        try:
            index.update(json.loads(meta.get("fp4lab.tensors") or "{}"))
        except ValueError as e:
            raise _corrupt(f, f"its fp4lab.tensors index is not JSON ({e})") from None
    index = index or _guess_index(tensors)
    out = {}
    for name, info in index.items():
        try:
            out[info["path"]] = _st_value(name, info, tensors)
        except KeyError as e:
            raise _corrupt(path, f"tensor {name!r} lacks {e}") from None
    return out


def _st_value(name: str, info: dict, tensors: dict[str, np.ndarray]) -> QArray | np.ndarray:
    """The array or QArray the index entry ``info`` of tensor ``name`` describes."""
    fmt = info.get("format")
    if fmt is None:
        a = tensors[name]
        return np.swapaxes(a, -1, -2) if info["transposed"] else a
    if name.endswith("_blocks"):
        blocks = tensors[name]
        codes = _nibbles(blocks.reshape(blocks.shape[:-2] + (-1,)))
        return _qarray(codes, tensors[name[:-len("_blocks")] + "_scales"], fmt)
    module = name.rpartition(".")[0]
    return _qarray(_nibbles(tensors[name]), tensors[f"{module}.weight_scale"], "nvfp4",
                   amax=np.float32(info["amax"]))


# ----------------------------------------------------------------------------- public API


def _out_path(path, layout: str) -> Path:
    """``path`` as a Path, refused unless it can be what ``layout`` writes: a ``.gguf`` file
    that is not a folder, or a folder that is not a file, under no file."""
    path = Path(path)
    if layout == "gguf" and (path.is_dir() or path.suffix != ".gguf"):
        raise ValueError(f"output path {str(path)!r}: the gguf layout writes one file whose "
                         "name ends in .gguf" + (", and this is a folder" if path.is_dir()
                                                 else ""))
    if layout != "gguf" and path.exists() and not path.is_dir():
        raise ValueError(f"output path {str(path)!r} is a file; the {layout} layout writes a "
                         "folder (model.safetensors, config.json)")
    above = next(p for p in path.parents if p.exists())
    if not above.is_dir():
        raise ValueError(f"output path {str(path)!r} lies under the file {str(above)!r}")
    return path


def save(tensors: Mapping[str, QArray | jax.Array | np.ndarray], path, layout: str, *,
         names: Callable[[str], str] | None = None, metadata: Mapping | None = None,
         input_amax: Mapping[str, float] | None = None, arch: str = "fp4lab") -> Path:
    """Write ``tensors`` (``{parameter path: QArray or array}``, as :func:`quantized_weights`
    returns) to ``path`` in ``layout`` (:data:`LAYOUTS`): a ``.gguf`` file for ``gguf``, a
    folder (``model.safetensors``, ``config.json``) for the others. ``names`` maps a path to
    its tensor name (default :func:`tensor_name`); ``metadata`` is stored alongside (GGUF:
    keys of the architecture, ``general.*`` and ``tokenizer.*`` as given, with their values'
    GGUF types, e.g. ``{"llama.block_count": 2}`` a uint32; any other key as the string
    ``fp4lab.<key>``; ``general.file_type`` from the weights; the others: ``config.json``'s
    ``fp4lab`` section);
    ``input_amax`` gives NVFP4 layers their static activation amax (ModelOpt's
    ``input_scale = amax / 2688``); ``arch``: GGUF's ``general.architecture``."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    if input_amax and layout != "nvfp4_modelopt":
        raise ValueError(f"input_amax is ModelOpt's input_scale; layout {layout!r} has none")
    names = names or tensor_name
    seen: dict[str, str] = {}
    for p in tensors:
        n = names(p)
        if n in seen:
            raise ValueError(f"tensor name {n!r} for both {seen[n]!r} and {p!r}")
        seen[n] = p
    path = _out_path(path, layout)
    if layout != "gguf":
        _model_config(path)  # a config.json the export must extend but cannot: refused now
    if layout == "gguf":
        path.parent.mkdir(parents=True, exist_ok=True)
        _save_gguf(tensors, path, names, metadata, arch)
    else:  # the writers make the folder once every tensor has passed their checks
        if layout == "mxfp4":
            _save_mxfp4(tensors, path, names, metadata)
        else:
            _save_nvfp4(tensors, path, names, metadata, layout == "nvfp4_modelopt", input_amax)
    return path


def export(params, how, path, layout: str, *, compute_dtype=None,
           num_blocks: int | None = None, contracting: Mapping[str, int] | None = None,
           **save_kw) -> Path:
    """:func:`quantized_weights` of ``params`` as ``how`` says (the model's record or a
    policy), written by :func:`save`; the policy is recorded in the metadata."""
    from fp4lab.policy import ExplainTable, explain, policy_to_dict

    _out_path(path, layout)  # a wrong path fails before the work
    weights = quantized_weights(params, how, compute_dtype=compute_dtype,
                                num_blocks=num_blocks, contracting=contracting)
    policy = how.policy if isinstance(how, ExplainTable) else get_policy(
        how if how is not None else _record_policy(params))
    try:
        recorded = policy_to_dict(policy)
    except ValueError:  # a recipe outside the registry: its layers' assignment, as text
        recorded = {"name": policy.name, "explain": str(explain(
            policy, [p.rpartition("/")[0] for p in weights if p.endswith("/kernel")]))}
    meta = {"policy": recorded, **(save_kw.pop("metadata", None) or {})}
    return save(weights, path, layout, metadata=meta, **save_kw)


def _record_policy(model) -> PrecisionPolicy:
    from fp4lab.flax import assignments

    return assignments(model).policy


def load(path) -> dict[str, QArray | np.ndarray]:
    """A checkpoint in one of the layouts: QArrays for the quantized kernels (``[in, out]``,
    blocks along ``in``), arrays for the rest. Written by :func:`save`, it is keyed by
    parameter path. Made elsewhere (a ``.gguf`` file, or a folder of ``.safetensors`` files,
    shards included, from gpt-oss, compressed-tensors or ModelOpt), it is keyed by tensor
    name (the module's name for an NVFP4 weight, ``X`` for gpt-oss's ``X_blocks``) and the
    layout is recognized from the names; an NVFP4 QArray's amax is then ``2688 /
    weight_global_scale`` (or ``2688 * weight_scale_2``), so its dequantization follows
    Transformer Engine's order, within an ulp or two of the consumer's (docs/export.md)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{str(path)!r}: a checkpoint is a .gguf file or a folder of "
                             ".safetensors files")
        return _load_gguf(path)
    return _load_safetensors_dir(path)

