"""experiments.model and experiments.data: shapes, causality, the corpus, bad configs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.data import load_text, stdlib_files
from experiments.model import HybridLM, ModelConfig

CFG = ModelConfig(pattern="M*-", d_model=32, num_heads=2, ssm_state=8, mtp=True)


@pytest.fixture(scope="module")
def model_and_params():
    model = HybridLM(CFG)
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, 256)
    return model, model.init(jax.random.key(1), tokens), tokens


def test_shapes_and_parameter_paths(model_and_params):
    model, params, tokens = model_and_params
    logits, mtp = model.apply(params, tokens)
    assert logits.shape == mtp.shape == (2, 24, 256) and logits.dtype == jnp.float32
    p = params["params"]
    assert set(p["blocks_0"]["mamba"]) >= {"in_proj", "out_proj", "conv_kernel", "A_log"}
    assert set(p["blocks_1"]["attention"]) == {"qkv", "out"}
    assert set(p["blocks_2"]["mlp"]) == {"up", "down"}
    assert {"embed", "head", "mtp_proj", "mtp_head"} <= set(p)


def test_a_later_token_never_changes_an_earlier_output(model_and_params):
    model, params, tokens = model_and_params
    f = jax.jit(model.apply)
    base, _ = f(params, tokens)
    for t in (0, 7, 23):
        changed = tokens.at[:, t].set((tokens[:, t] + 1) % 256)
        out, _ = f(params, changed)
        np.testing.assert_array_equal(np.asarray(out[:, :t]), np.asarray(base[:, :t]))
        assert not np.array_equal(np.asarray(out[:, t]), np.asarray(base[:, t]))


def test_flash_attention_in_the_model_equals_the_einsum_attention(model_and_params):
    model, params, tokens = model_and_params
    base, _ = model.apply(params, tokens)
    flash = HybridLM(dataclasses.replace(CFG, attention="flash"))
    out, _ = flash.apply(params, tokens)  # the same parameters
    np.testing.assert_allclose(np.asarray(out), np.asarray(base), rtol=0, atol=0.05)
    assert float(jnp.mean(jnp.abs(out - base))) < 2e-3  # BF16 compute: the last bits differ
    biased = HybridLM(dataclasses.replace(CFG, attention="flash", attention_accumulate="bf16",
                                          attention_saved="bfloat16"))
    g = jax.grad(lambda p: jnp.sum(biased.apply(p, tokens)[0]))(params)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(g))
    with pytest.raises(ValueError, match="attention='fused'"):
        ModelConfig(attention="fused")


def test_the_recurrent_state_path_equals_the_parallel_scan_in_fp32():
    from experiments.model import recurrent_scan, ssm_combine

    rng = np.random.default_rng(0)
    decay = jnp.asarray(rng.uniform(0.5, 1.0, (2, 40, 3, 4, 8)), jnp.float32)
    inp = jnp.asarray(rng.standard_normal((2, 40, 3, 4, 8)), jnp.float32)
    _, par = jax.lax.associative_scan(ssm_combine, (decay, inp), axis=1)
    rec = recurrent_scan(decay, inp, "fp32", "nearest", None)
    np.testing.assert_allclose(np.asarray(rec), np.asarray(par), rtol=2e-5, atol=2e-6)
    bf = recurrent_scan(decay, inp, "bf16", "nearest", None)
    assert np.array_equal(np.asarray(bf), np.asarray(bf.astype(jnp.bfloat16).astype(
        jnp.float32)))  # stored in BF16 after every step
    sr = [recurrent_scan(decay, inp, "bf16", "stochastic", jax.random.key(k)) for k in (0, 1)]
    assert not np.array_equal(np.asarray(sr[0]), np.asarray(sr[1]))
    i8 = recurrent_scan(decay, inp, "int8_block128", "nearest", None)
    assert float(jnp.max(jnp.abs(i8 - par))) > 0
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
    model = HybridLM(CFG)
    params = model.init(jax.random.key(1), tokens)
    state = HybridLM(dataclasses.replace(CFG, ssm_state_format="fp8_block128",
                                         ssm_state_rounding="stochastic"))
    a = state.apply(params, tokens, rngs={"ssm_state": jax.random.key(3)})[0]
    b = state.apply(params, tokens, rngs={"ssm_state": jax.random.key(4)})[0]
    assert not np.array_equal(np.asarray(a), np.asarray(b))
    for bad, match in (({"ssm_state_format": "int3"}, "ssm_state_format='int3'"),
                       ({"ssm_state_format": "fp32", "ssm_state_rounding": "stochastic"},
                        "below FP32")):
        with pytest.raises(ValueError, match=match):
            ModelConfig(**bad)


def test_the_residual_stream_stored_in_fp8(model_and_params):
    from experiments.model import residual_probes, store_residual
    from fp4lab.numerics.formats import E4M3

    x = jnp.array([[[500.0, -1e-4, 0.3, 448.0, 2.0 ** -9, 0.0]]])
    grid = np.asarray(store_residual(x, "e4m3"))  # NumPy check of the E4M3 grid
    np.testing.assert_array_equal(grid, [[[448.0, 0.0, 0.3125, 448.0, 2.0 ** -9, 0.0]]])
    g = jax.grad(lambda x: jnp.sum(store_residual(x, "e4m3") * 3.0))(x)
    np.testing.assert_array_equal(np.asarray(g), np.full(x.shape, 3.0))  # straight through
    tok = np.asarray(store_residual(x, "e4m3_token"))
    # scaled by the token's amax: 500 -> 448 -> fl(448 * fl(1 / fl(448 / 500)))
    assert tok[0, 0, 0] == pytest.approx(500.0, rel=1e-6) and tok[0, 0, 1] == 0.0
    assert E4M3.max == 448.0
    model, params, tokens = model_and_params
    base, _ = model.apply(params, tokens)
    for fmt in ("e4m3", "e4m3_token"):
        m = HybridLM(dataclasses.replace(CFG, residual_format=fmt))
        out, _ = m.apply(params, tokens)
        assert not np.array_equal(np.asarray(out), np.asarray(base))
        probes = residual_probes(m, params, tokens)
        assert list(probes) == ["blocks_0", "blocks_1", "blocks_2"]
        assert all(0 <= p["underflow"] < 1 and p["sqnr_db"] > 10 for p in probes.values())
    gated = HybridLM(dataclasses.replace(CFG, residual_gate=True))
    gp = gated.init(jax.random.key(1), tokens)
    assert float(gp["params"]["blocks_0"]["residual_gate"].sum()) == 0.0
    with pytest.raises(ValueError, match="residual_format='fp8'"):
        ModelConfig(residual_format="fp8")


def test_the_mlp_recomputed_from_its_stored_input(model_and_params):
    """model.mlp_saved: the forward is unchanged, the down projection's gradient too (its
    input is kept as it came), and the gradient into the MLP's input is the squared ReLU's
    at the FP8-stored hidden activations (fp4lab.gemm.saved.recompute; numerics in
    test_saved.py)."""
    model, params, tokens = model_and_params
    stored = HybridLM(dataclasses.replace(CFG, mlp_saved="fp8_block128"))

    def grads(m):
        def loss(p):
            logits, _ = m.apply(p, tokens)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits
        return jax.jit(jax.grad(loss, has_aux=True))(params)

    (g0, out0), (g1, out1) = grads(model), grads(stored)
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(out0))
    mlp0, mlp1 = g0["params"]["blocks_2"]["mlp"], g1["params"]["blocks_2"]["mlp"]
    np.testing.assert_array_equal(np.asarray(mlp1["down"]["kernel"]),
                                  np.asarray(mlp0["down"]["kernel"]))
    up0, up1 = np.asarray(mlp0["up"]["kernel"]), np.asarray(mlp1["up"]["kernel"])
    assert not np.array_equal(up0, up1)
    assert np.linalg.norm(up1 - up0) < 0.1 * np.linalg.norm(up0)  # E4M3's rounding, not noise
    with pytest.raises(ValueError, match="unknown format 'fp9'"):
        ModelConfig(mlp_saved="fp9")


def test_selective_scan_matches_a_sequential_loop():
    # the associative scan equals the recurrence h_t = a_t h_{t-1} + b_t step by step
    from experiments.model import ssm_combine

    a = jax.random.uniform(jax.random.key(0), (2, 9, 3))
    b = jax.random.normal(jax.random.key(1), (2, 9, 3))
    _, h = jax.lax.associative_scan(ssm_combine, (a, b), axis=1)
    ref, acc = [], jnp.zeros((2, 3))
    for t in range(9):
        acc = a[:, t] * acc + b[:, t]
        ref.append(acc)
    np.testing.assert_allclose(np.asarray(h), np.asarray(jnp.stack(ref, 1)), rtol=1e-5,
                               atol=1e-6)


def test_bad_model_configs():
    with pytest.raises(ValueError, match=r"unknown block kind\(s\) \['X'\]"):
        ModelConfig(pattern="M-X")
    with pytest.raises(ValueError, match="num_heads"):
        ModelConfig(d_model=30, num_heads=4)


def test_corpus_is_the_stdlib_split_by_file_and_deterministic(corpus_dir):
    files = stdlib_files()
    assert files == sorted(files) and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    a = load_text([corpus_dir], val_fraction=0.3)
    b = load_text([corpus_dir], val_fraction=0.3)
    np.testing.assert_array_equal(a.train, b.train)
    assert a.files[0] >= 1 and a.files[1] >= 1
    ba, bb = a.batch(0, 5, 4, 16), b.batch(0, 5, 4, 16)
    np.testing.assert_array_equal(ba.tokens, bb.tokens)
    assert ba.tokens.shape == (4, 17)
    assert not np.array_equal(a.batch(0, 6, 4, 16).tokens, ba.tokens)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_text(["/no/such/folder"])


def test_a_folder_gives_every_text_file_or_the_chosen_suffixes(tmp_path):
    (tmp_path / "a.txt").write_text("first document " * 40)
    (tmp_path / "b.md").write_text("# second " * 40)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.rst").write_text("third " * 40)
    (tmp_path / "model.bin").write_bytes(b"\x00\x01binary" * 40)  # not text: left out
    (tmp_path / ".hidden").write_text("secret " * 40)
    everything = load_text([tmp_path], val_fraction=0.3)
    assert sum(everything.files) == 3
    only = load_text([tmp_path], val_fraction=0.3, suffixes=(".txt", ".md"))
    assert sum(only.files) == 2 and b"third" not in only.train.tobytes() + only.val.tobytes()
    with pytest.raises(FileNotFoundError, match=r"no text files.*\('\.tex',\)"):
        load_text([tmp_path], suffixes=(".tex",))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_stored_residual_is_the_rounded_value_at_every_input(dtype):
    """+-inf saturates to +-448 and NaN stays NaN (``x + stop_gradient(q - x)`` made both NaN,
    gave 0, 384 or 512 from |x| = 16896 in bfloat16 and 1.07e9 in float32, and +0 for -0);
    the gradient is the identity everywhere, the non-finite inputs included."""
    from experiments.model import store_residual

    big = float(jnp.finfo(dtype).max)
    x = jnp.array([np.inf, -np.inf, np.nan, big, -big, 1e30, 16896.0, -20000.0, 464.0, 448.0,
                   2.0 ** -9, -(2.0 ** -10) * 3, -5e-4, 1e-40, -1e-40, -0.0, 0.3], dtype)
    want = np.array([448, -448, np.nan, 448, -448, 448, 448, -448, 448, 448, 2.0 ** -9,
                     -(2.0 ** -10) * 4, -0.0, 0.0, -0.0, -0.0, 0.3125], np.float32)
    for fmt in ("e4m3", "e4m3_token"):
        g = jax.grad(lambda x: jnp.sum(store_residual(x, fmt) * 3.0))(x)
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.full(x.shape, 3.0))
    got = np.asarray(jax.jit(store_residual, static_argnums=1)(x, "e4m3"), np.float32)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # -0 stays -0
    np.testing.assert_array_equal(got, want)  # NaN where NaN, nowhere else
    token = np.asarray(store_residual(x.reshape(1, 1, -1), "e4m3_token"), np.float32)
    assert np.isnan(token).sum() == 1 and np.isnan(token[0, 0, 2])  # NaN stays, alone


def test_deepseek_setting_keeps_one_e5m6_copy_of_the_attention_output():
    """model.attention_saved=e5m6_block128_pow2 with the policy storing attention/out's input
    in that format: the vjp keeps one E5M6 copy (the GEMM's) and no O of the attention's own;
    the forward is unchanged."""
    from experiments.policies import get
    from fp4lab.flax import quantize_model

    cfg = dataclasses.replace(CFG, mtp=False, attention="flash")
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, 256)
    params = HybridLM(cfg).init(jax.random.key(1), tokens)["params"]
    o_shape = (2, cfg.num_heads, 24, cfg.d_model // cfg.num_heads)  # also q, k and v's
    out = {}
    for saved in ("float32", "e5m6_block128_pow2"):
        qm = quantize_model(HybridLM(dataclasses.replace(cfg, attention_saved=saved)),
                            get("bf16_attn_out_saved_e5m6_pow2"))
        logits, pull = jax.vjp(lambda p: qm.apply({"params": p}, tokens)[0], params)
        res = [a for a in jax.tree.leaves(pull) if hasattr(a, "dtype")]
        out[saved] = (logits, [a.shape for a in res if a.dtype == jnp.float16],
                      sum(a.shape == o_shape for a in res))
    np.testing.assert_array_equal(np.asarray(out["float32"][0]),
                                  np.asarray(out["e5m6_block128_pow2"][0]))
    assert out["e5m6_block128_pow2"][1] == out["float32"][1] == [(1, 48, 128)]
    assert out["float32"][2] == 4 and out["e5m6_block128_pow2"][2] == 3  # q, k, v (+ O)
    with pytest.raises(ValueError, match="attention_saved='e5m7'"):
        ModelConfig(attention_saved="e5m7")
