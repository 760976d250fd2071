"""``python -m experiments.serve``'s answers to a user's mistakes: one line, ``error: ...``,
exit status 2, naming the value (what it generates with llama.cpp:
tests/experiments/test_serving.py, which runs the command on an exported model)."""

import sys

import pytest

from experiments import serve


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")  # never read: each mistake is caught before llama.cpp loads
    return path


@pytest.mark.parametrize("options, message", [
    (["--n-tokens", "0"], "--n-tokens 0: generate at least 1"),
    (["--temperature", "-0.5"], "--temperature -0.5: must be >= 0"),
    (["--temperature", "nan"], "--temperature nan: must be >= 0"),
    (["--seed", "-1"], "--seed -1: must be in [0, 4294967294]"),
    (["--seed", str(0xFFFFFFFF)], f"--seed {0xFFFFFFFF}: must be in"),
])
def test_a_bad_option_is_one_line_naming_its_value(model, options, message, capsys):
    assert serve.main([str(model), "--prompt", "The ", *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_a_missing_model_file_is_named(tmp_path, capsys):
    assert serve.main([str(tmp_path / "nope.gguf"), "--prompt", "x"]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nope.gguf'}: no such file\n"


def test_without_llama_cpp_or_the_consumers_python_it_says_how_to_get_them(
        model, monkeypatch, capsys):
    """Where llama_cpp cannot be imported the command is handed to the consumers' Python;
    where there is none either, one line names both and the script that builds it."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` fails
    monkeypatch.setenv("FP4LAB_CONSUMER_PYTHON", str(model.parent / "no-python"))
    monkeypatch.delenv("FP4LAB_SERVE_HANDED_OVER", raising=False)
    assert serve.main([str(model), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: llama-cpp-python is not installed in {sys.executable}")
    assert str(model.parent / "no-python") in err and "scripts/consumer-venv" in err
    assert err.count("\n") == 1
    monkeypatch.setenv("FP4LAB_SERVE_HANDED_OVER", "1")  # already handed over: no loop
    assert serve.main([str(model), "--prompt", "x"]) == 2
    assert "not importable in" in capsys.readouterr().err


def test_it_imports_nothing_the_consumers_python_lacks():
    """The consumers' Python runs experiments/serve.py as a file and has no fp4lab, JAX or
    NumPy-dependent module of this package: serve.py imports the standard library only."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(serve.__file__).read_text())
    top = {alias.name.split(".")[0] for node in tree.body
           if isinstance(node, ast.Import) for alias in node.names}
    top |= {node.module.split(".")[0] for node in tree.body
            if isinstance(node, ast.ImportFrom) and node.module}
    assert top <= set(sys.stdlib_module_names) | {"__future__"}, top
