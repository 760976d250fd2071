"""The NVFP4 safetensors layouts' shared part: each module's tensors from its QArray, the
unquantized tensors beside them, and the ``fp4lab.tensors`` index; ``nvfp4``
(compressed-tensors' ``nvfp4-pack-quantized``, as vLLM loads it) is written here, ModelOpt's
in :mod:`fp4lab.export.modelopt`."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fp4lab.export.blocks import Blocks, blocks, nvfp4_amax, nvfp4_encode_factor, pack
from fp4lab.export.safetensors_files import (module_name, quantized_items, write_config,
                                             write_safetensors)

FORMATS = ("nvfp4",)


def nvfp4_tensors(tensors, path: Path, names, module_tensors: Callable[[str, str, Blocks],
                                                                       dict]):
    """Write ``model.safetensors``: ``module_tensors(path, module, blocks)`` gives each
    quantized module's tensors (their names and arrays), the rest as they are. Returns the
    quantized modules and the unquantized linear layers."""
    out, index, ignore, quantized = {}, {}, [], []
    for p, name, value in quantized_items(tensors, names, out, index, ignore):
        module = module_name(name)
        b = blocks(p, value)
        amax = nvfp4_amax(p, b)
        own = module_tensors(p, module, b)
        out |= own
        quantized.append(module)
        index[next(iter(own))] = {"path": p, "transposed": True, "format": "nvfp4",
                                  "amax": float(amax)}
    write_safetensors(path / "model.safetensors", out, {"fp4lab.tensors": json.dumps(index)})
    return quantized, ignore


def _compressed_tensors(p: str, module: str, b: Blocks) -> dict:
    return {f"{module}.weight_packed": pack(b.codes),
            f"{module}.weight_scale": b.scales,
            f"{module}.weight_global_scale": np.array([nvfp4_encode_factor(b.amax)],
                                                      np.float32)}


# one expert's module of a stack: <stack>.experts.<j>.<projection> (Mixtral, Qwen-MoE and
# NemotronH name their checkpoints' experts so)
EXPERT_MODULE = re.compile(r"(.+\.experts)\.\d+\.[^.]+")


def targets(modules: list[str]) -> list[str]:
    """A config group's ``targets``: the modules by name, each expert stack by one regex
    over all its experts' modules. vLLM's fused MoE layer looks its scheme up under the
    names ``<stack>.0.<projection>`` of every projection its model class knows, some of
    which a checkpoint never has (NemotronH's third is ``None``): a stack listed module by
    module leaves those unmatched, and vLLM refuses the layer ("All MoE projections need to
    have same quantization scheme")."""
    stacks = {m[1] for m in map(EXPERT_MODULE.fullmatch, modules) if m}
    return sorted({m for m in modules if not EXPERT_MODULE.fullmatch(m)}
                  | {f"re:^{re.escape(s)}\\.\\d+\\..+$" for s in stacks})


def save_nvfp4(tensors, path: Path, names, metadata) -> None:
    """compressed-tensors' ``nvfp4-pack-quantized``: ``weight_packed``, ``weight_scale``,
    ``weight_global_scale = 2688 / amax`` (TE's encode factor) and its config group."""
    quantized, ignore = nvfp4_tensors(tensors, path, names, _compressed_tensors)
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
               "symmetric": True, "dynamic": False}
    config = {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": targets(quantized), "weights": weights,
                                      "input_activations": None, "output_activations": None,
                                      "format": "nvfp4-pack-quantized"}},
        "ignore": sorted(ignore)}, "fp4lab": {"layout": "nvfp4", **(metadata or {})}}
    write_config(path, config)
