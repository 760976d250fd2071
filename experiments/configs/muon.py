"""Does low precision cost Muon more or less than AdamW? {adamw, muon} x {bf16, nvfp4,
nemotron3}, three seeds each (about 15 minutes on 2 CPU cores). Muon runs at AdamW's
learning rate and weight decay with ``consistent_rms=0.2`` (experiments/optimizers.py); the
difference table gives, per policy, Muon's gap to its own BF16 run minus AdamW's, paired by
seed.

    python -m experiments.sweep --config muon --out results/muon
"""

from experiments.configs import sweep_section
from experiments.configs.default import get_config as _default


def get_config():
    c = _default()
    c.sweep = sweep_section(("bf16", "nvfp4", "nemotron3"), seeds=3,
                            variants=({"name": "adamw", "train.optimizer": "adamw"},
                                      {"name": "muon", "train.optimizer": "muon"}))
    return c
