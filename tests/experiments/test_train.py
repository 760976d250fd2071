"""experiments.train: learning, bit-exact resume, checkpoints, NaN stop, late precision switch,
bad configs."""

import dataclasses
import json

import numpy as np
import pytest

from experiments import policies
from experiments.data import Batch
from experiments.loop import TrainingDiverged
from experiments.records import read_jsonl
from experiments.train import train


def losses(workdir):
    return [(r["step"], r["loss"]) for r in read_jsonl(workdir / "metrics.jsonl") if "loss" in r]


@pytest.mark.slow
def test_an_interrupted_run_resumes_bit_exactly(tiny, token_dirs, tmp_path, monkeypatch):
    """The suite's one in-process end-to-end resume, of the most state a run carries at once:
    Muon's, NVFP4's stochastic rounding (the backward pass), FP8 delayed scaling's amax
    histories (the MLP) and the probes' history, on token files. A run on the llm.c files,
    and one on the nanoGPT files (the same tokens) that dies after its step-6 checkpoint
    and resumes: the same losses, probes and validation loss, bit for bit. The state each
    feature adds round-trips through a checkpoint bit for bit on its own below
    (test_a_checkpoint_restores_the_state_bit_for_bit); test_distributed.py resumes two
    processes."""
    from experiments.data import TokenData, load_data
    from fp4lab.policy import PrecisionPolicy, Rule, save_policy

    policy = tmp_path / "policy.json"
    save_policy(PrecisionPolicy(rules=(Rule(recipe="fp8_delayed", pattern=r".*mlp.*",
                                            name="MLP in delayed FP8"),), default="nvfp4"),
                policy)
    tiny.precision.policy = f"file:{policy}"
    tiny.train.optimizer, tiny.train.lr = "muon", 1e-2  # (at 3e-3 it learns 0.46 nats here)
    tiny.model.pattern = "-"  # one MLP block (delayed FP8) and the head (NVFP4, SR)
    tiny.data.tokens = str(token_dirs / "llmc" / "train.bin")
    assert load_data(tiny.data).train.max() >= 256  # ids above the byte vocabulary
    full = train(tiny, tmp_path / "llmc", progress=False)
    assert full["status"] == "ok" and np.isfinite(full["val_loss"])
    assert set(full["layers"].values()) >= {"nvfp4", "fp8_delayed"}
    assert losses(tmp_path / "llmc")[-1][1] < losses(tmp_path / "llmc")[0][1] - 0.5  # learns
    assert full["probe_summary"]

    class Interrupted(Exception):
        pass

    real_batch = TokenData.batch

    def batch(self, seed, step, batch_size, seq_len):
        if step == 9:
            raise Interrupted
        return real_batch(self, seed, step, batch_size, seq_len)

    tiny.data.tokens = str(token_dirs / "nanogpt" / "train.bin")
    monkeypatch.setattr(TokenData, "batch", batch)
    with pytest.raises(Interrupted):  # dies after the step-6 checkpoint
        train(tiny, tmp_path / "nanogpt", progress=False)
    monkeypatch.undo()
    assert max(s for s, _ in losses(tmp_path / "nanogpt")) >= 6
    resumed = train(tiny, tmp_path / "nanogpt", progress=False)
    assert losses(tmp_path / "nanogpt") == losses(tmp_path / "llmc")
    assert resumed["val_loss"] == full["val_loss"]
    assert resumed["probe_summary"] == full["probe_summary"]
    assert (tmp_path / "nanogpt" / "tb").is_dir()
    # what the runs read: the files, their tokens and the vocabulary (also the model's)
    vocab = json.loads((token_dirs / "llmc" / "tokenizer.json").read_text())["model"]["vocab"]
    for name, r in (("llmc", full), ("nanogpt", resumed)):
        assert r["data"]["token_format"] == name and r["data"]["vocab_size"] == len(vocab)
        assert r["data"]["paths"]["train"] == str(token_dirs / name / "train.bin")
        written = json.loads((tmp_path / name / "result.json").read_text())
        assert written["status"] == "ok" and written["data"] == r["data"]
        stored = json.loads((tmp_path / name / "config.json").read_text())
        assert stored["model"]["vocab"] == len(vocab) > 256


