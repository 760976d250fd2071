"""Precision beyond the GEMM operands (docs/beyond_the_gemms.md): flash-style attention
with its BF16 rounding points (``attention``), the precision of the data-parallel gradient
reduction (``reduction``), the train/inference mismatch of rollouts (``mismatch``) and the
quantized all-to-all of an expert-parallel MoE layer's dispatch (``dispatch``)."""
