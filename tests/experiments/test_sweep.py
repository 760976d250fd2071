"""experiments.sweep and experiments.auto_assign: resume, failures, reports, recommendations.

The sweep trains through ``experiments.sweep.run.train`` (and loads data through its
``load_data``): the tests that fake training patch those."""

import json
import math

import numpy as np
import pytest

import experiments.sweep as sweep
from experiments.sweep import cli as sweep_cli
from experiments.sweep import plots as sweep_plots
from experiments.sweep import run as sweep_run
from experiments.sweep.result import RunResult
from experiments.auto_assign import assign_from_summaries, layer_passes
from experiments.configs import apply_overrides, load_config
from experiments.train import train as real_train
from fp4lab.policy import explain, policy_from_dict, policy_to_dict
from fp4lab.gemm.recipe import OPERANDS


def tiny_sweep(corpus_dir, *overrides):
    """sweep_tiny on the tests' corpus (the ``text`` fixture's data: json's sources)."""
    return load_config("sweep_tiny", [f"data.paths=('{corpus_dir}',)", "data.val_fraction=0.3",
                                      *overrides])


@pytest.mark.slow
def test_sweep_resumes_skips_finished_runs_and_records_failures(tmp_path, corpus_dir, tiny,
                                                              monkeypatch):
    config = tiny_sweep(corpus_dir, "sweep.policies=('bf16','mxfp4','nvfp4')", "train.steps=6",
                        "probes.every=3", "model.pattern=-")  # one MLP block: the mechanics
    config.compile_cache = tiny.compile_cache
    calls = []

    def counting_train(spec, workdir, **kw):
        calls.append(spec.config.precision.policy)
        if spec.config.precision.policy == "mxfp4" and calls.count("mxfp4") == 1:
            raise RuntimeError("boom")  # a run that fails while training
        return real_train(spec, workdir, **kw)

    monkeypatch.setattr(sweep_run, "train", counting_train)
    results = sweep.run_sweep(config, tmp_path, progress=False)
    assert [r.status for r in results] == ["ok", "failed", "ok"]
    assert results[1].error == "RuntimeError: boom"
    assert calls == ["bf16", "mxfp4", "nvfp4"]
    for f in ("results.csv", "results.md", "loss_curves.png", "underflow_heatmap.png",
              "sqnr_heatmap.png"):
        assert (tmp_path / f).stat().st_size > 0, f
    md = (tmp_path / "results.md").read_text()
    assert "| nvfp4 | ok |" in md and "val gap vs bf16 %" in md and "failed" in md
    # an interrupted sweep: one finished run's result is lost; only that one runs again
    (tmp_path / "runs" / "nvfp4" / "result.json").unlink()
    calls.clear()
    again = sweep.run_sweep(config, tmp_path, progress=False)
    assert calls == ["nvfp4"]
    assert again[2].val_loss == results[2].val_loss  # resumed from its final checkpoint
    calls.clear()
    sweep.run_sweep(config, tmp_path, progress=False, retry_failed=True)
    assert calls == ["mxfp4"]
    config.train.lr = 1e-2  # another config must not silently reuse these runs
    with pytest.raises(ValueError, match=r"another config \(train.lr: 0.003 -> 0.01\)"):
        sweep.run_sweep(config, tmp_path, progress=False)


def test_probe_table_averages_layers_and_seeds_and_skips_infinities():
    def run(seed, nr):
        return {"policy": "nvfp4", "seed": seed, "status": "ok", "val_loss": 2.0,
                "final_train_loss": 2.0, "tokens_per_s": 1.0, "probe_summary": {
                    "a": {"wgrad_dy": {"noise_ratio": nr}, "fprop_x": {"map4_share": 0.25}},
                    "b": {"wgrad_dy": {"noise_ratio": float("inf")}}}}

    header, rows = sweep.probe_table([run(0, 6.0), run(1, 8.0)])
    row = dict(zip(header, rows[0], strict=True))
    assert row["policy"] == "nvfp4" and row["seeds"] == 2
    assert row["wgrad_dy noise ratio"] == 7.0 and row["fprop_x 4/6 share %"] == 25.0
    assert row["dgrad_dy noise ratio"] == ""  # measured nowhere
    assert sweep.probe_table([{"policy": "bf16", "status": "ok", "val_loss": 2.0,
                              "final_train_loss": 2.0, "tokens_per_s": 1.0}])[1] == []


