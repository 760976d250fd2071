"""The collectives of compiled XLA programs, read from their HLO text."""

from __future__ import annotations

import math
import re
from collections import Counter

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(?P<shape>\S[^=]*?)\s+(?P<kind>" + "|".join(KINDS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\w+\[([\d,]*)\]")


def collectives(hlo: str) -> Counter:
    """``Counter`` of ``(kind, scalar)`` over the collective instructions of ``hlo`` (an async
    pair counts once, by its ``-start``); ``scalar``: every array the instruction returns has
    one element (an amax all-reduce, ``u32[1,1,1]``), as opposed to one that moves tensor
    data."""
    found = Counter()
    for m in _OP.finditer(hlo):
        shapes = _ARRAY.findall(m.group("shape"))
        one = [all(d == "1" for d in s.split(",") if d) for s in shapes]
        found[m.group("kind"), bool(one) and all(one)] += 1
    return found


def moved_elements(hlo: str) -> Counter:
    """The elements the tensor-moving collectives of ``hlo`` return, summed by kind (an
    async pair counts once): what they move, however XLA groups them into instructions."""
    found = Counter()
    for m in _OP.finditer(hlo):
        sizes = [math.prod(int(d) for d in s.split(",") if d) for s in
                 _ARRAY.findall(m.group("shape"))]
        if any(n > 1 for n in sizes):
            found[m.group("kind")] += sum(sizes)
    return found


def moving(counts: Counter) -> Counter:
    """The collectives of ``counts`` that move tensor data (not scalars), by kind."""
    return Counter({kind: n for (kind, scalar), n in counts.items() if not scalar})


def scalar(counts: Counter) -> Counter:
    """The scalar collectives of ``counts``, by kind."""
    return Counter({kind: n for (kind, s), n in counts.items() if s})


_TENSOR = re.compile(r"->\s*tensor<((?:\d+x)*)(\w+)>")
_STABLEHLO_BYTES = {"f64": 8, "i64": 8, "ui64": 8, "f32": 4, "i32": 4, "ui32": 4, "bf16": 2,
                    "f16": 2, "i16": 2, "ui16": 2, "i8": 1, "ui8": 1, "i1": 1}


def stablehlo_moved_bytes(text: str, op: str = "all_to_all") -> int:
    """The bytes the ``stablehlo.<op>`` operations of a lowered program return, summed: what
    the program sends, before a backend widens narrow types for its collectives (XLA:CPU's
    compiled all-to-alls move BF16 as float32 and FP8 as float16)."""
    total = 0.0
    for line in text.splitlines():
        if f'"stablehlo.{op}"' not in line:
            continue
        for dims, dtype in _TENSOR.findall(line):
            size = _STABLEHLO_BYTES.get(dtype) or (1 if dtype.startswith("f8") else
                                                   0.5 if dtype.startswith("f4") else None)
            if size is None:
                raise ValueError(f"stablehlo_moved_bytes: element type {dtype!r}")
            n = 1
            for d in filter(None, dims.split("x")):
                n *= int(d)
            total += n * size
    return int(total)
