"""fp4lab.export: the weights as the QAT forward quantizes them, GGUF checked by GGML's own
Python package (gguf: its reader, its dequantizer and its quantizer), every layout read back
bit for bit, and what a layout cannot hold refused. The torch-based consumers (transformers,
compressed-tensors) are in test_export_consumers.py."""

import dataclasses
import json
import math
import os
import stat

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from adversarial import cases

import fp4lab
from fp4lab import export
from fp4lab.policy import PrecisionPolicy, Rule
from fp4lab.gemm.operand_quant import quantize_operand
from fp4lab.gemm.recipe import OperandQuant, get_recipe

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
        want = quantize_operand(kernel.astype(jnp.bfloat16)[None], op, 1, None,
                                outer=False).values[0].astype(jnp.float32)
        np.testing.assert_array_equal(np.asarray(fp4lab.dequantize(w[path])), np.asarray(want))
    assert w["norm/scale"] is params["params"]["norm"]["scale"]


@pytest.mark.parametrize("scale", ["expert", "shared"])
def test_an_expert_stack_is_each_experts_weight_as_the_grouped_gemm_multiplies_it(scale):
    """An expert stack ``[E, K, N]`` named by ``experts=`` becomes one QArray per expert,
    each the weight the recipe's forward GEMM multiplies for that expert (quantize_operand,
    bit for bit; and read off :func:`fp4lab.qragged_dot` itself: identity rows through each
    expert, activations kept float32), with its own NVFP4 tensor amax or, under
    ``expert_scale="shared"``, the stack's."""
    recipe = dataclasses.replace(get_recipe("nvfp4"), name=f"nvfp4_w_{scale}",
                                 fprop_x=OperandQuant(format="fp32"), expert_scale=scale)
    e, k, n = 3, 32, 48
    stack = jax.random.normal(jax.random.key(0), (e, k, n)) * jnp.array([1, 4, 0.25])[:, None,
                                                                                     None]
    params = {"moe": {"experts": {"up": stack}}, "head": {"kernel": jnp.ones((n, 8))}}
    w = export.quantized_weights(params, PrecisionPolicy(default=recipe),
                                 experts={"moe/experts/up": "moe/experts/ragged_dot_0"})
    got = w["moe/experts/up"]
    assert isinstance(got, tuple) and len(got) == e
    eye = jnp.tile(jnp.eye(k), (e, 1))
    used = fp4lab.qragged_dot(eye, stack, jnp.full((e,), k), recipe,
                              jax.random.key(1)).reshape(e, k, n)  # SR: the backward's
    want = np.abs(np.asarray(stack)).max(axis=(1, 2))
    shared = jnp.float32(want.max()) if scale == "shared" else None
    for j in range(e):
        mine = np.asarray(got[j].dequantize())
        np.testing.assert_array_equal(mine, np.asarray(quantize_operand(
            stack[j][None], recipe.fprop_w, 1, None, global_amax=shared,
            outer=False).values[0]))  # bit for bit, as the dense kernels' test
        # the GEMM applies the tensor factor after its product: an ulp apart, not a scale
        np.testing.assert_allclose(mine, np.asarray(used[j]), rtol=3e-7, atol=0)
    amax = [float(q.global_scale) for q in got]
    assert amax == (want.tolist() if scale == "expert" else [want.max()] * e)
    with pytest.raises(ValueError, match="experts names stacks the parameters do not have"):
        export.quantized_weights(params, "nvfp4", experts={"moe/up": "moe/ragged_dot_0"})


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
    back = export.load(target)
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

    from fp4lab.flax import quantized_weights

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(64, 64, use_bias=False, rngs=rngs)
                                    for _ in range(2)])

    w = quantized_weights(Net(nnx.Rngs(0)), "q4_0_qat")
    assert set(w) == {"layers/0/kernel", "layers/1/kernel"}
    assert all(isinstance(v, fp4lab.QArray) for v in w.values())
    back = export.load(export.save(w, tmp_path / "n.gguf", "gguf"))
    _same_qarray(back["layers/1/kernel"], w["layers/1/kernel"])