def test_step_metric_table_averages_steps_then_seeds_per_policy():
    def run(policy, seed, load):
        means = {} if load is None else {"moe_load_max": load, "moe_load_min": 0.5}
        return {"policy": policy, "seed": seed, "status": "ok", "val_loss": 2.0,
                "final_train_loss": 2.0, "tokens_per_s": 1.0, "step_metric_means": means}

    header, rows = sweep.step_metric_table([run("bf16", 0, 1.5), run("bf16", 1, 2.0),
                                            run("nvfp4", 0, None)])
    assert header == ["policy", "seeds", "moe_load_max", "moe_load_min"]
    assert rows == [["bf16", 2, 1.75, 0.5], ["nvfp4", 1, "", ""]]
    assert sweep.step_metric_table([run("bf16", 0, None)]) == ([], [])


def test_results_table_gaps_and_speed_are_relative_to_bf16():
    base = {"policy": "bf16", "status": "ok", "final_train_loss": 2.0, "val_loss": 2.0,
            "tokens_per_s": 1000.0, "underflow_by_kind": {"mlp/up": 0.0}}
    other = {"policy": "nvfp4", "status": "ok", "final_train_loss": 2.1, "val_loss": 2.2,
             "tokens_per_s": 500.0, "underflow_by_kind": {"mlp/up": 0.068}}
    failed = {"policy": "x", "status": "failed", "error": "ValueError: boom"}
    header, rows = sweep.results_table([base, other, failed])
    row = dict(zip(header, rows[1], strict=True))
    assert row["val gap vs bf16 %"] == 10.0 and row["speed vs bf16"] == 0.5
    assert row["underflow % mlp/up"] == 6.8
    assert rows[2][1].startswith("failed: ValueError: boom")


def test_a_run_result_is_read_in_one_place_with_defaults_for_keys_old_results_lack():
    config = load_config("sweep_tiny", ["sweep.policies=('bf16','nvfp4')", "sweep.seeds=2"])
    run = sweep.planned_runs(config)[3]  # nvfp4, seed 1
    old = {"name": "elsewhere", "policy": "nvfp4", "status": "ok", "val_loss": 2.5,
           "final_train_loss": 2.4, "tokens_per_s": 10.0, "run_info": {"host": "h"}}
    r = RunResult.from_record(old, run)
    assert (r.name, r.seed, r.variant, r.base_variant, r.reference_variant) == (
        "nvfp4-seed1", 1, "", "", None)  # the plan says where it belongs
    assert (r.params, dict(r.underflow_by_kind), dict(r.layers), r.error) == (None, {}, {}, "")
    assert r.ok and r.record["run_info"] == {"host": "h"}  # everything stored stays readable
    loose = RunResult.from_record({k: v for k, v in old.items() if k != "name"})
    assert (loose.name, loose.seed, loose.pair_seed) == ("", None, 0)  # read without its plan
    with pytest.raises(ValueError, match=r"run result 'x' has no \['val_loss'\]"):
        RunResult.from_record({"name": "x", "policy": "p", "status": "ok",
                               "final_train_loss": 1.0, "tokens_per_s": 1.0})
    failed = RunResult.from_record({"status": "failed", "error": "E: boom"}, run)
    assert not failed.ok and math.isnan(failed.val_loss)
    # the tables read dicts (a notebook's result.json) and results alike
    rows = [old, {**old, "policy": "bf16", "val_loss": 2.0}]
    assert sweep.results_table(rows) == sweep.results_table(
        [RunResult.from_record(x) for x in rows])


def test_seeds_pair_the_gaps_and_give_t_intervals():
    def run(policy, seed, val):
        return {"policy": policy, "seed": seed, "status": "ok", "final_train_loss": val,
                "val_loss": val, "tokens_per_s": 100.0}

    base = [2.0, 2.1, 1.9]  # the seeds differ more than the policies: pairing removes that
    near = [2.002, 2.1021, 1.9019]  # +0.1 %, +0.1 %, +0.1 %
    noisy = [2.04, 2.08, 1.92]  # +2 %, -0.95 %, +1.05 %
    results = [run("bf16", s, v) for s, v in enumerate(base)] + \
        [run("near", s, v) for s, v in enumerate(near)] + \
        [run("noisy", s, v) for s, v in enumerate(noisy)]
    header, rows = sweep.results_table(results)
    t = {r[0]: dict(zip(header, r, strict=True)) for r in rows}
    # independent formula: t(0.975, df=2) = 4.302652729911275
    for name, vals in (("near", near), ("noisy", noisy)):
        gaps = [100 * (v - b) / b for v, b in zip(vals, base, strict=True)]
        half = 4.302652729911275 * float(np.std(gaps, ddof=1)) / np.sqrt(3)
        assert t[name]["val gap vs bf16 %"] == round(float(np.mean(gaps)), 2)
        assert t[name]["gap 95% CI"] == f"[{np.mean(gaps) - half:.2f}, {np.mean(gaps) + half:.2f}]"
        assert t[name]["seeds"] == 3
    assert t["near"]["gap != 0"] == "yes" and t["noisy"]["gap != 0"] == "no"
    assert t["bf16"]["val loss sd"] == round(float(np.std(base, ddof=1)), 4)
    one = sweep.results_table([run("bf16", 0, 2.0), run("near", 0, 2.1)])[1][1]
    assert one[header.index("gap 95% CI")] == "" and one[header.index("gap != 0")] == ""


