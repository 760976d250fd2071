"""safetensors files (fp4lab's reader and atomic writer), a folder's ``config.json``, and
reading a folder of safetensors checkpoints back: fp4lab's own (by their index) and ones
made elsewhere (gpt-oss MXFP4, compressed-tensors and ModelOpt NVFP4, by their names)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fp4lab.export.blocks import NVFP4_FACTOR, corrupt, is_kernel, plain, qarray, require, unpack
from fp4lab.files import atomic
from fp4lab.numerics.qarray import QArray

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F8_E4M3": ml_dtypes.float8_e4m3fn, "U8": np.uint8, "I8": np.int8,
              "I32": np.int32, "F64": np.float64}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]):
    """safetensors' serialization, written atomically with the ordinary file mode (its own
    ``save_file`` leaves 0600)."""
    data = require("safetensors.flax").save({k: jnp.asarray(v) for k, v in tensors.items()},
                                             metadata=metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic(path) as tmp:
        tmp.write_bytes(data)


def _st_entry(path: Path, name: str, info) -> tuple[np.dtype, int, int, tuple[int, ...]]:
    """A safetensors header entry: the tensor's dtype, byte range and shape."""
    try:
        kind, (start, end) = info["dtype"], map(int, info["data_offsets"])
        shape = tuple(int(n) for n in info["shape"])
    except (KeyError, TypeError, ValueError):
        raise corrupt(path, f"tensor {name!r} is described as {info!r}") from None
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
        raise corrupt(path, f"{len(raw)} bytes, fewer than its header needs")
    try:
        header = json.loads(raw[8:8 + n])
        meta = header.pop("__metadata__", {}) or {}
    except (ValueError, AttributeError) as e:
        raise corrupt(path, f"its header is not a safetensors header ({e})") from None
    body = memoryview(raw)[8 + n:]
    out = {}
    for name, info in header.items():
        dtype, start, end, shape = _st_entry(path, name, info)
        if not 0 <= start <= end <= len(body) or end - start != math.prod(shape) * dtype.itemsize:
            raise corrupt(path, f"tensor {name!r} {list(shape)} needs bytes {start}..{end} of "
                                 f"{len(body)}")
        out[name] = np.frombuffer(body[start:end], dtype=dtype).reshape(shape).copy()
    return out, meta


def plain_tensors(p, value, name, tensors, index) -> str | None:
    """Store an unquantized tensor (a kernel transposed); returns its module's name when it
    is a kernel: a linear layer the checkpoint's config lists as not converted."""
    a = np.ascontiguousarray(plain(value))
    kernel = is_kernel(p, a)
    tensors[name] = np.ascontiguousarray(np.swapaxes(a, -1, -2)) if kernel else a
    index[name] = {"path": p, "transposed": kernel}
    return module_name(name) if kernel else None


def quantized_items(tensors, names, out: dict, index: dict, unquantized: list):
    """``(path, tensor name, QArray)`` of each quantized tensor, in order; the others are
    stored in ``out`` / ``index`` as they are (:func:`plain_tensors`), their linear layers'
    modules appended to ``unquantized``."""
    for p, value in tensors.items():
        name = names(p)
        if isinstance(value, QArray):
            yield p, name, value
        elif module := plain_tensors(p, value, name, out, index):
            unquantized.append(module)


def module_name(name: str) -> str:
    return name.rpartition(".")[0] if name.endswith(".weight") else name


def write_config(folder: Path, added: dict) -> None:
    """``folder/config.json`` with ``added``'s keys (``quantization_config``, ``fp4lab``)
    set: a model's config already there (``architectures``, ``model_type``, ...) keeps its
    other keys, so an engine can still instantiate the model; written atomically."""
    with atomic(folder / "config.json") as tmp:
        tmp.write_text(json.dumps({**model_config(folder), **added}, indent=2) + "\n")


def model_config(folder: Path) -> dict:
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


def load_safetensors_dir(path: Path) -> dict:
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
            raise corrupt(f, f"its fp4lab.tensors index is not JSON ({e})") from None
    index = index or _guess_index(tensors)
    out = {}
    for name, info in index.items():
        try:
            out[info["path"]] = _st_value(name, info, tensors)
        except KeyError as e:
            raise corrupt(path, f"tensor {name!r} lacks {e}") from None
    return out


def _st_value(name: str, info: dict, tensors: dict[str, np.ndarray]) -> QArray | np.ndarray:
    """The array or QArray the index entry ``info`` of tensor ``name`` describes."""
    fmt = info.get("format")
    if fmt is None:
        a = tensors[name]
        return np.swapaxes(a, -1, -2) if info["transposed"] else a
    if name.endswith("_blocks"):
        blocks = tensors[name]
        codes = unpack(blocks.reshape(blocks.shape[:-2] + (-1,)))
        return qarray(codes, tensors[name[:-len("_blocks")] + "_scales"], fmt)
    module = name.rpartition(".")[0]
    return qarray(unpack(tensors[name]), tensors[f"{module}.weight_scale"], "nvfp4",
                   amax=np.float32(info["amax"]))
