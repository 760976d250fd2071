"""The benchmark scripts still run (tiny sizes, interpret mode; no timing is asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from environments import MAXTEXT, python_of

BENCH = Path(__file__).parents[1] / "benchmarks"


def test_benchmark_scripts_run_in_smoke_mode(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import grouped_gemm
    import kernels
    import train_step

    kernels.main(["--smoke", "--config", "32x64x4"])
    train_step.main(["--recipes", "bf16,mxfp8", "--dim", "32", "--layers", "1", "--tokens",
                     "32", "--reps", "1", "--runs", "1"])
    out = capsys.readouterr().out
    assert "rht + nvfp4 + SR (wgrad)" in out and "training step, nvfp4 vs bf16" in out
    assert "quantize mxfp4 + SR" in out and "block_rows=32, block_cols=64" in out
    assert "mxfp8" in out.splitlines()[-1]
    grouped_gemm.main(["--recipes", "mxfp8", "--experts", "3", "--tokens", "24", "--dim", "32",
                       "--hidden", "32", "--reps", "1", "--runs", "1"])
    assert "loop of qdot_general mxfp8" in capsys.readouterr().out.splitlines()[-1]
    for name in ("kernels", "train_step", "grouped_gemm"):
        sys.modules.pop(name, None)


def test_quantize_benchmark_modes(capsys, monkeypatch):
    """benchmarks/quantize.py's three modes run; its loop count holds what docs/kernels.md
    says: NVFP4 and MXFP8 fake_quant, with or without SR, read or write every element in two
    loops (the amax pass and the rounding pass: the SR bits are computed in the latter)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import quantize

    quantize.main(["--smoke", "--formats", "nvfp4,mxfp8", "--sr"])
    quantize.main(["--sizes", "32,64", "--rounds", "1", "--sr", "--formats", "nvfp4"])
    quantize.main(["--fusions", "--size", "256", "--formats", "nvfp4,mxfp8"])
    out = capsys.readouterr().out
    assert "| nvfp4 | fp4lab fake_quant SR |" in out and "| nvfp4 fp4lab fake_quant SR |" in out
    full = {tuple(c.strip() for c in row.split("|")[1:3]): int(row.split("|")[4])
            for row in out.splitlines() if row.count("|") == 5 and row.split("|")[4].strip()
            .isdigit()}
    assert full == {(f, v): 2 for f in ("nvfp4", "mxfp8")
                    for v in ("fp4lab fake_quant", "fp4lab fake_quant SR")}, full
    sys.modules.pop("quantize", None)


@pytest.mark.slow
def test_maxtext_step_benchmark_runs_each_kind_of_variant(tmp_path):
    """benchmarks/maxtext_step.py in MaxText's environment, one round of 3 steps of a 1-layer
    MoE model (2 experts): the baseline, an fp4lab policy and MaxText's qwix quantization all
    run, and the JSON holds their kept step times and the table."""
    out = tmp_path / "step.json"
    cmd = [str(python_of(MAXTEXT)), str(BENCH / "maxtext_step.py"), "--variants",
           "maxtext,fp4lab:all:bf16,qwix:int8", "--rounds", "1", "--steps", "3", "--emb", "64",
           "--mlp", "128", "--layers", "1", "--heads", "2", "--head-dim", "32", "--seq", "64",
           "--experts", "2", "--experts-per-tok", "1", "--out", str(out)]
    with (tmp_path / "out").open("w") as stdout, (tmp_path / "err").open("w") as stderr:
        code = subprocess.run(cmd, stdout=stdout, stderr=stderr, timeout=300,
                              cwd=tmp_path).returncode
    assert code == 0, (tmp_path / "err").read_text()[-3000:]
    result = json.loads(out.read_text())
    assert [len(r) for r in result["steps_s"].values()] == [1, 1, 1]  # one round each
    assert all(len(r[0]) == 1 for r in result["steps_s"].values())  # 3 steps, 2 dropped
    assert not any(row["error"] for row in result["rows"])
    assert "| qwix:int8 |" in result["table"]
    assert "| fp4lab:all:bf16 |" in (tmp_path / "out").read_text()


def test_profile_attributes_a_steps_time_to_gemms_and_each_operands_quantizer(
        capsys, monkeypatch, tmp_path):
    """benchmarks/profile_step.py on the training-step model: BF16's time is GEMMs and the
    rest, NVFP4's also each backward operand's quantizer (named by its fp4lab scope); the
    --xplane/--hlo mode reads a profile and an HLO dump written elsewhere."""
    monkeypatch.syspath_prepend(str(BENCH))
    import jax
    import profile_step

    profile_step.main(["--recipes", "bf16,nvfp4", "--dim", "32", "--layers", "1",
                       "--tokens", "64", "--steps", "2"])
    rows = {r.split("|")[1].strip(): r.split("|")[2:4] for r in
            capsys.readouterr().out.splitlines() if r.startswith("| ")}
    ms = {c: [float(cell.split()[0]) for cell in cells] for c, cells in rows.items()
          if c != "category"}
    assert ms["gemm"][0] > 0 and ms["gemm"][1] > 0
    for operand in ("fprop_w", "dgrad_dy", "wgrad_x", "wgrad_dy"):
        assert ms[f"quantize {operand}"][1] > 0, operand
    assert ms.get("quantize wgrad_x", [0])[0] == 0  # BF16 casts X once, in its forward

    # the file mode, as MaxText's profiler and XLA's dump write them
    f = jax.jit(lambda x: jax.numpy.tanh(x @ x))
    x = jax.numpy.ones((64, 64))
    text = f.lower(x).compile().as_text()
    (tmp_path / "hlo").mkdir()
    (tmp_path / "hlo" / "m.after_optimizations.txt").write_text(text)
    f(x).block_until_ready()
    jax.profiler.start_trace(str(tmp_path / "trace"))
    f(x).block_until_ready()
    jax.profiler.stop_trace()
    profile_step.main(["--xplane", str(tmp_path / "trace"), "--hlo", str(tmp_path / "hlo"),
                       "--steps", "1", "--name", "tanh"])
    out = capsys.readouterr().out
    assert "| tanh ms/step (share) |" in out and "| gemm |" in out
    sys.modules.pop("profile_step", None)
    sys.modules.pop("train_step", None)
