"""The six operands of a quantized GEMM's forward and backward: the one table that recipes,
the quantized GEMM, probes and amax histories iterate (a bottom module: it imports nothing of
fp4lab's)."""

from __future__ import annotations

from typing import Literal, NamedTuple

__all__ = ["Operand", "OPERAND_TABLE", "OPERANDS"]


class Operand(NamedTuple):
    """One of the six GEMM operands: its ``name``, the ``gemm`` it feeds, the tensor whose
    ``role`` it plays (``x``, ``w`` or ``dy``) and its quantization ``axis`` on the canonical
    tensors ``X: (B, M, K)``, ``W: (B, K, N)``, ``dY: (B, M, N)`` (the GEMM's reduction)."""

    name: str
    gemm: Literal["fprop", "dgrad", "wgrad"]
    role: Literal["x", "w", "dy"]
    axis: int


# The one table of operands that the quantized GEMM, the probes and the recipes iterate.
OPERAND_TABLE = (
    Operand("fprop_x", "fprop", "x", -1),  # Y = X W, along K
    Operand("fprop_w", "fprop", "w", 1),
    Operand("dgrad_dy", "dgrad", "dy", -1),  # dX = dY W^T, along N
    Operand("dgrad_w", "dgrad", "w", -1),
    Operand("wgrad_x", "wgrad", "x", 1),  # dW = X^T dY, along the tokens M
    Operand("wgrad_dy", "wgrad", "dy", 1),
)
OPERANDS = tuple(o.name for o in OPERAND_TABLE)
