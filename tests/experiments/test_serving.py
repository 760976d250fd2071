"""A model trained with a QAT recipe, exported, and evaluated with the weights the consumers'
own code dequantizes (gguf in this environment; transformers and compressed-tensors in the
consumers', test_export_consumers.py): the same validation loss as fp4lab's QAT forward.

The comparison runs the model in float32 (``export(compute_dtype=float32)``): a BF16 model's
``Dense`` casts its kernel to BF16 before the GEMM, and a dequantized Q4_0 weight (a 4-bit
code times a float16 scale) has more significant bits than BF16 holds, so only a float32
model can take the consumer's weight as it is. The activations are still cast to BF16, as
the QAT recipes' forward does (``bf16_x_fp32_w``).
"""

import json
import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from environments import CONSUMERS, python_of

from experiments.export import export_run, validation_loss, with_weights
from experiments.runs import load_run
from fp4lab import export
from fp4lab.policy import all_layers
from fp4lab.recipe import OperandQuant, Recipe

# the QAT forward with the weight taken as it is: X cast to BF16, W in float32
BF16_X_FP32_W = Recipe(name="bf16_x_fp32_w", fprop_x=OperandQuant(format="bf16"),
                       fprop_w=OperandQuant(format="fp32"), backward="ste")


@pytest.fixture(scope="module")
def qat_run(train_tiny):
    """The tiny config trained 8 steps with Q4_0 weight QAT (shared by the tests here)."""
    return train_tiny("all:q4_0_qat")[1]


@pytest.mark.slow
def test_a_qat_model_served_from_gguf_has_its_qat_loss(qat_run, tmp_path):
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    run = load_run(qat_run)
    config, params, data = run.config, run.params, run.data
    qat = validation_loss(config, params, data, "all:q4_0_qat", dtype=jnp.float32)
    path = export.export({"params": params}, "q4_0_qat", tmp_path / "m.gguf", "gguf",
                         compute_dtype=jnp.float32)
    reader = gguf.GGUFReader(str(path))  # GGML's reader and dequantizer, nothing of fp4lab's
    field = reader.fields["fp4lab.tensors"]
    index = json.loads(bytes(field.parts[field.data[0]]).decode())
    weights = {}
    for t in reader.tensors:
        info = index[t.name]
        w = quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(
            tuple(int(n) for n in reversed(t.shape)))
        weights[info["path"]] = w.T if info["transposed"] else w
    kernels = [p for p in weights if p.endswith("/kernel")]
    assert len(kernels) >= 7 and all(index[export.tensor_name(p)]["format"] == "int4_q4_0"
                                     for p in kernels)
    served = validation_loss(config, with_weights(params, weights), data,
                             all_layers(BF16_X_FP32_W), dtype=jnp.float32)
    assert served == qat  # the same bits of loss
    head = np.asarray(params["head"]["kernel"])
    assert not np.array_equal(weights["head/kernel"], head)  # the weights did change
    assert np.abs(weights["head/kernel"] - head).max() < 0.2 * np.abs(head).max()
    # the command line writes the run under its own policy, kernels in its BF16 dtype
    assert export.load(export_run(qat_run, "gguf", tmp_path / "cli.gguf")).keys() == \
        weights.keys()


@pytest.mark.slow
@pytest.mark.parametrize("layout, recipe, x_format", [
    ("mxfp4", "mxfp4_weights", "bf16"), ("nvfp4", "nvfp4", "nvfp4")])
def test_the_same_model_served_by_transformers_and_compressed_tensors(
        qat_run, tmp_path, layout, recipe, x_format):
    """The trained parameters under MXFP4 (gpt-oss's weight-only recipe) and NVFP4, exported
    and dequantized by transformers / compressed-tensors (float32), evaluated with the
    recipe's own activation quantization: MXFP4 gives the QAT forward's loss bit for bit;
    NVFP4's weights differ from fp4lab's by at most an ulp (compressed-tensors' order of the
    scale products, test_export_consumers.py), and so does the loss, to 1e-6."""
    root = Path(__file__).parents[2]
    py = python_of(CONSUMERS)
    run = load_run(qat_run)
    config, params, data = run.config, run.params, run.data
    ref = validation_loss(config, params, data, f"all:{recipe}", dtype=jnp.float32)
    export.export({"params": params}, recipe, tmp_path / layout, layout,
                  compute_dtype=jnp.float32)
    out = tmp_path / "w.npz"
    script = root / "tests" / "consumers" / "dequantize.py"
    run = subprocess.run([str(py), str(script), layout, str(tmp_path / layout), str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    names = {export.tensor_name(p): p for p in export.quantized_weights({"params": params},
                                                                         recipe)}
    with np.load(out) as f:
        tag = "" if layout == "mxfp4" else "@fp32"
        weights = {names[k.partition("@")[0]]: (f[k] if layout == "mxfp4" else f[k].T)
                   for k in f.files if k.partition("@")[2] == tag.lstrip("@")}
    assert len(weights) >= 7
    served_recipe = Recipe(name=f"{x_format}_x_fp32_w", fprop_x=OperandQuant(format=x_format),
                           fprop_w=OperandQuant(format="fp32"), backward="ste")
    served = validation_loss(config, with_weights(params, weights), data,
                             all_layers(served_recipe), dtype=jnp.float32)
    if layout == "mxfp4":
        assert served == ref
    else:
        assert served == pytest.approx(ref, rel=1e-6, abs=0) and served != 0


@pytest.mark.slow
def test_the_export_command_says_a_wrong_output_path_in_one_line(qat_run, tmp_path, capsys):
    """--out a folder for GGUF, or a file for a folder layout: one line, no traceback."""
    from experiments.export import main

    (tmp_path / "file").write_text("x")
    for layout, policy, out, message in (
            ("gguf", "all:q4_0_qat", tmp_path, "and this is a folder"),
            ("nvfp4", "all:nvfp4", tmp_path / "file", "is a file; the nvfp4 layout writes")):
        assert main(["--run", str(qat_run), "--layout", layout, "--policy", policy,
                     "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: output path") and message in err, err
        assert err.count("\n") == 1
