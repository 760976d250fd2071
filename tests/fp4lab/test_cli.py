"""The fp4lab console script."""

import jax.numpy as jnp
import numpy as np
import pytest

from fp4lab import cli, export
from fp4lab.numerics.formats import FORMATS


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
    want = fp4lab.export.quantized_weights(  # the kernel as stored, by default
        {"blocks_0": {"mlp": {"up": {"kernel": flat["blocks_0/mlp/up/kernel"]}}}},
        "q4_0_qat")["blocks_0/mlp/up/kernel"]
    for source in ("params.npz", "p.safetensors"):
        out = tmp_path / f"{source}.gguf"
        assert cli.main(["export", str(tmp_path / source), "--policy", "q4_0_qat",
                         "--layout", "gguf", "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        assert "wrote" in printed and "no engine runs this file as a model" in printed
        back = export.load(out)
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


def test_export_path_errors_are_one_line(tmp_path, capsys):
    """An --out of the wrong kind (a file for a folder layout, a folder for GGUF, a path under
    a file) is one line, before any work; so is a corrupt parameter file."""
    np.savez(tmp_path / "p.npz", **{"l/kernel": np.ones((64, 8), np.float32)})
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir.gguf").mkdir()
    for layout, out, message in (
            ("nvfp4", "file", "is a file; the nvfp4 layout writes a folder"),
            ("gguf", "dir.gguf", "writes one file whose name ends in .gguf, and this is a folder"),
            ("gguf", "m.bin", "writes one file whose name ends in .gguf"),
            ("mxfp4", "file/sub", "lies under the file")):
        policy = {"nvfp4": "nvfp4", "gguf": "q4_0_qat", "mxfp4": "mxfp4_weights"}[layout]
        assert cli.main(["export", str(tmp_path / "p.npz"), "--policy", policy, "--layout",
                         layout, "--out", str(tmp_path / out)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00")
    assert cli.main(["export", str(tmp_path / "bad.safetensors"), "--policy", "q4_0_qat",
                     "--layout", "gguf", "--out", str(tmp_path / "m.gguf")]) == 2
    assert "is truncated or corrupt" in capsys.readouterr().err


def test_a_parameter_file_that_is_not_an_npz_is_one_line_naming_it(tmp_path, capsys):
    """A user's report: a file that is not a zip archive given as the .npz parameter file
    ended ``fp4lab export`` in zipfile's ``BadZipFile`` traceback (NumPy's pickle or EOF
    errors for others); it is one line naming the file and saying what it is not."""
    np.savez(tmp_path / "p.npz", **{"l/kernel": np.ones((64, 8), np.float32)})
    whole = (tmp_path / "p.npz").read_bytes()
    damaged = bytearray(whole)
    damaged[len(whole) // 2] ^= 0xFF  # a byte of the array changed: the member's CRC fails
    np.save(tmp_path / "a.npy", np.ones(3, np.float32))
    files = {
        "cut.npz": (whole[:len(whole) // 2], "begins as a zip archive but is cut short"),
        "text.npz": (b"not a zip archive\n" * 4, "it is not a zip archive"),
        "empty.npz": (b"", "it is empty (0 bytes)"),
        "array.npz": ((tmp_path / "a.npy").read_bytes(), "holds a single .npy array"),
        "crc.npz": (bytes(damaged), "Bad CRC-32"),
    }
    for name, (content, why) in files.items():
        path = tmp_path / name
        path.write_bytes(content)
        assert cli.main(["export", str(path), "--policy", "nvfp4", "--layout", "gguf",
                         "--out", str(tmp_path / "m.gguf")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"fp4lab: error: {str(path)!r} is not a valid .npz file")
        assert why in err and err.count("\n") == 1, err
        # fp4lab compare reads .npz files the same way
        assert cli.main(["compare", "--only-files", "--tensor", str(path)]) == 2
        assert capsys.readouterr().err == err
    assert not (tmp_path / "m.gguf").exists()
    (tmp_path / "zip.npy").write_bytes(whole)
    (tmp_path / "text.npy").write_bytes(b"not an array\n")
    for name, why in (("zip.npy", "it is a zip archive (.npz); name it .npz"),
                      ("text.npy", "is not a valid .npy file")):
        assert cli.main(["compare", "--only-files", "--tensor", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert str(tmp_path / name) in err and why in err and err.count("\n") == 1, err


@pytest.mark.parametrize("missing, layout", [("gguf", "gguf"), ("safetensors", "mxfp4")])
def test_a_missing_export_dependency_names_the_extra(tmp_path, capsys, monkeypatch, missing,
                                                     layout):
    """Without the export extra (the demo venv had none), the command says what to install
    in one line instead of a traceback from inside fp4lab.export."""
    import sys

    for name in [m for m in sys.modules if m == missing or m.startswith(missing + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)  # import gguf -> ModuleNotFoundError
    np.savez(tmp_path / "p.npz", **{"l/kernel": np.ones((64, 8), np.float32)})
    policy = {"gguf": "q4_0_qat", "mxfp4": "mxfp4_weights"}[layout]
    out = tmp_path / ("m.gguf" if layout == "gguf" else "m")
    assert cli.main(["export", str(tmp_path / "p.npz"), "--policy", policy, "--layout", layout,
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"fp4lab: error: fp4lab.export needs the {missing!r} package: "
                   "pip install 'fp4lab[export]'\n")
    assert not out.exists()


def test_q4_0_saturation_counts_only_clipped_values(tmp_path, capsys):
    """Q4_0 represents these blocks exactly (equal values: each is the block maximum, code
    -8; and the codes -8..7 times 0.25): no saturation, where it reported 100 % and 6.25 %;
    values beyond the positive end (+8 in a block whose maximum is negative) are clipped
    and counted."""
    from fp4lab.numerics.metrics import quant_metrics

    exact = np.stack([np.full(32, 0.75), np.tile(np.arange(-8, 8) * 0.25, 2)]).astype(
        np.float32)
    m = quant_metrics(jnp.asarray(exact), "int4_q4_0")
    assert float(m["saturation"]) == 0.0 and float(m["sqnr_db"]) == np.inf
    clipped = np.ones((1, 32), np.float32)
    clipped[0, 0] = -1.0  # the maximum: d = 1/8, so each +1 is +8, clipped to code 7
    assert float(quant_metrics(jnp.asarray(clipped), "int4_q4_0")["saturation"]) == 31 / 32
    np.save(tmp_path / "exact.npy", exact)
    assert cli.main(["compare", "--only-files", "--formats", "int4_q4_0", "--tensor",
                     str(tmp_path / "exact.npy")]) == 0
    row = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| int4_q4_0")][0]
    assert row.split("|")[5].strip() == "0.000", row  # saturation %
