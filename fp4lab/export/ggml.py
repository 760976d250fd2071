"""The ``gguf`` layout (llama.cpp): GGML's block types as a table, each with the fp4lab
formats it holds, its bytes both ways and what it refuses; the file written by the ``gguf``
package's writer and read by its reader (docs/export.md has every byte).

============  =====================  ==========================================================
GGML type     fp4lab formats         one block along K (ggml-common.h)
============  =====================  ==========================================================
``Q4_0``      ``int4_q4_0``          32 values: float16 ``d``, 16 bytes, byte j = q_j + 8 |
                                     (q_{j+16} + 8) << 4
``Q8_0``      ``int8_q8_0``          32 values: float16 ``d``, 32 int8 codes
``MXFP4``     ``mxfp4``,             32 values: the E8M0 byte, 16 bytes, byte j = E2M1 code j |
              ``mxfp4_floor``        code j+16 << 4
``NVFP4``     ``nvfp4``              64 values: four UE4M3 scale bytes (one per 16), 32 bytes,
                                     byte 8s + j = code 16s + j | code 16s + j + 8 << 4; the
                                     per-tensor factor in the F32 tensor ``<name>.scale``
============  =====================  ==========================================================
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from fp4lab.export.blocks import (F32, NVFP4_FACTOR, PARSE_ERRORS, Blocks, blocks, corrupt,
                                  is_kernel, nvfp4_amax, nvfp4_block_factors,
                                  nvfp4_decode_scale, pack, plain, qarray, require, unpack)
from fp4lab.files import atomic
from fp4lab.numerics.qarray import QArray


@dataclasses.dataclass(frozen=True)
class GGMLType:
    """One GGML block type: the fp4lab ``formats`` written as it, ``block`` values a block
    in ``size`` bytes; ``check(path, blocks)`` refuses what it cannot hold, ``to_bytes``
    gives ``[..., out, in / block * size]`` bytes, ``from_bytes`` the ``[..., out, in]``
    codes and ``[..., out, in / sub-block]`` scales of ``[..., out, n, size]`` blocks."""

    name: str
    formats: tuple[str, ...]
    block: int
    size: int
    file_type: str  # gguf.LlamaFileType, for general.file_type
    check: Callable[[str, Blocks], None]
    to_bytes: Callable[[Blocks], np.ndarray]
    from_bytes: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def _grouped(a: np.ndarray, n: int) -> np.ndarray:
    """``[..., out, m]`` as ``[..., out, m / n, n]``."""
    return a.reshape(a.shape[:-1] + (-1, n))


def _f16_bytes(scales: np.ndarray) -> np.ndarray:
    return scales.astype(np.float16).view(np.uint8).reshape(scales.shape + (2,))


def _finite_f16(path: str, b: Blocks) -> None:
    bad = ~np.isfinite(b.scales.astype(np.float32))
    if bad.any():
        raise ValueError(f"{path}: {int(bad.sum())} block(s) of {b.block} have a non-finite "
                         "float16 scale (a NaN or infinite weight, or a block maximum "
                         "beyond the float16 scale's range); llama.cpp would read NaN or "
                         "infinite weights there")


def _q4_0_bytes(b: Blocks) -> np.ndarray:
    """Two's complement nibbles -> GGML's ``q + 8`` (``code ^ 8``), halves of 32 a byte."""
    qs = _grouped(pack(b.codes ^ 8, halves=32), 16)
    return np.concatenate([_f16_bytes(b.scales), qs], -1).reshape(b.codes.shape[:-1] + (-1,))


def _q4_0_from(blk: np.ndarray):
    d = blk[..., :2].copy().view(np.float16)[..., 0]
    codes = unpack(blk[..., 2:], halves=32) ^ 8
    return codes.reshape(codes.shape[:-2] + (-1,)), d


def _q8_0_bytes(b: Blocks) -> np.ndarray:
    q = _grouped(b.codes.astype(np.int8).view(np.uint8), 32)
    return np.concatenate([_f16_bytes(b.scales), q], -1).reshape(b.codes.shape[:-1] + (-1,))


def _q8_0_from(blk: np.ndarray):
    d = blk[..., :2].copy().view(np.float16)[..., 0]
    codes = blk[..., 2:].copy().view(np.int8)
    return codes.reshape(codes.shape[:-2] + (-1,)), d


def _mxfp4_check(path: str, b: Blocks) -> None:
    if (b.scales == 255).any():
        raise ValueError(f"{path}: {int((b.scales == 255).sum())} block(s) hold NaN (E8M0 "
                         "0xFF), which llama.cpp refuses (ggml_validate_row_data) and reads "
                         "as 2^128 (ggml_e8m0_to_fp32_half)")


def _mxfp4_bytes(b: Blocks) -> np.ndarray:
    qs = _grouped(pack(b.codes, halves=32), 16)
    e = b.scales.astype(np.uint8)[..., None]
    return np.concatenate([e, qs], -1).reshape(b.codes.shape[:-1] + (-1,))


def _mxfp4_from(blk: np.ndarray):
    codes = unpack(blk[..., 1:], halves=32)
    return codes.reshape(codes.shape[:-2] + (-1,)), blk[..., 0].copy()


def _nvfp4_check(path: str, b: Blocks) -> None:
    """What GGML's NVFP4 cannot hold: a K that is not a whole number of 64, a non-finite
    amax, a scale byte GGML reads as another value (UE4M3 has no sign: a negative scale or
    -0 would lose its sign, and both E4M3 NaNs read as 0 or 240), and a block whose fp4lab
    decode factor ``fl(s_b * amax) * fl(1/2688)`` overflows (llama.cpp's stays finite)."""
    if b.codes.shape[-1] % 64:
        raise ValueError(f"{path}: K = {b.codes.shape[-1]} is not a whole number of GGML "
                         "NVFP4's 64-blocks (four scales of 16)")
    nvfp4_amax(path, b)
    byte = b.scales.view(np.uint8)
    bad = (byte >= 0x80) | (byte == 0x7F)
    if bad.any():
        raise ValueError(f"{path}: {int(bad.sum())} block scale(s) are negative, -0 or NaN "
                         f"(E4M3 bytes {sorted(set(byte[bad].tolist()))[:4]}); GGML's UE4M3 "
                         "scale has no sign and no NaN")
    if not np.isfinite(nvfp4_block_factors(b)).all():
        raise ValueError(f"{path}: the tensor amax {b.amax} makes fp4lab's decode factor "
                         "fl(s_b * amax) * fl(1/2688) overflow to inf; llama.cpp's weight "
                         "(q * s_b, then the .scale tensor) would be finite there")


def _nvfp4_bytes(b: Blocks) -> np.ndarray:
    d = _grouped(b.scales.view(np.uint8), 4)
    qs = _grouped(pack(b.codes, halves=16), 32)
    return np.concatenate([d, qs], -1).reshape(b.codes.shape[:-1] + (-1,))


def _nvfp4_from(blk: np.ndarray):
    codes = unpack(blk[..., 4:], halves=16)
    d = blk[..., :4].copy().view(ml_dtypes.float8_e4m3fn)
    return (codes.reshape(codes.shape[:-2] + (-1,)), d.reshape(d.shape[:-2] + (-1,)))


TYPES = (
    GGMLType("Q4_0", ("int4_q4_0",), 32, 18, "MOSTLY_Q4_0", _finite_f16, _q4_0_bytes,
             _q4_0_from),
    GGMLType("Q8_0", ("int8_q8_0",), 32, 34, "MOSTLY_Q8_0", _finite_f16, _q8_0_bytes,
             _q8_0_from),
    GGMLType("MXFP4", ("mxfp4", "mxfp4_floor"), 32, 17, "MOSTLY_MXFP4_MOE", _mxfp4_check,
             _mxfp4_bytes, _mxfp4_from),
    GGMLType("NVFP4", ("nvfp4",), 64, 36, "MOSTLY_NVFP4", _nvfp4_check, _nvfp4_bytes,
             _nvfp4_from),
)
BY_FORMAT = {f: t for t in TYPES for f in t.formats}
BY_NAME = {t.name: t for t in TYPES}
FORMATS = tuple(BY_FORMAT)
_PLAIN = ("F32", "F16", "BF16")
_FLOATS = {"bfloat16": "MOSTLY_BF16", "float16": "MOSTLY_F16", "float32": "ALL_F32"}

# the weights whose "<name>.scale" llama.cpp loads (llama-model.cpp, load_tensors: the
# generic pass over the layers, and the output weight when it is NVFP4)
LLAMA_SCALED = re.compile(
    r"output\.weight|blk\.\d+\.(attn_(q|k|v|output|qkv|gate)|ffn_(gate|up|down)"
    r"(_shexp|_exps)?|ssm_(in|out|alpha|beta)|nextn\.(eh_proj|shared_head_head))\.weight")


def ggml_bytes(path: str, q: QArray) -> tuple[GGMLType, Blocks, np.ndarray]:
    """A quantized kernel's GGML type, block form and bytes; what the type cannot hold is
    refused, naming the tensor."""
    t = BY_FORMAT.get(q.format.name)
    if t is None:
        known = ", ".join(f"{f} ({t.name})" for f, t in BY_FORMAT.items())
        raise ValueError(f"{path}: format {q.format.name!r} has no GGUF type; GGUF takes "
                         f"{known} or a pass-through dtype")
    b = blocks(path, q)
    t.check(path, b)
    return t, b, t.to_bytes(b)


def scale_name(name: str) -> str:
    """The name of an NVFP4 weight's per-tensor scale tensor, as llama.cpp's converter
    writes it: ``blk.0.ffn_up.weight`` -> ``blk.0.ffn_up.scale``."""
    return (name[: -len(".weight")] if name.endswith(".weight") else name) + ".scale"


def nvfp4_scale(b: Blocks) -> np.ndarray:
    """The ``.scale`` tensor of an NVFP4 kernel: F32, one value per leading index (an expert
    stack's ``[experts]``, else ``[1]``): ``fl(amax / 2688)`` (ModelOpt's
    ``weight_scale_2``), 1 when amax is 0 (fp4lab's dequantization is ``q * s_b`` there)."""
    c = F32(1) if b.amax == 0 else nvfp4_decode_scale(b.amax)
    return np.full(b.codes.shape[:-2] or (1,), c, np.float32)


# ---------------------------------------------------------------------------- the writer


def save_gguf(tensors, path: Path, names, metadata, *, arch: str = "fp4lab") -> None:
    """Write ``tensors`` as the GGUF file ``path`` (atomically, once every tensor passed)."""
    gguf = require("gguf")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic(path) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch)
        index = _add_tensors(gguf, writer, tensors, names, arch)
        writer.add_string("fp4lab.tensors", json.dumps(index, sort_keys=True))
        writer.add_file_type(_file_type(gguf, index))
        for key, v in (metadata or {}).items():
            if key.split(".")[0] in (arch, "general", "tokenizer"):  # a key the reader knows
                _add_typed(gguf, writer, key, v)
            else:
                writer.add_string(f"fp4lab.{key}", v if isinstance(v, str) else json.dumps(v))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def _add_tensors(gguf, writer, tensors, names, arch: str) -> dict:
    """Add every tensor (an NVFP4 weight with its ``.scale``; an expert stack, a tuple of
    one QArray per expert, as one tensor ``[experts, out, in]``, its ``.scale`` one value
    per expert); returns the index."""
    index, taken = {}, {names(p) for p in tensors}
    for p, value in tensors.items():
        name = names(p)
        if not isinstance(value, (QArray, tuple)):
            index[name] = _add_plain(gguf, writer, p, name, value)
            continue
        stack = isinstance(value, tuple)
        parts = ([ggml_bytes(f"{p}[{e}]", q) for e, q in enumerate(value)] if stack
                 else [ggml_bytes(p, value)])
        kinds = {t.name for t, _, _ in parts}
        if len(kinds) != 1:
            raise ValueError(f"{p}: an expert stack of several GGML types {sorted(kinds)}")
        t = parts[0][0]
        raw = np.stack([r for _, _, r in parts]) if stack else parts[0][2]
        writer.add_tensor(name, raw, raw_dtype=getattr(gguf.GGMLQuantizationType, t.name))
        index[name] = {"path": p, "transposed": True,
                       "format": (value[0] if stack else value).format.name,
                       **({"experts": len(value)} if stack else {})}
        if t.name == "NVFP4":
            s = scale_name(name)
            _check_scale_name(p, name, s, taken, arch)
            writer.add_tensor(s, np.concatenate([nvfp4_scale(b) for _, b, _ in parts]))
            amax = [float(b.amax) for _, b, _ in parts]
            index[name] |= {"amax": amax if stack else amax[0], "scale": s}
    return index


