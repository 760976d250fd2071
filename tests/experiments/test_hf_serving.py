"""A trained hybrid LM served by transformers' own NemotronHForCausalLM
(experiments/hf_nemotron_h.py; tests/consumers/hf_eval.py runs it in the consumers'
environment): the BF16 checkpoint and the compressed-tensors NVFP4 one give the logits of
fp4lab's forward pass on the same weights, both in float32, within float32 rounding.

Measured on the tiny config trained 8 steps under ``all:nvfp4`` (16 windows of 32 tokens,
|logits| up to ~4.2): max |diff| 2.4e-6 (BF16) and 3.2e-6 (NVFP4), losses equal to the
printed digits (4.6412 BF16, 4.6462 NVFP4; the run's QAT forward: 4.6608).

compressed-tensors decompresses NVFP4 to BF16 (its output dtype), and transformers casts
that to the float32 model: the served weights are fp4lab's NVFP4 values rounded to BF16 (an
NVFP4 value, code times block scale times 1/S_enc, has more bits than BF16 holds). The
fp4lab side rounds them the same way; with the float32 values the logits differ by ~1.6e-2,
which the test also checks, so it can tell the two apart.
"""

import dataclasses
import json
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from environments import CONSUMERS, python_of

from experiments import policies
from experiments.export import export_run, main, with_weights
from experiments.hf_nemotron_h import (check_expressible, hf_layout,
                                       hf_name, write_bf16)
from experiments.model import HybridLM, ModelConfig
from experiments.rollout import token_log_probs
from experiments.runs import load_run, validation_tokens
from experiments.step import model_config
from fp4lab import QArray, dequantize, export
from fp4lab.flax import quantize_model

ROOT = Path(__file__).parents[2]
TOLERANCE = 2e-5  # of max |logit|: float32 rounding through ~10 layers' sums
NAMES_M_ATTN_MLP = {  # NemotronHForCausalLM's parameters for the pattern "M*-"
    "model.embeddings.weight", "model.norm_f.weight", "lm_head.weight",
    *(f"model.layers.{i}.norm.weight" for i in range(3)),
    *(f"model.layers.0.mixer.{n}" for n in (
        "in_proj.weight", "out_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D",
        "dt_bias", "norm.weight")),
    *(f"model.layers.1.mixer.{n}_proj.weight" for n in "qkvo"),
    "model.layers.2.mixer.up_proj.weight", "model.layers.2.mixer.down_proj.weight"}


