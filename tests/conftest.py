"""Shared test setup: the NumPy oracle (tests/numpy_ref.py) is importable as ``numpy_ref``
from every test directory, and hypothesis uses a small, deterministic profile on 2 cores."""

import os
import sys

from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
