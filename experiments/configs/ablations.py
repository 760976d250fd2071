"""The NVFP4 pretraining paper's ablations at this scale, three seeds each (about 17 minutes on
2 CPU cores): which blocks to keep in BF16 (the first two vs the last two of the six, the same
block kinds ``M-`` either way), the paper's own assignment (``nvfp4_paper``), and the late
switch of every layer to BF16 for the last 10 % / 20 % of the steps
(``train.bf16_last_fraction``).

    python -m experiments.sweep --config ablations --out results/ablations
"""

from experiments.configs import sweep_section
from experiments.configs.default import get_config as _default


def get_config():
    c = _default()
    c.sweep = sweep_section(
        ("bf16", "nvfp4", "nvfp4_bf16_first2", "nvfp4_bf16_last2", "nvfp4_paper"), seeds=3,
        # paired by seed: which blocks in BF16 help more, and the paper's assignment
        compare=(("nvfp4_bf16_last2", "nvfp4_bf16_first2"), ("nvfp4_bf16_first2", "nvfp4"),
                 ("nvfp4_bf16_last2", "nvfp4"), ("nvfp4_paper", "nvfp4")),
        variants=({"name": "base"},
                  {"name": "late10", "train.bf16_last_fraction": 0.1, "policies": ("nvfp4",)},
                  {"name": "late20", "train.bf16_last_fraction": 0.2, "policies": ("nvfp4",)}))
    return c
