"""fp4lab.policy: precedence, depth selectors, presets on 12- and 7-block models, unused rules."""

import dataclasses

import pytest

from fp4lab.gemm.recipe import get_recipe
from fp4lab.policy import (Depth, PrecisionPolicy, Rule, all_layers, explain, get_policy,
                           nemotron3, nvfp4_paper)


def hybrid_paths(n):
    """A Nemotron-H-like model: embeddings, n blocks alternating mamba / attention / mlp."""
    paths = ["embed"]
    for i in range(n):
        mixer = ["mamba", "attn", "mlp"][i % 3]
        if mixer == "mamba":
            paths += [f"blocks_{i}/mamba/in_proj", f"blocks_{i}/mamba/out_proj"]
        elif mixer == "attn":
            paths += [f"blocks_{i}/attn/qkv", f"blocks_{i}/attn/out"]
        else:
            paths += [f"blocks_{i}/mlp/up", f"blocks_{i}/mlp/down"]
    return paths + ["lm_head"]


def by_path(table):
    return {a.path: a.recipe.name for a in table}


@pytest.mark.parametrize("n,tail", [(12, {10, 11}), (7, {5, 6})])
def test_nemotron3_preset(n, tail):
    t = by_path(explain(nemotron3(), hybrid_paths(n)))
    assert t["embed"] == t["lm_head"] == "bf16"
    for i in range(n):
        for p in [p for p in t if p.startswith(f"blocks_{i}/")]:
            if i in tail or "/attn/" in p:
                assert t[p] == "bf16", p
            elif p.endswith("mamba/out_proj"):
                assert t[p] == "mxfp8", p
            else:
                assert t[p] == "nvfp4", p


def test_nemotron3_ablations():
    t = by_path(explain(nemotron3(mamba_out=None), hybrid_paths(12)))
    assert t["blocks_0/mamba/out_proj"] == "nvfp4"
    t = by_path(explain(nemotron3(bf16_tail=0), hybrid_paths(12)))
    assert t["blocks_11/mlp/up"] == "nvfp4"


def test_a_preset_variant_says_which_variant_it_is(registry):
    """A log (explain's header, config.json) must tell the ablations from the preset."""
    assert nemotron3().name == nemotron3(get_recipe("nvfp4")).name == "nemotron3"
    assert nemotron3(bf16_tail=0).name == "nemotron3(bf16_tail=0)"
    assert nemotron3(mamba_out=None).name == "nemotron3(mamba_out=None)"
    assert nemotron3("mxfp4", bf16_tail=0.2).name == "nemotron3(default='mxfp4', bf16_tail=0.2)"
    assert nvfp4_paper("mxfp4").name == "nvfp4_paper(default='mxfp4')"
    assert str(explain(nemotron3(bf16_tail=0), ["blocks_0/mlp/up"])).startswith(
        "policy nemotron3(bf16_tail=0): ")
    from fp4lab.policy import register_policy

    register_policy("my_tail", lambda: nemotron3(bf16_tail=0))
    assert get_policy("my_tail").name == "my_tail"  # a registered name names it


@pytest.mark.parametrize("n,bf16_blocks",
                         [(12, {0, 10, 11}), (7, {0, 6}), (62, {0, 1, *range(54, 62)})])
def test_nvfp4_paper_scales_with_depth(n, bf16_blocks):
    paths = [f"layers_{i}/mlp/up" for i in range(n)]
    t = by_path(explain(nvfp4_paper(), paths))
    assert {i for i in range(n) if t[f"layers_{i}/mlp/up"] == "bf16"} == bf16_blocks


def test_first_match_wins_and_kind_and_default():
    p = PrecisionPolicy(rules=(Rule(recipe="mxfp8", pattern=".*/out_proj"),
                               Rule(recipe="bf16", pattern="blocks_1/.*"),
                               Rule(recipe="fp8_hybrid", kind="einsum")),
                        default="nvfp4")
    assert p.assign("blocks_1/out_proj").recipe.name == "mxfp8"  # first rule wins
    assert p.assign("blocks_1/in_proj").recipe.name == "bf16"
    assert p.assign("blocks_2/x", kind="einsum").recipe.name == "fp8_hybrid"
    assert p.assign("blocks_2/x", kind="dense").recipe.name == "nvfp4"
    assert p.assign("blocks_11/out_proj_extra").recipe.name == "nvfp4"  # fullmatch, not search


