"""The analyses of a trained tiny run: experiments.runs (the run read back),
experiments.rollout (the mismatch of rollout precisions against the BF16 trainer; sampling;
bad settings), experiments.ssm_state and experiments.residual. They share one run, trained 8
steps with BF16 GEMMs and a gated residual stream stored in E4M3 with per-token scales (which
the rollout and state analyses carry along, as a user's run would)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
    for got, want in zip(jax.tree.leaves(run.params), jax.tree.leaves(saved["params"])):
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
    for got, want in zip(jax.tree.leaves(again.params), jax.tree.leaves(run.params)):
        np.testing.assert_array_equal(got, want)


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
