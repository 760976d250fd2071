"""Quantize float32 rows with llama.cpp's own C code (run by the consumers' Python,
scripts/consumer-venv, where llama-cpp-python built llama.cpp; never by fp4lab's):

    python tests/consumers/ggml_quantize.py Q4_0|Q8_0 ROWS.npy OUT.npy

``ggml_quantize_chunk`` of libggml-base (shipped in llama-cpp-python's ``llama_cpp/lib``),
called through ctypes, quantizes each row of the float32 ``[rows, n]`` array as llama.cpp's
``llama-quantize`` does without an importance matrix (``quantize_row_q4_0_ref`` /
``quantize_row_q8_0_ref`` of ggml-quants.c); ``OUT.npy`` holds the bytes, ``[rows, n / 32 *
block bytes]`` uint8.
"""

import ctypes
import importlib.util
import sys
from pathlib import Path

import numpy as np

GGML_TYPES = {"Q4_0": (2, 18), "Q8_0": (8, 34)}  # enum ggml_type, bytes per block of 32


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
    return ggml


def quantize(rows: np.ndarray, qtype: str) -> np.ndarray:
    ggml_type, size = GGML_TYPES[qtype]
    rows = np.ascontiguousarray(rows, np.float32)
    n_rows, n = rows.shape
    out = np.zeros((n_rows, n // 32 * size), np.uint8)
    written = libggml_base().ggml_quantize_chunk(ggml_type, rows.ctypes.data, out.ctypes.data,
                                                 0, n_rows, n, None)
    assert written == out.size, (written, out.size)
    return out


if __name__ == "__main__":
    qtype, rows, out = sys.argv[1:]
    np.save(out, quantize(np.load(rows), qtype))
    print(f"{qtype}: {np.load(rows).shape[0]} rows quantized by {libggml_base()._name}")
