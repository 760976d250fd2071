"""The collectives of compiled XLA programs, read from their HLO text."""

from __future__ import annotations

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


def moving(counts: Counter) -> Counter:
    """The collectives of ``counts`` that move tensor data (not scalars), by kind."""
    return Counter({kind: n for (kind, scalar), n in counts.items() if not scalar})


def scalar(counts: Counter) -> Counter:
    """The scalar collectives of ``counts``, by kind."""
    return Counter({kind: n for (kind, s), n in counts.items() if s})
