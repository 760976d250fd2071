"""TetraJet-v2's OutControl against TetraJet-v2 without it and BF16 (docs/recipes.md): every
layer under ``bf16``, ``tetrajet_v2`` and ``tetrajet_v2_outcontrol`` (the 10 % input channels
of largest summed L2 norm in MXFP8, chosen after steps 5-9: ``train.outcontrol``), three
seeds each, at the recipes sweep's two lengths (75 and 150 steps). 18 runs; on 2 CPU cores
as two shards:

    python -m experiments.sweep --config outcontrol --out results/outcontrol --shard 0/2 &
    python -m experiments.sweep --config outcontrol --out results/outcontrol --shard 1/2
    python -m experiments.sweep --config outcontrol --out results/outcontrol --report
"""

from experiments.configs import sweep_section
from experiments.configs.default import get_config as _default


def get_config():
    c = _default()
    c.sweep = sweep_section(
        ("bf16", "tetrajet_v2", "tetrajet_v2_outcontrol"), seeds=3,
        compare=(("tetrajet_v2_outcontrol", "tetrajet_v2"),),
        variants=({"name": "short", "train.steps": 75, "train.warmup": 8},
                  {"name": "long"}))
    return c