def _check_scale_name(p: str, name: str, s: str, taken: set, arch: str) -> None:
    if s in taken:
        raise ValueError(f"{p}: its NVFP4 scale tensor {s!r} has the name of another tensor")
    if arch != "fp4lab" and not LLAMA_SCALED.fullmatch(name):
        raise ValueError(f"{p}: llama.cpp loads the per-tensor scale of an NVFP4 weight only "
                         f"for output.weight and a layer's attn/ffn/ssm/nextn projections "
                         f"(blk.N.ffn_up.weight, ...); for {name!r} it would not load "
                         f"{s!r} (and would refuse the file's extra tensor): keep that "
                         "weight out of NVFP4")


def _add_plain(gguf, writer, p: str, name: str, value) -> dict:
    a = plain(value)
    kernel = is_kernel(p, a)
    a = np.ascontiguousarray(np.swapaxes(a, -1, -2) if kernel else a)
    if a.dtype == ml_dtypes.bfloat16:
        writer.add_tensor(name, a.view(np.uint16), raw_dtype=gguf.GGMLQuantizationType.BF16)
    elif a.dtype in (np.float16, np.float32):
        writer.add_tensor(name, a)
    else:
        raise TypeError(f"{p}: dtype {a.dtype}; GGUF takes float32, float16 or bfloat16")
    return {"path": p, "transposed": kernel, "format": str(a.dtype)}


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
        kind = kinds.pop()  # an int array is UINT32, INT32 when a value is negative
        sub = (T.INT32 if kind is int and min(v) < 0 else
               {bool: T.BOOL, int: T.UINT32, float: T.FLOAT32, str: T.STRING}[kind])
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