def test_what_a_layout_cannot_hold_is_refused(tmp_path):
    w = export.quantized_weights(_params(), "nvfp4")
    mx8 = export.quantized_weights(_params(), "mxfp8")
    with pytest.raises(ValueError, match="format 'mxfp8' has no gguf type; the gguf layout "
                                         "takes int4_q4_0, int8_q8_0, mxfp4, mxfp4_floor, nvfp4"):
        export.save(mx8, tmp_path / "m.gguf", "gguf")
    with pytest.raises(ValueError, match="format 'nvfp4' has no mxfp4 type"):
        export.save(w, tmp_path / "m", "mxfp4")
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.gguf").exists()  # nothing
    with pytest.raises(ValueError, match="unknown layout 'onnx'"):
        export.save(w, tmp_path / "m", "onnx")
    with pytest.raises(ValueError, match="input_amax is ModelOpt's input_scale"):
        export.save(w, tmp_path / "m", "nvfp4", input_amax={"head/kernel": 1.0})
    with pytest.raises(ValueError, match=r"input_amax names \['norm/scale'\]"):
        export.save(w, tmp_path / "m", "nvfp4_modelopt", input_amax={"norm/scale": 1.0})
    quantized = sorted(p for p, v in w.items() if isinstance(v, fp4lab.QArray))
    with pytest.raises(ValueError, match=r"but not for \[" + repr(quantized[1:])[1:-1]):
        export.save(w, tmp_path / "m", "nvfp4_modelopt", input_amax={quantized[0]: 1.0})
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
                                  fprop_x=OperandQuant(format="nvfp4", hadamard=16),
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
    tensors, _ = export.read_safetensors(tmp_path / "ct" / "model.safetensors")
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
    back = export.load(tmp_path / "g.gguf")
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
        export.load(tmp_path / "k.gguf")


# --------------------------------------------------------- GGML's MXFP4 and NVFP4 types


def _fp4_params():
    k = jax.random.split(jax.random.key(3), 3)
    return {"params": {
        "blocks_0": {"mlp": {"up": {"kernel": jax.random.normal(k[0], (128, 96))},
                             "down": {"kernel": jax.random.normal(k[1], (64, 128)) * 1e-3}}},
        "norm": {"scale": jnp.linspace(0.5, 1.5, 128)},
        "head": {"kernel": jax.random.normal(k[2], (128, 40))}}}  # a partial 16x16 tile


def _ulps(a, b) -> np.ndarray:
    """Distance in float32 ulps (of values that share their signs or are zero)."""
    ia, ib = (np.asarray(v, np.float32).view(np.int32).astype(np.int64) for v in (a, b))
    ia, ib = (np.where(i < 0, -(i & 0x7FFFFFFF), i) for i in (ia, ib))
    return np.abs(ia - ib)


def _unsigned_zeros(a: np.ndarray) -> np.ndarray:
    """``a`` with -0 as +0: GGML's E2M1 table (kvalues_mxfp4) has no -0."""
    return np.where(a == 0, np.float32(0), a).astype(np.float32)


