"""fp4lab's MXFP4 and NVFP4 checkpoints dequantized by the consumers' own code: transformers'
gpt-oss MXFP4 loader and compressed-tensors' NVFP4 decompressor (directly, and from the
ModelOpt layout through its converter), run in the consumers' environment
(scripts/consumer-venv; tests/consumers/dequantize.py), against ``fp4lab.dequantize``; and
fp4lab's GGUF Q4_0 / Q8_0 bytes against llama.cpp's own C quantizer, and its GGUF MXFP4 /
NVFP4 bytes read by llama.cpp's own C dequantizer (tests/consumers/ggml_quantize.py).

The weights are the adversarial blocks of tests/adversarial.py (values on and beside every
rounding boundary of the scale and element arithmetic), their non-finite values (which the
layouts refuse, test_export.py) set to zero, and a Gaussian kernel.
"""

import dataclasses
import json
import select
import subprocess
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from environments import CONSUMERS, python_of
from adversarial import cases

import fp4lab
from fp4lab import export
from fp4lab.export import ggml
from fp4lab.export.blocks import blocks as kernel_blocks

ROOT = Path(__file__).parents[2]
SERVER = ROOT / "tests" / "consumers" / "serve.py"
TIMEOUT_S = 600  # for one script's run


class Consumer:
    """One process of the consumers' Python for the whole module (tests/consumers/serve.py:
    torch, transformers and llama.cpp load once), running the consumer scripts on request."""

    def __init__(self, python: Path, log: Path):
        self.log = log
        with log.open("w") as err:
            self.process = subprocess.Popen([str(python), str(SERVER)], cwd=ROOT, text=True,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=err)

    def run(self, script: str, *args) -> None:
        """``python tests/consumers/<script> args...``, in the shared process."""
        self.process.stdin.write(json.dumps([script, *map(str, args)]) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], TIMEOUT_S)
        line = self.process.stdout.readline() if ready else ""
        tail = self.log.read_text(errors="replace")[-3000:]
        assert line, f"{script} {args}: no answer (after {TIMEOUT_S} s or an exit)\n{tail}"
        answer = json.loads(line)
        assert answer["ok"], f"{script} {args}:\n{answer['error']}\n{tail}"

    def close(self):
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def consumer(tmp_path_factory):
    served = Consumer(python_of(CONSUMERS), tmp_path_factory.mktemp("consumer") / "log")
    try:
        yield served
    finally:
        served.close()


def _consume(consumer, layout, checkpoint, tmp_path) -> dict[str, np.ndarray]:
    out = tmp_path / f"{layout}.npz"
    consumer.run("dequantize.py", layout, checkpoint, out)
    with np.load(out) as f:
        return {k: f[k] for k in f.files}


def _weights(fmt: str) -> dict[str, fp4lab.QArray]:
    """QArrays of [in, out] kernels quantized along in: the adversarial cases (blocks along
    their last axis, so each case's transpose) and a Gaussian kernel."""
    out = {}
    for i, c in enumerate(cases(fmt)):
        # non-finite values (which the layouts refuse) become zeros
        x = jnp.asarray(np.ascontiguousarray(np.where(np.isfinite(c.x), c.x, 0).T))
        kw = {"tile": c.tile} if c.tile else {"axis": 0}
        amax = None if c.global_amax is None else jnp.float32(c.global_amax)
        q = fp4lab.quantize(x, fmt, global_amax=amax, **kw) if fmt == "nvfp4" else \
            fp4lab.quantize(x, fmt, **kw)
        out[f"case_{i}/kernel"] = q
    rng = np.random.default_rng(0)
    out["gauss/kernel"] = fp4lab.quantize(jnp.asarray(rng.standard_normal((256, 96)),
                                                      jnp.float32), fmt, axis=0)
    return out