def _file_type(gguf, index: dict) -> int:
    """llama.cpp's ``general.file_type``: the type of most quantized weights, else of the
    kernels (BF16, F16, F32)."""
    kinds = [v["format"] for v in index.values() if v["transposed"]]
    by_format = {f: t.file_type for f, t in BY_FORMAT.items()} | _FLOATS
    found = [getattr(gguf.LlamaFileType, by_format[k]) for k in kinds if k in by_format]
    return int(max(set(found), key=found.count)) if found else int(gguf.LlamaFileType.ALL_F32)


# ---------------------------------------------------------------------------- the reader


def _reader(gguf, path: Path):
    """gguf's reader of ``path`` and fp4lab's index (None for a file made elsewhere); a
    truncated or corrupt file is a ValueError naming it, and the tensor whose bytes the
    file lacks."""

    class Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            for f in fields:  # parts: name length, name, n_dims, dims, GGML type, offset
                name, dims, kind, offset = (f.parts[i] for i in (1, 3, 4, 5))
                block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(kind[0]))]
                end = start_offs + int(offset[0]) + math.prod(map(int, dims)) * size // block
                if end > len(self.data):
                    raise corrupt(path, f"tensor {bytes(name).decode()!r} ends at byte {end}, "
                                        f"past the end of the file ({len(self.data)} bytes)")
            super()._build_tensors(start_offs, fields)

    try:
        reader = Reader(str(path))
        field = reader.fields.get("fp4lab.tensors")
        index = (None if field is None else
                 json.loads(bytes(field.parts[field.data[0]]).decode()))
    except PARSE_ERRORS as e:
        raise (e if "truncated or corrupt" in str(e) else corrupt(path, e)) from None
    return reader, index


