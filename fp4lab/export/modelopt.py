"""The ``nvfp4_modelopt`` layout (TensorRT-LLM, ModelOpt): the weights' tensors and
``hf_quant_config.json``, each from its own function, so either changes alone."""

from __future__ import annotations

import json
from pathlib import Path

from fp4lab.export.blocks import NVFP4_FACTOR, F32, Blocks, nvfp4_decode_scale, pack
from fp4lab.export.nvfp4 import nvfp4_tensors
from fp4lab.export.safetensors_files import write_config
from fp4lab.numerics.qarray import QArray

FORMATS = ("nvfp4",)


def save_modelopt(tensors, path: Path, names, metadata, *, input_amax=None) -> None:
    """ModelOpt's names: ``<module>.weight`` (uint8 codes), ``weight_scale`` (E4M3),
    ``weight_scale_2 = amax / 2688`` and, with ``input_amax`` for every quantized layer, the
    static ``input_scale = amax_x / 2688`` (W4A4, ``NVFP4``); without it the checkpoint is
    weight-only (``W4A16_NVFP4``: the engine keeps activations in BF16), since an engine
    given ``NVFP4`` without activation scales has none to use (vLLM leaves them
    uninitialized). ``config.json`` gets ModelOpt's ``quantization_config`` (what vLLM reads);
    ``hf_quant_config.json`` the same for TensorRT-LLM."""
    input_amax = input_amax or {}
    quantized = {p for p, v in tensors.items() if isinstance(v, QArray)}
    stray = sorted(set(input_amax) - quantized)
    if stray:
        raise ValueError(f"input_amax names {stray}, which are not quantized weights")
    missing = sorted(quantized - set(input_amax))
    if input_amax and missing:
        raise ValueError(f"input_amax gives W4A4 activation scales for some quantized weights "
                         f"but not for {missing}: give every one, or none (weight-only)")
    algo = "NVFP4" if input_amax else "W4A16_NVFP4"

    def module_tensors(p: str, module: str, b: Blocks) -> dict:
        own = {f"{module}.weight": pack(b.codes), f"{module}.weight_scale": b.scales,
               f"{module}.weight_scale_2": nvfp4_decode_scale(b.amax)}
        if p in input_amax:
            own[f"{module}.input_scale"] = F32(F32(input_amax[p]) / NVFP4_FACTOR)
        return own

    modules, ignore = nvfp4_tensors(tensors, path, names, module_tensors)
    write_hf_quant_config(path, ignore, algo)
    write_config(path, {"quantization_config": quantization_config(modules, ignore, algo),
                        "fp4lab": {"layout": "nvfp4_modelopt", **(metadata or {})}})


def quantization_config(modules: list[str], exclude: list[str], algo: str) -> dict:
    """``config.json``'s ``quantization_config`` in ModelOpt's own form (0.31+), which vLLM
    reads before ``hf_quant_config.json``: NVFP4 weights in groups of 16, the activations
    NVFP4 too for ``NVFP4`` (W4A4), none for ``W4A16_NVFP4``."""
    weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    return {"quant_method": "modelopt", "quant_algo": algo, "group_size": 16,
            "ignore": sorted(exclude), "producer": {"name": "fp4lab"},
            "config_groups": {"group_0": {
                "targets": sorted(modules), "weights": weights,
                "input_activations": dict(weights) if algo == "NVFP4" else None}}}


def write_hf_quant_config(path: Path, exclude: list[str], algo: str) -> None:
    """``hf_quant_config.json``: ModelOpt's description of the checkpoint (TensorRT-LLM's);
    ``kv_cache_quant_algo`` null: the KV cache is not quantized."""
    hf = {"producer": {"name": "fp4lab"},
          "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16,
                           "exclude_modules": sorted(exclude)}}
    (path / "hf_quant_config.json").write_text(json.dumps(hf, indent=2) + "\n")
