"""fp4lab.export: the weights as the QAT forward quantizes them, GGUF checked by GGML's own
Python package (gguf: its reader, its dequantizer and its quantizer), every layout read back
bit for bit, and what a layout cannot hold refused. The torch-based consumers (transformers,
compressed-tensors) are in test_export_consumers.py."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from adversarial import cases

import fp4lab
from fp4lab import export
from fp4lab.policy import PrecisionPolicy, Rule
from fp4lab.qdot import quantize_operand
from fp4lab.recipe import OperandQuant, get_recipe

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402



def _params(k_in=64, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    return {"params": {
        "blocks_0": {"mlp": {"up": {"kernel": jax.random.normal(k[0], (k_in, 96))},
                             "down": {"kernel": jax.random.normal(k[1], (96, k_in)) * 1e-3}}},
        "norm": {"scale": jnp.linspace(0.5, 1.5, k_in)},
        "head": {"kernel": jax.random.normal(k[2], (k_in, 32))}}}


def _same_qarray(a, b):
    assert (a.format.name, a.shape) == (b.format.name, b.shape)
    np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    np.testing.assert_array_equal(np.asarray(a.scale).view(np.uint8),
                                  np.asarray(b.scale).view(np.uint8))


@pytest.mark.parametrize("recipe", ["q4_0_qat", "mxfp4_weights", "nvfp4", "int4_qat"])
def test_quantized_weights_are_the_forward_gemms_weights(recipe):
    """Each kernel's QArray dequantizes to the weight the recipe's forward GEMM multiplies
    (quantize_operand on the canonical [1, K, N] weight, as qdot does), from the kernel in
    the compute dtype; the norm scale is left alone."""
    params = _params()
    w = export.quantized_weights(params, recipe, compute_dtype=jnp.bfloat16)
    op = get_recipe(recipe).fprop_w
    for path in ("blocks_0/mlp/up/kernel", "blocks_0/mlp/down/kernel", "head/kernel"):
        kernel = params["params"]
        for part in path.split("/"):
            kernel = kernel[part]
        want = quantize_operand(kernel.astype(jnp.bfloat16)[None], op, 1, None)[0]
        np.testing.assert_array_equal(np.asarray(fp4lab.dequantize(w[path])), np.asarray(want))
    assert w["norm/scale"] is params["params"]["norm"]["scale"]


def test_a_policy_names_the_weights_it_keeps_in_high_precision():
    policy = PrecisionPolicy(rules=(Rule(name="head", pattern="head", recipe="bf16"),),
                             default="q4_0_qat", name="q4_0_bf16_head")
    w = export.quantized_weights(_params(), policy)
    assert w["head/kernel"].dtype == jnp.bfloat16
    assert isinstance(w["blocks_0/mlp/up/kernel"], fp4lab.QArray)


def _gguf_cases(fmt):
    """GGML's adversarial blocks (tests/adversarial.py) as [out, in] weights, 256 rows."""
    return [c.x for c in cases(fmt)]


@pytest.mark.parametrize("fmt, recipe, qtype", [
    ("int4_q4_0", "q4_0_qat", "Q4_0"), ("int8_q8_0", "q8_0_qat", "Q8_0")])
def test_gguf_is_read_dequantized_and_requantized_by_ggml_to_the_same_bits(
        tmp_path, fmt, recipe, qtype):
    ggml_type = getattr(gguf.GGMLQuantizationType, qtype)
    weights = _gguf_cases(fmt)
    params = {f"layer_{i}": {"kernel": jnp.asarray(x.T)} for i, x in enumerate(weights)}
    params["norm"] = {"scale": jnp.arange(8, dtype=jnp.float32)}
    params["embed"] = {"embedding": jnp.ones((4, 8), jnp.bfloat16)}
    path = export.export(params, recipe, tmp_path / "model.gguf", "gguf")
    reader = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    assert set(by_name) == {f"layer_{i}.weight" for i in range(len(weights))} | {
        "norm.scale", "embed.embedding"}
    ours = export.quantized_weights(params, recipe)
    for i, x in enumerate(weights):
        t = by_name[f"layer_{i}.weight"]
        assert t.tensor_type == ggml_type and [int(n) for n in t.shape] == [x.shape[1],
                                                                            x.shape[0]]
        # GGML's own quantizer of the same float weights writes the same bytes
        np.testing.assert_array_equal(np.asarray(t.data), quants.quantize(x, ggml_type))
        # and its dequantizer gives fp4lab's dequantized weight, bit for bit
        got = quants.dequantize(np.asarray(t.data), ggml_type)
        want = np.asarray(fp4lab.dequantize(ours[f"layer_{i}/kernel"])).T
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(by_name["norm.scale"].data), np.arange(8))
    assert by_name["embed.embedding"].tensor_type == gguf.GGMLQuantizationType.BF16
    policy = json.loads(bytes(reader.fields["fp4lab.policy"].parts[-1]).decode())
    assert policy["default"] == recipe
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "fp4lab"


