"""A two-run sweep of the tiny config (tests, smoke checks)."""

import ml_collections

from experiments.configs.tiny import get_config as _tiny


def get_config():
    c = _tiny()
    # seeds: a count (seed, seed + 1, ...) or a list; seeded_policies: the policies that run
    # under every seed (() = all; the others run the first seed only)
    c.sweep = ml_collections.ConfigDict(dict(policies=("bf16", "nvfp4"), seeds=1,
                                             seeded_policies=(), sizes=(), variants=(),
                                             compare=()),
                                        type_safe=False)  # seeds: an int or a tuple
    return c
