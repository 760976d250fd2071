"""The fp4lab console script."""

import numpy as np
import pytest

from fp4lab import cli
from fp4lab.formats import FORMATS


def test_formats_table(capsys):
    assert cli.main(["formats"]) == 0
    out = capsys.readouterr().out
    for name in FORMATS:
        assert f"| {name} " in out
    assert "e4m3/16 + fp32/tensor" in out and "e8m0/32" in out


def test_compare_on_distributions_and_files(tmp_path, capsys):
    w = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
    np.save(tmp_path / "w.npy", w)
    np.savez(tmp_path / "acts.npz", a=w * 3, b=w[:8])
    plot = tmp_path / "out" / "cmp.png"
    rc = cli.main(["compare", "--size", "4096", "--formats", "nvfp4,mxfp8,bf16",
                   "--tensor", str(tmp_path / "w.npy"), "--tensor", str(tmp_path / "acts.npz"),
                   "--plot", str(plot)])
    assert rc == 0
    out = capsys.readouterr().out
    for section in ("gaussian", "student-t(3)", "log-normal", "w.npy", "acts.npz:a", "acts.npz:b"):
        assert f"## {section} " in out
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_compare_errors_are_clear(tmp_path, capsys):
    assert cli.main(["compare", "--formats", "nvfp9", "--size", "1024"]) == 2
    assert "unknown format 'nvfp9'" in capsys.readouterr().err
    assert cli.main(["compare", "--tensor", str(tmp_path / "missing.npy")]) == 2
    assert "does not exist" in capsys.readouterr().err
    np.save(tmp_path / "ints.npy", np.arange(10))
    assert cli.main(["compare", "--only-files", "--tensor", str(tmp_path / "ints.npy")]) == 2
    assert "not floating point" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["compare", "--size", "1000"])


def test_compare_keeps_each_tensors_dtype_reads_jax_bf16_and_writes_the_plot_format(
        tmp_path, capsys):
    import jax.numpy as jnp

    w = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    np.save(tmp_path / "w32.npy", w)
    np.save(tmp_path / "w16.npy", np.asarray(jnp.asarray(w, jnp.bfloat16)))  # saved as |V2
    assert np.load(tmp_path / "w16.npy").dtype == np.dtype("V2")
    plot = tmp_path / "cmp.jpg"
    assert cli.main(["compare", "--only-files", "--formats", "bf16,nvfp4", "--tensor",
                     str(tmp_path / "w32.npy"), "--tensor", str(tmp_path / "w16.npy"),
                     "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "## w32.npy (32x64, float32)" in out and "## w16.npy (32x64, bfloat16)" in out
    # float32 tensors are no longer rounded to BF16 first: bf16 is lossy there, exact on BF16
    rows = {sec.split(" ")[0]: sec for sec in out.split("## ")[1:]}
    assert "| bf16" in rows["w32.npy"] and " inf " not in rows["w32.npy"].split("| bf16")[1][:60]
    assert " inf " in rows["w16.npy"].split("| bf16")[1][:60]
    assert plot.read_bytes()[:3] == b"\xff\xd8\xff"  # JPEG, not PNG bytes
    assert cli.main(["compare", "--size", "1024", "--plot", str(tmp_path / "x.bmpx")]) == 2
    assert "use one of" in capsys.readouterr().err
    np.save(tmp_path / "raw.npy", np.zeros(4, np.dtype("V1")))
    assert cli.main(["compare", "--only-files", "--tensor", str(tmp_path / "raw.npy")]) == 2
    assert "do not say their number format" in capsys.readouterr().err


def test_compare_size_help_says_multiple_of_1024(capsys):
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    assert "multiple of 1024" in capsys.readouterr().out


def test_export_writes_a_checkpoint_from_a_parameter_file(tmp_path, capsys):
    import jax.numpy as jnp
    from safetensors.flax import save_file

    import fp4lab

    rng = np.random.default_rng(0)
    flat = {"blocks_0/mlp/up/kernel": rng.standard_normal((64, 32)).astype(np.float32),
            "norm/scale": np.ones(64, np.float32)}
    np.savez(tmp_path / "params.npz", **flat)
    save_file({k: jnp.asarray(v) for k, v in flat.items()}, str(tmp_path / "p.safetensors"))
    want = fp4lab.quantize(jnp.asarray(flat["blocks_0/mlp/up/kernel"], jnp.bfloat16).astype(
        jnp.float32), "int4_q4_0", axis=0)  # the BF16 kernel, as a BF16 layer's forward
    for source in ("params.npz", "p.safetensors"):
        out = tmp_path / f"{source}.gguf"
        assert cli.main(["export", str(tmp_path / source), "--policy", "q4_0_qat",
                         "--layout", "gguf", "--out", str(out)]) == 0
        assert "wrote" in capsys.readouterr().out
        back = fp4lab.load_exported(out)
        np.testing.assert_array_equal(
            np.asarray(fp4lab.dequantize(back["blocks_0/mlp/up/kernel"])),
            np.asarray(fp4lab.dequantize(want)))
        np.testing.assert_array_equal(back["norm/scale"], flat["norm/scale"])
    # an engine's checkpoint is not a parameter file: its '.'-named tensors hold no kernel
    save_file({"blocks_0.mlp.up.weight": jnp.ones((32, 64))}, str(tmp_path / "e.safetensors"))
    assert cli.main(["export", str(tmp_path / "e.safetensors"), "--policy", "nvfp4",
                     "--layout", "nvfp4", "--out", str(tmp_path / "n")]) == 2
    assert "no linear layer" in capsys.readouterr().err
    assert cli.main(["export", str(tmp_path / "missing.npz"), "--policy", "nvfp4", "--layout",
                     "gguf", "--out", str(tmp_path / "x.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err
