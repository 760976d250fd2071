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
* ``nvfp4_modelopt``: compressed-tensors' ModelOpt converter to its own format, then the same;
* ``make_nvfp4``: a checkpoint made by compressed-tensors itself (no fp4lab), written to
  CHECKPOINT, with its own decompression of it.

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
    assert hf["quant_algo"] in ("NVFP4", "W4A16_NVFP4") and hf["group_size"] == 16, hf
    tensors = load_file(str(path / "model.safetensors"))
    targets = sorted({k.rpartition(".")[0] for k, v in tensors.items()
                      if k.endswith(".weight") and v.dtype == torch.uint8})
    converter = ModelOptNvfp4Converter(ignore=hf["exclude_modules"], targets=targets)
    tensors = converter.validate(tensors)  # processes them too
    scheme = QuantizationScheme(targets=targets, weights={
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
        "symmetric": True, "dynamic": False})
    return _decompress(tensors, scheme)


def make_nvfp4(path: Path) -> dict:
    """A checkpoint made by compressed-tensors itself, with no fp4lab in it: two Linear
    weights quantized with its NVFP4A16 scheme (its global scale, its group scales, its
    compressor), saved with safetensors' torch writer; returns its own decompression."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    from safetensors.torch import save_file

    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for module, shape, spread in (("layers.0.mlp.up", (96, 64), 1.0), ("lm_head", (32, 64), 1e-3)):
        w = torch.randn(shape, generator=gen) * spread
        w[0, :16] = 0.0  # an all-zero group: compressed-tensors gives it a nonzero scale
        gs = generate_gparam(w.min(), w.max())
        groups = w.reshape(shape[0], -1, 16)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights,
                                     global_scale=gs)
        state = NVFP4PackedCompressor.compress(
            {"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme)
        tensors.update({f"{module}.{k}": v.contiguous() for k, v in state.items()})
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return _decompress(tensors, scheme)


if __name__ == "__main__":
    layout, checkpoint, out = sys.argv[1:]
    import numpy as np

    result = {"mxfp4": mxfp4, "nvfp4": nvfp4, "nvfp4_modelopt": nvfp4_modelopt,
              "make_nvfp4": make_nvfp4}[layout](Path(checkpoint))
    np.savez(out, **result)
    print(f"{layout}: {len(result)} tensors from {checkpoint}")
