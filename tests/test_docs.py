"""Every Python example in the README and docs/ runs: the ```python blocks of each file are
executed in order in one namespace (later examples may use names defined by earlier ones)."""

import re
from pathlib import Path

import matplotlib
import pytest

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1))
            for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_documentation_examples_run(path, monkeypatch, tmp_path):
    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    blocks = python_blocks(path)
    if path.name == "README.md":
        assert len(blocks) >= 3, "the README tour lost its examples (tensor, GEMM, model)"
    namespace: dict = {}
    for line, code in blocks:
        try:
            exec(compile(code, f"{path.name}:{line}", "exec"), namespace)
        except Exception as e:  # name the example that failed
            raise AssertionError(f"{path.name} example at line {line} failed: {e!r}") from e
