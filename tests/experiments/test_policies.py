"""experiments.policies: its names are registered with fp4lab.policy.get_policy, the one
parser of policy strings, so a string means one policy in quantize_model, fp4lab.export and
the experiments."""

import subprocess
import sys
import warnings

import pytest

import fp4lab.policy
from experiments import policies
from fp4lab import export
from fp4lab.policy import PolicyWarning, get_policy, policy_to_dict

STRINGS = ["nvfp4", "all:mxfp8", "nemotron3", "nvfp4_paper", "nvfp4_bf16_last2",
           "mxfp8_bf16_first1", "bf16_mlp_saved_fp8", "nemotron3_no_tail"]


def test_importing_experiments_registers_its_names_with_fp4lab():
    """Before ``import experiments`` fp4lab does not know the experiments' names; after it,
    ``fp4lab.policy.get_policy`` resolves them (a fresh interpreter: this one has them)."""
    script = """
import fp4lab.policy as p
for name in ("nvfp4_bf16_last2", "bf16_mlp_saved_fp8"):
    try:
        p.get_policy(name)
    except ValueError as e:
        assert "unknown policy" in str(e), e
    else:
        raise SystemExit(f"{name} resolved before experiments was imported")
import experiments
print(p.get_policy("nvfp4_bf16_last2").name, p.get_policy("bf16_mlp_saved_fp8").name)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["nvfp4_bf16_last2", "bf16_mlp_saved_fp8"]


def test_experiment_names_resolve_through_fp4lab_and_carry_their_name():
    assert policies.get is policies.get_policy is fp4lab.policy.get_policy
    for name in list(policies.NAMED) + ["nvfp4_bf16_last2", "nemotron3"]:
        assert fp4lab.policy.get_policy(name).name == name
    p = fp4lab.policy.get_policy("nvfp4_bf16_first2")
    assert p.default.name == "nvfp4" and p.rules[0].depth.first == 2
    with pytest.raises(ValueError, match="families <recipe>_bf16_first<k>, "
                                         "<recipe>_bf16_last<k>"):
        fp4lab.policy.get_policy("nvfp5_bf16_last2")


@pytest.mark.parametrize("name", STRINGS)
def test_a_string_is_one_policy_in_quantize_model_export_and_experiments(name, monkeypatch,
                                                                          tmp_path):
    from flax import nnx

    from fp4lab.flax import assignments, linear_layers, quantize_model

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(32, 32, use_bias=False, rngs=rngs)
                                    for _ in range(3)])

    want = policies.get(name)
    assert get_policy(name) == want
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyWarning)  # rules for layers Net does not have
        model = quantize_model(Net(nnx.Rngs(0)), name)
    assert assignments(model).policy == want
    recorded = {}
    monkeypatch.setattr(export, "save", lambda weights, path, layout, metadata, **kw:
                        recorded.update(metadata))
    net = Net(nnx.Rngs(0))  # fp4lab.export takes pure data: the parameters, the layers' kinds
    export.export(nnx.to_pure_dict(nnx.state(net, nnx.Param)), name, tmp_path / "net.gguf",
                  "gguf", layers=dict(linear_layers(net)))
    assert recorded["policy"] == policy_to_dict(want)


def test_analyses_refuse_outcontrol_policies():
    """Analyses that restore a run's parameters only (residual storage, export, validation
    logits) refuse a policy with OutControl: its split lives in the training state."""
    from experiments.policies import get, without_outcontrol

    mixed = get("all:tetrajet_v2")
    assert without_outcontrol(mixed, "x") is mixed
    with pytest.raises(ValueError, match="experiments.export: policy .* uses "
                                         "tetrajet_v2_outcontrol"):
        without_outcontrol(get("all:tetrajet_v2_outcontrol"), "experiments.export")
