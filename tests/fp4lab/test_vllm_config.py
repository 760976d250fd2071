"""fp4lab's NVFP4 folders read by vLLM 0.33's own configuration code (``make check-vllm``):
quantization-method detection, ``from_config`` and each linear layer's dispatch, run by
tests/consumers/vllm_config.py in vLLM's environment (scripts/vllm-venv). vLLM cannot run a
model on a CPU machine, but its config code can; the layers' kernels are not built.

The folders are a tiny Llama (``LlamaForCausalLM``'s config.json written first, fp4lab's
export extends it): every projection NVFP4 (with one amax, as vLLM fuses q/k/v and gate/up
and keeps one global scale for each fused layer), ``lm_head`` BF16. Beside the folders as
``fp4lab.export.save`` writes them, hand-edited copies record which configuration vLLM
0.33 accepts for the ModelOpt layout, weight-only (W4A16) and W4A4, and why the others fail
(the vLLM source lines are in each case's note). Beside them, a tiny NemotronH with an MoE
layer (experts NVFP4, everything else BF16) as ``experiments.hf_nemotron_h.write_nvfp4``
writes it in both layouts: vLLM loads its experts into one fused-MoE layer. Skipped where
``.venv-vllm`` is absent (``make test`` does not build it; ``make check-vllm`` does).
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import fp4lab
from fp4lab import export
from fp4lab.policy import PrecisionPolicy, Rule

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "tests" / "consumers" / "vllm_config.py"
HIDDEN, INTER, VOCAB = 64, 128, 128
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
         "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": VOCAB,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
PROJECTIONS = [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"] + \
              [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")]
MOE_STACK = "model.layers.2.mixer.experts"


def _vllm_python() -> Path:
    py = Path(os.environ.get("FP4LAB_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if not py.exists():
        pytest.skip(f"no vLLM environment at {py}: `make check-vllm` builds it "
                    "(sh scripts/vllm-venv), or set FP4LAB_VLLM_PYTHON")
    return py


def _weights(shared_amax: bool = True) -> dict:
    """The tiny Llama's weights, quantized as fp4lab's ``nvfp4`` recipe does. vLLM fuses
    q/k/v_proj and gate/up_proj into one layer with one global scale, so by default every
    kernel gets the same amax (8.0, beyond its Gaussian values); ``shared_amax=False``
    leaves each its own."""
    shapes = {**{f"self_attn/{p}_proj": (HIDDEN, HIDDEN) for p in "qkvo"},
              "mlp/gate_proj": (HIDDEN, INTER), "mlp/up_proj": (HIDDEN, INTER),
              "mlp/down_proj": (INTER, HIDDEN)}
    keys = iter(jax.random.split(jax.random.key(0), len(shapes) + 2))
    layer = {}
    for path, shape in shapes.items():
        group, name = path.split("/")
        kernel = jax.random.normal(next(keys), shape)
        if shared_amax:
            kernel = kernel.at[0, 0].set(8.0)
        layer.setdefault(group, {})[name] = {"kernel": kernel}
    params = {"model": {"embed_tokens": {"embedding": jax.random.normal(next(keys),
                                                                        (VOCAB, HIDDEN))},
                        "norm": {"scale": jnp.ones(HIDDEN)}, "layers": {"0": layer}},
              "lm_head": {"kernel": jax.random.normal(next(keys), (HIDDEN, VOCAB))}}
    policy = PrecisionPolicy(rules=(Rule(pattern="lm_head", recipe="bf16"),
                                    Rule(pattern=".*", recipe="nvfp4")))
    return export.quantized_weights({"params": params}, policy)


def _folder(path: Path, layout: str, shared_amax: bool = True, **kw) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(LLAMA))
    return export.save(_weights(shared_amax), path, layout, **kw)


def _nemotron_h_moe(root: Path) -> dict[str, Path]:
    """A NemotronH ``M*E`` (Mamba, attention, MoE: 4 experts of width 128 on a latent of 64,
    top-2, sigmoid router), its experts NVFP4 (``moe_preset("gpt_oss", experts="nvfp4")``),
    written in both layouts: ``moe_nvfp4`` (compressed-tensors), ``moe_modelopt``."""
    from experiments.hf_nemotron_h import write_nvfp4
    from experiments.model import HybridLM, ModelConfig
    from fp4lab.flax import quantize_model
    from fp4lab.policy.presets import moe_preset

    cfg = ModelConfig(pattern="M*E", d_model=64, num_heads=4, moe_experts=4, moe_top_k=2,
                      moe_router="sigmoid", moe_bias_rate=0.01, moe_latent=64, dtype="float32")
    inputs = jnp.zeros((2, 32), jnp.int32)
    params = HybridLM(cfg).init(jax.random.key(1), inputs)["params"]
    record = quantize_model(HybridLM(cfg), moe_preset("gpt_oss", experts="nvfp4")).assignments(
        {"params": params}, inputs, rngs={"quant": jax.random.key(0)})
    return {name: write_nvfp4(params, record, cfg, root / name, max_positions=32, layout=layout)
            for name, layout in (("moe_nvfp4", "nvfp4"), ("moe_modelopt", "nvfp4_modelopt"))}


def _edit(src: Path, dst: Path, hf_quant: dict | None = None,
          quantization_config: dict | None = None) -> Path:
    """A copy of ``src`` with its hf_quant_config.json replaced (and config.json's
    ``quantization_config`` taken out, so that vLLM reads the file) or its config.json given
    another ``quantization_config``."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    if hf_quant is not None:
        (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant))
        config.pop("quantization_config")
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _legacy(algo: str, kv: bool = True) -> dict:
    """hf_quant_config.json as ModelOpt writes it, ``producer.name`` ``modelopt``."""
    quantization = {"quant_algo": algo, "group_size": 16, "exclude_modules": ["lm_head"]}
    if kv:
        quantization["kv_cache_quant_algo"] = None
    return {"producer": {"name": "modelopt"}, "quantization": quantization}


