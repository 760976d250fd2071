"""Numerics: number formats as data, rounding onto their grids, block geometry, scale
schemes, the QArray, quantize/dequantize/fake_quant, the Hadamard transform, the metrics of
a quantized tensor and the kernel table the quantizers dispatch through. Nothing here knows
of GEMMs, recipes or models."""
