"""What the seed systems claim beyond the GEMM operands, at small scale, three seeds each
(docs/beyond_the_gemms.md): BF16 with the MLP inputs saved in FP8 (Kimi K2: no measurable
cost; ``k2`` adds the squared ReLU recomputed from its FP8-stored input), the attention
output saved in E4M3 vs E5M6 (DeepSeek-V3), and the MTP gradient's survival through FP32 vs
BF16 reduction of a shared output layer (Nemotron 3 Ultra; the BF16 variant's gap is against
the FP32 one's). Run it on 8 simulated devices, one batch row each, so that the reduction has
replicas to reduce:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m experiments.sweep --config beyond --out results/beyond
"""

from experiments.configs import sweep_section
from experiments.configs.default import get_config as _default

_MTP = {"model.mtp": True, "model.mtp_tied_head": True, "train.grad_survival": True,
        "probes.every": 0, "policies": ("bf16",)}


def get_config():
    c = _default()
    c.sweep = sweep_section(
        ("bf16", "bf16_mlp_saved_fp8", "bf16_attn_out_saved_fp8", "bf16_attn_out_saved_e5m6"),
        seeds=3, compare=(("bf16_attn_out_saved_e5m6", "bf16_attn_out_saved_fp8"),),
        variants=({"name": "base"},
                  {"name": "k2", "model.mlp_saved": "fp8_block128",
                   "policies": ("bf16_mlp_saved_fp8",), "baseline_variant": "base"},
                  {"name": "mtp_fp32", "train.grad_reduce": "fp32", **_MTP},
                  {"name": "mtp_bf16_head", "train.grad_reduce": "fp32",
                   "train.grad_reduce_rules": (("head/.*", "bf16_ring"),), **_MTP,
                   "baseline_variant": "mtp_fp32"}))
    return c
