"""The side environments ``make test`` builds, whose own code checks fp4lab: the inference
engines' (``.venv-consumers``, scripts/consumer-venv) and MaxText's (``.venv-maxtext``,
scripts/maxtext-venv)."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# JAX's persistent compilation cache for the tests' runs, shared by test processes and the
# processes they start: a test that trains the same program again (resume, a rerun sweep, the
# notebook's sweep) loads it instead of compiling for ~20 s. Programs are keyed by their HLO,
# so a stale entry is never used for a changed program.
COMPILE_CACHE = os.environ.get("FP4LAB_TEST_CACHE",
                               str(ROOT / ".pytest_cache" / "jax-compile"))
CONSUMERS = ("FP4LAB_CONSUMER_PYTHON", ".venv-consumers", "scripts/consumer-venv")
MAXTEXT = ("FP4LAB_MAXTEXT_PYTHON", ".venv-maxtext", "scripts/maxtext-venv")


def python_of(environment: tuple[str, str, str]) -> Path:
    """The environment's Python: ``$variable``, else its folder in the checkout. Missing, it
    fails the test under CI and skips it elsewhere, naming the script that builds it."""
    variable, folder, script = environment
    py = Path(os.environ.get(variable, ROOT / folder / "bin" / "python"))
    if not py.exists():
        message = (f"no Python at {py}: `make test` builds it (sh {script}), or set "
                   f"{variable}")
        (pytest.fail if os.environ.get("CI") else pytest.skip)(message)
    return py
