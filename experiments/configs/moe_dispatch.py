"""The precision of an expert-parallel MoE layer's dispatch (docs/beyond_the_gemms.md): the MoE
hybrid (``MEM*ME``, as ``--config moe``) with its dispatched rows as they are, or rounded as
an MXFP8 (torchao) or MXFP4 all-to-all delivers them (``model.moe_dispatch``; the backward
unquantized), under ``bf16`` and with NVFP4 experts (``nvfp4_experts``); every gap against
the BF16 model with an unquantized dispatch (``baseline_variant``). Three seeds each, 18 runs;
on 2 CPU cores as two shards:

    python -m experiments.sweep --config moe_dispatch --out results/moe_dispatch --shard 0/2 &
    python -m experiments.sweep --config moe_dispatch --out results/moe_dispatch --shard 1/2
    python -m experiments.sweep --config moe_dispatch --out results/moe_dispatch --report
"""

from experiments.configs import sweep_section
from experiments.configs.default import get_config as _default
from experiments.configs.moe import MOE


def get_config():
    c = _default()
    c.sweep = sweep_section(
        ("bf16", "nvfp4_experts"), seeds=3,
        variants=({"name": "bf16_rows", **MOE},
                  {"name": "mxfp8_rows", **MOE, "model.moe_dispatch": "mxfp8",
                   "baseline_variant": "bf16_rows"},
                  {"name": "mxfp4_rows", **MOE, "model.moe_dispatch": "mxfp4",
                   "baseline_variant": "bf16_rows"}))
    return c