@pytest.mark.parametrize("recipe, layout", [
    ("q4_0_qat", "gguf"), ("q8_0_qat", "gguf"), ("mxfp4_weights", "mxfp4"),
    ("nvfp4", "nvfp4"), ("nvfp4_1d_weights", "nvfp4"), ("nvfp4", "nvfp4_modelopt")])
def test_every_layout_loads_back_to_the_same_weights(tmp_path, recipe, layout):
    params = _params()
    params["params"]["embed"] = {"embedding": jnp.ones((4, 64), jnp.bfloat16)}
    # 40 outputs: the last 16x16 tile along out is partial
    params["params"]["odd"] = {"kernel": jax.random.normal(jax.random.key(7), (64, 40))}
    w = export.quantized_weights(params, recipe, compute_dtype=jnp.bfloat16)
    target = tmp_path / ("m.gguf" if layout == "gguf" else "m")
    export.save(w, target, layout)
    back = fp4lab.load_exported(target)
    assert set(back) == set(w)
    for path, v in w.items():
        if not isinstance(v, fp4lab.QArray):
            np.testing.assert_array_equal(np.asarray(back[path]), np.asarray(v))
            assert np.asarray(back[path]).dtype == np.asarray(v).dtype
        elif v.tile:  # 16x16 tiles come back as 1D groups carrying their tile's scale
            assert back[path].tile is None and back[path].axis == 0
            np.testing.assert_array_equal(np.asarray(fp4lab.dequantize(back[path])),
                                          np.asarray(fp4lab.dequantize(v)))
            np.testing.assert_array_equal(np.asarray(back[path].global_scale),
                                          np.asarray(v.global_scale))
        else:
            _same_qarray(back[path], v)


def test_an_nnx_model_exports_by_its_layer_paths(tmp_path):
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(64, 64, use_bias=False, rngs=rngs)
                                    for _ in range(2)])

    w = export.quantized_weights(Net(nnx.Rngs(0)), "q4_0_qat")
    assert set(w) == {"layers/0/kernel", "layers/1/kernel"}
    assert all(isinstance(v, fp4lab.QArray) for v in w.values())
    back = export.load(export.save(w, tmp_path / "n.gguf", "gguf"))
    _same_qarray(back["layers/1/kernel"], w["layers/1/kernel"])


def test_what_a_layout_cannot_hold_is_refused(tmp_path):
    w = export.quantized_weights(_params(), "nvfp4")
    with pytest.raises(ValueError, match="format 'nvfp4' has no GGUF type"):
        export.save(w, tmp_path / "m.gguf", "gguf")
    with pytest.raises(ValueError, match="is not MXFP4"):
        export.save(w, tmp_path / "m", "mxfp4")
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.gguf").exists()  # nothing
    with pytest.raises(ValueError, match="unknown layout 'onnx'"):
        export.save(w, tmp_path / "m", "onnx")
    with pytest.raises(ValueError, match="input_amax is ModelOpt's input_scale"):
        export.save(w, tmp_path / "m", "nvfp4", input_amax={"head/kernel": 1.0})
    with pytest.raises(ValueError, match=r"input_amax names \['norm/scale'\]"):
        export.save(w, tmp_path / "m", "nvfp4_modelopt", input_amax={"norm/scale": 1.0})
    odd = export.quantized_weights(_params(k_in=48), "q4_0_qat")  # K = 48: 1.5 blocks
    with pytest.raises(ValueError, match="K = 48 is not a whole number of 32-blocks"):
        export.save(odd, tmp_path / "m.gguf", "gguf")
    nan = {"k": {"kernel": jnp.ones((64, 8)).at[3, 1].set(jnp.nan)}}
    with pytest.raises(ValueError, match=r"1 block\(s\) hold NaN.*2\^128"):
        export.export(nan, "mxfp4_weights", tmp_path / "n", "mxfp4")
    inf = {"k": {"kernel": jnp.ones((64, 16)).at[0, 0].set(jnp.inf)}}
    with pytest.raises(ValueError, match="the tensor amax is inf"):
        export.export(inf, "nvfp4", tmp_path / "i", "nvfp4")
    with pytest.raises(ValueError, match="tensor name 'a.weight' for both"):
        export.save({"a/kernel": jnp.ones((32, 2)), "a.weight": jnp.ones(2)},
                    tmp_path / "d.gguf", "gguf")
    with pytest.raises(ValueError, match="transforms or stochastically rounds"):
        rht = dataclasses.replace(get_recipe("bf16"), name="rht_w",
                                  fprop_w=OperandQuant(format="nvfp4", hadamard=16))
        export.quantized_weights(_params(), rht)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export.load(tmp_path / "nothing")


