"""Policies on models written the way Flax users write them: Linen's automatic names, NNX
attribute paths, other block names; rules that match nothing are warned about or refused."""

import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn
from flax import nnx

import fp4lab.flax
from fp4lab.flax import quantize_model
from fp4lab.policy import (PolicyWarning, PrecisionPolicy, Rule, block_pattern_for, explain,
                           nemotron3, nvfp4_paper)


class Block(nn.Module):  # unnamed submodules: Linen calls them Dense_0, Dense_1
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(64)(nn.relu(nn.Dense(256)(x)))


class UnnamedMLP(nn.Module):  # the reproducer: Block_0 ... Block_7, a head Dense_0
    @nn.compact
    def __call__(self, x):
        for _ in range(8):
            x = Block()(x)
        return nn.Dense(10)(x)


def recipes(table):
    return {a.path: a.recipe.name for a in table}


def test_unnamed_linen_blocks_and_head_get_the_nemotron3_assignment():
    model, x = UnnamedMLP(), jnp.ones((2, 64))
    params = model.init(jax.random.key(0), x)
    qm = quantize_model(model, nemotron3())
    t = recipes(qm.explain(params, x))
    assert len(t) == 17 and t["Dense_0"] == "bf16"  # the head, outside the blocks
    for i in range(8):  # ceil(0.15 * 8) = 2 BF16 blocks at the end
        want = "bf16" if i >= 6 else "nvfp4"
        assert t[f"Block_{i}/Dense_0"] == t[f"Block_{i}/Dense_1"] == want, i
    with warnings.catch_warnings():
        warnings.simplefilter("error", PolicyWarning)  # nothing is left unmatched
        qm.apply(params, x, rngs={"quant": jax.random.key(1)})


class AttnBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x + nn.SelfAttention(num_heads=2, qkv_features=32)(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32)(x, x)
        return x + nn.Dense(32)(nn.gelu(nn.Dense(64)(x)))


class AttnModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = AttnBlock()(x)
        return nn.Dense(8)(x)


@pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated:DeprecationWarning")
def test_linen_attention_modules_are_recognised_by_their_automatic_names():
    model, x = AttnModel(), jnp.ones((1, 4, 32))
    params = model.init(jax.random.key(0), x)
    t = recipes(quantize_model(model, nemotron3()).explain(params, x))
    attn = [p for p in t if "Attention_0/" in p]
    assert len(attn) == 4 * 2 * 4  # 4 blocks, 2 attention modules, query/key/value/out
    assert {t[p] for p in attn} == {"bf16"}
    assert t["AttnBlock_0/Dense_0"] == "nvfp4" and t["AttnBlock_3/Dense_0"] == "bf16"


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16,
                                           decode=False, rngs=rngs)
        self.mlp = nnx.Linear(16, 16, rngs=rngs)


class NNXModel(nnx.Module):
    def __init__(self, n, rngs):
        self.layers = nnx.List([NNXBlock(rngs) for _ in range(n)])
        self.lm_out = nnx.Linear(16, 8, rngs=rngs)


def test_nnx_attribute_paths_and_list_indices():
    model = NNXModel(7, nnx.Rngs(0))
    quantize_model(model, nemotron3())
    t = recipes(fp4lab.flax.explain(nemotron3(), model))
    assert t["layers/0/mlp"] == "nvfp4" and t["layers/6/mlp"] == "bf16"
    assert t["layers/2/attn/query"] == t["layers/2/attn/out"] == "bf16"
    assert t["lm_out"] == "bf16"  # outside the blocks


@pytest.mark.parametrize("path,block", [("blocks_3/x", 3), ("Block_3/Dense_0", 3),
                                        ("TransformerBlock_12/x", 12), ("layers/3/mlp", 3),
                                        ("h.3/attn", 3), ("h_3/mlp", 3), ("blocks.3/attn", 3),
                                        ("layer3/x", 3), ("decoder/layers/2/self_attn", 2),
                                        ("Dense_0", None), ("LayerNorm_0/x", None),
                                        ("mtp_block/up", None), ("ch_3/x", None)])
def test_default_block_pattern(path, block):
    assert PrecisionPolicy().block_of(path) == block


def test_block_argument_names_the_block_modules():
    paths = [f"Stage_{i}/Dense_{j}" for i in range(4) for j in range(2)] + ["Dense_0"]
    with pytest.warns(PolicyWarning, match="no layer path has a block index.*block="):
        t = explain(nemotron3(), paths)
        assert set(recipes(t).values()) == {"nvfp4"}
        quantize_model(_PathModel(paths), nemotron3())
    t = recipes(explain(nemotron3(), paths, block="Stage"))
    assert t["Stage_3/Dense_0"] == "bf16" and t["Stage_2/Dense_1"] == "nvfp4"
    assert t["Dense_0"] == "bf16"
    assert PrecisionPolicy().with_block(r"stage(\d+)").block_of("x/stage7/y") == 7
    with pytest.raises(ValueError, match="no group"):
        block_pattern_for(r"stage\d+(?:)")


class _PathModel(nnx.Module):
    """An NNX model whose Linear layers sit at the given ``a/b`` paths."""

    def __init__(self, paths):
        for p in paths:
            owner = self
            *parents, leaf = p.split("/")
            for name in parents:
                if not hasattr(owner, name):
                    setattr(owner, name, nnx.Module())
                owner = getattr(owner, name)
            setattr(owner, leaf, nnx.Linear(4, 4, rngs=nnx.Rngs(0)))


def test_custom_policy_typos_warn_or_raise():
    model = UnnamedMLP()
    x = jnp.ones((2, 64))
    params = model.init(jax.random.key(0), x)
    typo = PrecisionPolicy(rules=(Rule(recipe="bf16", pattern=".*/mlp_dwon"),), name="mine")
    qm = quantize_model(model, typo)
    with pytest.warns(PolicyWarning,
                      match=r"policy mine: rules matched no layer: '/\.\*/mlp_dwon/'"):
        qm.apply(params, x)
    strict = quantize_model(model, typo, strict=True)
    with pytest.raises(ValueError, match="mlp_dwon"):
        strict.apply(params, x)
    with pytest.raises(ValueError, match="mlp_dwon"):
        quantize_model(NNXModel(2, nnx.Rngs(0)), typo, strict=True)
    with pytest.raises(ValueError, match="mlp_dwon"):
        qm.explain(params, x, strict=True)


def test_rule_kinds_are_flax_class_names_in_any_case():
    assert Rule(recipe="bf16", kind="Dense").kind == "dense"
    with pytest.raises(ValueError, match=r"kind='Denes' is not a layer kind.*densegeneral"):
        Rule(recipe="bf16", kind="Denes")


def test_optional_preset_rules_are_listed_not_warned_about():
    t = explain(nemotron3(), [f"blocks_{i}/mlp/up" for i in range(4)] + ["head"])
    text = str(t)
    assert "unused optional rule" in text and "mamba out_proj" in text
    assert "UNUSED rule" not in text
    with pytest.warns(PolicyWarning, match="first 2/62"):  # a depth preset on a flat model
        quantize_model(NNXModel(0, nnx.Rngs(0)), nvfp4_paper())
