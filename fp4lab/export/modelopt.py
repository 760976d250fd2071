"""The ``nvfp4_modelopt`` layout (TensorRT-LLM, ModelOpt): the weights' tensors and
``hf_quant_config.json``, each from its own function, so either changes alone."""

from __future__ import annotations

import json
from pathlib import Path

from fp4lab.export.blocks import NVFP4_FACTOR, F32, Blocks, nvfp4_decode_scale, pack
from fp4lab.export.nvfp4 import nvfp4_tensors
from fp4lab.export.safetensors_files import write_config
from fp4lab.qarray import QArray

FORMATS = ("nvfp4",)


def save_modelopt(tensors, path: Path, names, metadata, *, input_amax=None) -> None:
    """ModelOpt's names: ``<module>.weight`` (uint8 codes), ``weight_scale`` (E4M3),
    ``weight_scale_2 = amax / 2688`` and, for the layers in ``input_amax``, the static
    ``input_scale = amax_x / 2688``; ``hf_quant_config.json``."""
    input_amax = input_amax or {}
    stray = sorted(set(input_amax) - {p for p, v in tensors.items() if isinstance(v, QArray)})
    if stray:
        raise ValueError(f"input_amax names {stray}, which are not quantized weights")

    def module_tensors(p: str, module: str, b: Blocks) -> dict:
        own = {f"{module}.weight": pack(b.codes), f"{module}.weight_scale": b.scales,
               f"{module}.weight_scale_2": nvfp4_decode_scale(b.amax)}
        if p in input_amax:
            own[f"{module}.input_scale"] = F32(F32(input_amax[p]) / NVFP4_FACTOR)
        return own

    _, ignore = nvfp4_tensors(tensors, path, names, module_tensors)
    write_hf_quant_config(path, ignore)
    write_config(path, {"fp4lab": {"layout": "nvfp4_modelopt", **(metadata or {})}})


def write_hf_quant_config(path: Path, exclude: list[str]) -> None:
    """``hf_quant_config.json``: ModelOpt's description of the checkpoint."""
    hf = {"producer": {"name": "fp4lab"},
          "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                           "exclude_modules": sorted(exclude)}}
    (path / "hf_quant_config.json").write_text(json.dumps(hf, indent=2) + "\n")

