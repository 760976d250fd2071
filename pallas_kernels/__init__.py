"""Pallas GPU kernels for fp4lab's hot paths, each equal to its fp4lab reference bit for bit.

They register into fp4lab's kernel table (:func:`register`, called through the
``fp4lab.kernels`` entry point); fp4lab never imports this package.

* :mod:`pallas_kernels.quantize`: NVFP4 (1D 16-blocks; 2D 16x16 weight tiles writing the
  row-wise and the transposed copy in one pass), MXFP8 (E4M3/E5M2, rceil/floor) and MXFP4
  quantization along the last axis, and dequantization to BF16. Reference:
  :func:`fp4lab.quantize` / :func:`fp4lab.dequantize`.
* :mod:`pallas_kernels.common`: the exact building blocks (bit-level abs-max, correctly
  rounded division through PTX ``div.rn.f32``, E2M1 rounding and packing).

Kernels run compiled through Pallas' Triton backend on NVIDIA GPUs and in interpret mode
elsewhere (``interpret=None`` picks by backend), which is how CI tests them; CI also lowers
each kernel for an abstract H200 so that a kernel that stops lowering fails without a GPU.
"""


def register() -> None:
    """Register these kernels in fp4lab's kernel table (:mod:`fp4lab.numerics.backend`). fp4lab
    calls it through the ``fp4lab.kernels`` entry point; calling it again changes nothing."""
    from fp4lab.numerics import backend
    from pallas_kernels import quantize, rht

    for kernel in (*quantize.KERNELS, rht.KERNEL):
        backend.register(kernel)
