"""fp4lab: low-precision training numerics for JAX.

The layers, from the bottom up: ``formats`` (number formats as data), ``rounding`` (grids,
saturating casts, packing), ``scaling`` (scale schemes), ``quantize`` (QArray, quantize,
dequantize, fake_quant) and ``metrics`` (underflow, saturation, error, scale health).
"""

from fp4lab.formats import ELEMENTS, FORMATS, ElementFormat, Format, format_names, get_format
from fp4lab.metrics import quant_metrics
from fp4lab.quantize import QArray, dequantize, fake_quant, quantize

__version__ = "0.1.0"

__all__ = [
    "ELEMENTS",
    "FORMATS",
    "ElementFormat",
    "Format",
    "QArray",
    "dequantize",
    "fake_quant",
    "format_names",
    "get_format",
    "quant_metrics",
    "quantize",
]
