"""Dequantize fp4lab's exported checkpoints with the consumers' own code (run by the
consumers' Python, scripts/consumer-venv; never by fp4lab's):

    python tests/consumers/dequantize.py LAYOUT CHECKPOINT OUT.npz

* ``mxfp4``: ``transformers.integrations.mxfp4.convert_moe_packed_tensors`` (how transformers
  loads gpt-oss's MXFP4 experts) of every ``*_blocks`` / ``*_scales`` pair (expert stacks as
  they are, a plain weight as one expert), in float32 and in bfloat16, under the name without
  the suffix and with ``@bf16`` appended;
* ``nvfp4``: ``compressed_tensors``' ``NVFP4PackedCompressor.decompress`` of every module, with
  the scheme parsed from the checkpoint's ``config.json`` by compressed-tensors itself, in its
  default (bfloat16) output and in float32 (``@fp32``);
* ``nvfp4_modelopt``: compressed-tensors' ModelOpt converter to its own format, then the same.

Every result is the consumer's weight as it hands it to its model: ``[in, out]`` for
transformers' experts (``[experts, in, out]``; a plain weight's expert axis dropped), ``[out,
in]`` for compressed-tensors' Linear weights. Stored as float32 in ``OUT.npz``.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def mxfp4(path: Path) -> dict:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(str(path / "model.safetensors"))
    out = {}
    for name, blocks in tensors.items():
        if not name.endswith("_blocks"):
            continue
        base = name[: -len("_blocks")]
        scales = tensors[f"{base}_scales"]
        experts = blocks.ndim == 4  # [experts, out, in / 32, 16], as gpt-oss's
        for dtype, tag in ((torch.float32, ""), (torch.bfloat16, "@bf16")):
            if experts:
                w = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
            else:  # a plain [out, in] weight: one expert
                w = convert_moe_packed_tensors(blocks[None], scales[None], dtype=dtype)[0]
            out[base + tag] = w.float().numpy()
    return out


def _scheme(path: Path):
    from compressed_tensors.config import CompressionFormat  # noqa: F401 (registers formats)
    from compressed_tensors.quantization import QuantizationConfig

    config = json.loads((path / "config.json").read_text())["quantization_config"]
    qc = QuantizationConfig.model_validate(config)
    assert qc.format == "nvfp4-pack-quantized", qc.format
    return qc.config_groups["group_0"]


def _decompress(tensors: dict, scheme) -> dict:
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    out = {}
    for name in tensors:
        if not name.endswith(".weight_packed"):
            continue
        module = name[: -len(".weight_packed")]
        state = {k.rpartition(".")[2]: v for k, v in tensors.items()
                 if k.rpartition(".")[0] == module}
        w = NVFP4PackedCompressor.decompress(state, scheme)["weight"]
        out[f"{module}.weight"] = w.float().numpy()
        # the same arithmetic in float32: compressed-tensors' dequantize with an FP32 output
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
        from compressed_tensors.quantization.lifecycle.forward import dequantize

        packed = state["weight_packed"]
        m, n = packed.shape
        q = unpack_fp4_from_uint8(packed, m, n * 2, dtype=torch.float32)
        w32 = dequantize(x_q=q, scale=state["weight_scale"].to(torch.float32),
                         args=scheme.weights, global_scale=state["weight_global_scale"],
                         dtype=torch.float32)
        out[f"{module}.weight@fp32"] = w32.numpy()
    return out


def nvfp4(path: Path) -> dict:
    return _decompress(load_file(str(path / "model.safetensors")), _scheme(path))


def nvfp4_modelopt(path: Path) -> dict:
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import (
        ModelOptNvfp4Converter,
    )
    from compressed_tensors.quantization import QuantizationScheme

    hf = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
    assert hf["quant_algo"] == "NVFP4" and hf["group_size"] == 16, hf
    tensors = load_file(str(path / "model.safetensors"))
    targets = sorted({k.rpartition(".")[0] for k, v in tensors.items()
                      if k.endswith(".weight") and v.dtype == torch.uint8})
    converter = ModelOptNvfp4Converter(ignore=hf["exclude_modules"], targets=targets)
    tensors = converter.validate(tensors)  # processes them too
    scheme = QuantizationScheme(targets=targets, weights={
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
        "symmetric": True, "dynamic": False})
    return _decompress(tensors, scheme)


if __name__ == "__main__":
    layout, checkpoint, out = sys.argv[1:]
    import numpy as np

    result = {"mxfp4": mxfp4, "nvfp4": nvfp4, "nvfp4_modelopt": nvfp4_modelopt}[layout](
        Path(checkpoint))
    np.savez(out, **result)
    print(f"{layout}: {len(result)} tensors from {checkpoint}")