def load_gguf(path: Path) -> dict:
    """A GGUF file's tensors: QArrays for the GGML block types (``[..., in, out]``; an expert
    stack written from a tuple of QArrays, a tuple again), arrays for the rest, keyed by
    parameter path (fp4lab's index) or by tensor name."""
    reader, index = _reader(require("gguf"), path)
    by_name = {t.name: t for t in reader.tensors}
    index = index or _guess_index(path, by_name)
    scales = {info["scale"] for info in index.values() if "scale" in info}
    out = {}
    for t in reader.tensors:
        if t.name in scales:
            continue
        info, kind = index[t.name], t.tensor_type.name
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists ne0 (the last axis) first
        if kind in BY_NAME:
            out[info["path"]] = _qarray_of(BY_NAME[kind], np.asarray(t.data), shape, info)
            continue
        a = np.asarray(t.data)
        a = (a.view(ml_dtypes.bfloat16) if kind == "BF16" else a).reshape(shape)
        out[info["path"]] = np.swapaxes(a, -1, -2) if info["transposed"] else a
    return out


def _qarray_of(t: GGMLType, raw: np.ndarray, shape_out_in, info: dict
               ) -> QArray | tuple[QArray, ...]:
    """A weight's QArray; an expert stack's (``experts`` in the index) one per expert, each
    with its own amax, as :func:`save_gguf` was given it."""
    codes, scales = t.from_bytes(raw.reshape(shape_out_in[:-1] + (-1, t.size)))
    fmt = info.get("format") or t.formats[0]
    codes = codes.reshape(shape_out_in)
    if "experts" not in info:
        return qarray(codes, scales, fmt, amax=info.get("amax"))
    amax = info.get("amax") or [None] * len(codes)
    return tuple(qarray(c, s, fmt, amax=a) for c, s, a in zip(codes, scales, amax, strict=True))