def test_planned_runs_follow_sweep_seeds(tiny):
    c = load_config("sweep_tiny", ["sweep.policies=('bf16','nvfp4','mxfp8')", "sweep.seeds=3",
                                   "sweep.seeded_policies=('bf16','nvfp4')"])
    assert [(r.policy, r.seed, r.name) for r in sweep.planned_runs(c)] == [
        ("bf16", 0, "bf16-seed0"), ("nvfp4", 0, "nvfp4-seed0"), ("mxfp8", 0, "mxfp8-seed0"),
        ("bf16", 1, "bf16-seed1"), ("nvfp4", 1, "nvfp4-seed1"), ("bf16", 2, "bf16-seed2"),
        ("nvfp4", 2, "nvfp4-seed2")]
    c.sweep.seeds = (7, 3)
    assert sweep.sweep_seeds(c) == [7, 3]
    for bad in (0, (1, 1), (-1,), True):
        c.sweep.seeds = bad
        with pytest.raises(ValueError, match="sweep.seeds"):
            sweep.sweep_seeds(c)
    c.sweep.seeds, c.sweep.seeded_policies = 2, ("nvfp5",)
    with pytest.raises(ValueError, match=r"sweep.seeded_policies: unknown policy 'nvfp5'"):
        sweep.planned_runs(c)
    c.sweep.seeded_policies = ("bf16", "nemotron3")  # not in the sweep: selects nothing
    assert [r.name for r in sweep.planned_runs(c)] == [
        "bf16-seed0", "nvfp4-seed0", "mxfp8-seed0", "bf16-seed1"]
    assert sweep.run_name("file:a/b.json", 2) == "file_a_b.json-seed2"


def test_heatmaps_grey_out_operands_a_recipe_does_not_quantize():
    quantized = sweep_plots.quantized_operands({"head": "bf16", "mlp": "nvfp4",
                                                "qat": "mxfp4_w_mxfp8_a_qat", "odd": "-"})
    assert not any(quantized("head", op) for op in OPERANDS)  # BF16 casts: grey
    assert all(quantized("mlp", op) for op in OPERANDS)
    assert [quantized("qat", op) for op in OPERANDS] == [True, True] + [False] * 4
    assert quantized("odd", "fprop_x") and quantized("missing", "wgrad_dy")  # measured: drawn


def test_runs_that_differ_only_in_the_seed_compile_one_program(tiny, text):
    import jax
    import jax.numpy as jnp

    from experiments.model import HybridLM
    from experiments.step import TrainState, make_optimizer, make_step, model_config
    from fp4lab.flax import quantize_model

    tiny.model.pattern = "-"  # one MLP block: the step's keys are the model's
    model = HybridLM(model_config(tiny))
    b = text.batch(0, 0, 2, tiny.data.seq_len)
    params = model.init(jax.random.key(0), jnp.asarray(b.tokens[:, :-1]))["params"]
    tx, sched = make_optimizer(tiny.train)
    state = TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params),
                       bad_step=jnp.int32(-1))
    qm = quantize_model(model, "all:nvfp4")
    steps = [make_step(qm, tx, sched, seed, 0.0) for seed in (0, 1)]
    args = (state, jnp.asarray(b.tokens), jnp.asarray(b.weights))
    texts = [s.func.lower(*args, **s.keywords).as_text() for s in steps]
    assert texts[0] == texts[1]  # the seed is data, not a constant: one compiled program
    keys = [jax.random.key_data(s.keywords["base_key"]) for s in steps]
    assert not np.array_equal(np.asarray(keys[0]), np.asarray(keys[1]))  # the seeds' own keys