def test_depth_selectors():
    d = Depth(first=2, last_fraction=0.15)
    assert [i for i in range(12) if d.selects(i, 12)] == [0, 1, 10, 11]
    assert [i for i in range(7) if Depth(last_fraction=0.15).selects(i, 7)] == [5, 6]
    with pytest.raises(ValueError, match="fractions"):
        Depth(last_fraction=1.5)
    with pytest.raises(ValueError, match="num_blocks"):
        PrecisionPolicy(rules=(Rule(recipe="bf16", depth=Depth(last=1)),)).assign("blocks_3/a")


def test_unused_rules_are_reported_and_strict_raises():
    p = PrecisionPolicy(rules=(Rule(recipe="bf16", pattern=".*/atention/.*"),), name="typo")
    t = explain(p, hybrid_paths(3))
    assert t.unused == [0] and "UNUSED rule 0" in str(t)
    with pytest.raises(ValueError, match="rules matched no layer.*atention"):
        explain(p, hybrid_paths(3), strict=True)
    assert "blocks_1/attn/qkv" in str(explain(nemotron3(), hybrid_paths(3)))


def test_presets_by_name_and_errors():
    assert get_policy("nemotron3").name == "nemotron3"
    assert get_policy("all:mxfp8").assign("anything").recipe.name == "mxfp8"
    assert all_layers("bf16").rules == ()
    with pytest.raises(ValueError, match="unknown policy 'nemotron4'"):
        get_policy("nemotron4")
    with pytest.raises(ValueError, match="unknown recipe 'nvfp9'"):
        Rule(recipe="nvfp9")
    with pytest.raises(ValueError, match="not a valid regex"):
        Rule(recipe="bf16", pattern="(")


def test_reprs_name_registered_recipes_and_skip_defaults():
    """A user's report: ``repr(nemotron3().rules)`` was 15,940 characters (every recipe's
    formats spelled out)."""
    p = get_policy("nemotron3")
    assert len(repr(p)) < 1000
    assert repr(p.rules[2]) == ("Rule(recipe='bf16', depth=Depth(last_fraction=0.15), "
                                "name='last 15% of blocks')")
    assert repr(PrecisionPolicy(default="nvfp4")) == "PrecisionPolicy(default='nvfp4')"
    unregistered = dataclasses.replace(get_recipe("nvfp4"), name="mine")
    assert "OperandQuant" in repr(Rule(recipe=unregistered))  # no name to stand for it


# ----------------------------------------------------------------------------- one parser


@pytest.fixture
def registry():
    """The registry of policy names as it was, restored after the test."""
    from fp4lab.policy.registry import scoped_registry

    with scoped_registry():
        yield


def test_a_recipe_or_its_name_is_every_layer_in_it():
    nvfp4 = get_recipe("nvfp4")
    assert get_policy("nvfp4") == get_policy(nvfp4) == get_policy("all:nvfp4") == \
        all_layers("nvfp4")
    assert get_policy("nvfp4").name == "all(nvfp4)"
    p = PrecisionPolicy(default="mxfp8")
    assert get_policy(p) is p


def test_registered_names_and_families_resolve_and_carry_their_name(registry):
    from fp4lab.policy import PRESETS, register_policy, register_policy_family

    def mine():
        return PrecisionPolicy(default="mxfp8")  # named "custom" by its factory

    register_policy("mine", mine)
    register_policy("mine", mine)  # the same factory again: nothing changes
    assert PRESETS["mine"] is mine
    assert get_policy("mine") == PrecisionPolicy(default="mxfp8", name="mine")

    def every_k(m):
        return None if int(m[2]) == 0 else all_layers(m[1])

    register_policy_family(r"(\w+?)_every(\d+)", every_k, label="<recipe>_every<k>")
    assert get_policy("fp8_hybrid_every3") == PrecisionPolicy(default="fp8_hybrid",
                                                              name="fp8_hybrid_every3")
    with pytest.raises(ValueError, match="unknown policy 'nvfp4_every0'.*<recipe>_every<k>"):
        get_policy("nvfp4_every0")  # the factory said no
    assert get_policy("nemotron3") == nemotron3()  # a preset is a registered name


