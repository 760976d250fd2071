"""The recipes of the last two years head to head (docs/recipes.md): every layer under BF16,
NVIDIA's NVFP4, Four Over Six, row-scaled NVFP4, Quartet, Quartet II, TetraJet-v2, FP4 All
the Way, MXFP4 (Tseng et al.) and MXFP8 with RCEIL and FLOOR scales, three seeds each, at two
training lengths (``short``: 75 steps, ``long``: the default 150; the gap's growth with
tokens is what these papers argue about). 66 runs; 89 minutes on 2 CPU cores as two shards
(with the test suite sharing the cores for most of it):

    python -m experiments.sweep --config recipes --out results/recipes --shard 0/2 &
    python -m experiments.sweep --config recipes --out results/recipes --shard 1/2
    python -m experiments.sweep --config recipes --out results/recipes --report
"""

from experiments.configs import sweep_section
from experiments.configs.default import get_config as _default

RECIPE_POLICIES = ("bf16", "nvfp4", "nvfp4_4over6", "nvfp4_row_scaled", "quartet", "quartet_ii",
                   "tetrajet_v2", "fp4_all_the_way", "mxfp4", "mxfp8", "mxfp8_floor")


def get_config():
    c = _default()
    c.sweep = sweep_section(
        RECIPE_POLICIES, seeds=3,
        # paired by seed: each published recipe against the one it sets out to improve
        compare=(("nvfp4_4over6", "nvfp4"), ("nvfp4_row_scaled", "nvfp4"),
                 ("quartet_ii", "nvfp4"), ("tetrajet_v2", "nvfp4"),
                 ("fp4_all_the_way", "nvfp4"), ("quartet", "mxfp4"),
                 ("mxfp8_floor", "mxfp8")),
        variants=({"name": "short", "train.steps": 75, "train.warmup": 8},
                  {"name": "long"}))
    return c