@pytest.mark.slow
def test_a_sweep_over_seeds_reports_intervals(tmp_path, corpus_dir, tiny):
    config = tiny_sweep(corpus_dir, "sweep.policies=('bf16','nvfp4')", "sweep.seeds=2",
                        "train.steps=6", "probes.every=3", "model.pattern=-")
    config.compile_cache = tiny.compile_cache
    results = sweep.run_sweep(config, tmp_path, progress=False)
    assert [(r.policy, r.seed) for r in results] == [
        ("bf16", 0), ("nvfp4", 0), ("bf16", 1), ("nvfp4", 1)]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [
        "bf16-seed0", "bf16-seed1", "nvfp4-seed0", "nvfp4-seed1"]
    assert results[0].val_loss != results[2].val_loss  # the seed changes the run
    header, rows = sweep.results_table(results)
    row = dict(zip(header, rows[1], strict=True))
    assert row["seeds"] == 2 and row["gap 95% CI"].startswith("[")
    for f in ("loss_gap_curves.png", "gap_intervals.png", "results.md"):
        assert (tmp_path / f).stat().st_size > 0, f


def _fake_train(spec, workdir, **kw):
    """A run's files without training: losses that depend on the policy and the seed."""
    from experiments.records import write_json_atomic

    c = spec.config
    workdir.mkdir(parents=True, exist_ok=True)
    val = 2.0 + 0.01 * len(c.precision.policy) + 0.003 * c.seed
    (workdir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "loss": val + 1 / (i + 1)}) + "\n" for i in range(20)))
    result = {"name": workdir.name, "policy": c.precision.policy, "status": "ok",
              "val_loss": val, "final_train_loss": val, "tokens_per_s": 100.0 + c.seed}
    write_json_atomic(workdir / "config.json", c.to_dict())
    write_json_atomic(workdir / "result.json", result)
    return result


def test_sharded_sweeps_merge_into_the_sequential_report(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep_run, "train", _fake_train)
    config = load_config("sweep_tiny", ["sweep.policies=('bf16','nvfp4','mxfp8')",
                                        "sweep.seeds=2", "sweep.seeded_policies=('bf16','nvfp4')"])
    sequential = sweep.run_sweep(config, tmp_path / "seq", progress=False)
    shards = [sweep.run_sweep(config, tmp_path / "sharded", progress=False, shard=(i, 3))
              for i in range(3)]
    names = [[r.name for r in s] for s in shards]
    assert sorted(sum(names, [])) == sorted(r.name for r in sequential)  # disjoint, complete
    assert not (tmp_path / "sharded" / "results.md").exists()  # shards write no report
    partial = sweep.collect_results(config, tmp_path / "partial")
    assert {r.status for r in partial} == {"missing"}
    merged = sweep.collect_results(config, tmp_path / "sharded")
    assert sweep.write_reports(merged, tmp_path / "sharded") == \
        (tmp_path / "seq" / "results.md").read_text()
    assert sweep.main(["--config", "sweep_tiny", "--out", str(tmp_path / "sharded"), "--report",
                       "sweep.policies=('bf16','nvfp4','mxfp8')", "sweep.seeds=2",
                       "sweep.seeded_policies=('bf16','nvfp4')"]) == 0
    for bad, error in (("3/3", r"index must be in 0\.\.2 \(shards are counted from 0: "
                                r"0/3, 1/3, 2/3\)"), ("1", "must look like I/N"),
                       ("a/b", "must look like I/N"), ("0/0", "number of shards must be >= 1")):
        with pytest.raises(ValueError, match=f"--shard '{bad}'.*{error}"):
            sweep.parse_shard(bad)


def _ops(underflow, mse):
    m = {"underflow": underflow, "mse": mse, "rel_mse": mse, "saturation": 0.0}
    return {"fprop_x": m, "fprop_w": dict(m, underflow=0.0),
            "dgrad_dy": dict(m, underflow=math.nan)}  # NaN: not quantized, ignored


def test_auto_assignment_picks_the_cheapest_recipe_within_thresholds():
    summaries = {
        "nvfp4": {"a/in_proj": _ops(0.01, 1e-6), "a/out_proj": _ops(1.0, 1e-6),
                  "b/up": _ops(0.01, 1e-2)},
        "mxfp8": {"a/in_proj": _ops(0.0, 1e-8), "a/out_proj": _ops(0.0, 1e-8),
                  "b/up": _ops(0.2, 1e-8)},
    }
    policy, chosen = assign_from_summaries(summaries, ["nvfp4", "mxfp8", "bf16"])
    assert {k: v[0] for k, v in chosen.items()} == {
        "a/in_proj": "nvfp4", "a/out_proj": "mxfp8", "b/up": "bf16"}
    assert "underflow 100.0% > 5.0%" in chosen["a/out_proj"][1]
    assert [a.recipe.name for a in explain(policy, list(chosen), strict=True)] == [
        "nvfp4", "mxfp8", "bf16"]
    assert policy_from_dict(json.loads(json.dumps(policy_to_dict(policy)))) == policy
    ok, why = layer_passes(_ops(0.0, 1e-3), 0.05, 1e-2, max_rel_mse=1e-4)
    assert not ok and "rel_mse" in why
    # only fprop_w must pass (it never underflows in _ops): a/out_proj's underflow is ignored
    _, fwd = assign_from_summaries(summaries, ["nvfp4", "mxfp8", "bf16"],
                                   operands=["fprop_w"])
    assert {k: v[0] for k, v in fwd.items()} == {
        "a/in_proj": "nvfp4", "a/out_proj": "nvfp4", "b/up": "mxfp8"}
    with pytest.raises(ValueError, match="unknown operands"):
        assign_from_summaries(summaries, ["nvfp4", "bf16"], operands=["fprop_q"])
    with pytest.raises(ValueError, match="no probe summary"):
        assign_from_summaries({"nvfp4": summaries["nvfp4"]}, ["nvfp4", "mxfp8", "bf16"])


