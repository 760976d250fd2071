"""The quantized GEMM: the six operands of a training GEMM (``operands``), how a recipe
quantizes each (``recipe``), dimension numbers as one canonical batched GEMM
(``canonical``), the operand quantization every core GEMM shares (``operand_quant``), the
custom_vjp GEMM and the features composed around it (``qdot``: ``qdot_general``,
``qeinsum``), einsum parsing (``einsum``) and what is stored for the backward pass
(``saved``)."""
