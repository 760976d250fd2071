"""Which implementation quantizes: the XLA reference or a Pallas kernel.

``backend="auto"`` (the default everywhere) uses the Pallas kernels of ``pallas_kernels``
when JAX's default backend is a GPU and a kernel covers the request, and otherwise the XLA
reference, with the reason reported once per distinct case as a :class:`KernelFallback`
warning (on a machine without a GPU the XLA path is simply the path, and nothing is said).
``"xla"`` always takes the reference; ``"pallas"`` always takes the kernel (compiled on a
GPU, interpret mode elsewhere) and raises when none covers the request.

The kernels equal the reference bit for bit (round to nearest), so the choice changes speed,
not results; stochastic rounding kernels are unbiased and deterministic per key but draw other
random bits than ``jax.random``.
"""

from __future__ import annotations

import warnings

import jax

__all__ = ["BACKENDS", "KernelFallback", "choose", "values_axis"]

BACKENDS = ("auto", "xla", "pallas")
_warned: set[str] = set()


class KernelFallback(UserWarning):
    """``backend="auto"`` on a GPU fell back to XLA; the message says why."""


def _kernel_reason(fmt, axis_from_end: int, tile, rounding: str, extra: str | None):
    if extra:
        return extra
    from pallas_kernels.quantize import supports

    return supports(fmt, axis_from_end, tile, rounding)


def values_axis(fmt, axis_from_end: int, tile) -> int:
    """The block axis a kernel sees when only the dequantized values are wanted
    (``fake_quant``): any 1D block axis can be moved last and back (same blocks, same bits)."""
    return -1 if tile is None and fmt.granularity == "block" else axis_from_end


def choose(backend: str, fmt, *, axis_from_end: int = -1, tile=None, rounding="nearest",
           unsupported: str | None = None, strict: bool = True) -> str:
    """``"xla"`` or ``"pallas"`` for this request (see the module docstring).

    ``unsupported``: a reason the caller already knows the kernel path cannot serve.
    ``strict=False``: ``"pallas"`` falls back like ``"auto"`` (with the warning) instead of
    raising; a GEMM uses it so that one operand without a kernel does not fail the GEMM."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "xla" or fmt.is_passthrough:
        return "xla"
    if backend == "auto" and jax.default_backend() != "gpu":
        return "xla"
    reason = _kernel_reason(fmt, axis_from_end, tile, rounding, unsupported)
    if reason is None:
        return "pallas"
    if backend == "pallas" and strict:
        raise ValueError(f"backend='pallas': no kernel for {fmt.name}: {reason}")
    msg = f"fp4lab: {fmt.name} quantization runs in XLA, not a Pallas kernel: {reason}"
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, KernelFallback, stacklevel=3)
    return "xla"