def test_config_overrides_are_typed_and_checked():
    c = load_config("default", ["train.steps=7", "train.lr=1", "precision.policy=mxfp8",
                                "data.paths=['a', 'b']"])
    assert c.train.steps == 7 and c.train.lr == 1.0 and isinstance(c.train.lr, float)
    assert c.precision.policy == "mxfp8" and c.data.paths == ("a", "b")
    with pytest.raises(KeyError, match="no 'train.stepz'"):
        apply_overrides(c, ["train.stepz=3"])
    with pytest.raises(ValueError, match="key=value"):
        apply_overrides(c, ["train.steps"])
    with pytest.raises(FileNotFoundError, match="configs here: ablations, beyond, bpe, default"):
        load_config("nope")


def test_a_run_stored_before_a_key_existed_is_no_change_at_its_old_value():
    from experiments.configs import config_changes

    new = load_config("default").to_dict()
    old = {**new, "train": {k: v for k, v in new["train"].items()
                            if k not in ("optimizer", "muon", "grad_reduce",
                                         "grad_reduce_rules", "grad_survival")},
           "model": {k: v for k, v in new["model"].items()
                     if not k.startswith(("attention", "ssm_state_", "residual_",
                                          "mtp_tied"))}}
    assert config_changes(old, new) == {}  # stored before Muon and flash: AdamW, einsum
    muon = load_config("default", ["train.optimizer=muon"]).to_dict()
    assert config_changes(old, muon) == {"train.optimizer": (None, "muon")}


def test_run_folders_are_safe_names_for_any_policy(tmp_path):
    assert sweep.run_name("file:results/auto/policy.json") == "file_results_auto_policy.json"
    assert sweep.run_name("all:nvfp4") == "all_nvfp4" and sweep.run_name("bf16") == "bf16"
    config = load_config("sweep_tiny", ["sweep.policies=('all:nvfp4','all/nvfp4')"])
    with pytest.raises(ValueError, match="duplicates"):
        sweep.run_sweep(config, tmp_path, progress=False)
    assert not (tmp_path / "runs").exists()


def _fake_variant_train(spec, workdir, **kw):
    """Losses that depend on the policy, seed, width and late switch (no training)."""
    from experiments.records import write_json_atomic

    c = spec.config
    workdir.mkdir(parents=True, exist_ok=True)
    q = c.precision.policy != "bf16"
    val = (3.0 - 0.01 * c.model.d_model + 0.003 * c.seed
           + q * (0.05 - 0.1 * c.train.bf16_last_fraction + 0.002 * c.seed ** 2))
    (workdir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "loss": val + 1 / (i + 1)}) + "\n" for i in range(20)))
    result = {"policy": c.precision.policy, "status": "ok", "val_loss": val,
              "final_train_loss": val, "tokens_per_s": 100.0, "params": 1000 * c.model.d_model}
    write_json_atomic(workdir / "config.json", c.to_dict())
    write_json_atomic(workdir / "result.json", result)
    return result


