"""Qwen3.8-Next's FP8 residual stream at small scale, three seeds each
(docs/beyond_the_gemms.md): the stream between blocks stored in E4M3 unscaled (saturating at
448) and with one abs-max scale per token, each in the plain and in the gated model
(``model.residual_gate``: ``x + sigmoid(g) * mixer(norm(x))``). Every FP8 variant's gap is
against the BF16-GEMM model with the same gating and an FP32 stream (``baseline_variant``),
and the gated FP8 variants are compared with the ungated ones (``reference_variant``): the
difference table then tests Qwen's condition that gates bound what FP8 must carry.

    python -m experiments.sweep --config residual --out results/residual
"""

from experiments.configs import sweep_section
from experiments.configs.default import get_config as _default


def get_config():
    c = _default()
    gated = {"model.residual_gate": True}
    c.sweep = sweep_section(("bf16",), seeds=3, variants=(
        {"name": "base"},
        {"name": "e4m3", "model.residual_format": "e4m3", "baseline_variant": "base"},
        {"name": "e4m3_token", "model.residual_format": "e4m3_token",
         "baseline_variant": "base"},
        {"name": "gated", **gated, "baseline_variant": "base"},
        {"name": "gated_e4m3", **gated, "model.residual_format": "e4m3",
         "baseline_variant": "gated", "reference_variant": "e4m3"},
        {"name": "gated_e4m3_token", **gated, "model.residual_format": "e4m3_token",
         "baseline_variant": "gated", "reference_variant": "e4m3_token"}))
    return c
