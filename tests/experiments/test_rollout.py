"""The analyses of a trained tiny run: experiments.runs (the run read back, and a damaged
run refused in one line by every reader: load_run, the export command, a resumed training),
experiments.rollout (the mismatch of rollout precisions against the BF16 trainer; sampling;
bad settings), experiments.ssm_state and experiments.residual, and experiments.export's word
on a post-training quantization. They share one run, trained 8 steps with BF16 GEMMs and a
gated residual stream stored in E4M3 with per-token scales (which the rollout and state
analyses carry along, as a user's run would)."""

import json
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from environments import ROOT

from experiments import rollout, runs


@pytest.fixture(scope="module")
def trained(train_tiny):
    """``(config, run folder)`` of the shared run."""
    return train_tiny("bf16", residual_gate=True, residual_format="e4m3_token")


@pytest.mark.slow
def test_rollout_mismatch_of_a_trained_run(trained, tmp_path, monkeypatch):
    tiny, run = trained
    (tmp_path / "run").symlink_to(run)
    monkeypatch.chdir(tmp_path)  # a relative run folder, as on the command line
    records = rollout.measure_run("run", batches=1, sample=4,
                                  precisions=("nvfp4", "fp16"), groups=("all", "head"))
    got = {(r["mode"], r["precision"], r["group"]): r for r in records}
    assert set(got) == {(m, p, g) for m in rollout.MODES for p, g in (
        ("nvfp4", "all"), ("nvfp4", "head"), ("fp16", "all"))}
    err = {k: v["token_mult_prob_error"] for k, v in got.items()}
    for mode in rollout.MODES:  # FP16 serving is far closer to the BF16 trainer than NVFP4
        assert 1.0 < err[(mode, "fp16", "all")] < err[(mode, "nvfp4", "head")] \
            < err[(mode, "nvfp4", "all")]
    assert all(v["seed"] == tiny.seed for v in records)
    md = rollout.report(records)
    assert "| teacher | nvfp4 | head | 1 |" in md
    assert json.loads(json.dumps(records)) == records
    with pytest.raises(ValueError, match="--sample 32"):
        rollout.measure_run("run", sample=tiny.data.seq_len)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        runs.load_run(tmp_path)


@pytest.mark.slow
def test_a_run_reads_back_the_parameters_training_saved(trained, tmp_path):
    import orbax.checkpoint as ocp

    tiny, folder = trained
    run = runs.load_run(folder)
    assert run.workdir == folder.resolve() and run.config.seed == tiny.seed
    # the whole TrainState as orbax stored it (no target: nothing of the loader's)
    saved = ocp.StandardCheckpointer().restore(folder.resolve() / "ckpt" / "8" / "default")
    assert set(saved) >= {"params", "opt_state", "step"} and int(saved["step"]) == 8
    assert jax.tree.structure(run.params) == jax.tree.structure(saved["params"])
    for got, want in zip(jax.tree.leaves(run.params), jax.tree.leaves(saved["params"]), strict=True):
        assert got.dtype == want.dtype == jnp.float32
        np.testing.assert_array_equal(got, want)
    inputs, targets = runs.validation_tokens(run.config, run.data, 2)
    d = tiny.data
    assert inputs.shape == targets.shape == (2 * d.batch_size, d.seq_len)
    assert inputs.dtype == targets.dtype == jnp.int32
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    val = run.data.val_batches(2, d.batch_size, d.seq_len)
    np.testing.assert_array_equal(targets, np.concatenate([b.tokens[:, 1:] for b in val]))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="has no checkpoint"):
        runs.load_run(tmp_path)
    # a run stored before data.tokens and data.suffixes existed reads as it trained
    import json
    import shutil

    old = tmp_path / "old"
    shutil.copytree(folder, old)
    stored = json.loads((old / "config.json").read_text())
    for key in ("tokens", "suffixes"):
        stored["data"].pop(key, None)
    (old / "config.json").write_text(json.dumps(stored))
    again = runs.load_run(old)
    for got, want in zip(jax.tree.leaves(again.params), jax.tree.leaves(run.params), strict=True):
        np.testing.assert_array_equal(got, want)


def _data_files(step):
    """The files of an orbax checkpoint step's OCDBT database: its B+tree nodes and the
    arrays' chunks (``default/d/*``, ``default/ocdbt.process_<i>/d/*``)."""
    return sorted(p for p in (step / "default").rglob("*")
                  if p.is_file() and p.parent.name == "d")


