"""torchao's MXFP8 grouped GEMM (its MoE training path, emulated on CPU) on given operands, with
the operands it multiplies (run by the consumers' Python, scripts/consumer-venv):

    python tests/consumers/torchao_grouped.py IN.npz OUT.npz

``IN.npz``: ``x (M, K)`` rows sorted by expert, ``w (G, K, N)``, ``dy (M, N)``, ``sizes (G,)``,
and ``blocks (B, 32)``: rows for torchao's ``to_mx`` alone.
For each scale rule ``rceil`` and ``floor`` (torchao's ``ScaleCalculationMode``),
``torchao.prototype.moe_training.mxfp8_grouped_mm._MXFP8GroupedMM`` runs forward and backward
with ``kernel_preference=EMULATED`` (``to_mx`` per 1x32 block, the dequantized BF16 operands
multiplied by ``torch._grouped_mm``) and ``pad_token_groups_for_grouped_mm=True`` (each expert's
rows zero-padded to a multiple of 32 before quantizing, so no block holds two experts' tokens).
``OUT.npz`` holds, per rule (``<rule>/...``):

* ``y``, ``dx``, ``dw``: torchao's outputs (BF16, its emulation's only output dtype on CPU);
* ``fprop_a``, ``fprop_b``, ``dgrad_a``, ``dgrad_b``, ``wgrad_a``, ``wgrad_b``, ``*_offs``: the
  operands and group end offsets of its three ``torch._grouped_mm`` calls, recorded as torchao
  passes them (its padded token order), as float32;
* ``blocks``: ``blocks`` through ``to_mx`` (E4M3, one block per row) and its ``to_dtype``, float32.
"""

import sys

import numpy as np
import torch
from torchao.prototype.moe_training import mxfp8_grouped_mm
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
from torchao.quantization.quantize_.common import KernelPreference

GEMMS = ("fprop", "dgrad", "wgrad")  # the order torchao's forward and backward call them in


def run(x, w, dy, sizes, mode: ScaleCalculationMode) -> dict[str, np.ndarray]:
    calls = []
    grouped_mm = torch._grouped_mm

    def recording(a, b, offs=None, **kw):
        calls.append((a, b, offs))
        return grouped_mm(a, b, offs=offs, **kw)

    x = torch.from_numpy(x).requires_grad_()
    # torchao takes the weights as (G, K, N) views of a (G, N, K) tensor (nn.Linear's layout)
    w_nk = torch.from_numpy(np.ascontiguousarray(np.swapaxes(w, 1, 2))).requires_grad_()
    offs = torch.from_numpy(np.cumsum(sizes).astype(np.int32))
    torch._grouped_mm = recording
    try:
        y = mxfp8_grouped_mm._MXFP8GroupedMM.apply(
            x, w_nk.transpose(-2, -1), offs, torch.bfloat16, KernelPreference.EMULATED,
            False, mode, True)
        y.backward(torch.from_numpy(dy).to(torch.bfloat16))
    finally:
        torch._grouped_mm = grouped_mm
    assert len(calls) == 3, f"torchao called torch._grouped_mm {len(calls)} times, not 3"
    out = {"y": y, "dx": x.grad, "dw": w_nk.grad.transpose(-2, -1)}
    for gemm, (a, b, o) in zip(GEMMS, calls, strict=True):
        out |= {f"{gemm}_a": a, f"{gemm}_b": b, f"{gemm}_offs": o}
    return {k: v.detach().float().numpy() for k, v in out.items()}


def main(src: str, dst: str) -> None:
    with np.load(src) as f:
        x, w, dy, sizes, blocks = (f[k] for k in ("x", "w", "dy", "sizes", "blocks"))
    out = {}
    for rule, mode in (("rceil", ScaleCalculationMode.RCEIL),
                       ("floor", ScaleCalculationMode.FLOOR)):
        out |= {f"{rule}/{k}": v for k, v in run(x, w, dy, sizes, mode).items()}
        scale, data = to_mx(torch.from_numpy(blocks), torch.float8_e4m3fn, 32, mode)
        out[f"{rule}/blocks"] = to_dtype(data, scale, torch.float8_e4m3fn, 32,
                                         torch.float32).numpy()
    np.savez(dst, **out)


if __name__ == "__main__":
    main(*sys.argv[1:])
