"""Per-expert against shared per-tensor scales of the expert stacks (docs/numerics.md, "Grouped
GEMMs"): the MoE hybrid (``MEM*ME``, as ``--config moe``) with NVFP4 experts, each expert's
operands scaled for their own amax (``nvfp4_experts``: TE's ``GroupedLinear``) or for the
stack's (``nvfp4_experts_shared``: one FP32 global scale per operand for all experts, as
vLLM's FP8 MoE loads its input scale), the rest BF16; gaps to the BF16 model and the two
paired by seed. Three seeds each, 9 runs; on 2 CPU cores as two shards:

    python -m experiments.sweep --config moe_scale --out results/moe_scale --shard 0/2 &
    python -m experiments.sweep --config moe_scale --out results/moe_scale --shard 1/2
    python -m experiments.sweep --config moe_scale --out results/moe_scale --report
"""

from experiments.configs import sweep_section
from experiments.configs.default import get_config as _default
from experiments.configs.moe import MOE


def get_config():
    c = _default()
    c.sweep = sweep_section(
        ("bf16", "nvfp4_experts", "nvfp4_experts_shared"), seeds=3,
        compare=(("nvfp4_experts_shared", "nvfp4_experts"),),
        variants=({"name": "moe", **MOE},))
    return c