def test_sizes_and_variants_cross_and_pair_their_gaps(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep_run, "train", _fake_variant_train)
    config = load_config("sweep_tiny", ["sweep.policies=('bf16','nvfp4')", "sweep.seeds=3"])
    config.sweep.sizes = ({"name": "small", "d_model": 16}, {"d_model": 32})
    config.sweep.variants = ({"name": "base"},
                             {"name": "late", "train.bf16_last_fraction": 0.2,
                              "policies": ("nvfp4",)})
    v = {x.name: x for x in sweep.sweep_variants(config)}
    assert list(v) == ["small-base", "small-late", "d_model32-base", "d_model32-late"]
    assert (v["small-late"].base, v["small-late"].reference) == ("small-base", "small-base")
    assert (v["d_model32-base"].base, v["d_model32-base"].reference) == (
        "d_model32-base", "small-base")
    assert v["d_model32-late"].overrides == {"model.d_model": 32,
                                             "train.bf16_last_fraction": 0.2}
    plan = sweep.planned_runs(config)
    assert len(plan) == 3 * (2 + 1 + 2 + 1)
    late = next(r for r in plan if r.variant.name == "d_model32-late")
    assert late.name == "d_model32-late/nvfp4-seed0"
    c = sweep.run_config(config, late)
    assert (c.model.d_model, c.train.bf16_last_fraction, c.name) == (32, 0.2, late.name)

    results = sweep.run_sweep(config, tmp_path, progress=False)
    assert (tmp_path / "runs" / "small-late" / "nvfp4-seed2" / "result.json").exists()
    val = {(r.variant, r.policy, r.seed): r.val_loss for r in results}

    def gaps(variant, base):  # independent: the per-seed relative gaps
        return [100 * (val[(variant, "nvfp4", s)] - val[(base, "bf16", s)])
                / val[(base, "bf16", s)] for s in range(3)]

    header, rows = sweep.results_table(results)
    table = {(r[0], r[1]): dict(zip(header, r, strict=True)) for r in rows}
    assert header[0] == "variant" and len(rows) == 6
    assert table[("small-late", "nvfp4")]["val gap vs bf16 %"] == round(
        float(np.mean(gaps("small-late", "small-base"))), 2)
    d_header, d_rows = sweep.difference_table(results)
    diffs = {(r[0], r[1]): dict(zip(d_header, r, strict=True)) for r in d_rows}
    assert set(diffs) == {("nvfp4", "small-late"), ("nvfp4", "d_model32-base"),
                          ("nvfp4", "d_model32-late")}
    for variant, ref, base, ref_base in (
            ("small-late", "small-base", "small-base", "small-base"),
            ("d_model32-base", "small-base", "d_model32-base", "small-base")):
        d = np.subtract(gaps(variant, base), gaps(ref, ref_base))
        half = 4.302652729911275 * float(np.std(d, ddof=1)) / np.sqrt(3)
        row = diffs[("nvfp4", variant)]
        assert row["vs variant"] == ref and row["seeds"] == 3
        assert row["difference %"] == round(float(d.mean()), 2)
        assert row["difference 95% CI"] == f"[{d.mean() - half:.2f}, {d.mean() + half:.2f}]"
    assert diffs[("nvfp4", "small-late")]["difference %"] < 0  # the late switch recovers
    md = (tmp_path / "results.md").read_text()
    assert "Gap differences between variants" in md and "| nvfp4 | small-late | small-base |" in md
    for f in ("differences.csv", "gap_vs_size.png", "gap_intervals.png"):
        assert (tmp_path / f).stat().st_size > 0, f
    # sweep.compare: one policy against another, per variant that ran both, paired by seed
    c_header, c_rows = sweep.comparison_table(results, [("nvfp4", "bf16")])
    assert [r[2] for r in c_rows] == ["small-base", "d_model32-base"]
    row = dict(zip(c_header, c_rows[0], strict=True))
    assert row["difference %"] == round(float(np.mean(gaps("small-base", "small-base"))), 2)
    config.sweep.compare = (("nvfp4", "mxfp8"),)
    with pytest.raises(ValueError, match="sweep.compare entry"):
        sweep.run_sweep(config, tmp_path, progress=False)


