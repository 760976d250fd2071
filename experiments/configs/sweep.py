"""The README's default sweep: the default run under the precision policies of the NVFP4
recipes and their ablations, the headline policies under three seeds (about 14 minutes on 2
CPU cores)."""

from experiments.configs import sweep_section
from experiments.configs.default import get_config as _default


def get_config():
    c = _default()
    c.sweep = sweep_section(
        ("bf16", "nvfp4", "nemotron3", "nemotron3_no_mxfp8", "nemotron3_no_tail",
         "nvfp4_no_rht", "nvfp4_no_sr", "nvfp4_1d_weights", "mxfp8", "mxfp4", "fp8_hybrid"),
        # a count (seed, seed + 1, ...) or a list of seeds; seeded_policies: the policies that
        # run under every seed (the others run the first seed only)
        seeds=3, seeded_policies=("bf16", "nvfp4", "nemotron3"))
    return c