def _bf16(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _ulps(a, b) -> np.ndarray:
    """Distance in float32 ulps (the values compared share their signs or are zero)."""
    ia = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    ib = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return np.abs(ia - ib)


def test_transformers_reads_the_mxfp4_checkpoint_as_fp4lab_dequantizes_it(
        consumer, tmp_path):
    weights = _weights("mxfp4")
    # gpt-oss's case: an expert stack W[e, in, out] quantized along in, stored as
    # experts.gate_up_proj_blocks [e, out, in/32, 16] and _scales [e, out, in/32]
    rng = np.random.default_rng(1)
    weights["experts/gate_up_proj"] = fp4lab.quantize(
        jnp.asarray(rng.standard_normal((4, 64, 96)) * 2.0 ** rng.integers(-8, 8, (4, 1, 96)),
                    jnp.float32), "mxfp4", axis=1)
    assert len(weights) >= 2
    export.save(weights, tmp_path / "mx", "mxfp4")
    got = _consume(consumer, "mxfp4", tmp_path / "mx", tmp_path)
    for path, q in weights.items():
        name = export.tensor_name(path)
        want = np.asarray(fp4lab.dequantize(q))
        # transformers hands the model [in, out], as the kernel: exact in float32 and BF16
        np.testing.assert_array_equal(got[name].view(np.uint32), want.view(np.uint32))
        np.testing.assert_array_equal(got[name + "@bf16"], _bf16(want))


@pytest.mark.parametrize("layout", ["nvfp4", "nvfp4_modelopt"])
def test_compressed_tensors_reads_the_nvfp4_checkpoint(consumer, tmp_path, layout):
    """compressed-tensors dequantizes ``q * fl(s_b / g)``; Transformer Engine, and fp4lab,
    ``q * fl(fl(s_b * amax) * fl(1/2688))``. fp4lab's compressed-tensors checkpoint stores
    TE's ``g = 2688 / amax`` (``[1]``, float32), so in float32 the orders differ by at most
    an ulp, and compressed-tensors' BF16 weight (its default output) equals fp4lab's BF16
    weight except where the two float32 values sit on either side of a BF16 rounding point.
    From the ModelOpt layout (``weight_scale_2 = amax / 2688``, a scalar), compressed-tensors'
    converter takes ``g = 1 / weight_scale_2``, one more rounding, and with a scalar ``g`` its
    BF16 path rounds ``s_b / g`` to BF16 before the product: within 3 float32 ulps and one
    BF16 ulp."""
    weights = _weights("nvfp4")
    assert len(weights) > 3
    export.save(weights, tmp_path / layout, layout)
    got = _consume(consumer, layout, tmp_path / layout, tmp_path)
    worst, worst_bf16, differ_bf16, total = 0, 0, 0, 0
    for path, q in weights.items():
        module = export.tensor_name(path)
        want = np.asarray(fp4lab.dequantize(q))
        f32, bf16 = got[module + "@fp32"].T, got[module].T  # compressed-tensors: [out, in]
        assert np.array_equal(np.signbit(f32[f32 != 0]), np.signbit(want[f32 != 0]))
        worst = max(worst, int(_ulps(f32, want).max()))
        differ = bf16 != _bf16(want)
        if layout == "nvfp4":  # each BF16 difference: a float32 one across a rounding point
            np.testing.assert_array_equal(bf16[differ], _bf16(f32)[differ])
        worst_bf16 = max(worst_bf16, int((_ulps(bf16, _bf16(want)) >> 16).max()))
        differ_bf16 += int(differ.sum())
        total += want.size
    assert worst <= (1 if layout == "nvfp4" else 3), f"{layout}: {worst} float32 ulps"
    if layout == "nvfp4":
        assert differ_bf16 == 0  # none on these inputs
    else:
        assert worst_bf16 <= 1 and differ_bf16 < 0.2 * total, (worst_bf16, differ_bf16, total)


def test_a_checkpoint_made_by_compressed_tensors_loads_into_qarrays(consumer, tmp_path):
    """compressed-tensors quantizes and compresses two weights itself (NVFP4A16: its global
    scale, group scales, packing and safetensors writer); fp4lab.export.load recognizes the
    layout from the names and returns QArrays whose dequantization is compressed-tensors' own,
    within two float32 ulps (amax = 2688 / global scale, then Transformer Engine's order) and
    equal in BF16 except across a BF16 rounding point. compressed-tensors gives an all-zero
    group the scale 0.125 instead of 0; its values stay zero."""
    got = _consume(consumer, "make_nvfp4", tmp_path / "ct", tmp_path)
    back = export.load(tmp_path / "ct")
    assert set(back) == {"layers.0.mlp.up", "lm_head"}
    for module, q in back.items():
        assert q.format.name == "nvfp4" and q.shape == got[module + ".weight"].T.shape
        want = np.asarray(fp4lab.dequantize(q))
        f32, bf16 = got[module + ".weight@fp32"].T, got[module + ".weight"].T
        assert int(_ulps(f32, want).max()) <= 2
        differ = bf16 != _bf16(want)
        np.testing.assert_array_equal(bf16[differ], _bf16(f32)[differ])
        assert float(np.asarray(q.scale)[0, 0].astype(np.float32)) == 0.125  # the zero group
        assert (want[:16, 0] == 0).all()


def _ggml_blocks(fmt: str) -> np.ndarray:
    """Blocks of 32 (float32 ``[n, 32]``): GGML's adversarial blocks (tests/adversarial.py)
    and those where fp4lab's arithmetic and C's part ways unless the export takes care:
    subnormal maxima of either sign (C's ``d`` is subnormal, its ``1/d`` infinite) and tiny
    ones (``d`` rounds to zero), maxima near 2**-124 among subnormals (XLA:CPU flushes
    those), scales too small for float16, ties of +m and -m in both orders, zeros, -0.0
    (alone, first, last), a lone subnormal among zeros, and negative maxima."""
    rng = np.random.default_rng(0)
    sub = lambda n, top: (rng.integers(1, top, n).astype(np.uint32).view(np.float32)  # noqa
                          * rng.choice(np.float32([-1, 1]), n))
    blocks = [c.x.reshape(-1, 32) for c in cases(fmt)]
    blocks += [sub((16, 32), 2**23), sub((4, 32), 8)]
    near = sub((8, 32), 2**23)
    near[:, 5] = np.float32(2.0**-124) * rng.uniform(1, 2, 8).astype(np.float32)
    near[::2, 5] *= -1
    blocks += [near] + [(rng.standard_normal((8, 32)) * np.float32(2.0**e)).astype(np.float32)
                        for e in (-124, -110, -40, -24)]
    ties = np.ones((4, 32), np.float32) * np.float32(1.5)
    ties[0, 3], ties[1, 0], ties[2, 31], ties[3, ::2] = -1.5, -1.5, -1.5, -1.5
    zeros = np.zeros((6, 32), np.float32)
    zeros[1], zeros[2, 0], zeros[3, 31] = -0.0, -0.0, -0.0
    zeros[4, 9], zeros[5, 9] = 1e-40, -1e-40
    negative = rng.standard_normal((8, 32)).astype(np.float32)
    negative[np.arange(8), rng.integers(0, 32, 8)] = -5.0
    return np.concatenate(blocks + [ties, zeros, negative])


def _c_bytes(consumer, qtype, rows, tmp_path) -> np.ndarray:
    np.save(tmp_path / "rows.npy", rows)
    consumer.run("ggml_quantize.py", qtype, tmp_path / "rows.npy", tmp_path / "c.npy")
    return np.load(tmp_path / "c.npy")


@pytest.mark.parametrize("fmt, recipe, qtype", [
    ("int4_q4_0", "q4_0_qat", "Q4_0"), ("int8_q8_0", "q8_0_qat", "Q8_0")])
def test_gguf_bytes_are_llama_cpps_own(consumer, tmp_path, fmt, recipe, qtype):
    """The GGUF file's Q4_0 / Q8_0 bytes equal those of llama.cpp's C quantizer
    (``ggml_quantize_chunk``: ``quantize_row_q4_0_ref`` / ``quantize_row_q8_0_ref``, as
    llama-cpp-python built them) on the same float weights, block for block, including the
    blocks whose maxima are float32 subnormals (zero scales whose sign, and codes, C's IEEE
    arithmetic decides), and float32's largest values, whose bytes fp4lab computes alike
    (their float16 scale overflows, so the writer refuses them: test_export.py)."""
    blocks = _ggml_blocks(fmt)
    blocks = np.concatenate([blocks, np.zeros((-len(blocks) % 8, 32), np.float32)])
    rows = blocks.reshape(-1, 256)  # [out, in]: 8 blocks a row
    path = export.export({"w": {"kernel": jnp.asarray(rows.T)}}, recipe, tmp_path / "m.gguf",
                         "gguf")
    import gguf

    ours = np.asarray(gguf.GGUFReader(str(path)).tensors[0].data)
    theirs = _c_bytes(consumer, qtype, rows, tmp_path)
    size = theirs.shape[1] // 8
    differ = (ours.reshape(-1, size) != theirs.reshape(-1, size)).any(axis=1)
    assert ours.shape == theirs.shape and not differ.any(), (
        f"{int(differ.sum())} of {len(differ)} blocks differ, e.g. block "
        f"{blocks[differ][0]!r}")
    top = np.finfo(np.float32).max
    huge = np.float32([[top] + [1.0] * 31, [-top] + [-1.0] * 31, [1.0] * 31 + [-top]])
    q = export.quantized_weights({"w": {"kernel": jnp.asarray(huge.T)}}, recipe)["w/kernel"]
    raw = ggml.BY_NAME[qtype].to_bytes(kernel_blocks("w/kernel", q))
    np.testing.assert_array_equal(raw, _c_bytes(consumer, qtype, huge, tmp_path))


# ------------------------------------------------------------- GGUF MXFP4 and NVFP4


def _fp4_kernels(fmt: str) -> dict[str, fp4lab.QArray]:
    """[in, out] kernels quantized along in, with K a whole number of GGML's blocks (32 for
    MXFP4, 64 for NVFP4): the adversarial cases (their blocks of 16 laid four to a row of 64,
    a 16x16-tile case's K zero-padded to a multiple of 64; same tensor amax) and a Gaussian."""
    out = {}
    for i, c in enumerate(cases(fmt)):
        x = np.where(np.isfinite(c.x), c.x, 0).astype(np.float32)
        if fmt == "nvfp4" and c.tile:
            k = x.T
            k = np.concatenate([k, np.zeros((-len(k) % 64, k.shape[1]), np.float32)])
            q = fp4lab.quantize(jnp.asarray(k), fmt, tile=c.tile)
        elif fmt == "nvfp4":
            q = fp4lab.quantize(jnp.asarray(x.reshape(-1, 64).T), fmt, axis=0)
        else:
            q = fp4lab.quantize(jnp.asarray(x.T), fmt, axis=0)
        out[f"case_{i}/kernel"] = q
    rng = np.random.default_rng(0)
    out["gauss/kernel"] = fp4lab.quantize(jnp.asarray(rng.standard_normal((256, 96)),
                                                      jnp.float32), fmt, axis=0)
    return out


def _c_values(consumer, qtype: str, raw: np.ndarray, tmp_path) -> np.ndarray:
    """llama.cpp's to_float of ``[rows, bytes]`` GGML blocks (after its loader's check)."""
    np.save(tmp_path / "blocks.npy", raw)
    consumer.run("ggml_quantize.py", "dequantize", qtype, tmp_path / "blocks.npy",
                 tmp_path / "values.npy")
    return np.load(tmp_path / "values.npy")


def _unsigned_zeros(a) -> np.ndarray:
    """-0 as +0: GGML's E2M1 table (kvalues_mxfp4) has no -0, so its weights have none."""
    return np.where(np.asarray(a) == 0, np.float32(0), a).astype(np.float32)


@pytest.mark.parametrize("fmt, qtype", [("mxfp4", "MXFP4"), ("nvfp4", "NVFP4")])
def test_llama_cpp_reads_the_gguf_fp4_weights_as_fp4lab_dequantizes_them(
        consumer, tmp_path, fmt, qtype):
    """fp4lab's GGUF MXFP4 / NVFP4 tensors, as the file holds them, pass llama.cpp's loader
    check (ggml_validate_row_data) and its C dequantizer (the type's to_float:
    dequantize_row_mxfp4 / dequantize_row_nvfp4) gives:

    * MXFP4: fp4lab's dequantized weight bit for bit, except that GGML's E2M1 table has no
      -0 (code 8 is +0): the only differing bits are fp4lab's -0 as +0;
    * NVFP4, before its ``.scale``: ``q * s_b`` exactly, which is fp4lab's dequantization at
      a tensor amax of 2688 (``fl(fl(s_b * 2688) * fl(1/2688)) = s_b``), the -0 aside: the
      codes and block scales are read as fp4lab holds them;
    * NVFP4 times its ``.scale`` (``fl(amax / 2688)``, as ``ggml_mul`` multiplies the
      matmul's output by it): within 2 float32 ulps of fp4lab's dequantization, which rounds
      ``fl(s_b * amax) * fl(1/2688)`` per block first (Transformer Engine's order); the
      count of values that differ is in the failure message and docs/export.md."""
    weights = _fp4_kernels(fmt)
    path = export.save(weights, tmp_path / "m.gguf", "gguf")
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    differ, total, negative_zeros = 0, 0, 0
    for p, q in weights.items():
        name = export.tensor_name(p)
        raw = np.asarray(tensors[name].data)
        got = _c_values(consumer, qtype, raw.reshape(q.shape[1], -1), tmp_path)  # [out, in]
        want = np.asarray(fp4lab.dequantize(q)).T
        negative_zeros += int(((want == 0) & np.signbit(want)).sum())
        if qtype == "MXFP4":
            np.testing.assert_array_equal(got.view(np.uint32),
                                          _unsigned_zeros(want).view(np.uint32))
            continue
        unit = q if not q.tile else export.load(path)[p]  # 16x16 tiles: the 1D groups held
        unit = dataclasses.replace(unit, global_scale=jnp.float32(2688))
        np.testing.assert_array_equal(
            got.view(np.uint32), _unsigned_zeros(np.asarray(fp4lab.dequantize(unit)).T).view(
                np.uint32))
        scale = np.asarray(tensors[name.removesuffix("weight") + "scale"].data)
        served = got * scale[0]
        assert np.array_equal(np.signbit(served), np.signbit(_unsigned_zeros(want)))
        ulps = _ulps(served, want)
        assert int(ulps.max()) <= 2, (p, int(ulps.max()))
        differ, total = differ + int((ulps > 0).sum()), total + want.size
    assert negative_zeros > 0  # the -0 codes were exercised
    if qtype == "NVFP4":
        assert 0 < differ < 0.25 * total, (differ, total)
        print(f"\nNVFP4 GGUF: {differ:,} of {total:,} values differ from fp4lab's, by at most "
              "2 float32 ulps")


def test_llama_cpps_mxfp4_quantizer_is_the_ocp_floor_rule_with_its_own_ties(consumer, tmp_path):
    """What llama.cpp's own MXFP4 quantizer (quantize_row_mxfp4_ref, as llama-quantize runs
    it) writes for the same float weights, against fp4lab's ``mxfp4_floor`` (the OCP rule it
    follows, ``e = floor(log2 amax) - 2``): the same scale byte except where ``log2f``
    rounds an amax just below ``2^k`` up to ``k`` (GGML's byte is then one more), and, where
    the scales agree, the same codes except at E2M1 ties (GGML keeps the first of two equally
    near values of its table, the smaller magnitude; fp4lab rounds to even) and where fp4lab
    has -0 (GGML +0). So a GGUF file fp4lab writes from ``mxfp4_floor`` weights differs from
    llama-quantize's only there; fp4lab's ``mxfp4`` (RCEIL) is another scale rule."""
    x = np.concatenate([np.where(np.isfinite(c.x), c.x, 0) for c in cases("mxfp4")]
                       + [np.random.default_rng(0).standard_normal((64, 32))]).astype(np.float32)
    rows = x.reshape(-1, 64)  # [out, in]
    theirs = _c_bytes(consumer, "MXFP4", rows, tmp_path).reshape(-1, 17)
    q = fp4lab.quantize(jnp.asarray(rows.T), "mxfp4_floor", axis=0)
    ours = ggml.BY_NAME["MXFP4"].to_bytes(kernel_blocks("w", q)).reshape(-1, 17)
    amax = np.abs(x).max(axis=1).astype(np.float64)
    moved = ours[:, 0] != theirs[:, 0]
    k = np.ceil(np.log2(amax[moved]))
    assert moved.any() and (theirs[moved, 0] == ours[moved, 0] + 1).all()
    assert ((amax[moved] < 2.0 ** k) & (amax[moved] > 2.0 ** k * (1 - 2.0 ** -16))).all()
    same = ~moved
    oc = ggml.unpack(ours[same, 1:], halves=32).astype(int)
    tc = ggml.unpack(theirs[same, 1:], halves=32).astype(int)
    v = x[same] * np.exp2(127.0 - ours[same, :1])  # the block's elements before rounding
    table = np.float64([0, .5, 1, 1.5, 2, 3, 4, 6] * 2) * np.repeat([1, -1], 8)
    tie = np.isin(np.abs(v), [.25, .75, 1.25, 1.75, 2.5, 3.5, 5])
    differ, zero = oc != tc, (oc == 8) & (tc == 0)
    assert differ.any() and (tie | zero | ~differ).all()
    assert (np.abs(table[tc]) < np.abs(table[oc]))[tie & differ & ~zero].all()
