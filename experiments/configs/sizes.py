"""The gap to BF16 against model size, the shape of the NVFP4 paper's figure: widths 32, 64
and 128 of the default six-block model under bf16, nvfp4 and nemotron3, three seeds each
(about 25 minutes on 2 CPU cores; ``gap_vs_size.png``).

    python -m experiments.sweep --config sizes --out results/sizes
"""

from experiments.configs import sweep_section
from experiments.configs.default import get_config as _default


def get_config():
    c = _default()
    c.sweep = sweep_section(("bf16", "nvfp4", "nemotron3"), seeds=3,
                            sizes=({"name": "d32", "d_model": 32}, {"name": "d64", "d_model": 64},
                                   {"name": "d128", "d_model": 128}))
    return c