def _guess_index(path: Path, by_name: dict) -> dict:
    """The index of a file made elsewhere: every tensor keyed by its name, a GGML block
    type's as its ``[in, out]`` kernel; an NVFP4 weight's amax from its ``.scale`` tensor
    (``fl(scale * 2688)``; 2688 without one, where fp4lab's dequantization is ``q * s_b``,
    GGML's own)."""
    index = {}
    for name, t in by_name.items():
        kind = t.tensor_type.name
        if kind not in BY_NAME and kind not in _PLAIN:
            raise ValueError(f"{str(path)!r}: tensor {name!r} is GGML {kind}; fp4lab reads "
                             f"{', '.join(BY_NAME)}, {', '.join(_PLAIN)}")
        index[name] = {"path": name, "transposed": kind in BY_NAME}
        if kind != "NVFP4":
            continue
        s = scale_name(name)
        c = np.unique(np.asarray(by_name[s].data, np.float32)) if s in by_name else [F32(1)]
        if len(c) != 1:
            raise ValueError(f"{str(path)!r}: tensor {s!r} holds {len(c)} different scales "
                             "(one per expert); a QArray has one tensor amax")
        index[name] |= {"amax": float(F32(c[0]) * NVFP4_FACTOR)}
        if s in by_name:
            index[name]["scale"] = s
    return index
