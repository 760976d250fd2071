"""Quantize float32 rows, and dequantize GGML blocks, with llama.cpp's own C code (run by
the consumers' Python, scripts/consumer-venv, where llama-cpp-python built llama.cpp; never
by fp4lab's):

    python tests/consumers/ggml_quantize.py Q4_0|Q8_0|MXFP4|NVFP4 ROWS.npy OUT.npy
    python tests/consumers/ggml_quantize.py dequantize Q4_0|Q8_0|MXFP4|NVFP4 BYTES.npy OUT.npy

Quantizing: ``ggml_quantize_chunk`` of libggml-base (shipped in llama-cpp-python's
``llama_cpp/lib``), called through ctypes, quantizes each row of the float32 ``[rows, n]``
array as llama.cpp's ``llama-quantize`` does without an importance matrix
(``quantize_row_q4_0_ref``, ``quantize_row_q8_0_ref``, ``quantize_row_mxfp4_ref``,
``quantize_row_nvfp4_ref`` of ggml-quants.c); ``OUT.npy`` holds the bytes, ``[rows, n /
block * block bytes]`` uint8.

Dequantizing: ``ggml_validate_row_data`` (what llama.cpp's loader checks) must accept the
``[rows, bytes]`` uint8 blocks, then the type's ``to_float`` from ``ggml_get_type_traits``
(``dequantize_row_q4_0``, ..., ``dequantize_row_nvfp4``) gives ``OUT.npy``, float32 ``[rows,
n]``: the weight llama.cpp's CPU backend computes with (an NVFP4 weight before its
per-tensor ``.scale``, which llama.cpp multiplies into the matmul's output).
"""

import ctypes
import importlib.util
import sys
from pathlib import Path

import numpy as np

# enum ggml_type (ggml.h), values per block, bytes per block (ggml-common.h)
GGML_TYPES = {"Q4_0": (2, 32, 18), "Q8_0": (8, 32, 34), "MXFP4": (39, 32, 17),
              "NVFP4": (40, 64, 36)}


class TypeTraits(ctypes.Structure):
    """``struct ggml_type_traits`` (ggml.h)."""

    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


def libggml_base() -> ctypes.CDLL:
    lib = Path(importlib.util.find_spec("llama_cpp").submodule_search_locations[0]) / "lib"
    found = sorted(lib.glob("libggml-base.*"))
    if not found:
        raise FileNotFoundError(f"no libggml-base in {lib}")
    ggml = ctypes.CDLL(str(found[0]))
    ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
    ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_void_p]
    ggml.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
    ggml.ggml_get_type_traits.argtypes = [ctypes.c_int]
    ggml.ggml_validate_row_data.restype = ctypes.c_bool
    ggml.ggml_validate_row_data.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    return ggml


def _traits(ggml, qtype: str) -> TypeTraits:
    """The type's traits, checked against the sizes this script (and fp4lab) assume."""
    ggml_type, block, size = GGML_TYPES[qtype]
    t = ggml.ggml_get_type_traits(ggml_type).contents
    assert (t.type_name.decode().upper(), t.blck_size, t.type_size) == (qtype, block, size), (
        t.type_name, t.blck_size, t.type_size)
    return t


def quantize(rows: np.ndarray, qtype: str) -> np.ndarray:
    ggml = libggml_base()
    _traits(ggml, qtype)
    ggml_type, block, size = GGML_TYPES[qtype]
    rows = np.ascontiguousarray(rows, np.float32)
    n_rows, n = rows.shape
    out = np.zeros((n_rows, n // block * size), np.uint8)
    written = ggml.ggml_quantize_chunk(ggml_type, rows.ctypes.data, out.ctypes.data, 0, n_rows,
                                       n, None)
    assert written == out.size, (written, out.size)
    return out


def dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    ggml = libggml_base()
    to_float = TO_FLOAT(_traits(ggml, qtype).to_float)
    ggml_type, block, size = GGML_TYPES[qtype]
    raw = np.ascontiguousarray(raw, np.uint8)
    n_rows, n_bytes = raw.shape
    if not ggml.ggml_validate_row_data(ggml_type, raw.ctypes.data, raw.size):
        raise ValueError(f"ggml_validate_row_data refuses these {qtype} blocks")
    out = np.empty((n_rows, n_bytes // size * block), np.float32)
    to_float(raw.ctypes.data, out.ctypes.data, out.size)
    return out


if __name__ == "__main__":
    if sys.argv[1] == "dequantize":
        qtype, blocks, out = sys.argv[2:]
        np.save(out, dequantize(np.load(blocks), qtype))
        print(f"{qtype}: {np.load(blocks).shape[0]} rows dequantized by {libggml_base()._name}")
    else:
        qtype, rows, out = sys.argv[1:]
        np.save(out, quantize(np.load(rows), qtype))
        print(f"{qtype}: {np.load(rows).shape[0]} rows quantized by {libggml_base()._name}")