@pytest.mark.parametrize("n", [16, 32])
def test_ggml_nibble_order_is_the_halves_of_each_run(n):
    """fp4lab.numerics.rounding.pack_nibbles(halves=n), which the GGUF writer uses: in each run of n
    codes, byte j holds code j low and code j + n/2 high (ggml-common.h's block_q4_0 and
    block_mxfp4 with n = 32, each 16 of block_nvfp4 with n = 16), and unpack inverts it."""
    from fp4lab.numerics import rounding

    codes = np.random.default_rng(n).integers(0, 16, (3, 4 * n), dtype=np.uint8)
    packed = np.asarray(rounding.pack_nibbles(jnp.asarray(codes), -1, halves=n))
    runs = codes.reshape(3, 4, n)
    want = runs[..., : n // 2] | (runs[..., n // 2:] << 4)
    np.testing.assert_array_equal(packed, want.reshape(3, -1))
    np.testing.assert_array_equal(
        np.asarray(rounding.unpack_nibbles(jnp.asarray(packed), -1, halves=n)), codes)
    with pytest.raises(ValueError, match="cannot pack halves of runs of 64 along axis 1 of "
                                         "length 48"):
        rounding.pack_nibbles(jnp.zeros((2, 48), jnp.uint8), 1, halves=64)


@pytest.mark.parametrize("recipe, qtype", [
    ("mxfp4_weights", "MXFP4"), ("nvfp4", "NVFP4"), ("nvfp4_1d_weights", "NVFP4")])
def test_gguf_holds_mxfp4_and_nvfp4_as_ggml_reads_them(tmp_path, recipe, qtype):
    """MXFP4 and NVFP4 kernels as GGML's own types (llama.cpp's C code checks the bytes in
    test_export_consumers.py; here GGML's NumPy port, gguf.quants): gguf's reader finds
    them, an NVFP4 weight with its F32 ``<name>.scale`` = ``fl(amax / 2688)``; GGML's
    dequantization of the bytes (times that scale) is fp4lab's dequantized weight, MXFP4
    bit for bit (+0 where fp4lab has -0), NVFP4 within 2 float32 ulps (docs/export.md);
    load gives the QArrays back (16x16 tiles as the 1D groups they hold)."""
    w = export.quantized_weights(_fp4_params(), recipe)
    path = export.save(w, tmp_path / "m.gguf", "gguf")
    reader = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    ggml_type = getattr(gguf.GGMLQuantizationType, qtype)
    for p in ("blocks_0/mlp/up/kernel", "blocks_0/mlp/down/kernel", "head/kernel"):
        name = export.tensor_name(p)
        assert by_name[name].tensor_type == ggml_type
        got = quants.dequantize(np.asarray(by_name[name].data), ggml_type).astype(np.float32)
        want = np.asarray(fp4lab.dequantize(w[p])).T  # [out, in], as GGML's rows
        if qtype == "MXFP4":
            np.testing.assert_array_equal(got.view(np.uint32),
                                          _unsigned_zeros(want).view(np.uint32))
            continue
        scale = np.asarray(by_name[name[:-len("weight")] + "scale"].data)
        amax = np.float32(w[p].global_scale)
        assert scale.dtype == np.float32 and scale.tolist() == [amax / np.float32(2688)]
        assert int(_ulps(got * scale[0], want).max()) <= 2
        assert np.array_equal(np.signbit(got * scale[0]), np.signbit(_unsigned_zeros(want)))
    file_type = reader.fields["general.file_type"]
    assert int(file_type.parts[file_type.data[0]][0]) == int(getattr(
        gguf.LlamaFileType, "MOSTLY_MXFP4_MOE" if qtype == "MXFP4" else "MOSTLY_NVFP4"))
    back = export.load(path)
    assert set(back) == set(w)
    for p, v in w.items():
        if not isinstance(v, fp4lab.QArray):
            np.testing.assert_array_equal(np.asarray(back[p]), np.asarray(v))
            continue
        assert back[p].tile is None and back[p].format == v.format
        np.testing.assert_array_equal(np.asarray(fp4lab.dequantize(back[p])).view(np.uint32),
                                      np.asarray(fp4lab.dequantize(v)).view(np.uint32))
        if not v.tile:
            _same_qarray(back[p], v)


def test_gguf_refuses_fp4_that_ggml_cannot_hold(tmp_path):
    """Refused, naming the tensor, with nothing written: an NVFP4 K that is not a whole
    number of GGML's 64-blocks, a negative block scale (UE4M3 has no sign), a tensor amax
    whose fp4lab decode factor overflows, an MXFP4 NaN block, an NVFP4 weight whose
    ``.scale`` llama.cpp would not load (for an architecture llama.cpp runs), and a
    ``.scale`` name another tensor has."""
    def nv(k_in, scale=1.0):
        return export.quantized_weights({"k": {"kernel": jnp.ones((k_in, 8)) * scale}},
                                        "nvfp4_1d_weights")["k/kernel"]

    cases = [({"k/kernel": nv(96)}, {}, r"k/kernel: K = 96 is not a whole number of GGML "
                                        r"NVFP4's 64-blocks"),
             ({"k/kernel": dataclasses.replace(nv(64), scale=-nv(64).scale)}, {},
              r"k/kernel: 32 block scale\(s\) are negative, -0 or NaN"),
             ({"k/kernel": nv(64, 1e37)}, {}, r"k/kernel: the tensor amax \S+ makes fp4lab's "
                                              "decode factor .* overflow"),
             ({"k/kernel": nv(64)}, {"arch": "llama"}, "k/kernel: llama.cpp loads the per-"
                                                       "tensor scale of an NVFP4 weight only"),
             ({"k/kernel": nv(64), "k/scale": jnp.ones(3)}, {},
              "k/kernel: its NVFP4 scale tensor 'k.scale' has the name of another tensor")]
    mx = export.quantized_weights({"k": {"kernel": jnp.ones((64, 8)).at[3, 1].set(jnp.nan)}},
                                  "mxfp4_weights")
    cases.append((mx, {}, r"k/kernel: 1 block\(s\) hold NaN .*llama.cpp refuses"))
    for tensors, kw, message in cases:
        with pytest.raises(ValueError, match=message):
            export.save(tensors, tmp_path / "m.gguf", "gguf", **kw)
        assert list(tmp_path.iterdir()) == []
    export.save({"k/kernel": nv(64)}, tmp_path / "m.gguf", "gguf", arch="llama",
                names={"k/kernel": "blk.0.ffn_up.weight"}.__getitem__)
    assert {t.name for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors} == {
        "blk.0.ffn_up.weight", "blk.0.ffn_up.scale"}


def test_a_gguf_file_of_mxfp4_and_nvfp4_made_elsewhere_loads_into_qarrays(tmp_path):
    """GGML MXFP4 blocks from gguf's own quantizer, and NVFP4 blocks of arbitrary bytes (gguf
    has no NVFP4 quantizer), written by gguf's writer with no fp4lab index: their QArrays
    dequantize to GGML's values (gguf.quants.dequantize), MXFP4 bit for bit, NVFP4 bit for
    bit without a ``.scale`` (amax 2688: fp4lab's factor is then s_b itself) and within 2
    ulps of GGML's values times the ``.scale`` with one (amax = fl(scale * 2688))."""
    rng = np.random.default_rng(0)
    mx = quants.quantize(rng.standard_normal((8, 64)).astype(np.float32),
                         gguf.GGMLQuantizationType.MXFP4)
    nv = rng.integers(0, 256, (2, 16, 36), dtype=np.uint8)  # 2 weights [8, 128]
    nv[..., :4] %= 0x7F  # UE4M3 scale bytes: no sign, no NaN
    nv = nv.reshape(2, 8, 72)
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "llama")
    writer.add_tensor("blk.0.ffn_gate.weight", mx, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    for i in range(2):
        writer.add_tensor(f"blk.{i}.ffn_up.weight", nv[i],
                          raw_dtype=gguf.GGMLQuantizationType.NVFP4)
    writer.add_tensor("blk.1.ffn_up.scale", np.float32([0.0123]))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):
        step()
    back = export.load(tmp_path / "g.gguf")
    assert set(back) == {"blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.1.ffn_up.weight"}
    got = np.asarray(fp4lab.dequantize(back["blk.0.ffn_gate.weight"])).T
    ggml = quants.dequantize(mx, gguf.GGMLQuantizationType.MXFP4).astype(np.float32)
    np.testing.assert_array_equal(_unsigned_zeros(got).view(np.uint32), ggml.view(np.uint32))
    for i, scale in ((0, None), (1, np.float32(0.0123))):
        q = back[f"blk.{i}.ffn_up.weight"]
        ggml = quants.dequantize(nv[i], gguf.GGMLQuantizationType.NVFP4).astype(np.float32)
        got = _unsigned_zeros(np.asarray(fp4lab.dequantize(q)).T)
        if scale is None:
            assert float(q.global_scale) == 2688
            np.testing.assert_array_equal(got.view(np.uint32), ggml.view(np.uint32))
        else:
            assert float(q.global_scale) == np.float32(scale * np.float32(2688))
            assert int(_ulps(got, ggml * scale).max()) <= 2


