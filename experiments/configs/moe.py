"""Mixture-of-Experts under the seed recipes (docs/experiments.md): the default hybrid with its
MLP blocks (``M-M*M-``) against the same hybrid with MoE blocks in their place (``MEM*ME``:
8 experts, top-2, each expert half the MLP's width, so a token's active expert parameters
match the dense MLP's) under ``bf16``, ``nvfp4``, ``nemotron3`` and ``mxfp8``; NVFP4 on the
expert stacks alone against NVFP4 on the dense MLPs alone (``nvfp4_experts``, ``nvfp4_mlp``,
the rest BF16); the seed rule as ablations: a LatentMoE (``model.moe_latent=32``) with its
latent projections in BF16 (``nemotron3``) or NVFP4 (``nemotron3_latent_nvfp4``), and the
router's GEMM in BF16 (``model.moe_router_dtype=bfloat16``) against FP32. Three seeds each,
45 runs; on 2 CPU cores as two shards:

    python -m experiments.sweep --config moe --out results/moe --shard 0/2 &
    python -m experiments.sweep --config moe --out results/moe --shard 1/2
    python -m experiments.sweep --config moe --out results/moe --report
"""

from experiments.configs import sweep_section
from experiments.configs.default import get_config as _default

MOE = {"model.pattern": "MEM*ME"}


def get_config():
    c = _default()
    c.sweep = sweep_section(
        ("bf16", "nvfp4", "nemotron3", "mxfp8", "nvfp4_mlp", "nvfp4_experts",
         "nemotron3_latent_nvfp4"), seeds=3,
        compare=(("nemotron3_latent_nvfp4", "nemotron3"),),
        variants=(
            {"name": "dense", "policies": ("bf16", "nvfp4", "nemotron3", "mxfp8", "nvfp4_mlp")},
            {"name": "moe", **MOE,
             "policies": ("bf16", "nvfp4", "nemotron3", "mxfp8", "nvfp4_experts")},
            {"name": "latent", **MOE, "model.moe_latent": 32,
             "policies": ("bf16", "nemotron3", "nemotron3_latent_nvfp4")},
            {"name": "router_bf16", **MOE, "model.moe_router_dtype": "bfloat16",
             "policies": ("bf16", "nemotron3")}))
    return c
