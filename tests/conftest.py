"""Shared test setup: 8 simulated CPU devices (for sharding tests; set before JAX starts),
the NumPy oracles (tests/oracles/: ``from oracles import numpy_ref``) and the test helpers
importable from every test directory, and a small, deterministic hypothesis profile for 2 cores."""

import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    """The slow end-to-end tests first (stable otherwise): xdist hands tests out in this
    order, so the long ones start while short ones can still fill the other worker, instead of
    one long test running alone at the end (longest first: the classic greedy schedule)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