# ------------------------------------------------------------ the QAT forward's own weights


def _forward_weights(model, variables, *inputs) -> dict[str, np.ndarray]:
    """Each Dense / DenseGeneral's weight as fp4lab's QAT forward multiplies it, read off the
    forward itself: inside ``model.apply`` (a ``quantize_model`` wrapper), every layer's input
    gets the one-hot vectors of its contracting axes appended, with the biases zeroed, whose
    outputs are the rows of its GEMM's weight ``[K, N]`` exactly (a product with 1.0, sums
    with 0.0: the values, not the signs of zeros); the layer's own rows go on through the
    model."""
    from flax import linen as nn

    got = {}

    def capture(next_fun, args, kwargs, context):
        m = context.module
        if not (isinstance(m, nn.DenseGeneral | nn.Dense) and context.method_name == "__call__"):
            return next_fun(*args, **kwargs)
        x = args[0]
        n = len(np.atleast_1d(getattr(m, "axis", -1)))  # the contracting axes: the last n
        assert sorted(a % x.ndim for a in np.atleast_1d(getattr(m, "axis", -1))) == list(
            range(x.ndim - n, x.ndim))
        lead, contracted = x.shape[:-n], x.shape[-n:]
        k = math.prod(contracted)
        eye = jnp.eye(k, dtype=x.dtype).reshape((k,) + contracted)
        y = next_fun(jnp.concatenate([x.reshape((-1,) + contracted), eye]))
        got["/".join(m.scope.path)] = np.asarray(y[-k:]).reshape(k, -1)
        return y[:-k].reshape(lead + y.shape[1:])

    zero_bias = jax.tree_util.tree_map_with_path(
        lambda p, v: jnp.zeros_like(v) if jax.tree_util.keystr(p).endswith("['bias']") else v,
        variables)
    with nn.intercept_methods(capture):
        model.apply(zero_bias, *inputs)
    return got


