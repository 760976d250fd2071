"""Shared fixtures for the experiment tests: a small real-text corpus (the stdlib's json
package) and the tiny config."""

import json
import os
from pathlib import Path

import pytest

from experiments.configs import load_config
from experiments.data import load_text


@pytest.fixture(scope="session")
def corpus_dir():
    return Path(json.__file__).parent


@pytest.fixture(scope="session")
def text(corpus_dir):
    return load_text([corpus_dir], val_fraction=0.3)


# JAX's persistent compilation cache: a test that trains the same program again (resume, a
# rerun sweep) loads it instead of compiling for ~20 s. Programs are keyed by their HLO, so a
# stale entry is never used for a changed program.
CACHE = os.environ.get("FP4LAB_TEST_CACHE",
                       str(Path(__file__).parents[2] / ".pytest_cache" / "jax-compile"))


@pytest.fixture
def tiny():
    c = load_config("tiny")
    c.compile_cache = CACHE
    return c
