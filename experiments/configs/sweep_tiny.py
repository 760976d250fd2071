"""A two-run sweep of the tiny config (tests, smoke checks)."""

from experiments.configs import sweep_section
from experiments.configs.tiny import get_config as _tiny


def get_config():
    c = _tiny()
    c.sweep = sweep_section(("bf16", "nvfp4"))
    return c