def test_baseline_and_reference_variants_name_whose_runs_a_variant_is_measured_against(
        tmp_path, monkeypatch):
    """A change whose own cost is the question (an FP8 residual stream) takes its gaps from an
    earlier variant's bf16 runs, and a variant can be compared with any earlier one."""
    monkeypatch.setattr(sweep_run, "train", _fake_variant_train)
    config = load_config("sweep_tiny", ["sweep.policies=('bf16','nvfp4')", "sweep.seeds=3"])
    config.sweep.variants = (
        {"name": "base"},
        {"name": "wide", "model.d_model": 48, "baseline_variant": "base"},
        {"name": "late", "train.bf16_last_fraction": 0.2, "policies": "nvfp4"},
        {"name": "wide_late", "model.d_model": 48, "train.bf16_last_fraction": 0.2,
         "policies": ("nvfp4",), "baseline_variant": "wide", "reference_variant": "late"})
    v = {x.name: x for x in sweep.sweep_variants(config)}
    assert [(x.base, x.reference) for x in v.values()] == [
        ("base", None), ("base", "base"), ("base", "base"), ("wide", "late")]
    results = sweep.run_sweep(config, tmp_path, progress=False)
    val = {(r.variant, r.policy, r.seed): r.val_loss for r in results}

    def gaps(variant, policy, base):
        return np.array([100 * (val[(variant, policy, s)] - val[(base, "bf16", s)])
                         / val[(base, "bf16", s)] for s in range(3)])

    header, rows = sweep.results_table(results)
    table = {(r[0], r[1]): dict(zip(header, r, strict=True)) for r in rows}
    wide = table[("wide", "bf16")]  # the baseline policy, measured against another variant
    assert wide["val gap vs bf16 %"] == round(float(gaps("wide", "bf16", "base").mean()), 2)
    assert wide["val gap vs bf16 %"] < 0 and wide["gap 95% CI"]  # wider is better here
    assert table[("base", "bf16")]["gap 95% CI"] == ""  # the baseline itself
    d_header, d_rows = sweep.difference_table(results)
    diffs = {(r[0], r[1]): dict(zip(d_header, r, strict=True)) for r in d_rows}
    assert ("bf16", "base") not in diffs and ("bf16", "wide") in diffs
    d = gaps("wide_late", "nvfp4", "wide") - gaps("late", "nvfp4", "base")
    row = diffs[("nvfp4", "wide_late")]
    assert row["vs variant"] == "late" and row["difference %"] == round(float(d.mean()), 2)
    for bad, error in (({"baseline_variant": "later"}, "not an earlier variant"),
                       ({"reference_variant": "wide"}, r"earlier: \['base'\]"),
                       ({"baseline_variant": "late"}, "runs no 'bf16'")):
        config.sweep.variants = (
            {"name": "base"}, {"name": "late", "train.lr": 0.1, "policies": "nvfp4"}
            if "late" in bad.values() else {"name": "x", "train.lr": 0.1, **bad},
            {"name": "y", "train.lr": 0.2, **bad}, {"name": "wide", "model.d_model": 32})
        with pytest.raises(ValueError, match=error):
            sweep.sweep_variants(config)


def test_bad_variants_fail_before_any_run(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep_run, "train", _fake_variant_train)
    config = load_config("sweep_tiny")
    for variants, error in (
            (({"train.lr": 0.1},), "needs a 'name'"),
            (({"name": "a b", "train.lr": 0.1},), "must be a folder name"),
            (({"name": "a"}, {"name": "a", "train.lr": 0.1}), "duplicate names"),
            (("fast",), "must be a non-empty dict")):
        config.sweep.variants = variants
        with pytest.raises(ValueError, match=error):
            sweep.run_sweep(config, tmp_path, progress=False)
    config.sweep.variants = ({"name": "typo", "train.lrr": 0.1},)
    with pytest.raises(KeyError, match="train.lrr"):
        sweep.run_sweep(config, tmp_path, progress=False)
    config.sweep.variants, config.sweep.sizes = ({"name": "w", "model.d_model": 8},), (
        {"d_model": 16},)
    with pytest.raises(ValueError, match=r"both set \['model.d_model'\]"):
        sweep.run_sweep(config, tmp_path, progress=False)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def _recording_train(spec, workdir, **kw):
    """A run's config.json and result.json as train writes them, without training."""
    from experiments.records import write_json_atomic

    c, policy = spec.config, spec.policy
    workdir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(workdir / "config.json", spec.record)
    result = {"name": c.name, "policy": c.precision.policy, "status": "ok", "val_loss": 2.0,
              "final_train_loss": 2.0, "tokens_per_s": 1.0, "layers": {
                  "head": policy.default.name}}
    write_json_atomic(workdir / "result.json", result)
    return result