def _exported_values(weights) -> dict[str, np.ndarray]:
    return {p.rpartition("/")[0]: np.asarray(fp4lab.dequantize(q)) for p, q in weights.items()
            if p.endswith("/kernel")}


def test_a_float32_dense_exports_the_weight_its_qat_forward_multiplies(tmp_path):
    """A float32 Flax model (nn.Dense without dtype=) quantizes its float32 kernel: the
    library's default and the command line's default (the kernel as stored) export exactly
    the weight of its QAT forward (the command line's old BF16 default changed 77 % of the
    Q4_0 values)."""
    from flax import linen as nn
    from flax import traverse_util

    from fp4lab import cli
    from fp4lab.flax import quantize_model

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(32, name="down")(nn.relu(nn.Dense(64, name="up")(x)))

    model = MLP()
    variables = model.init(jax.random.key(0), jnp.ones((1, 64)))
    forward = _forward_weights(quantize_model(model, "all:q4_0_qat"), variables,
                               jnp.ones((2, 64)))
    library = _exported_values(export.quantized_weights(variables, "q4_0_qat"))
    assert set(forward) == set(library) == {"up", "down"}
    for layer, w in forward.items():
        np.testing.assert_array_equal(library[layer], w)
    flat = {"/".join(k): np.asarray(v)
            for k, v in traverse_util.flatten_dict(variables["params"]).items()}
    np.savez(tmp_path / "p.npz", **flat)
    assert cli.main(["export", str(tmp_path / "p.npz"), "--policy", "q4_0_qat", "--layout",
                     "gguf", "--out", str(tmp_path / "m.gguf")]) == 0
    served = export.load(tmp_path / "m.gguf")
    for layer, w in forward.items():
        got = np.asarray(fp4lab.dequantize(served[f"{layer}/kernel"]))
        np.testing.assert_array_equal(got, w)
    bf16 = _exported_values(export.quantized_weights(variables, "q4_0_qat",
                                                     compute_dtype=jnp.bfloat16))
    assert (bf16["up"] != forward["up"]).mean() > 0.5  # what the old default exported


def test_export_takes_each_layer_from_the_models_record():
    """A user's report: a Linen MLP under a policy whose rule names the kind "dense" trained
    both layers in q4_0_qat while export, resolving the policy again over parameters that do
    not say their kinds, returned BF16 kernels without a word. The model's record (what its
    forward pass did) gives both layers their recipe and the dtype their kernels had at the
    GEMM (BF16 here); the policy alone is refused."""
    from flax import linen as nn

    from fp4lab.flax import quantize_model
    from fp4lab.policy import PrecisionPolicy, Rule

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(64, dtype=jnp.bfloat16, name="layers_0")(x))
            return nn.Dense(32, dtype=jnp.bfloat16, name="layers_1")(x)

    policy = PrecisionPolicy(rules=(Rule(pattern=".*", kind="dense", recipe="q4_0_qat"),),
                             default="bf16")
    model, x = MLP(), jnp.ones((2, 64))
    variables = model.init(jax.random.key(0), x)
    qmodel = quantize_model(model, policy)
    record = qmodel.assignments(variables, x)
    assert [(a.path, a.recipe.name, a.compute_dtype) for a in record] == [
        ("layers_0", "q4_0_qat", "bfloat16"), ("layers_1", "q4_0_qat", "bfloat16")]
    forward = _forward_weights(qmodel, variables, x)  # read off BF16 outputs: rounded
    exported = _exported_values(export.quantized_weights(variables, record))
    assert set(exported) == {"layers_0", "layers_1"}
    for layer, w in forward.items():
        np.testing.assert_array_equal(exported[layer].astype(jnp.bfloat16), w)
    as_stored = _exported_values(export.quantized_weights(variables, "q4_0_qat"))
    differ = (as_stored["layers_0"].astype(jnp.bfloat16) != forward["layers_0"]).mean()
    assert differ > 0.05  # the float32 kernel quantized: 15 % of the values differ
    with pytest.raises(ValueError, match="names a layer kind.*assignments") as refused:
        export.quantized_weights(variables, policy)
    message = str(refused.value)  # the values filled in: no placeholder leaks
    assert "(kind='" in message and "{" not in message and "}" not in message


