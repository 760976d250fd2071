"""Two-operand einsum specs as ``dot_general`` dimension numbers (what ``qeinsum`` needs).

Letters in both inputs and the output are batch dims, letters in both inputs only are
contracted; ellipses stand for the same dims in every term (right-aligned, no size-1
broadcasting). A letter that appears in one input only and not in the output would be summed
alone: that is refused (sum it before the einsum).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["EinsumPlan", "plan_einsum"]


class EinsumPlan(NamedTuple):
    dimension_numbers: tuple  # for lax.dot_general(a, b, ...)
    out_perm: tuple[int, ...]  # transpose of dot_general's output into the spec's output


def _expand_ellipses(spec: str, ndim_a: int, ndim_b: int) -> tuple[str, str, str]:
    """``'...d,df->...f'`` -> ``('Ad', 'df', 'Af')``: explicit letters for the ellipsis dims
    (right-aligned between the operands, as numpy broadcasting aligns them)."""
    try:
        ins, out = spec.replace(" ", "").split("->")
        sa, sb = ins.split(",")
    except ValueError:
        raise ValueError(f"qeinsum spec {spec!r} must look like 'bsd,df->bsf' (two operands "
                         "and an explicit output)") from None
    if "." not in spec:
        return sa, sb, out
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in spec]
    n = [nd - (len(s) - 3) if "..." in s else 0 for s, nd in ((sa, ndim_a), (sb, ndim_b))]
    if min(n) < 0:
        raise ValueError(f"qeinsum spec {spec!r} does not match ranks {ndim_a} and {ndim_b}")
    letters = "".join(free[:max(n)])
    sa, sb = (s.replace("...", letters[len(letters) - k:]) for s, k in ((sa, n[0]), (sb, n[1])))
    return sa, sb, out.replace("...", letters)


def plan_einsum(spec: str, shape_a: tuple[int, ...], shape_b: tuple[int, ...]) -> EinsumPlan:
    """The ``dot_general`` of ``einsum(spec, a, b)`` and the output transpose after it."""
    sa, sb, out = _expand_ellipses(spec, len(shape_a), len(shape_b))
    for term, name in ((sa, "first operand"), (sb, "second operand"), (out, "output")):
        if not term.isalpha() and term:
            raise ValueError(f"qeinsum spec {spec!r}: the {name} {term!r} has characters "
                             "other than letters (and one '...')")
        repeated = sorted({c for c in term if term.count(c) > 1})
        if repeated:
            why = "" if name == "output" else " (a diagonal or trace, which a GEMM is not)"
            raise ValueError(f"qeinsum spec {spec!r}: {repeated} repeat in the {name}{why}")
    unknown = [c for c in out if c not in sa and c not in sb]
    if unknown:
        raise ValueError(f"qeinsum spec {spec!r}: output letters {unknown} are in neither "
                         "operand")
    if len(sa) != len(shape_a) or len(sb) != len(shape_b):
        raise ValueError(f"qeinsum spec {spec!r} does not match shapes {tuple(shape_a)} and "
                         f"{tuple(shape_b)}")
    for s, other, name in ((sa, sb, "first"), (sb, sa, "second")):
        lonely = [c for c in s if c not in out and c not in other]
        if lonely:
            raise ValueError(f"qeinsum spec {spec!r}: {lonely} of the {name} operand are "
                             "summed alone; sum them before the einsum")
    batch = [c for c in sa if c in sb and c in out]
    contract = [c for c in sa if c in sb and c not in out]
    dn = ((tuple(sa.index(c) for c in contract), tuple(sb.index(c) for c in contract)),
          (tuple(sa.index(c) for c in batch), tuple(sb.index(c) for c in batch)))
    produced = batch + [c for c in sa if c not in sb] + [c for c in sb if c not in sa]
    return EinsumPlan(dn, tuple(produced.index(c) for c in out))
