"""Run NemotronH checkpoints (experiments/hf_nemotron_h.py) in transformers' own
``NemotronHForCausalLM`` (run by the consumers' Python, scripts/consumer-venv; never by
fp4lab's):

    python tests/consumers/hf_eval.py TOKENS.npy FOLDER OUT.npz [FOLDER OUT.npz ...]

Each FOLDER is loaded with ``from_pretrained(FOLDER, dtype=torch.float32)`` on the CPU, in
eval mode (a compressed-tensors NVFP4 checkpoint is decompressed by compressed-tensors,
through transformers' quantizer), and run on the int token windows ``TOKENS.npy`` ``[B, L]``
(no cache, no attention mask). ``OUT.npz`` holds ``logits`` (float32 ``[B, L, V]``) and
``info``, a JSON string: the model's class, its parameters' dtypes, the linear layers'
weights' dtypes and whether they are the dense ``weight`` (decompressed), the dtypes that
came out of every block (the residual stream) and of every gated RMSNorm, and the
implementation that ran the Mamba-2 scan and convolution: the reference PyTorch one
(``torch``), which runs when neither ``mamba_ssm`` nor ``causal_conv1d`` is installed, else
the name of the package.
"""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch


def _scan_implementation() -> str:
    """Which code the mixer's scan and convolution call: transformers falls back to its
    reference PyTorch functions (the naive chunked scan) when these packages are absent."""
    found = [p for p in ("mamba_ssm", "causal_conv1d") if importlib.util.find_spec(p)]
    return ",".join(found) or "torch"


def _run(folder: Path, tokens: np.ndarray) -> tuple[np.ndarray, dict]:
    from transformers import NemotronHForCausalLM
    from transformers.models.nemotron_h import modeling_nemotron_h as m

    config = json.loads((folder / "config.json").read_text())
    kw = {}
    if "quantization_config" in config:  # decompressed by compressed-tensors at load
        from transformers import CompressedTensorsConfig

        kw["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    model, loading = NemotronHForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, output_loading_info=True, **kw)
    model.eval()
    seen = {"blocks": set(), "gated_norms": set()}
    hooks = [mod.register_forward_hook(
        lambda _m, _i, o, key=key: seen[key].add(str(o.dtype)))
        for key, kind in (("blocks", m.NemotronHBlock), ("gated_norms", m.NemotronHRMSNormGated))
        for mod in model.modules() if isinstance(mod, kind)]
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(tokens, dtype=torch.long),
                       use_cache=False).logits
    for h in hooks:
        h.remove()
    linear = {name: (str(mod.weight.dtype), isinstance(mod.weight, torch.nn.Parameter)
                     and tuple(mod.weight.shape) == (mod.out_features, mod.in_features))
              for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    info = {"class": type(model).__name__, "training": model.training,
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "linear": linear, "block_out_dtypes": sorted(seen["blocks"]),
            "gated_norm_out_dtypes": sorted(seen["gated_norms"]),
            "scan": _scan_implementation(),
            "loading": {k: sorted(map(str, v)) for k, v in loading.items()},
            "decompressed": "quantization_config" in kw}
    return logits.float().numpy(), info


def main(argv: list[str]) -> None:
    if len(argv) < 3 or len(argv) % 2 == 0:
        raise SystemExit("usage: hf_eval.py TOKENS.npy FOLDER OUT.npz [FOLDER OUT.npz ...]")
    tokens = np.load(argv[0])
    for folder, out in zip(argv[1::2], argv[2::2], strict=True):
        logits, info = _run(Path(folder), tokens)
        np.savez(out, logits=logits, info=np.array(json.dumps(info)))


if __name__ == "__main__":
    main(sys.argv[1:])
