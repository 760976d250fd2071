"""The benchmark scripts still run (tiny sizes, interpret mode; no timing is asserted)."""

import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "benchmarks"


def test_benchmark_scripts_run_in_smoke_mode(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import kernels
    import train_step

    kernels.main(["--smoke", "--config", "32x64x4"])
    train_step.main(["--recipes", "bf16,mxfp8", "--dim", "32", "--layers", "1", "--tokens",
                     "32", "--reps", "1", "--runs", "1"])
    out = capsys.readouterr().out
    assert "rht + nvfp4 + SR (wgrad)" in out and "training step, nvfp4 vs bf16" in out
    assert "quantize mxfp4 + SR" in out and "block_rows=32, block_cols=64" in out
    assert "mxfp8" in out.splitlines()[-1]
    sys.modules.pop("kernels", None)
    sys.modules.pop("train_step", None)
