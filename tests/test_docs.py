"""Every Python example in the README and docs/ runs, each on its own: a ```python block runs
in a fresh namespace unless its first line says ``# continues the previous example`` (then it
runs in the namespace the previous block left)."""

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
        if not code.lstrip().startswith("# continues the previous example"):
            namespace = {}
        try:
            exec(compile(code, f"{path.name}:{line}", "exec"), namespace)
        except Exception as e:  # name the example that failed
            raise AssertionError(f"{path.name} example at line {line} failed: {e!r}") from e


def _project_text_files():
    """The repository's tracked (and new, unignored) text files, via git when it is there."""
    import subprocess

    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
        paths = [ROOT / p for p in out.splitlines()]
    except (OSError, subprocess.CalledProcessError):  # not a checkout: walk it
        paths = [p for p in ROOT.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts]
    suffixes = {".py", ".md", ".toml", ".ipynb", ".cfg", ".txt", ""}
    return [p for p in paths if p.is_file() and p.suffix in suffixes and p.stat().st_size < 2e6]


def test_nothing_refers_to_a_file_outside_the_repository():
    """Docstrings, tests and documents cite the project's own files (docs/numerics.md is the
    specification); a reader of the repository has nothing else."""
    # (spelled in pieces, so that this line does not match itself)
    outside = re.compile("|".join([r"(?<![\w.])" + "shar" + "ed/", "/" + "work/",
                                   r"\b(?:NUMERICS|GPU|BEYOND_GEMMS|DESIGN)" + r"\.md"]))
    hits = []
    for path in _project_text_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if outside.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "references to files outside the repository:\n" + "\n".join(hits)


def test_cited_docs_exist():
    """Every ``docs/<page>.md`` a file cites, and every relative Markdown link, exists."""
    missing = []
    for path in _project_text_files():
        text = path.read_text(errors="replace")
        for m in re.finditer(r"\bdocs/[\w./-]+\.md", text):
            if not (ROOT / m.group(0)).exists():
                missing.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
        if path.suffix == ".md":
            for m in re.finditer(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", text):
                if not (path.parent / m.group(1)).exists():
                    missing.append(f"{path.relative_to(ROOT)}: link {m.group(1)}")
    assert not missing, "cited files that do not exist:\n" + "\n".join(missing)
