"""``fp4lab.*`` is what a user needs (fewer than 30 names); the rest is reached by module."""

import importlib

import fp4lab


def test_the_top_level_is_small_and_every_name_resolves():
    assert len(fp4lab.__all__) < 30, fp4lab.__all__
    assert all(hasattr(fp4lab, name) for name in fp4lab.__all__)


def test_names_left_out_of_the_top_level_live_in_their_modules():
    for path in ("numerics.formats.ELEMENTS", "numerics.formats.ElementFormat",
                 "numerics.hadamard.rht", "numerics.backend.KernelFallback",
                 "numerics.metrics.METRIC_NAMES", "gemm.recipe.OPERANDS",
                 "features.delayed.DelayedScaling", "gemm.recipe.SavedX",
                 "features.outcontrol.OutControl", "policy.Depth",
                 "policy.nvfp4_paper", "policy.all_layers", "policy.PolicyWarning"):
        module, name = path.rsplit(".", 1)
        assert hasattr(importlib.import_module(f"fp4lab.{module}"), name), path
        assert name not in fp4lab.__all__