def _bf16(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.fixture(scope="module")
def served(train_tiny, tmp_path_factory):
    """The tiny config trained under all:nvfp4, written as NemotronH folders (BF16 and
    NVFP4) and run by transformers on 2 validation batches: ``(run folder, run, inputs,
    targets, {weights: (folder, logits, info)})``."""
    folder = train_tiny("all:nvfp4")[1]
    run = load_run(folder)
    inputs, targets = validation_tokens(run.config, run.data, 2)
    tmp = tmp_path_factory.mktemp("hf")
    np.save(tmp / "tokens.npy", np.asarray(inputs))
    args = [str(tmp / "tokens.npy")]
    for weights in ("bf16", "nvfp4"):
        args += [str(export_run(folder, weights, tmp / weights)),
                 str(tmp / f"{weights}.npz")]
    done = subprocess.run([str(python_of(CONSUMERS)), str(ROOT / "tests" / "consumers" /
                                                          "hf_eval.py"), *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    out = {}
    for weights in ("bf16", "nvfp4"):
        with np.load(tmp / f"{weights}.npz") as f:
            out[weights] = (tmp / weights, f["logits"], json.loads(str(f["info"])))
    return folder, run, inputs, targets, out


def _forward(run, params, inputs) -> np.ndarray:
    """fp4lab's forward pass of the run's model in float32, no policy."""
    cfg = dataclasses.replace(model_config(run.config, run.data), dtype="float32")
    return np.asarray(jax.jit(lambda p, x: HybridLM(cfg).apply({"params": p}, x)[0])(
        params, inputs))


def _loss(logits, targets) -> float:
    return -float(jnp.mean(token_log_probs(jnp.asarray(logits), targets)))


def _check_served(info: dict, decompressed: bool) -> None:
    """transformers' own path ran: every weight loaded (none initialized), float32
    everywhere (the residual stream out of every block, every gated RMSNorm), the reference
    PyTorch scan (no mamba-ssm kernels), dense decompressed Linear weights."""
    assert info["class"] == "NemotronHForCausalLM" and not info["training"]
    assert info["loading"] == {"missing_keys": [], "unexpected_keys": [],
                               "mismatched_keys": [], "error_msgs": []}, info["loading"]
    assert info["param_dtypes"] == ["torch.float32"]
    assert info["block_out_dtypes"] == ["torch.float32"]
    assert info["gated_norm_out_dtypes"] == ["torch.float32"]
    assert info["scan"] == "torch"
    assert info["decompressed"] == decompressed
    assert len(info["linear"]) == 9
    assert all(v == ["torch.float32", True] for v in info["linear"].values()), info["linear"]


def _report(name, folder, logits, ref, targets) -> None:
    """One line under ``pytest -s``: the losses, the largest logit difference, the file."""
    size = (folder / "model.safetensors").stat().st_size
    print(f"\n{name:5} fp4lab {_loss(ref, targets):.6f}  transformers {_loss(logits, targets):.6f}"
          f"  max|logit diff| {np.abs(logits - ref).max():.2e}  {size:,} bytes")


@pytest.mark.slow
def test_transformers_serves_the_bf16_checkpoint_with_fp4labs_logits(served):
    _, run, inputs, targets, out = served
    folder, logits, info = out["bf16"]
    _check_served(info, decompressed=False)
    with open(folder / "model.safetensors", "rb") as f:  # every tensor BF16, HF's names
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    header.pop("__metadata__")
    assert set(header) == NAMES_M_ATTN_MLP
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    ref = _forward(run, jax.tree.map(_bf16, run.params), inputs)
    _report("BF16", folder, logits, ref, targets)
    assert np.abs(logits - ref).max() <= TOLERANCE * np.abs(ref).max()
    assert _loss(logits, targets) == pytest.approx(_loss(ref, targets), rel=1e-6)
    # the same logits are not the float32 parameters' (the BF16 rounding shows)
    assert np.abs(logits - _forward(run, run.params, inputs)).max() > \
        10 * TOLERANCE * np.abs(ref).max()


@pytest.mark.slow
def test_transformers_serves_the_nvfp4_checkpoint_with_fp4labs_logits(served):
    """fp4lab's NVFP4 weights (each kernel as the run's quantized forward computes it, from
    its record), dequantized by fp4lab and rounded to BF16 as compressed-tensors hands them
    over, in fp4lab's float32 forward: the logits transformers computes from the file."""
    folder, run, inputs, targets, out = served
    path, logits, info = out["nvfp4"]
    _check_served(info, decompressed=True)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "nemotron_h" and config["fp4lab"]["layout"] == "nvfp4"
    assert config["quantization_config"]["ignore"] == []  # every linear layer is NVFP4
    cfg = model_config(run.config, run.data)
    record = quantize_model(HybridLM(cfg), policies.get("all:nvfp4")).assignments(
        {"params": run.params}, inputs[:8], rngs={"quant": jax.random.key(0)})
    quantized = {p: v for p, v in export.quantized_weights({"params": run.params},
                                                           record).items()
                 if isinstance(v, QArray)}
    assert len(quantized) == 7 and all(q.format.name == "nvfp4" for q in quantized.values())
    served_weights = {p: _bf16(dequantize(q)) for p, q in quantized.items()}
    ref = _forward(run, with_weights(run.params, served_weights), inputs)
    _report("NVFP4", path, logits, ref, targets)
    assert np.abs(logits - ref).max() <= TOLERANCE * np.abs(ref).max()
    assert _loss(logits, targets) == pytest.approx(_loss(ref, targets), rel=1e-6)
    f32 = _forward(run, with_weights(run.params, {p: np.asarray(dequantize(q))
                                                  for p, q in quantized.items()}), inputs)
    assert np.abs(logits - f32).max() > 10 * TOLERANCE * np.abs(ref).max()
    # the three modules of the fused qkv share its tensor amax
    back = export.load(path)
    amax = {float(back[f"blocks_1/attention/{n}_proj/kernel"].global_scale) for n in "qkv"}
    assert amax == {float(quantized["blocks_1/attention/qkv/kernel"].global_scale)}


@pytest.mark.slow
def test_the_command_writes_a_folder_and_refuses_a_used_one_in_one_line(served, tmp_path,
                                                                        capsys):
    folder = served[0]
    assert main(["--run", str(folder), "--layout", "bf16", "--out", str(tmp_path / "cli")]) == 0
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == ["config.json",
                                                                    "model.safetensors"]
    assert main(["--run", str(folder), "--out", str(tmp_path / "cli"),
                 "--layout", "nvfp4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: output folder") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli"]  # no temporary left


@pytest.mark.parametrize("option, value", [
    ("residual_format", "e4m3"), ("residual_gate", True), ("ssm_state_format", "bf16"),
    ("attention_accumulate", "bf16_p")])
def test_a_model_option_transformers_cannot_express_is_refused_by_name(option, value,
                                                                       tmp_path):
    extra = {"attention": "flash"} if option == "attention_accumulate" else {}
    cfg = ModelConfig(pattern="M*-", d_model=32, num_heads=2, **{option: value}, **extra)
    with pytest.raises(ValueError, match=f"model option {option}={value!r}"):
        check_expressible(cfg)
    params = HybridLM(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match=option):
        write_bf16(params, cfg, tmp_path / "out", max_positions=4)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_forward_only_options_and_the_mtp_head_are_accepted_and_the_mtp_head_left_out():
    """Options that change only the backward pass (or compute the same forward) pass the
    check; the MTP head's parameters are dropped and every other one gets NemotronH's name:
    exactly NemotronHForCausalLM's parameters."""
    cfg = ModelConfig(pattern="M*-", d_model=32, num_heads=2, mtp=True, attention="flash",
                      attention_saved="bfloat16", mlp_saved="fp8_block128",
                      ssm_state_format="fp32")
    check_expressible(cfg)
    params = HybridLM(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    flat = {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert any(p.startswith("mtp_") for p in flat)
    laid = hf_layout(flat, cfg)
    assert {hf_name(p) for p in laid} == NAMES_M_ATTN_MLP
    conv = laid["blocks_0/mamba/conv1d/weight"]  # [C, 1, W]: conv_kernel [W, C] transposed
    assert conv.shape == (64 + 2 * 16, 1, 4)  # x, B, C
    np.testing.assert_array_equal(conv[:, 0], flat["blocks_0/mamba/conv_kernel"].T)
    qkv = flat["blocks_1/attention/qkv/kernel"]
    for i, n in enumerate("qkv"):
        np.testing.assert_array_equal(laid[f"blocks_1/attention/{n}_proj/kernel"],
                                      qkv[:, 32 * i: 32 * (i + 1)])
    with pytest.raises(ValueError, match="path='blocks_0/mamba/nope'"):
        hf_name("blocks_0/mamba/nope")


MOE_BLOCK = dict(pattern="M*E", d_model=32, num_heads=2, moe_experts=4, moe_top_k=2,
                 moe_router="sigmoid", moe_bias_rate=0.01, moe_latent=16)


def test_the_moe_hybrid_is_laid_out_as_nemotron_h_moe():
    """An MoE block's tensors under NemotronH's names: the router (and its bias) as
    ``gate``, each expert of a stack as its own ``experts.<j>.up_proj``/``down_proj``
    ``[out, in]``, the latent projections; an all-zero shared expert and zero bias stand in
    for what the block lacks, and options NemotronH cannot route are refused by name."""
    cfg = ModelConfig(**{**MOE_BLOCK, "moe_bias_rate": 0.0})
    params = HybridLM(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    flat = {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    laid = hf_layout(flat, cfg)
    mixer = "model.layers.2.mixer."
    names = {hf_name(p) for p in laid if p.startswith("blocks_2/")}
    assert names == {"model.layers.2.norm.weight", *(mixer + n for n in (
        "gate.weight", "gate.e_score_correction_bias", "fc1_latent_proj.weight",
        "fc2_latent_proj.weight", "shared_experts.up_proj.weight",
        "shared_experts.down_proj.weight")), *(f"{mixer}experts.{j}.{n}_proj.weight"
                                                for j in range(4) for n in ("up", "down"))}
    np.testing.assert_array_equal(laid["blocks_2/moe/experts/3/up/kernel"],
                                  flat["blocks_2/moe/experts/up"][3])
    assert not laid["blocks_2/moe/router_bias"].any()
    assert not laid["blocks_2/moe/shared_expert/down/kernel"].any()
    for option, value in [("moe_router", "softmax"), ("moe_experts", 1),
                          ("moe_router_dtype", "bfloat16"), ("moe_dispatch", "mxfp8")]:
        keys = {**MOE_BLOCK, option: value, **({"moe_top_k": 1} if option == "moe_experts"
                                               else {})}
        with pytest.raises(ValueError, match=f"model option {option}="):
            check_expressible(ModelConfig(**keys))
    check_expressible(ModelConfig(**{**MOE_BLOCK, "moe_router": "softmax", "moe_top_k": 1,
                                     "moe_bias_rate": 0.0}))  # top-1 softmax: weight 1
    from experiments.engines import check_nemotron_h

    check_nemotron_h(cfg)  # llama.cpp's nemotron_h_moe runs it
    for pattern, why in [("M*E-", "MLP blocks beside MoE blocks"),
                         ("*E", "no Mamba or no attention block")]:
        with pytest.raises(ValueError, match=f"nemotron_h_moe cannot run .*{why}"):
            check_nemotron_h(dataclasses.replace(cfg, pattern=pattern))
