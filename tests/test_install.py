"""What the editable install (``pip install -e .``, as the Makefile runs it) makes importable
outside the checkout: ``fp4lab`` and ``experiments`` from any folder, and a user's own
``experiments`` (a package, or a folder without ``__init__.py``) still first where there is
one: setuptools' editable finder comes after the ordinary search of ``sys.path``
(pyproject.toml, README "Install")."""

import os
import subprocess
import sys

import pytest
from environments import ROOT


def _python(cwd, code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_experiments_imports_outside_the_checkout(tmp_path):
    said = _python(tmp_path, "import experiments, experiments.runs, experiments.serve, fp4lab; "
                             "print(experiments.__file__); print(fp4lab.__file__)")
    assert said.splitlines() == [str(ROOT / "experiments" / "__init__.py"),
                                 str(ROOT / "fp4lab" / "__init__.py")]


@pytest.mark.parametrize("init", [True, False], ids=["package", "folder"])
def test_a_users_own_experiments_comes_first(tmp_path, init):
    (tmp_path / "experiments").mkdir()
    if init:
        (tmp_path / "experiments" / "__init__.py").write_text("")
    (tmp_path / "experiments" / "mine.py").write_text("WHOSE = 'mine'\n")
    said = _python(tmp_path, "import experiments, experiments.mine; "
                             "print(list(experiments.__path__)); print(experiments.mine.WHOSE)")
    assert said.splitlines() == [str([str(tmp_path / "experiments")]), "mine"]