def test_an_nnx_model_exports_from_its_own_record():
    from flax import nnx

    from fp4lab.flax import quantize_model, quantized_weights

    model = nnx.Sequential(nnx.Linear(64, 32, rngs=nnx.Rngs(0)), nnx.Linear(32, 64,
                                                                            rngs=nnx.Rngs(1)))
    quantize_model(model, "all:q8_0_qat")
    weights = quantized_weights(model)
    assert {p for p, v in weights.items() if isinstance(v, fp4lab.QArray)} == {
        "layers/0/kernel", "layers/1/kernel"}
    with pytest.raises(ValueError, match="not quantized by"):
        quantized_weights(nnx.Sequential(nnx.Linear(64, 32, rngs=nnx.Rngs(0))))
    with pytest.raises(TypeError, match="NNX model exports through fp4lab.flax"):
        export.quantized_weights(model, "all:q8_0_qat")  # the library takes pure data


def test_stock_attention_kernels_export_as_their_qat_forward_multiplies(tmp_path):
    """nn.MultiHeadDotProductAttention's DenseGeneral kernels (query/key/value [in, heads,
    head_dim], out [heads, head_dim, out]) are quantized as fp4lab's interception hands them
    to the GEMM: contracting axes flattened into K, blocks along K (the bias tells which
    axes a kernel contracts; without one, ``contracting=`` does)."""
    from flax import linen as nn

    from fp4lab.flax import quantize_model

    x = jax.random.normal(jax.random.key(1), (2, 5, 64))
    for use_bias in (True, False):
        model = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=64,
                                                use_bias=use_bias)
        variables = model.init(jax.random.key(0), x, x)
        forward = _forward_weights(quantize_model(model, "all:q4_0_qat"), variables, x, x)
        assert set(forward) == {"query", "key", "value", "out"}
        kw = {} if use_bias else {"contracting": {"query": 1, "key": 1, "value": 1, "out": 2}}
        weights = export.quantized_weights(variables, "q4_0_qat", **kw)
        exported = _exported_values(weights)
        for layer, w in forward.items():
            assert exported[layer].shape == (64, 64)
            np.testing.assert_array_equal(exported[layer], w)
        back = export.load(export.save(weights, tmp_path / f"{use_bias}.gguf",
                                                "gguf"))
        _same_qarray(back["out/kernel"], weights["out/kernel"])
    with pytest.raises(ValueError, match=r"key/kernel: a kernel of shape \(64, 2, 32\) whose "
                                         "contracting axes its bias does not tell"):
        export.quantized_weights(variables, "q4_0_qat")


# ------------------------------------------------------------------- what GGUF cannot hold


@pytest.mark.parametrize("recipe", ["q4_0_qat", "q8_0_qat"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e9])
def test_gguf_refuses_a_block_it_would_write_as_nan_or_inf(tmp_path, recipe, bad):
    """One NaN or infinite weight (or a block maximum whose float16 scale overflows: 1e9)
    made its whole block NaN/inf in the file; now it is refused, naming the tensor, and
    nothing is written."""
    params = {"ok": {"kernel": jnp.ones((64, 8))},
              "bad": {"kernel": jnp.ones((64, 8)).at[33, 2].set(bad)}}
    with pytest.raises(ValueError, match=r"bad/kernel: 1 block\(s\) of 32 have a non-finite "):
        export.export(params, recipe, tmp_path / "m.gguf", "gguf")
    assert list(tmp_path.iterdir()) == []


