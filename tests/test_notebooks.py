"""The notebooks run top to bottom (a cell that raises fails the test), and the committed
files are exactly what notebooks/build.py writes: sources only, outputs stripped."""

import sys
from pathlib import Path

import nbformat
import pytest
from environments import COMPILE_CACHE

NOTEBOOKS = Path(__file__).parents[1] / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))
import build  # noqa: E402  (notebooks/build.py)

NAMES = sorted(build.NOTEBOOKS)


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_is_the_built_one_without_outputs(name):
    committed = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(not c.get("outputs") and not c.get("execution_count")
               for c in committed.cells if c.cell_type == "code"), f"{name} has outputs"
    assert committed == build.build(name), f"{name} differs from build.py: run it"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_top_to_bottom(name, monkeypatch):
    from nbclient import NotebookClient

    # the kernel compiles through the tests' JAX cache: notebook 03's tiny sweep is the
    # programs test_sweep's seed sweep compiles (the same sweep_tiny config and steps)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", COMPILE_CACHE)

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    assert any(o.get("output_type") == "display_data" for c in nb.cells
               for o in c.get("outputs", [])), "no figure was drawn"