def _config(algo: str, **kw) -> dict:
    """config.json's quantization_config in ModelOpt >= 0.31's form."""
    return {"quant_method": "modelopt", "quant_algo": algo, "group_size": 16,
            "ignore": ["lm_head"], "producer": {"name": "fp4lab"}, **kw}


FP4_ARGS = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
WEIGHT_ONLY_GROUPS = {"group_0": {"targets": ["Linear"], "input_activations": None,
                                  "weights": FP4_ARGS}}


# name: (source folder, hf_quant_config.json, config.json quantization_config)
EDITS = {
    "legacy_no_kv_cache_quant_algo": ("modelopt", _legacy("NVFP4", kv=False), None),
    "legacy_nvfp4": ("modelopt", _legacy("NVFP4"), None),
    "legacy_nvfp4_input_scale": ("modelopt_w4a4", _legacy("NVFP4"), None),
    "legacy_w4a16_nvfp4": ("modelopt", _legacy("W4A16_NVFP4"), None),
    "config_w4a16_nvfp4": ("modelopt", None, _config("W4A16_NVFP4")),
    "config_nvfp4_weight_only_groups": ("modelopt", None,
                                        _config("NVFP4", config_groups=WEIGHT_ONLY_GROUPS)),
    "config_nvfp4_input_scale": ("modelopt_w4a4", None, _config("NVFP4")),
    "config_nvfp4": ("modelopt", None, _config("NVFP4")),
    "config_w4a16_nvfp4_input_scale": ("modelopt_w4a4", None, _config("W4A16_NVFP4")),
}


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """vLLM's findings on every folder, from one run of the script (vLLM imports once)."""
    python = _vllm_python()
    root = tmp_path_factory.mktemp("vllm")
    amax = {p: 4.0 for p, v in _weights().items() if isinstance(v, fp4lab.QArray)}
    folders = {"nvfp4": _folder(root / "nvfp4", "nvfp4"),
               "modelopt": _folder(root / "modelopt", "nvfp4_modelopt"),
               "modelopt_w4a4": _folder(root / "modelopt_w4a4", "nvfp4_modelopt",
                                        input_amax=amax),
               "nvfp4_own_amax": _folder(root / "nvfp4_own_amax", "nvfp4", shared_amax=False)}
    for name, (src, hf, qc) in EDITS.items():
        folders[name] = _edit(folders[src], root / name, hf, qc)
    folders.update(_nemotron_h_moe(root))
    run = subprocess.run([str(python), str(SCRIPT), *map(str, folders.values())], text=True,
                         capture_output=True, timeout=600, cwd=ROOT)
    results = [json.loads(line[len("RESULT "):]) for line in run.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert len(results) == len(folders), run.stdout + run.stderr
    (root / "vllm.log").write_text(run.stdout + run.stderr)
    print("\n".join(line for line in run.stdout.splitlines()  # shown under pytest -s
                    if not line.startswith("RESULT ")))
    by_folder = {r["folder"]: r for r in results}
    return {name: by_folder[str(f)] for name, f in folders.items()}


def _assert_modules(result: dict, **want) -> None:
    assert result["modules"]["lm_head"] == {"method": "UnquantizedLinearMethod"}
    for module in PROJECTIONS:
        got = result["modules"][module]
        assert {k: got[k] for k in want} == want, (module, got)


def test_vllm_serves_the_compressed_tensors_folder_weight_only(vllm):
    """``nvfp4-pack-quantized`` with ``input_activations: null`` is NVFP4A16 in vLLM 0.33:
    ``CompressedTensorsW4A4Fp4(use_a16=True)`` (compressed_tensors.py:795-797), whose
    kernels are weight-only (Marlin, FlashInfer CuTe-DSL W4A16): activations stay BF16."""
    r = vllm["nvfp4"]
    assert r["ok"], r["fails"]
    assert r["quantization"] == "compressed-tensors"
    assert r["ignore"] == ["lm_head"]
    _assert_modules(r, method="CompressedTensorsLinearMethod", input_activations=None,
                    scheme="CompressedTensorsW4A4Fp4{'use_a16': True}")
    for module in PROJECTIONS:
        w = r["modules"][module]["weights"]
        assert (w["num_bits"], w["type"], w["strategy"], w["group_size"]) == \
            (4, "float", "tensor_group", 16)


def test_vllm_gives_the_shards_of_a_fused_layer_one_global_scale(vllm):
    """q/k/v_proj and gate/up_proj, each quantized with its own amax: vLLM's Llama fuses
    them (packed_modules_mapping) and keeps one global scale, the shards' max
    (compressed_tensors_w4a4_nvfp4.py:111; ModelOpt: modelopt.py:2093), so the other shards
    would be dequantized off by the ratio of the amaxes. The check refuses such a folder."""
    r = vllm["nvfp4_own_amax"]
    assert not r["ok"]
    assert r["fused"] == {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                          "gate_up_proj": ["gate_proj", "up_proj"]}
    assert sorted(f.split(":")[0] for f in r["fails"]) == [
        "model.layers.0.mlp.gate_up_proj", "model.layers.0.self_attn.qkv_proj"], r["fails"]
    assert all("weight_global_scale" in f for f in r["fails"])


@pytest.mark.parametrize("name, mode", [("modelopt", "W4A16"), ("modelopt_w4a4", "W4A4")])
def test_vllm_serves_the_modelopt_folder(vllm, name, mode):
    """The layout as fp4lab writes it: weight-only (``W4A16_NVFP4``) without activation
    amaxes, W4A4 (``NVFP4``, ``input_scale``) with them; config.json's ModelOpt
    ``quantization_config`` is what vLLM reads."""
    _assert_serves(vllm[name], mode)


# name: (what vLLM 0.33 decides: None if it fails, else the activation's QuantKey is
# None (W4A16) or not (W4A4)); the failure's text; why
ACCEPTS = {
    "legacy_no_kv_cache_quant_algo": (None, "kv_cache_quant_algo",
                                      "modelopt.py:817-828 requires the key (null is fine)"),
    "legacy_nvfp4": (None, "input_scale", "W4A4: KNvfp4Dynamic registers input_scale with "
                     "torch.empty (modelopt.py:2098-2111); nothing loads it"),
    "legacy_nvfp4_input_scale": ("W4A4", None, ""),
    "legacy_w4a16_nvfp4": (None, "Unknown ModelOpt quant algo",
                           "model_arch_config_convertor.py:256-269 knows FP8*, NVFP4 and "
                           "MIXED_PRECISION only, on the hf_quant_config.json path"),
    "config_w4a16_nvfp4": ("W4A16", None, "LINEAR_ALGOS, modelopt.py:152-153"),
    "config_nvfp4_weight_only_groups": ("W4A16", None, "modelopt.py:797-811"),
    "config_nvfp4_input_scale": ("W4A4", None, ""),
    "config_nvfp4": (None, "input_scale", "as legacy_nvfp4"),
    "config_w4a16_nvfp4_input_scale": ("W4A16", None, "_DropInputScale, modelopt.py:2532"),
}


@pytest.mark.parametrize("name", sorted(ACCEPTS))
def test_what_vllm_accepts_for_the_modelopt_layout(vllm, name):
    """config.json's quantization_config (``quant_method: modelopt``) is read before, and
    instead of, hf_quant_config.json (transformers_utils/config.py:953-965); there
    ``producer`` is not looked at and ``kv_cache_quant_algo`` is not required."""
    mode, failure, _why = ACCEPTS[name]
    r = vllm[name]
    if mode is None:
        assert not r["ok"] and any(failure in f for f in r["fails"]), r
        return
    _assert_serves(r, mode)


def _assert_serves(r: dict, mode: str) -> None:
    assert r["ok"], r["fails"]
    assert r["quantization"] == "modelopt_fp4"
    assert r["quant_algo"] == ("NVFP4" if mode == "W4A4" else "W4A16_NVFP4")
    params = ["weight", "weight_scale", "weight_scale_2"]
    if mode == "W4A4":
        _assert_modules(r, method="ModelOptLinearMethod", params=["input_scale", *params])
        assert all(r["modules"][m]["activation"] != "None" for m in PROJECTIONS)
    else:
        _assert_modules(r, method="ModelOptLinearMethod", activation="None",
                        params=[*params, "(input_scale)"])


@pytest.mark.parametrize("name, method", [("moe_nvfp4", "CompressedTensorsW4A4Nvfp4MoEMethod"),
                                          ("moe_modelopt", "ModelOptNvFp4FusedMoE")])
def test_vllm_loads_the_nemotron_h_experts_into_one_fused_moe_layer(vllm, name, method):
    """NemotronH's per-expert ``up_proj``/``down_proj`` are no Linear layers in vLLM but one
    non-gated (relu2) fused-MoE layer (nemotron_h.py:229-253): its dispatch gives the weight-only
    NVFP4 MoE method, and vLLM's ``RoutedExperts.load_weights`` takes all 24 expert tensors
    (4 experts x 2 projections x weight, block scales, global scale) into its parameters, every
    one it registers filled but the activation scales that W4A16 never reads."""
    r = vllm[name]
    assert r["ok"], r["fails"]
    moe = r["experts"][MOE_STACK]
    assert (moe["method"], moe["quantized"], moe["use_a16"]) == (method, True, True), moe
    assert (moe["experts"], moe["hidden"], moe["intermediate"], moe["activation"]) == \
        (4, 64, 128, "relu2_no_mul")
    assert moe["loaded"] == "24 of 24 checkpoint tensors"
    assert all(n.startswith(("w13_input", "w2_input")) for n in moe["unused"]), moe["unused"]
    assert len(moe["global_scales"]) == 2
    assert not any(m.startswith(MOE_STACK + ".") for m in r["modules"])