def _cut(path):
    text = path.read_bytes()
    path.write_bytes(text[:len(text) // 2])


# how a copy of the run is damaged, and what the error must say: the file, what is wrong
DAMAGE = {
    "empty data files": (lambda step: [p.write_bytes(b"") for p in _data_files(step)],
                         "ckpt/8", r"default/d/\w+ is empty \(0 bytes; the checkpoint needs"),
    "deleted data files": (lambda step: [p.unlink() for p in _data_files(step)],
                           "ckpt/8", r"default/d/\w+ is missing"),
    "the arrays' data files deleted": (
        lambda step: [p.unlink() for p in _data_files(step) if "process" in str(p)],
        "ckpt/8", r"default/ocdbt.process_0/d/\w+ is missing"),
    "cut-short _METADATA": (lambda step: _cut(step / "default" / "_METADATA"), "ckpt/8",
                            r"default/_METADATA is cut short or not JSON \(\w"),
    "cut-short config.json": (lambda step: _cut(step.parent.parent / "config.json"),
                              "config.json", r"its config.json is damaged \(cut short or not "
                              r"JSON: .*\); run_info.json holds the same record"),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_run_is_one_line_naming_the_run_and_the_file(trained, tmp_path, capsys,
                                                                damage):
    """A user's report: a run whose checkpoint data files were emptied ended in a 148-line
    TensorStore traceback, deleted ones in a 1,000-character spec, a cut-short config.json
    or _METADATA in "Expecting value: line 7" without the file's name. Every reader of a
    run (load_run for the analyses, the export command) now says in one line which run and
    file are damaged and what can be done; so does a resumed training (below)."""
    from experiments import export

    copy = tmp_path / "run"
    shutil.copytree(trained[1], copy)
    how, where, what = DAMAGE[damage]
    how(copy / "ckpt" / "8")
    with pytest.raises(ValueError) as e:
        runs.load_run(copy)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 500, msg
    assert msg.startswith(f"run {str(copy.resolve())!r}: ") and where in msg, msg
    assert re.search(what, msg), msg
    if where == "ckpt/8":
        assert "ckpt/8 is damaged or incomplete" in msg
        assert msg.endswith("no intact earlier checkpoint is kept: copy the run again from "
                            "where it was made, or train it again in a new folder"), msg
    assert e.value.__cause__ is None  # no chained traceback of orbax's or json's
    assert e.value.__context__ is None or e.value.__suppress_context__
    capsys.readouterr()
    assert export.main(["--run", str(copy), "--layout", "gguf", "--gguf-arch", "fp4lab",
                        "--out", str(tmp_path / "m.gguf")]) == 2
    assert capsys.readouterr().err == f"error: {msg}\n"
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.slow
def test_a_checkpoint_whose_bytes_changed_is_one_line_from_the_command(trained, tmp_path):
    """Bytes changed in place, which no size or tree tells before orbax reads them: orbax's
    own error (a bare Exception with a page of TensorStore's spec) becomes the same one
    line, naming the chunk it could not read, on the command's stderr. (Orbax's other
    reads of the checkpoint, left pending when the first failed, may still print their own
    failures on a closed event loop, before or after it, at times (seen on a loaded
    machine): that is orbax's and TensorStore's, and why this runs in a process of its own.)"""
    copy = tmp_path / "run"
    shutil.copytree(trained[1], copy)
    for p in _data_files(copy / "ckpt" / "8"):
        if "process" in str(p):  # the arrays' chunks, not the tree's root node
            p.write_bytes(bytes(255 - b for b in p.read_bytes()))
    done = subprocess.run([sys.executable, "-m", "experiments.export", "--run", str(copy),
                           "--layout", "gguf", "--gguf-arch", "fp4lab", "--out",
                           str(tmp_path / "m.gguf")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines()  # absl's and XLA's log lines aside
             if not re.match(r"(WARNING|INFO|[IWE]\d{4} )", line)]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and len(errors[0]) < 500, done.stderr[:3000]
    # anything else is orbax's pending reads failing on its closed event loop (before the
    # error line or after it, as the threads are scheduled), never a traceback of the command
    assert not any("experiments/" in line for line in lines if line.startswith("  File")), \
        done.stderr[:3000]
    assert errors[0].startswith(f"error: run {str(copy.resolve())!r}: checkpoint ckpt/8 is "
                                "damaged or incomplete: it could not be read (")
    assert re.search(r"\(\w+: the chunk params\.\S+: .*\); no intact earlier checkpoint",
                     errors[0]), errors[0]
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.slow
def test_a_damaged_checkpoint_names_an_intact_earlier_step_and_resume_refuses_it(
        trained, tmp_path):
    """With an earlier checkpoint kept (orbax keeps two), the error says it is intact and how
    to use it; moved aside, the damaged step no longer stops the run from being read. A
    resumed training reads the checkpoint through the same check."""
    from experiments.train import train

    tiny, folder = trained
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    shutil.copytree(copy / "ckpt" / "8", copy / "ckpt" / "4")  # the same arrays, at step 4
    for p in _data_files(copy / "ckpt" / "8"):
        p.write_bytes(b"")
    with pytest.raises(ValueError, match=re.escape(
            f"step 4 is intact: move {str(copy.resolve() / 'ckpt' / '8')!r} out of ckpt/ to "
            "read (or resume) the run from step 4")) as e:
        runs.load_run(copy)
    assert "\n" not in str(e.value) and " is empty (0 bytes" in str(e.value)
    with pytest.raises(ValueError, match=r"checkpoint ckpt/8 is damaged or incomplete: "
                       r"default/d/\w+ is empty") as e:
        train(tiny, copy, progress=False)
    assert "\n" not in str(e.value)
    shutil.move(copy / "ckpt" / "8", tmp_path / "damaged_step_8")
    back = runs.load_run(copy)
    for got, want in zip(jax.tree.leaves(back.params),
                         jax.tree.leaves(runs.load_run(folder).params), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_exporting_under_another_policy_says_it_is_a_post_training_quantization(
        trained, tmp_path, capsys):
    """A user's report: ``--policy`` other than the run's wrote a post-training quantization
    of it without a word. The command says so in one line; under a policy that says the
    same as the run's (another name for it) it says nothing."""
    from experiments import export

    folder = trained[1]
    out = tmp_path / "m.gguf"
    assert export.main(["--run", str(folder), "--layout", "gguf", "--gguf-arch", "fp4lab",
                        "--policy", "all:q8_0_qat", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"note: run {folder.name!r} was trained under policy 'bf16'; exporting "
                        "it under policy 'all:q8_0_qat' is a post-training quantization (PTQ) "
                        "of its weights, not the result of training under that policy (QAT)")
    assert lines[1].startswith(f"wrote {out} (gguf)") and out.is_file()
    run = runs.load_run(folder)
    assert export.ptq_note(run, "all:bf16") is None and export.ptq_note(run, "bf16") is None
    assert "'nvfp4'" in export.ptq_note(run, "nvfp4")


def test_sampling_keeps_the_prompt_and_returns_the_sampled_log_probs():
    vocab, length, n = 5, 6, 3
    table = jax.random.normal(jax.random.key(1), (vocab, vocab))

    def forward(params, tokens):  # a causal toy model: the logits depend on the last token
        return params[tokens]

    tokens = jnp.array([[1, 2, 3, 0, 0, 0], [4, 4, 1, 0, 0, 0]])
    out, logp = rollout.sample_tokens(jax.jit(forward), table, tokens, n, jax.random.key(0))
    np.testing.assert_array_equal(out[:, :length - n], tokens[:, :length - n])
    want = jax.nn.log_softmax(table[out[:, length - n - 1:-1]], axis=-1)
    np.testing.assert_allclose(logp, np.take_along_axis(
        np.asarray(want), np.asarray(out[:, length - n:])[..., None], -1)[..., 0], rtol=1e-6)


def test_unknown_rollout_settings_are_named():
    with pytest.raises(ValueError, match="unknown rollout precision 'int3'"):
        rollout.rollout_policy("int3", "all")
    with pytest.raises(ValueError, match="unknown layer group 'mlp'"):
        rollout.rollout_policy("nvfp4", "mlp")


@pytest.mark.slow
def test_ssm_state_precision_of_a_trained_run(trained):
    from experiments import ssm_state

    records = ssm_state.measure_run(trained[1], batches=1, sample=6, variants=(
        ("bf16", "nearest"), ("fp8_block128", "stochastic")))
    assert [(r["format"], r["rounding"]) for r in records] == [
        ("bf16", "nearest"), ("fp8_block128", "stochastic")]
    for r in records:
        assert r["kl"] > 0 and len(r["kl_by_quarter"]) == 4
        assert r["fp32_recurrent_vs_parallel_max_abs_logit"] < 0.1  # BF16 logits of one scan
        assert 0 <= r["line_length"] <= 6
    assert records[1]["kl"] > records[0]["kl"]  # FP8 state errs more than BF16
    assert "| fp8_block128 | stochastic | 1 |" in ssm_state.report(records)


@pytest.mark.slow
def test_residual_stream_storage_of_a_trained_run(trained):
    from experiments import residual

    tiny, run = trained
    records = residual.measure_run(run, batches=1)
    assert [(r["gated"], r["trained"], r["storage"]) for r in records] == [
        (True, "e4m3_token", "e4m3"), (True, "e4m3_token", "e4m3_token")]
    unscaled, token = records
    assert token["loss_change_%"] == 0.0 and token["loss"] == token["reference_loss"]
    assert unscaled["loss_change_%"] != 0.0
    blocks = [f"blocks_{i}" for i in range(len(tiny.model.pattern))]
    assert list(token["blocks"]) == blocks
    assert all(b["saturation"] == 0.0 and b["sqnr_db"] > 15 for b in token["blocks"].values())
    assert all(0 < b["amax"] for b in unscaled["blocks"].values())
    assert "| yes | e4m3_token | e4m3 | 1 |" in residual.report(records)
