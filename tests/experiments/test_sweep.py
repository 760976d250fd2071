"""experiments.sweep and experiments.auto_assign: resume, failures, reports, recommendations."""

import json
import math

import pytest

import experiments.sweep as sweep
from experiments.auto_assign import assign_from_summaries, layer_passes
from experiments.configs import apply_overrides, load_config
from experiments.train import train as real_train
from fp4lab.policy import explain, policy_from_dict, policy_to_dict


@pytest.mark.slow
def test_sweep_resumes_skips_finished_runs_and_records_failures(tmp_path, text, tiny,
                                                              monkeypatch):
    config = load_config("sweep_tiny", ["sweep.policies=('bf16','nvfp5','nvfp4')",
                                        "train.steps=6", "probes.every=3"])
    config.compile_cache = tiny.compile_cache
    calls = []

    def counting_train(c, workdir, **kw):
        calls.append(c.precision.policy)
        return real_train(c, workdir, data=text, **kw)

    monkeypatch.setattr(sweep, "train", counting_train)
    results = sweep.run_sweep(config, tmp_path, progress=False)
    assert [r["status"] for r in results] == ["ok", "failed", "ok"]
    assert "unknown policy 'nvfp5'" in results[1]["error"]
    assert calls == ["bf16", "nvfp5", "nvfp4"]
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
    assert again[2]["val_loss"] == results[2]["val_loss"]  # resumed from its final checkpoint
    calls.clear()
    sweep.run_sweep(config, tmp_path, progress=False, retry_failed=True)
    assert calls == ["nvfp5"]
    config.train.lr = 1e-2  # another config must not silently reuse these runs
    with pytest.raises(ValueError, match=r"another config \(train.lr: 0.003 -> 0.01\)"):
        sweep.run_sweep(config, tmp_path, progress=False)


def test_results_table_gaps_and_speed_are_relative_to_bf16():
    base = {"policy": "bf16", "status": "ok", "final_train_loss": 2.0, "val_loss": 2.0,
            "tokens_per_s": 1000.0, "underflow_by_kind": {"mlp/up": 0.0}}
    other = {"policy": "nvfp4", "status": "ok", "final_train_loss": 2.1, "val_loss": 2.2,
             "tokens_per_s": 500.0, "underflow_by_kind": {"mlp/up": 0.068}}
    failed = {"policy": "x", "status": "failed", "error": "ValueError: boom"}
    header, rows = sweep.results_table([base, other, failed])
    row = dict(zip(header, rows[1]))
    assert row["val gap vs bf16 %"] == 10.0 and row["speed vs bf16"] == 0.5
    assert row["underflow % mlp/up"] == 6.8
    assert rows[2][1].startswith("failed: ValueError: boom")


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
    with pytest.raises(FileNotFoundError, match="configs here: default"):
        load_config("nope")


def test_run_folders_are_safe_names_for_any_policy(tmp_path):
    assert sweep.run_name("file:results/auto/policy.json") == "file_results_auto_policy.json"
    assert sweep.run_name("all:nvfp4") == "all_nvfp4" and sweep.run_name("bf16") == "bf16"
    config = load_config("sweep_tiny", ["sweep.policies=('all:nvfp4','all/nvfp4')"])
    with pytest.raises(ValueError, match="duplicates"):
        sweep.run_sweep(config, tmp_path, progress=False)
    assert not (tmp_path / "runs").exists()
