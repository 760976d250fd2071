"""The kernel table: which implementation serves a request, the XLA reference or a kernel.

Kernels are registered here by data, as Transformer Engine's scaling modes carry their block
dims: a :class:`Kernel` says which scale scheme, elements, blocks, tiles, roundings, axis,
transform and input ranks it serves, and :func:`decide` (the one place that chooses, as TE's
``_quantize_impl`` does) matches a :class:`Request` against the table. ``fp4lab`` never
imports a kernel package: ``pallas_kernels`` registers its kernels through the
``fp4lab.kernels`` entry point (loaded the first time a kernel could serve, on a GPU or with
``backend="pallas"``), or explicitly with ``pallas_kernels.register()``.

``backend="auto"`` (the default everywhere) takes a kernel when JAX's default backend is a
GPU and one serves the request, and otherwise the XLA reference, with the reason reported
once per distinct case as a :class:`KernelFallback` warning (on a machine without a GPU the
XLA path is simply the path, and nothing is said). ``"xla"`` always takes the reference;
``"pallas"`` always takes a kernel (compiled on a GPU, interpret mode elsewhere) and raises
when none serves the request.

The kernels equal the reference bit for bit, stochastic rounding included (both draw
:mod:`fp4lab.numerics.random_bits` at each element's logical position), so the choice changes
speed, not results.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import warnings
from collections.abc import Callable
from typing import Literal

import jax

from fp4lab.numerics.formats import ElementFormat, Format
from fp4lab.numerics.random_bits import COUNTER_LIMIT

__all__ = ["BACKENDS", "KernelFallback", "Request", "Kernel", "register", "kernels", "decide",
           "find", "refusal"]

BACKENDS = ("auto", "xla", "pallas")
ENTRY_POINT_GROUP = "fp4lab.kernels"
Op = Literal["quantize", "dequantize", "rht_quantize"]


class KernelFallback(UserWarning):
    """``backend="auto"`` on a GPU fell back to XLA; the message says why."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """What is asked: ``op`` on an input of ``shape`` in ``format``, blocked along ``axis``
    (counted from the end) or in 2D ``tile``s, with ``rounding``, after a Hadamard transform
    of size ``transform`` (``rht_quantize``: ``shape`` is the (tokens, features) matrix and
    the transform runs along the tokens, ``axis=-2``)."""

    op: Op
    format: Format
    shape: tuple[int, ...]
    axis: int = -1
    tile: tuple[int, int] | None = None
    rounding: str = "nearest"
    transform: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Kernel:
    """A kernel and the requests it serves (every field but ``fn`` is data to match).

    ``fn``: ``quantize``: ``fn(x, fmt, *, axis, tile, global_amax, rounding, key) -> QArray``;
    ``dequantize``: ``fn(q, dtype) -> Array``; ``rht_quantize``: ``fn(x, fmt, key, *,
    rounding, signs) -> QArray`` of ``rht(x, axis=0).T`` quantized along its last axis."""

    name: str
    op: Op
    scheme: type
    elements: tuple[ElementFormat, ...]
    blocks: tuple[int, ...] = ()  # 1D block sizes (``Format.block``) served
    tiles: tuple[tuple[int, int] | None, ...] = (None,)  # None: 1D blocks
    roundings: tuple[str, ...] = ("nearest",)
    axes: tuple[int, ...] = (-1,)
    transforms: tuple[int | None, ...] = (None,)
    ndims: tuple[int, ...] | None = None  # input ranks served (None: any)
    fn: Callable = dataclasses.field(repr=False)  # compared by identity: jit-static safe

    def refusal(self, r: Request) -> str | None:
        """Why this kernel cannot serve ``r``, or ``None``."""
        fmt = r.format
        if not isinstance(fmt.scaling, self.scheme):
            return f"the {self.name} kernel serves {self.scheme.__name__} scales"
        if fmt.element not in self.elements:
            names = ", ".join(e.name for e in self.elements)
            return f"the {self.name} kernel serves {names} elements, not {fmt.element.name}"
        if r.tile not in self.tiles:
            served = ", ".join("1D blocks" if t is None else f"tile={t}" for t in self.tiles)
            return f"the {self.name} kernel serves {served}, not " + (
                "1D blocks" if r.tile is None else f"tile={r.tile}")
        if r.tile is None and fmt.block not in self.blocks:
            return (f"the {self.name} kernel serves blocks of "
                    f"{' or '.join(map(str, self.blocks))}, not {fmt.name}'s {fmt.block}")
        if r.rounding not in self.roundings:
            return f"the {self.name} kernel rounds {' or '.join(self.roundings)}, not " \
                   f"{r.rounding}"
        if r.axis not in self.axes:
            return f"the {self.name} kernel blocks axis {self.axes[0]}; axis={r.axis} " \
                   "(transpose first)"
        if r.transform not in self.transforms:
            return f"the {self.name} kernel takes transforms {self.transforms}, not " \
                   f"{r.transform}"
        if r.rounding == "stochastic" and _positions(r) >= COUNTER_LIMIT:
            return (f"the {self.name} kernel counts stochastic-rounding positions in 32 bits; "
                    f"shape {r.shape} has 2**32 elements or more")
        if self.ndims is not None and len(r.shape) not in self.ndims:
            return f"the {self.name} kernel takes rank {' or '.join(map(str, self.ndims))} " \
                   f"inputs, not shape {r.shape}"
        return None


def _positions(r: Request) -> int:
    """Elements of the quantized operand: the input's, its rows padded to the transform."""
    if r.transform and r.shape:
        rows = -(-r.shape[0] // r.transform) * r.transform
        return rows * math.prod(r.shape[1:])
    return math.prod(r.shape)


_TABLE: dict[str, Kernel] = {}
_loaded = False
_warned: set[str] = set()


def register(kernel: Kernel) -> None:
    """Add ``kernel`` to the table (a kernel of the same name is replaced)."""
    if not isinstance(kernel, Kernel):
        raise TypeError("register takes a fp4lab.numerics.backend.Kernel, got "
                        f"{type(kernel).__name__}")
    _TABLE[kernel.name] = kernel


def kernels() -> list[Kernel]:
    """The registered kernels (loading the ``fp4lab.kernels`` entry points first)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            ep.load()()
    return list(_TABLE.values())


def _lookup(r: Request, table=None) -> tuple[Kernel | None, str]:
    if math.prod(r.shape) == 0:
        return None, "an empty array is quantized by XLA (its result is empty)"
    candidates = [k for k in (kernels() if table is None else table) if k.op == r.op]
    if not candidates:
        return None, f"no {r.op} kernel is registered (install or register pallas_kernels)"
    reasons = []
    for k in candidates:
        why = k.refusal(r)
        if why is None:
            return k, ""
        if isinstance(r.format.scaling, k.scheme):
            reasons.append(why)
    if not reasons:
        return None, f"no {r.op} kernel for {type(r.format.scaling).__name__} scales"
    return None, "; ".join(reasons)


def find(request: Request) -> Kernel | None:
    """The registered kernel that serves ``request``, if any (no backend mode, no warning)."""
    return _lookup(request)[0]


def refusal(request: Request, table: tuple[Kernel, ...] | None = None) -> str | None:
    """Why no registered kernel (or none of ``table``) serves ``request``, or ``None`` when
    one does."""
    kernel, why = _lookup(request, table)
    return None if kernel is not None else why


def decide(backend: str, request: Request, *, unsupported: str | None = None,
           strict: bool = True) -> Kernel | None:
    """The kernel that serves ``request``, or ``None`` for the XLA reference (see the module
    docstring). ``unsupported``: a reason the caller already knows no kernel can serve.
    ``strict=False``: ``"pallas"`` falls back like ``"auto"`` (with the warning) instead of
    raising; a GEMM uses it so that one operand without a kernel does not fail the GEMM."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; use one of {', '.join(BACKENDS)}")
    fmt = request.format
    if backend == "xla" or fmt.is_passthrough:
        return None
    if backend == "auto" and jax.default_backend() != "gpu":
        return None
    kernel, reason = (None, unsupported) if unsupported else _lookup(request)
    if kernel is not None:
        return kernel
    if backend == "pallas" and strict:
        raise ValueError(f"backend='pallas': no kernel for {fmt.name}: {reason}")
    msg = f"fp4lab: {fmt.name} {request.op} runs in XLA, not a kernel: {reason}"
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, KernelFallback, stacklevel=3)
    return None