def _random_like(tree, seed=0):
    """A tree of the same structure, shapes and dtypes with random values in every leaf, so
    that a restore that drops, swaps or rounds any leaf shows (drawn by NumPy: a JAX draw
    per leaf compiled a program per shape)."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(tree)
    rng = np.random.default_rng(seed)
    out = []
    for x in leaves:
        if jnp.issubdtype(x.dtype, jnp.floating):
            y = rng.standard_normal(x.shape, np.float32).astype(x.dtype)
        else:
            y = rng.integers(0, 1000, x.shape).astype(x.dtype)
        out.append(jax.device_put(y, x.sharding))
    return jax.tree.unflatten(treedef, out)


@pytest.mark.parametrize("optimizer, policy", [("adamw", "nvfp4"), ("muon", "fp8_delayed"),
                                               ("adamw", "tetrajet_v2"),
                                               ("adamw", "tetrajet_v2_outcontrol")])
def test_a_checkpoint_restores_the_state_bit_for_bit(tiny, text, tmp_path, optimizer, policy):
    """What a resume reads back is what was saved: the whole TrainState (step, parameters,
    AdamW's or Muon's state, FP8 delayed scaling's amax histories) through train's own
    checkpoints, every leaf with its dtype and bits. (NVFP4's SR stream is no state: a
    step's key is the seed's folded with the step.)"""
    import jax
    from optax.contrib import MuonState

    from experiments.checkpoints import Checkpoints
    from experiments.run_spec import specify
    from experiments.setup import build

    tiny.train.optimizer, tiny.precision.policy = optimizer, policy
    if policy == "tetrajet_v2":  # OsciReset's accumulators are part of the state
        tiny.train.osci_reset.period, tiny.train.osci_reset.window = 4, 1
    like = build(specify(tiny, text)).state
    # the features' states (OsciReset's accumulators, OutControl's summed channel norms,
    # the amax histories) are part of the state; the probes keep none
    assert set(like.features) == {"tetrajet_v2": {"osci_reset"},
                                  "tetrajet_v2_outcontrol": {"channel_norms"},
                                  "fp8_delayed": {"amax_history"}}.get(policy, set())
    assert all(jax.tree.leaves(v) for v in like.features.values())
    is_muon = lambda x: isinstance(x, MuonState)  # noqa: E731
    assert any(is_muon(x) for x in jax.tree.leaves(like.opt_state, is_leaf=is_muon)) == \
        (optimizer == "muon")
    state = _random_like(like)
    Checkpoints(tmp_path.resolve()).save(7, state, wait=True)
    back = Checkpoints(tmp_path.resolve()).restore(like)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


@pytest.mark.slow
def test_a_nan_in_the_batch_stops_cleanly_with_the_last_good_state(tiny, text, tmp_path):
    @dataclasses.dataclass
    class Poisoned(type(text)):
        def batch(self, seed, step, batch_size, seq_len):
            b = super().batch(seed, step, batch_size, seq_len)
            w = b.weights.copy()
            if step == 5:
                w[0, 0] = np.nan
            return Batch(b.tokens, w)

    data = Poisoned(text.train, text.val, text.files, text.source)
    tiny.precision.policy, tiny.model.pattern = "bf16", "-"  # (the mechanics: one block)
    with pytest.raises(TrainingDiverged, match="non-finite at step 5"):
        train(tiny, tmp_path / "run", data=data, progress=False)
    recorded = losses(tmp_path / "run")
    assert [s for s, _ in recorded][:5] == [0, 1, 2, 3, 4]
    assert all(np.isfinite(v) for s, v in recorded if s < 5)
    assert (tmp_path / "run" / "ckpt" / "5").is_dir()  # the state before step 5


@pytest.mark.slow
def test_late_precision_switch_runs_the_last_steps_in_bf16(tiny, text, tmp_path):
    tiny.train.steps = 6
    tiny.train.ckpt_every = 0
    tiny.probes.every = 0
    tiny.model.pattern = "-"  # one MLP block: the switch is per step, not per layer kind
    tiny.precision.policy = "bf16"
    bf16 = train(tiny, tmp_path / "bf16", data=text, progress=False)
    tiny.precision.policy = "mxfp4"
    mxfp4 = train(tiny, tmp_path / "mxfp4", data=text, progress=False)  # no switch
    assert mxfp4["val_loss"] != bf16["val_loss"]  # so that equal runs below mean something
    tiny.train.bf16_last_fraction = 1.0  # every step in BF16: identical to the bf16 run
    switched = train(tiny, tmp_path / "switched", data=text, progress=False)
    assert losses(tmp_path / "switched") == losses(tmp_path / "bf16")
    assert switched["val_loss"] == bf16["val_loss"]
    tiny.train.bf16_last_fraction = 0.5  # steps 0-2 in MXFP4, steps 3-5 in BF16
    half = train(tiny, tmp_path / "half", data=text, progress=False)
    assert losses(tmp_path / "half")[0] != losses(tmp_path / "bf16")[0]  # parts at step 0
    assert losses(tmp_path / "half")[:3] == losses(tmp_path / "mxfp4")[:3]
    assert all(a != b for a, b in zip(losses(tmp_path / "half")[3:],
                                      losses(tmp_path / "mxfp4")[3:], strict=True))
    assert half["status"] == "ok" and half["val_loss"] != mxfp4["val_loss"]


def test_bad_configs_fail_with_clear_errors(tiny, text, tmp_path):
    bad = tiny.copy_and_resolve_references()
    bad.precision.policy = "nvfp5"
    with pytest.raises(ValueError, match="unknown policy 'nvfp5'; known: .*nemotron3"):
        train(bad, tmp_path / "a", data=text, progress=False)
    bad = tiny.copy_and_resolve_references()
    bad.model.pattern = "M?-"
    with pytest.raises(ValueError, match="unknown block kind"):
        train(bad, tmp_path / "b", data=text, progress=False)
    bad = tiny.copy_and_resolve_references()
    bad.data.seq_len = 10**8
    with pytest.raises(ValueError, match="seq_len=100000000 does not fit the corpus"):
        train(bad, tmp_path / "c", data=text, progress=False)
    bad = tiny.copy_and_resolve_references()
    bad.data.paths = ("/no/such/corpus",)
    with pytest.raises(FileNotFoundError, match="/no/such/corpus"):
        train(bad, tmp_path / "d", progress=False)
    bad = tiny.copy_and_resolve_references()
    bad.data.batch_size = 7
    with pytest.raises(ValueError, match="batch_size=7 is not divisible"):
        train(bad, tmp_path / "e", data=text, progress=False)


def test_named_policies_resolve():
    assert policies.get("nemotron3_no_mxfp8").name == "nemotron3_no_mxfp8"
    assert not any("mamba" in r.label() for r in policies.get("nemotron3_no_mxfp8").rules)
    assert not any(r.depth for r in policies.get("nemotron3_no_tail").rules)
    assert policies.get("nvfp4_no_rht").default.name == "nvfp4_no_rht"
    assert policies.get("all:mxfp8").default.name == "mxfp8"
    from fp4lab.policy import explain

    paths = [f"blocks_{i}/mlp/up" for i in range(6)] + ["head"]
    for name, want in (("nvfp4_bf16_first2", ["bf16"] * 2 + ["nvfp4"] * 5),
                       ("nvfp4_bf16_last2", ["nvfp4"] * 4 + ["bf16"] * 2 + ["nvfp4"]),
                       ("mxfp8_bf16_last1", ["mxfp8"] * 5 + ["bf16", "mxfp8"])):
        assert [a.recipe.name for a in explain(policies.get(name), paths)] == want, name
    for bad in ("nvfp4_bf16_last0", "nvfp5_bf16_last2"):
        with pytest.raises(ValueError, match="unknown policy"):
            policies.get(bad)


def test_a_few_steps_reduce_the_loss_on_a_fixed_batch(tiny, text):
    import jax
    import jax.numpy as jnp

    from experiments.model import HybridLM
    from experiments.step import TrainState, make_optimizer, make_step, model_config
    from fp4lab.flax import quantize_model

    model = HybridLM(model_config(tiny))
    b = text.batch(0, 0, 8, tiny.data.seq_len)
    params = model.init(jax.random.key(0), jnp.asarray(b.tokens[:, :-1]))["params"]
    tiny.train.lr, tiny.train.warmup = 1e-2, 1
    tx, sched = make_optimizer(tiny.train)
    state = TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params),
                       bad_step=jnp.int32(-1))
    step = make_step(quantize_model(model, "nemotron3"), tx, sched, 0, 0.0)
    seen = []
    for _ in range(8):
        state, m, _ = step(state, jnp.asarray(b.tokens), jnp.asarray(b.weights))
        seen.append(float(m["loss"]))
    assert seen[-1] < seen[0] - 0.5, seen
    assert int(state.step) == 8 and int(state.bad_step) == -1


@pytest.mark.slow
def test_a_workdir_with_another_config_is_refused_unless_the_change_is_allowed(tiny, text,
                                                                               tmp_path):
    tiny.train.steps, tiny.train.ckpt_every, tiny.probes.every = 6, 0, 0
    tiny.precision.policy = "bf16"  # the cheapest program to compile: the test is the config
    tiny.model.pattern = "-"
    train(tiny, tmp_path, data=text, progress=False)
    other = tiny.copy_and_resolve_references()
    other.precision.policy, other.train.steps = "nvfp4", 8
    with pytest.raises(ValueError, match=r"another config \(precision.policy: 'bf16' -> "
                                         r"'nvfp4', train.steps: 6 -> 8\).*--allow-changes"):
        train(other, tmp_path, data=text, progress=False)
    longer = tiny.copy_and_resolve_references()
    longer.train.steps = 8
    r = train(longer, tmp_path, data=text, progress=False, allow_changes=("train.steps",))
    assert r["config_changes"] == [{"step": 6, "changes": {"train.steps": [6, 8]}}]
    assert [s for s, _ in losses(tmp_path)] == list(range(8))  # continued, not restarted
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 8


@pytest.mark.slow
def test_ctrl_c_stops_after_the_step_saves_and_says_how_to_resume(tiny, corpus_dir, tmp_path,
                                                                  monkeypatch, capsys):
    import signal

    from experiments import data as data_module
    from experiments.train import main

    real_batch = data_module.TextData.batch

    def batch(self, seed, step, batch_size, seq_len):
        if step == 3 and not (tmp_path / "interrupted").exists():
            (tmp_path / "interrupted").touch()
            # Ctrl-C, delivered synchronously: the SIGINT handler the run installed
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
        return real_batch(self, seed, step, batch_size, seq_len)

    monkeypatch.setattr(data_module.TextData, "batch", batch)
    args = ["--config", "tiny", "--workdir", str(tmp_path / "run"),
            f"data.paths=('{corpus_dir}',)",
            f"compile_cache={tiny.compile_cache}", "probes.every=0", "train.ckpt_every=0",
            "model.pattern=-"]  # one MLP block: the test is the interruption
    assert main(args) == 130
    err = capsys.readouterr().err
    assert "interrupted after step 4 of 12" in err and "again to resume" in err
    assert "Traceback" not in err
    ckpt = tmp_path / "run" / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["4"]  # saved, nothing half-written
    assert main(args) == 0  # resumes and finishes
    assert [s for s, _ in losses(tmp_path / "run")] == list(range(12))


def test_nonsensical_sizes_are_refused_before_anything_loads(tiny, tmp_path, monkeypatch):
    """``data.batch_size=0`` trained to ``status: ok`` with a loss of 0 and
    ``data.val_batches=0`` to a NaN validation loss; ``precision.backend=cuda`` failed only
    after the data had loaded."""
    from experiments import run_spec
    from experiments.configs import apply_overrides

    def no_loading(d):
        raise AssertionError("the data was loaded before the config was checked")

    monkeypatch.setattr(run_spec, "load_data", no_loading)
    for override, error in (
            ("data.batch_size=0", "data.batch_size=0 must be an integer >= 1"),
            ("data.val_batches=0", "data.val_batches=0 must be an integer >= 1"),
            ("data.seq_len=0", "data.seq_len=0 must be an integer >= 1"),
            ("train.steps=-5", "train.steps=-5 must be an integer >= 1"),
            ("train.log_every=0", "train.log_every=0 must be an integer >= 1"),
            ("train.ckpt_every=-1", "train.ckpt_every=-1 must be an integer >= 0"),
            ("model.num_heads=0", "model.num_heads=0 must be an integer >= 1"),
            ("train.lr=-0.001", r"train.lr=-0.001 must be a number in \(0, inf\)"),
            ("train.lr=nan", None),  # (a string: refused by the override's type)
            ("train.bf16_last_fraction=1.5", r"bf16_last_fraction=1.5 must be .* \[0, 1\]"),
            ("train.warmup=12", "train.warmup=12 must be below train.steps=12"),
            ("precision.backend='cuda'", "precision.backend='cuda': use one of auto, xla"),
            ("train.optimizer='sgd'", "train.optimizer='sgd'")):
        if error is None:
            with pytest.raises(ValueError, match="train.lr must be of type float"):
                apply_overrides(tiny.copy_and_resolve_references(), [override])
            continue
        bad = apply_overrides(tiny.copy_and_resolve_references(), [override])
        with pytest.raises(ValueError, match=error):
            train(bad, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()  # nothing written for a refused config
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="file'? is a file"):
        train(tiny, tmp_path / "file", progress=False)


def test_user_mistakes_print_one_line_and_exit_2(tiny, corpus_dir, tmp_path, capsys):
    """The entry points' bad inputs: one ``error:`` line (no traceback) and exit status 2,
    as the fp4lab command line does; what is not a user's mistake keeps its traceback."""
    from experiments import auto_assign, residual, rollout, ssm_state
    from experiments import sweep as sweep_module
    from experiments import train as train_module
    from experiments.commands import command

    (tmp_path / "a_file").write_text("x")
    data = f"data.paths=('{corpus_dir}',)"
    run = ["--config", "tiny", "--workdir", str(tmp_path / "run"), data]
    cases = [
        (train_module, run + ["data.batch_size=0"], "data.batch_size=0 must be"),
        (train_module, run + ["data.val_batches=0"], "data.val_batches=0 must be"),
        (train_module, run + ["precision.policy=nvfp5"], "unknown policy 'nvfp5'"),
        (train_module, run + ["precision.policy=file:/no/such.json"], "/no/such.json"),
        (train_module, run + ["precision.backend=cuda"], "precision.backend='cuda'"),
        (train_module, run + ["train.stepz=3"], "the config has no 'train.stepz'"),
        (train_module, run + ["train.steps=many"], "train.steps must be of type int"),
        (train_module, run + ["train.steps"], "must look like key=value"),
        (train_module, run + ["model.pattern=M?-"], "unknown block kind"),
        (train_module, run + ["model.dtype=float7"], "model.dtype='float7' is not a dtype"),
        (train_module, run + ["data.seq_len=100000"], "data.seq_len=100000 does not fit"),
        (train_module, run[:4] + ["data.paths=('/no/such/corpus',)"], "/no/such/corpus"),
        (train_module, run[:4] + ["data.tokens='/no/such.bin'"], "/no/such.bin"),
        (train_module, ["--config", "nope", "--workdir", str(tmp_path)], "config 'nope' not"),
        (train_module, ["--config", str(tmp_path / "a_file"), "--workdir", str(tmp_path)],
         "is not a config file"),
        (train_module, ["--config", "tiny", "--workdir", str(tmp_path / "a_file")],
         "is a file"),
        (sweep_module, ["--config", "sweep_tiny", "--out", str(tmp_path / "s"), data,
                        "sweep.policies=('bf16','nvfp5')"], "unknown policy 'nvfp5'"),
        (sweep_module, ["--config", "sweep_tiny", "--out", str(tmp_path / "s"), data,
                        "sweep.seeds=0"], "sweep.seeds=0"),
        (sweep_module, ["--config", "sweep_tiny", "--out", str(tmp_path / "a_file")],
         "is a file, not a folder"),
        (sweep_module, ["--report", "--out", str(tmp_path / "missing")],
         "--report: no folder"),
        (auto_assign, ["--config", "tiny", "--ladder", "nvfp5,bf16"], "nvfp5"),
        (rollout, ["--run", str(tmp_path / "missing")], "holds no run"),
        (rollout, ["--run", str(tmp_path), "--precisions", "fp7"], "precision 'fp7'"),
        (residual, ["--run", str(tmp_path / "missing")], "holds no run"),
        (ssm_state, ["--run", str(tmp_path / "missing")], "holds no run")]
    for module, argv, message in cases:
        assert module.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, (argv, err)
        assert message in err, (argv, err)
    assert not (tmp_path / "run").exists() and not (tmp_path / "s").exists()

    @command
    def buggy(argv=None):
        raise TypeError("a bug")

    with pytest.raises(TypeError, match="a bug"):
        buggy([])


@pytest.mark.slow
def test_a_run_under_an_edited_policy_file_is_refused_on_resume_and_by_its_analyses(
        tiny, text, tmp_path):
    """A run interrupted and resumed after its ``file:`` policy was edited continued under
    the new file without a word; its config.json now holds the policy's rules and hash."""
    from experiments.runs import load_run
    from fp4lab.policy import all_layers, save_policy

    policy = tmp_path / "policy.json"
    save_policy(all_layers("mxfp8"), policy)
    tiny.precision.policy = f"file:{policy}"
    tiny.train.steps, tiny.train.ckpt_every, tiny.probes.every = 4, 2, 0
    tiny.model.pattern = "-"  # one MLP block: the test is the policy file
    r = train(tiny, tmp_path / "run", data=text, progress=False)
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    assert stored["precision"]["policy_rules"]["default"] == "mxfp8"
    assert r["policy_sha256"] == stored["precision"]["policy_sha256"] == \
        policies.fingerprint(all_layers("mxfp8"))
    assert r["data"] == text.record() and set(r["layers"].values()) == {"mxfp8"}
    save_policy(all_layers("nvfp4"), policy)  # edited
    changed = f"trained under policy file '{policy}' as it read then, and it has changed since"
    with pytest.raises(ValueError, match=changed + ".*--allow-changes precision.policy_sha256"):
        train(tiny, tmp_path / "run", data=text, progress=False)
    with pytest.raises(ValueError, match=changed + r".*its config.json \(precision.policy_"):
        load_run(tmp_path / "run")  # rollout, residual, ssm_state and export read runs so
    save_policy(all_layers("mxfp8"), policy)  # as it was: the run is its own again
    assert load_run(tmp_path / "run").config.precision.policy_sha256 == r["policy_sha256"]


@pytest.mark.slow
def test_osci_reset_acts_at_the_end_of_each_window(tiny, text, tmp_path):
    """train.osci_reset (TetraJet-v2's OsciReset): with period 4 and a window of 1 step from
    step 0, weights are reset only after steps 2 and 6 (t % 4 == window + 1), and with a
    threshold near 0 every weight whose grid point moved in the window is; a policy without
    the OsciReset format is refused. (MXFP4 weight-only QAT as the forward quantizer: the
    mechanism is the same as under tetrajet_v2's double blocks, and it compiles in a
    fraction of the time.)"""
    tiny.train.steps, tiny.train.ckpt_every, tiny.probes.every = 8, 0, 0
    tiny.precision.policy, tiny.model.pattern = "mxfp4_weights", "-"
    o = tiny.train.osci_reset
    o.period, o.window, o.threshold, o.start, o.format = 4, 1, 1e-9, 0, "mxfp4"
    train(tiny, tmp_path / "run", data=text, progress=False)
    resets = {r["step"]: r["osci_resets"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")
              if "osci_resets" in r}
    assert set(resets) == set(range(8))
    assert {s for s, n in resets.items() if n} <= {2, 6} and resets[2] + resets[6] > 0
    tiny.precision.policy = "nvfp4"
    with pytest.raises(ValueError, match="no layer's forward weight is in format mxfp4"):
        train(tiny, tmp_path / "nvfp4", data=text, progress=False)


def test_outcontrol_records_every_gemm_input(tiny, text):
    """OutControl's record pass adds, per GEMM with the recipe, the L2 norm over the tokens
    of each input channel of that GEMM's X in the step's forward pass (in the layer's
    compute dtype): here against the inputs of every Dense layer, captured by a Flax
    interceptor, summed in float64."""
    import flax.linen as nn
    import jax

    from experiments.run_spec import specify
    from experiments.setup import build
    from fp4lab.features.outcontrol import record

    tiny.precision.policy = "tetrajet_v2_outcontrol"
    setup = build(specify(tiny, text))
    norms0 = setup.state.features["channel_norms"]
    params = {"params": setup.state.params}
    assert all((np.asarray(v) == 0).all() for v in jax.tree.leaves(norms0))
    tokens = setup.spec.data.batch(0, 3, tiny.data.batch_size, tiny.data.seq_len).tokens
    key = jax.random.key(11)
    seen = {}

    def capture(next_fun, args, kwargs, context):
        m = context.module
        if isinstance(m, (nn.Dense, nn.DenseGeneral, nn.Einsum)) and \
                context.method_name == "__call__":
            x = args[0] if m.dtype is None else args[0].astype(m.dtype)  # as the GEMM gets it
            seen["/".join(m.scope.path)] = np.asarray(x, np.float64)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(capture):
        once = record(setup.qmodel, params, norms0, tokens[:, :-1], key)
    twice = record(setup.qmodel, params, once, tokens[:, :-1], key)
    flat = {"/".join(k[:-1]): v for k, v in flax_flat(once).items()}
    assert set(flat) == set(seen) and len(flat) == 7  # every GEMM of the tiny model
    for path, x in seen.items():
        k = flat[path].shape[0]
        want = np.sqrt((x.reshape(-1, k) ** 2).sum(axis=0))  # the contracted dims trail
        np.testing.assert_allclose(flat[path], want, rtol=1e-5, err_msg=path)
    for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(twice), strict=True):
        np.testing.assert_array_equal(np.asarray(b), 2 * np.asarray(a))
    # validation after the record window splits as the next step would
    from experiments.step import make_eval

    batch = setup.spec.data.val_batches(1, tiny.data.batch_size, tiny.data.seq_len)[0]
    outcontrol = setup.feature("channel_norms")
    plain, split = (float(make_eval(setup.qmodel, 0)(
        setup.state.params, outcontrol.variables(once, mode, False), batch.tokens,
        batch.weights)) for mode in ("record", "split"))
    assert plain != split


def test_outcontrol_that_would_never_split_is_refused(tiny, text):
    from experiments.run_spec import specify
    from experiments.setup import build

    tiny.precision.policy = "tetrajet_v2_outcontrol"
    tiny.train.steps, tiny.train.bf16_last_fraction = 20, 0.25  # quantized: steps 0-14
    tiny.train.outcontrol.start, tiny.train.outcontrol.steps = 10, 5
    with pytest.raises(ValueError, match="chosen after step 14.*would never split"):
        build(specify(tiny, text))
    tiny.train.outcontrol.steps = 4
    assert build(specify(tiny, text)).feature("channel_norms").mode(14, True) == "split"


def flax_flat(tree):
    import flax

    return flax.traverse_util.flatten_dict(tree)


@pytest.mark.slow
def test_outcontrol_trains_plain_records_then_splits(tiny, text, tmp_path):
    """train.outcontrol with start 1 and 2 steps: steps 0-2 are tetrajet_v2's bit for bit
    (the record pass changes nothing), from step 3 on the split GEMMs give other losses, and
    the final state holds the two recorded steps' norms."""
    import jax

    from experiments.checkpoints import Checkpoints
    from experiments.run_spec import specify
    from experiments.setup import build

    tiny.train.steps, tiny.train.ckpt_every, tiny.probes.every = 5, 0, 0
    tiny.model.pattern = "-"  # one MLP block: three GEMMs, four programs compile quickly
    tiny.train.outcontrol.start, tiny.train.outcontrol.steps = 1, 2
    tiny.precision.policy = "tetrajet_v2"
    train(tiny, tmp_path / "base", data=text, progress=False)
    tiny.precision.policy = "tetrajet_v2_outcontrol"
    train(tiny, tmp_path / "split", data=text, progress=False)
    base, split = losses(tmp_path / "base"), losses(tmp_path / "split")
    assert base[:3] == split[:3]
    assert all(a != b for a, b in zip(base[3:], split[3:], strict=True))
    like = build(specify(tiny, text)).state
    state = Checkpoints((tmp_path / "split").resolve()).restore(like)
    leaves = [np.asarray(v) for v in jax.tree.leaves(state.features["channel_norms"])]
    assert len(leaves) == 3 and all((v > 0).all() and np.isfinite(v).all() for v in leaves)


def test_outcontrol_beside_delayed_scaling(tiny, text, tmp_path):
    """A policy with OutControl layers and FP8 delayed-scaling layers: the model traced for
    the channel norms and the record pass both get the amax histories."""
    import jax

    from experiments.run_spec import specify
    from experiments.setup import build
    from fp4lab.features.outcontrol import record
    from fp4lab.policy import PrecisionPolicy, Rule, save_policy

    policy = tmp_path / "policy.json"
    save_policy(PrecisionPolicy(rules=(Rule(recipe="fp8_delayed", pattern=r".*mlp.*"),),
                                default="tetrajet_v2_outcontrol"), policy)
    tiny.precision.policy = f"file:{policy}"
    setup = build(specify(tiny, text))
    state = setup.state.features
    assert state["amax_history"] and "mlp" not in str(jax.tree.structure(
        state["channel_norms"]))
    tokens = setup.spec.data.batch(0, 0, tiny.data.batch_size, tiny.data.seq_len).tokens
    norms = record(setup.qmodel, {"params": setup.state.params,
                                  "amax_history": state["amax_history"]},
                   state["channel_norms"], tokens[:, :-1], jax.random.key(0))
    assert all((np.asarray(v) > 0).all() for v in jax.tree.leaves(norms))