def test_exported_files_have_the_ordinary_mode(tmp_path):
    """safetensors' own writer left 0600; every file is written with the umask's mode."""
    old = os.umask(0o022)
    try:
        export.export(_params(), "nvfp4", tmp_path / "n", "nvfp4")
        export.export(_params(), "q4_0_qat", tmp_path / "m.gguf", "gguf")
    finally:
        os.umask(old)
    for f in (tmp_path / "n" / "model.safetensors", tmp_path / "n" / "config.json",
              tmp_path / "m.gguf"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
    assert sorted(p.name for p in tmp_path.rglob("*")) == [
        "config.json", "m.gguf", "model.safetensors", "n"]  # no temporary file left


@pytest.mark.parametrize("recipe, layout", [
    ("q4_0_qat", "gguf"), ("mxfp4_weights", "mxfp4"), ("nvfp4", "nvfp4"),
    ("nvfp4", "nvfp4_modelopt")])
def test_a_truncated_or_corrupt_file_is_named(tmp_path, recipe, layout):
    """load_exported on a cut or damaged checkpoint says so, naming the file (and the tensor
    whose bytes are missing), instead of NumPy's reshape or struct's unpack errors."""
    target = tmp_path / ("m.gguf" if layout == "gguf" else "m")
    export.export(_params(), recipe, target, layout)
    f = target if layout == "gguf" else target / "model.safetensors"
    raw = f.read_bytes()
    for n in (0, 4, 8, 30, len(raw) // 2, len(raw) - 1):
        f.write_bytes(raw[:n])
        with pytest.raises(ValueError, match="is truncated or corrupt") as e:
            export.load(target)
        assert str(f) in str(e.value)
        if n == len(raw) - 1:
            assert repr(_last_tensor(raw, layout)) in str(e.value), str(e.value)
    for at in (2, 12, 60):  # flipped bytes in the header
        f.write_bytes(raw[:at] + bytes(b ^ 0xFF for b in raw[at:at + 4]) + raw[at + 4:])
        with pytest.raises(ValueError, match="is truncated or corrupt"):
            export.load(target)


def _last_tensor(raw: bytes, layout: str) -> str:
    """The name of the tensor whose bytes come last in a file."""
    if layout == "gguf":
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".gguf") as t:
            t.write(raw)
            t.flush()
            tensors = gguf.GGUFReader(t.name).tensors
            return max(tensors, key=lambda x: x.data_offset).name
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    header.pop("__metadata__", None)
    return max(header, key=lambda k: header[k]["data_offsets"][1])


def test_import_fp4lab_is_the_core_alone():
    """``import fp4lab`` loads the core (formats, quantizers, recipes, GEMMs, policies,
    probes, metrics), not the study tools nor the export's file libraries."""
    import subprocess
    import sys

    code = ("import sys, fp4lab; print(' '.join(sorted(m for m in sys.modules if m in ("
            "'fp4lab.export', 'fp4lab.beyond.attention', 'fp4lab.beyond.mismatch', "
            "'fp4lab.beyond.reduction', "
            "'fp4lab.flax', 'gguf', 'safetensors', 'flax'))))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert run.stdout.strip() == ""
    assert {"quantize", "qdot_general", "PrecisionPolicy", "probe_table", "quant_metrics",
            "QArray", "Recipe"} <= set(fp4lab.__all__)
    assert not {"export", "load_exported", "flash_attention", "mismatch_metrics",
                "recompute", "saved_bytes"} & set(fp4lab.__all__)


def test_gguf_keys_of_the_architecture_are_typed(tmp_path):
    """A user's report: save(..., arch="llama", metadata={"llama.block_count": 1}) wrote
    the string ``fp4lab.llama.block_count``, so no architecture key a llama.cpp loader reads
    could be written. Keys of the architecture, ``general.*`` and ``tokenizer.*`` keep their
    names and get their GGUF types; the rest stay fp4lab's strings; the file type is the
    weights'."""
    import gguf

    params = {"blk": {"kernel": jnp.ones((64, 32))}, "norm": {"scale": jnp.ones(32)}}
    weights = export.quantized_weights(params, "q4_0_qat")
    path = export.save(weights, tmp_path / "m.gguf", "gguf", arch="llama", metadata={
        "llama.block_count": 1, "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.attention.head_count_kv": [0, 2], "general.name": "tiny", "note": {"a": 1},
        "tokenizer.ggml.tokens": ["a", "b"], "llama.swa": [-1, 2]})
    fields = gguf.GGUFReader(path).fields
    T = gguf.GGUFValueType

    def value(key):
        f = fields[key]
        return f.types, f.contents()

    assert value("general.architecture") == ([T.STRING], "llama")
    assert value("llama.block_count") == ([T.UINT32], 1)
    types, eps = value("llama.attention.layer_norm_rms_epsilon")
    assert types == [T.FLOAT32] and abs(eps - 1e-5) < 1e-12
    assert value("llama.attention.head_count_kv") == ([T.ARRAY, T.UINT32], [0, 2])
    assert value("tokenizer.ggml.tokens") == ([T.ARRAY, T.STRING], ["a", "b"])
    assert value("llama.swa") == ([T.ARRAY, T.INT32], [-1, 2])
    assert value("general.name") == ([T.STRING], "tiny")
    assert value("fp4lab.note") == ([T.STRING], '{"a": 1}')
    assert value("general.file_type")[1] == int(gguf.LlamaFileType.MOSTLY_Q4_0)
    assert "fp4lab.llama.block_count" not in fields
    with pytest.raises(ValueError, match="'llama.bad': an array needs elements of one type"):
        export.save(weights, tmp_path / "n.gguf", "gguf", arch="llama",
                    metadata={"llama.bad": [1, "x"]})
    assert not (tmp_path / "n.gguf").exists()


@pytest.mark.parametrize("layout", ["nvfp4", "nvfp4_modelopt", "mxfp4"])
def test_a_models_config_json_is_extended_not_overwritten(tmp_path, layout):
    """A user's report: both NVFP4 layouts wrote a config.json holding only fp4lab's keys
    over the model's own (no architectures, no model_type: no engine can build the model).
    The model's keys stay; one that is not JSON is refused before anything is written."""
    recipe = "mxfp4_weights" if layout == "mxfp4" else "nvfp4_no_sr"
    weights = export.quantized_weights({"mlp": {"kernel": jnp.ones((64, 32))}}, recipe)
    folder = tmp_path / "m"
    folder.mkdir()
    model = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
             "hidden_size": 64}
    (folder / "config.json").write_text(json.dumps(model))
    export.save(weights, folder, layout)
    config = json.loads((folder / "config.json").read_text())
    assert {k: config[k] for k in model} == model
    assert config["fp4lab"]["layout"] == layout
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is there but is not JSON"):
        export.save(weights, bad, layout)
    assert sorted(p.name for p in bad.iterdir()) == ["config.json"]


@pytest.mark.parametrize("with_amax", [False, True])
def test_the_modelopt_layout_says_weight_only_unless_every_activation_scale_is_given(
        tmp_path, with_amax):
    """Without activation amaxes the checkpoint is weight-only (``W4A16_NVFP4``, no
    ``input_scale``); with one per quantized layer it is W4A4 (``NVFP4``). Both files say
    so, ``kv_cache_quant_algo`` null (tests/fp4lab/test_vllm_config.py runs vLLM's parser)."""
    w = export.quantized_weights(_params(), "nvfp4")
    quantized = sorted(p for p, v in w.items() if isinstance(v, fp4lab.QArray))
    amax = {p: 3.0 for p in quantized} if with_amax else None
    folder = export.save(w, tmp_path / "m", "nvfp4_modelopt", input_amax=amax)
    algo = "NVFP4" if with_amax else "W4A16_NVFP4"
    hf = json.loads((folder / "hf_quant_config.json").read_text())["quantization"]
    assert (hf["quant_algo"], hf["kv_cache_quant_algo"], hf["group_size"]) == (algo, None, 16)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"]) == ("modelopt", algo)
    group = qc["config_groups"]["group_0"]
    assert len(group["targets"]) == len(quantized)
    assert (group["input_activations"] is not None) == with_amax
    tensors, _ = export.read_safetensors(folder / "model.safetensors")
    scales = [n for n in tensors if n.endswith(".input_scale")]
    assert len(scales) == (len(quantized) if with_amax else 0)
    if with_amax:
        assert all(tensors[n] == np.float32(3.0) / np.float32(2688.0) for n in scales)

