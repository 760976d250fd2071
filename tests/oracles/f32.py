"""float32 arithmetic for the oracles: one IEEE-754 rounding (nearest-even) per operation,
as NumPy's float32 ``* / + - sqrt`` give it, and XLA:CPU's DAZ/FTZ emulated on request:
every float32 input (:meth:`Arith.f`) and result below ``2**-126`` in magnitude becomes a
zero of the same sign (:func:`ftz32`)."""

from __future__ import annotations

import numpy as np

__all__ = ["F32", "FLT_MAX", "FLT_MIN_NORMAL", "ftz32", "Arith"]

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)  # 3.4028235e38
FLT_MIN_NORMAL = F32(np.finfo(np.float32).tiny)  # 2**-126


def ftz32(a):
    """Flush float32 subnormals to a zero of the same sign (DAZ/FTZ emulation): values with
    ``|a| < 2**-126`` become ``copysign(0, a)``; zeros, normals, infinities and NaNs are
    returned unchanged. Always float32."""
    a = np.asarray(a, dtype=F32)
    return np.where(np.abs(a) < FLT_MIN_NORMAL, np.copysign(F32(0.0), a), a).astype(F32)


class Arith:
    """float32 arithmetic, one rounding per call; ``ftz``: flush subnormal results (and
    inputs, through :meth:`f`) to a signed zero."""

    def __init__(self, ftz: bool):
        self.ftz = ftz

    def f(self, a):
        """An input as float32, flushed under DAZ."""
        a = np.asarray(a, F32)
        return ftz32(a) if self.ftz else a

    def _op(self, fn, *args):
        with np.errstate(all="ignore"):
            return self.f(fn(*[np.asarray(a, F32) for a in args], dtype=F32))

    def mul(self, a, b):
        return self._op(np.multiply, a, b)

    def div(self, a, b):
        return self._op(np.divide, a, b)

    def add(self, a, b):
        return self._op(np.add, a, b)

    def sub(self, a, b):
        return self._op(np.subtract, a, b)

    def sqrt(self, a):
        return self._op(np.sqrt, a)

    def seqsum(self, a, axis=-1):
        """Sum along ``axis`` (keepdims), one element after the other from the first (never
        ``np.sum``'s pairwise order)."""
        a = np.moveaxis(np.asarray(a, F32), axis, 0)
        total = a[0]
        for i in range(1, a.shape[0]):
            total = self.add(total, a[i])
        return np.expand_dims(total, axis)