def test_safetensors_files_carry_their_dtypes(tmp_path):
    """The safetensors header (read independently here) says what the consumers will read:
    uint8 codes, float8_e4m3fn and uint8 E8M0 scales, a float32 global scale."""
    w = export.quantized_weights(_params(), "nvfp4", compute_dtype=jnp.bfloat16)
    export.save(w, tmp_path / "ct", "nvfp4")
    raw = (tmp_path / "ct" / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert header["head.weight_packed"]["dtype"] == "U8"
    assert header["head.weight_packed"]["shape"] == [32, 32]
    assert header["head.weight_scale"] == {**header["head.weight_scale"], "dtype": "F8_E4M3",
                                           "shape": [32, 4]}
    assert header["head.weight_global_scale"]["dtype"] == "F32"
    amax = float(jnp.max(jnp.abs(_params()["params"]["head"]["kernel"].astype(jnp.bfloat16))))
    tensors, _ = export._read_safetensors(tmp_path / "ct" / "model.safetensors")
    assert tensors["head.weight_global_scale"][0] == np.float32(2688) / np.float32(amax)
    assert tensors["head.weight_scale"].dtype == ml_dtypes.float8_e4m3fn
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "nvfp4-pack-quantized" and config["ignore"] == []
    assert config["config_groups"]["group_0"]["weights"]["group_size"] == 16


def test_a_gguf_file_made_by_ggml_loads_into_qarrays(tmp_path):
    """A GGUF file written with gguf's own writer and quantizer (no fp4lab index): keyed by
    tensor name, its Q4_0 / Q8_0 weights as [in, out] kernels whose dequantization is GGML's,
    bit for bit; other GGML types are refused by name."""
    rng = np.random.default_rng(0)
    w4 = rng.standard_normal((16, 64)).astype(np.float32)
    w8 = rng.standard_normal((8, 96)).astype(np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", quants.quantize(w4, gguf.GGMLQuantizationType.Q4_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.add_tensor("blk.0.ffn_down.weight", quants.quantize(w8,
                                                               gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):
        step()
    back = fp4lab.load_exported(tmp_path / "g.gguf")
    assert back["blk.0.ffn_up.weight"].format.name == "int4_q4_0"
    for name, w, qtype in (("blk.0.ffn_up.weight", w4, gguf.GGMLQuantizationType.Q4_0),
                           ("blk.0.ffn_down.weight", w8, gguf.GGMLQuantizationType.Q8_0)):
        ggml = quants.dequantize(quants.quantize(w, qtype), qtype)
        np.testing.assert_array_equal(np.asarray(fp4lab.dequantize(back[name])).T.view(np.uint32),
                                      ggml.view(np.uint32))
    np.testing.assert_array_equal(back["output_norm.weight"], np.ones(64))
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_tensor("t", quants.quantize(np.ones((1, 32), np.float32),
                                           gguf.GGMLQuantizationType.Q5_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q5_0)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):
        step()
    with pytest.raises(ValueError, match="tensor 't' is GGML Q5_0"):
        fp4lab.load_exported(tmp_path / "k.gguf")