def test_a_policy_file_is_identified_by_its_content(tmp_path, corpus_dir, monkeypatch):
    """Edit a ``file:`` policy and rerun the sweep: its finished run is not reused under the
    edited file (the old numbers were reported under it); with the file as it was, it is."""
    from fp4lab.policy import all_layers, save_policy

    calls = []
    monkeypatch.setattr(sweep_run, "train", lambda spec, w, **kw: calls.append(
        spec.config.name) or _recording_train(spec, w, **kw))
    policy = tmp_path / "policy.json"
    save_policy(all_layers("nvfp4"), policy)
    config = tiny_sweep(corpus_dir, f"sweep.policies=('bf16','file:{policy}')")
    out = tmp_path / "sweep"
    sweep.run_sweep(config, out, progress=False, shard=(0, 1))
    assert len(calls) == 2
    stored = json.loads((out / "runs" / sweep.run_name(f"file:{policy}") / "config.json")
                        .read_text())["precision"]
    assert stored["policy_rules"]["default"] == "nvfp4" and len(stored["policy_sha256"]) == 64
    sweep.run_sweep(config, out, progress=False, shard=(0, 1))
    assert len(calls) == 2  # the same content: reused
    save_policy(all_layers("mxfp8"), policy)  # edited
    with pytest.raises(ValueError, match=f"trained under policy file '{policy}' as it read "
                                         r"then, and it has changed since \(sha256 "
                                         ".*remove that folder"):
        sweep.run_sweep(config, out, progress=False, shard=(0, 1))
    assert len(calls) == 2  # refused before anything trained
    save_policy(all_layers("nvfp4"), policy)  # as it was
    assert [r.layers for r in sweep.run_sweep(config, out, progress=False, shard=(0, 1))
            ] == [{"head": "bf16"}, {"head": "nvfp4"}] and len(calls) == 2
    # runs stored before config.json held the policy's hash: a named policy's is its name's
    # (the code's rules), a file's content then cannot be known
    for name in ("bf16", sweep.run_name(f"file:{policy}")):
        path = out / "runs" / name / "config.json"
        old = json.loads(path.read_text())
        del old["precision"]["policy_sha256"], old["precision"]["policy_rules"]
        path.write_text(json.dumps(old))
    with pytest.raises(ValueError, match=f"stored before runs recorded their policy's "
                                         f"content: whether policy file '{policy}' has "
                                         "changed since it trained cannot be told"):
        sweep.run_sweep(config, out, progress=False, shard=(0, 1))
    config.sweep.policies = ("bf16",)
    sweep.run_sweep(config, out, progress=False, shard=(0, 1))
    assert len(calls) == 2


def test_the_whole_plan_is_checked_before_any_run_trains(tmp_path, corpus_dir, monkeypatch):
    """A bad policy name, backend or variant failed only when its run started, after the
    earlier runs had trained (for minutes)."""
    from experiments.data import load_data

    calls, loads = [], []
    monkeypatch.setattr(sweep_run, "train", lambda spec, w, **kw: calls.append(
        spec.config.name) or {"status": "ok", "val_loss": 2.0, "final_train_loss": 2.0,
                              "tokens_per_s": 1.0})
    monkeypatch.setattr(sweep_run, "load_data", lambda d: loads.append(d) or load_data(d))
    for overrides, error in (
            (["sweep.policies=('bf16','nvfp4','nvfp5')"], "sweep run 'nvfp5': unknown policy"),
            (["sweep.policies=('bf16','file:/no/such.json')"], "/no/such.json"),
            (["precision.backend=cuda"], r"sweep run 'bf16': precision.backend='cuda'"),
            (["sweep.variants=({'name': 'a'}, {'name': 'b', 'data.seq_len': 1000000})"],
             r"sweep run 'b/bf16': data.seq_len=1000000 does not fit the corpus"),
            (["sweep.variants=({'name': 'a'}, {'name': 'b', 'data.val_batches': 0})"],
             r"sweep run 'b/bf16': data.val_batches=0 must be an integer >= 1"),
            (["sweep.variants=({'name': 'a'}, {'name': 'b', 'model.pattern': 'M?'})"],
             r"sweep run 'b/bf16': pattern 'M\?': unknown block kind")):
        loads.clear()
        with pytest.raises((ValueError, FileNotFoundError), match=error):
            sweep.run_sweep(tiny_sweep(corpus_dir, *overrides), tmp_path, progress=False)
        assert not calls and not (tmp_path / "runs").exists()
        assert not loads or "backend" not in error  # refused before loading the data
    loads.clear()
    sweep.run_sweep(tiny_sweep(corpus_dir, "sweep.policies=('bf16','nvfp4')"), tmp_path,
                    progress=False, shard=(0, 1))
    assert calls == ["bf16", "nvfp4"] and len(loads) == 1  # once per data section


def test_the_help_example_parses_and_plans_on_the_default_config():
    import shlex

    ap = sweep_cli.parser()
    text = next(a.help for a in ap._actions if a.dest == "overrides")
    example = shlex.split(text.split("e.g. ", 1)[1])
    args = ap.parse_args(example)
    config = load_config(args.config, args.overrides)
    assert config.train.steps == 300 and config.sweep.policies == ("bf16", "nvfp4")
    assert [r.name for r in sweep.planned_runs(config)] == [
        f"{p}-seed{s}" for s in range(3) for p in ("bf16", "nvfp4")]


def test_sweep_command_line_mistakes_say_what_is_wrong(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        sweep.main(["--shard", "2/2", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "error: --shard '2/2': the shard index must be in 0..1" in capsys.readouterr().err
    assert sweep.main(["--report", "--out", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err == (
        f"error: --report: no folder {str(tmp_path / 'none')!r} to merge the results of "
        "(give the --out the sweep or its shards wrote to)\n")
