"""A two-run sweep of the tiny config (tests, smoke checks)."""

import ml_collections

from experiments.configs.tiny import get_config as _tiny


def get_config():
    c = _tiny()
    c.sweep = ml_collections.ConfigDict(dict(policies=("bf16", "nvfp4")))
    return c