def test_registering_a_name_twice_with_another_factory_is_an_error(registry):
    from fp4lab.policy import register_policy, register_policy_family

    with pytest.raises(ValueError, match="'nemotron3' is already registered"):
        register_policy("nemotron3", lambda: nemotron3(bf16_tail=0.0))
    assert get_policy("nemotron3") == nemotron3()  # unchanged
    register_policy_family(r"x(\d+)", lambda m: None, label="x<k>")
    with pytest.raises(ValueError, match="already registered with another factory"):
        register_policy_family(r"x(\d+)", lambda m: None, label="x<k>")
    for bad in ("nvfp4", "all:nvfp4", "", " mine"):  # a recipe, a prefix, empty, spaces
        with pytest.raises(ValueError, match="policy name"):
            register_policy(bad, nemotron3)
    with pytest.raises(ValueError, match="not a valid regex"):
        register_policy_family("(", lambda m: None, label="bad")


def test_an_unknown_name_lists_what_is_known(registry):
    from fp4lab.policy import register_policy_family

    register_policy_family(r"(\w+?)_every(\d+)", lambda m: None, label="<recipe>_every<k>")
    with pytest.raises(ValueError) as e:
        get_policy("nemotron4")
    msg = str(e.value)
    assert msg.startswith("unknown policy 'nemotron4'; known: names nemotron3, nvfp4_paper")
    for known in ("families ", "<recipe>_every<k>", "a recipe for every layer (bf16, ",
                  "mxfp4_weights", "all:<recipe>", "file:<policy.json>"):
        assert known in msg, known
    with pytest.raises(ValueError, match="unknown policy 3"):
        get_policy(3)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_quantize_model_takes_a_recipe_name(api):
    """``quantize_model(model, "nvfp4")`` is ``quantize_model(model, "all:nvfp4")``, as
    ``fp4lab.export`` and the experiments read a recipe name."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fp4lab.flax import assignments, quantize_model

    x = jax.random.normal(jax.random.key(1), (4, 32))
    if api == "linen":
        import flax.linen as nn

        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(32, name="down")(nn.relu(nn.Dense(64, name="up")(x)))

        q, ref = quantize_model(MLP(), "nvfp4"), quantize_model(MLP(), "all:nvfp4")
        assert q.policy == all_layers("nvfp4")
        variables = q.init(jax.random.key(0), x)
        rngs = {"quant": jax.random.key(2)}
        out = q.apply(variables, x, rngs=rngs)
        want = ref.apply(variables, x, rngs=rngs)
        plain = MLP().apply(variables, x)
        assert {a.recipe.name for a in q.explain(variables, x)} == {"nvfp4"}
    else:
        from flax import nnx

        class MLP(nnx.Module):
            def __init__(self, rngs):
                self.up = nnx.Linear(32, 64, rngs=rngs)
                self.down = nnx.Linear(64, 32, rngs=rngs)

            def __call__(self, x):
                return self.down(nnx.relu(self.up(x)))

        q, ref = MLP(nnx.Rngs(0)), MLP(nnx.Rngs(0))
        plain = MLP(nnx.Rngs(0))(x)
        quantize_model(q, "nvfp4")
        quantize_model(ref, "all:nvfp4")
        assert assignments(q).policy == all_layers("nvfp4")
        assert {a.recipe.name for a in assignments(q)} == {"nvfp4"}
        out, want = q(x), ref(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    assert not np.array_equal(np.asarray(out), np.asarray(plain))  # it did quantize
    assert jnp.all(jnp.isfinite(out))


# a policy file's keys at every level: the inputs (a misspelt key silently trained the
# whole model in BF16), then more of the same class
BAD_POLICY_FILES = [
    ({"rules": [{"recipe": "bf16", "patern": "head"}], "default": "nvfp4"},
     r"policy rule 0: unknown key 'patern'; known: recipe, pattern, kind"),
    ({"rules": [], "defualt": "nvfp4"}, r"policy: unknown key 'defualt'; known: rules, default"),
    ({"rulez": [{"recipe": "bf16", "pattern": "head"}], "default": "nvfp4"},
     r"policy: unknown key 'rulez'"),
    ({}, r"policy: missing key 'default'"),
    ([{"recipe": "bf16"}], r"policy must be a JSON object, not list"),
    ({"default": "nvfp4", "rules": [{"pattern": "head"}]}, r"policy rule 0: missing key 'recipe'"),
    ({"default": "nvfp4", "rules": [{"recipe": "bf16", "depth": {"lst": 2}}]},
     r"policy rule 0 depth: unknown key 'lst'; known: first, last, first_fraction"),
    ({"default": "nvfp4", "rules": [{"recipe": "bf16", "depth": {"last": True}}]},
     r"policy rule 0 depth: last=True must be an integer"),
    ({"default": "nvfp4", "rules": [{"recipe": "bf16", "required": "no"}]},
     r"policy rule 0: required='no' must be true or false"),
    ({"default": "nvfp4", "rules": {"recipe": "bf16"}}, r"policy: rules=.* must be a list"),
    ({"default": "nvfp4", "rules": ["bf16"]}, r"policy rule 0 must be a JSON object, not str"),
    ({"default": "nvfp44"}, r"policy: default: unknown recipe 'nvfp44'; known recipes: bf16"),
    ({"default": "nvfp4", "rules": [{"recipe": "bf16", "pattern": "("}]},
     r"policy rule 0: rule pattern '\(' is not a valid regex"),
]


@pytest.mark.parametrize("content,error", BAD_POLICY_FILES)
def test_a_policy_file_with_an_unknown_key_or_a_wrong_value_is_an_error(tmp_path, content,
                                                                         error):
    import json

    path = tmp_path / "policy.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=r"policy file '.*policy.json': " + error) as e:
        get_policy(f"file:{path}")
    assert "\n" not in str(e.value)


def test_a_saved_policy_loads_back_equal(tmp_path):
    from fp4lab.policy import load_policy, save_policy

    for policy in (nemotron3(), nvfp4_paper(), all_layers("mxfp8"), PrecisionPolicy(
            rules=(Rule(recipe="bf16", pattern="head", kind="Dense", required=False,
                        depth=Depth(first=1, last_fraction=0.25)),), default="nvfp4")):
        save_policy(policy, tmp_path / "p.json")
        assert load_policy(tmp_path / "p.json") == policy


def test_a_policy_path_that_is_no_json_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"policy file '.*' is a folder, not a file"):
        get_policy(f"file:{tmp_path}")
    with pytest.raises(FileNotFoundError, match=r"policy file '.*nope.json' does not exist"):
        get_policy(f"file:{tmp_path / 'nope.json'}")
    (tmp_path / "cut.json").write_text('{"default": "nvf')
    with pytest.raises(ValueError, match=r"policy file '.*cut.json' is not JSON"):
        get_policy(f"file:{tmp_path / 'cut.json'}")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match=r"policy file '.*bin.json' is not JSON"):
        get_policy(f"file:{tmp_path / 'bin.json'}")


def test_the_default_block_pattern_reads_blocks_not_the_moe_modules_inside_them():
    """A block index is the first path element naming a block or a layer; an MoE module in a
    block (MaxText's MoeBlock_0, a Linen SparseMoeBlock_1) is never one: in MaxText's scanned
    layers (no index) its expert stacks are the stacked blocks, not block 0."""
    p = PrecisionPolicy()
    found = {path: p.block_of(path) for path in [
        "blocks_3/mlp", "TransformerBlock_2/x", "h.4/attn", "layers/5/SparseMoeBlock_1/e",
        "decoder/layers_1/MoeBlock_0/ragged_dot_0", "decoder/layers/MoeBlock_0/ragged_dot_0",
        "model/MoEBlock_2/w", "Block_1"]}
    assert found == {"blocks_3/mlp": 3, "TransformerBlock_2/x": 2, "h.4/attn": 4,
                     "layers/5/SparseMoeBlock_1/e": 5,
                     "decoder/layers_1/MoeBlock_0/ragged_dot_0": 1,
                     "decoder/layers/MoeBlock_0/ragged_dot_0": None,
                     "model/MoEBlock_2/w": None, "Block_1": 1}
