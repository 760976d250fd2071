"""The README's default sweep: the default run under the precision policies of the NVFP4
recipes and their ablations (about 10 minutes on 2 CPU cores)."""

import ml_collections

from experiments.configs.default import get_config as _default


def get_config():
    c = _default()
    c.sweep = ml_collections.ConfigDict(dict(policies=(
        "bf16", "nvfp4", "nemotron3", "nemotron3_no_mxfp8", "nemotron3_no_tail",
        "nvfp4_no_rht", "nvfp4_no_sr", "nvfp4_1d_weights", "mxfp8", "mxfp4", "fp8_hybrid")))
    return c
