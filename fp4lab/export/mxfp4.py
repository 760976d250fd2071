"""The ``mxfp4`` layout: gpt-oss's MXFP4 safetensors, as transformers loads them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fp4lab.export.blocks import blocks, pack
from fp4lab.export.safetensors_files import quantized_items, write_config, write_safetensors

FORMATS = ("mxfp4", "mxfp4_floor")  # E2M1 elements, E8M0 scales per 32


def save_mxfp4(tensors, path: Path, names, metadata) -> None:
    """``<name>_blocks`` (uint8 ``[..., out, in/32, 16]``, element 2i in the low nibble) and
    ``<name>_scales`` (E8M0 bytes ``[..., out, in/32]``) per quantized kernel, the rest as
    they are; ``config.json``'s ``quantization_config``."""
    out, index, skipped = {}, {}, []
    for p, name, value in quantized_items(tensors, names, out, index, skipped):
        b = blocks(p, value)
        if (b.scales == 255).any():
            raise ValueError(f"{p}: {int((b.scales == 255).sum())} block(s) hold NaN (E8M0 "
                             "0xFF); transformers reads 0xFF as 2^128, so a NaN block cannot "
                             "round-trip")
        lead = b.codes.shape[:-1]
        out[f"{name}_blocks"] = pack(b.codes).reshape(lead + (-1, 16))
        out[f"{name}_scales"] = b.scales.astype(np.uint8)
        index[f"{name}_blocks"] = {"path": p, "transposed": True, "format": value.format.name}
    write_safetensors(path / "model.safetensors", out, {"fp4lab.tensors": json.dumps(index)})
    config = {"quantization_config": {"quant_method": "mxfp4",
                                      "modules_to_not_convert": sorted(skipped)},
              "fp4lab": {"layout": "mxfp4", **(metadata or {})}}
    write_config(path, config)
