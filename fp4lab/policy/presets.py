"""The library's preset policies: every layer in one recipe, Nemotron 3's recipe,
NVIDIA's NVFP4 pretraining paper's, and the MoE systems' (:data:`MOE_PRESETS`: experts in
one recipe, the rest in another)."""

from __future__ import annotations

from fp4lab.policy.rules import Depth, PrecisionPolicy, Rule
from fp4lab.gemm.recipe import Recipe, get_recipe

__all__ = ["all_layers", "nemotron3", "nvfp4_paper", "moe_preset", "MOE_PRESETS"]


# embeddings, output heads and MTP layers in BF16, by structure and by name: Nemotron 3's
# rule, and DeepSeek-V3's ("the embedding module, the output head" kept in high precision)
_ENDS_IN_BF16 = (
    Rule(name="outside the blocks (embeddings, head, MTP)", recipe="bf16", outside_blocks=True),
    Rule(name="embeddings/head/MTP by name", recipe="bf16", required=False,
         pattern=r"(?i)(?:.*/)?(?:embed\w*|lm_head|head|output|unembed\w*|mtp\w*|"
                 r"logits?)(?:_\d+)?(?:/.*)?"))
# an expert stack: a grouped GEMM (jax.lax.ragged_dot, intercepted) or a layer inside a
# module named experts (an expert written as Linen/NNX layers)
_EXPERT_LAYERS = r"(?i)(?:.*/)?experts?(?:_\d+)?/.*"

# name -> (the experts' recipe, every other GEMM's recipe, whom it follows). Routers keep
# their own precision in all of them (no rule names one: fp4lab.policy.rules.ROUTER_PATTERN)
MOE_PRESETS = {
    "deepseek_v4": ("fp4_qat", "fp8_blockwise",
                    "DeepSeek-V4: FP4 (E2M1) QAT of the expert weights, DeepSeek-V3's FP8 "
                    "(1x128 / 128x128 blocks) for every other GEMM"),
    "kimi_k3": ("mxfp4_w_mxfp8_a_qat", "bf16",
                "Kimi K3: MXFP4 expert weights with MXFP8 activations (QAT), the rest BF16"),
    "gpt_oss": ("mxfp4_weights", "bf16",
                "gpt-oss: MXFP4 expert weights (forward), the rest BF16"),
}


def moe_preset(name: str, experts: str | Recipe | None = None,
               default: str | Recipe | None = None) -> PrecisionPolicy:
    """The MoE system ``name`` of :data:`MOE_PRESETS`: its expert stacks in their recipe,
    embeddings, heads and MTP layers in BF16, every other GEMM in its ``default``; routers as
    the model computes them. ``experts`` / ``default`` vary it."""
    if name not in MOE_PRESETS:
        raise ValueError(f"MoE preset {name!r}: use one of {', '.join(MOE_PRESETS)}")
    want_experts, want_default, _ = MOE_PRESETS[name]
    experts, default = experts or want_experts, default or want_default
    rules = (*_ENDS_IN_BF16,
             Rule(name="expert stacks (grouped GEMMs)", recipe=experts, kind="experts",
                  required=False),
             Rule(name="expert layers", recipe=experts, pattern=_EXPERT_LAYERS, required=False))
    return PrecisionPolicy(rules=rules, default=default, name=_variant(
        name, experts=(experts, want_experts), default=(default, want_default)))


def all_layers(recipe: str | Recipe) -> PrecisionPolicy:
    """Every layer in ``recipe``."""
    r = get_recipe(recipe)
    return PrecisionPolicy(default=r, name=f"all({r.name})")


def nemotron3(default: str | Recipe = "nvfp4", *, mamba_out: str | Recipe | None = "mxfp8",
              bf16_tail: float = 0.15) -> PrecisionPolicy:
    """Nemotron 3 Super's assignment: NVFP4 by default; embeddings, output head and MTP
    layers, attention projections, latent projections and the last 15 % of blocks in BF16;
    Mamba output projections in MXFP8 (NVFP4 underflowed there). ``mamba_out=None`` or
    ``bf16_tail=0`` give the ablations without those rules.

    Layers are recognised by name in any case (``embed``, ``lm_head``, ``head``, ``output``,
    ``mtp``; any path element containing ``attn``/``attention``, as Linen's
    ``SelfAttention_0`` and ``MultiHeadDotProductAttention_0`` do) and by structure: every
    layer in no block (an auto-named ``Dense_0`` head after ``Block_0 ... Block_7``) is an
    embedding, head or MTP layer and stays in BF16."""
    rules = list(_ENDS_IN_BF16)
    if bf16_tail:
        rules.append(Rule(name=f"last {bf16_tail:.0%} of blocks", recipe="bf16",
                          depth=Depth(last_fraction=bf16_tail)))
    rules += [
        # a path element naming attention that is not itself a block (AttnBlock_3 is one)
        Rule(name="attention projections", recipe="bf16", required=False,
             pattern=r"(?i)(?:.*/)?(?![^/]*(?:block|layer)s?[_.]?\d*/)[^/]*(?:attn|attention)"
                     r"[^/]*/.*"),
        Rule(name="latent projections", recipe="bf16", required=False,
             pattern=r"(?i).*latent\w*.*"),
    ]
    if mamba_out is not None:
        rules.append(Rule(name="mamba out_proj", recipe=mamba_out, required=False,
                          pattern=r"(?i).*(?:mamba|ssm|mixer)\w*/out_proj\w*"))
    return PrecisionPolicy(rules=tuple(rules), default=default, name=_variant(
        "nemotron3", default=(default, "nvfp4"), mamba_out=(mamba_out, "mxfp8"),
        bf16_tail=(bf16_tail, 0.15)))


def nvfp4_paper(default: str | Recipe = "nvfp4") -> PrecisionPolicy:
    """The NVFP4 paper's 12B setting: the first 2 and last 8 of 62 blocks in BF16, scaled to
    the model's depth (at least one block each): ``2/62`` and ``8/62`` of the blocks."""
    return PrecisionPolicy(
        rules=(Rule(name="first 2/62 and last 8/62 of blocks", recipe="bf16",
                    depth=Depth(first=1, last=1, first_fraction=2 / 62,
                                last_fraction=8 / 62)),),
        default=default, name=_variant("nvfp4_paper", default=(default, "nvfp4")))


def _variant(preset: str, **args) -> str:
    """A preset's name with the arguments that differ from its defaults (``args``: name ->
    (value, default)): ``nemotron3(bf16_tail=0, mamba_out=None)``, so that a log says which
    variant ran."""
    def show(v):
        return repr(v.name) if isinstance(v, Recipe) else repr(v)

    changed = [f"{k}={show(v)}" for k, (v, default) in args.items()
               if (v.name if isinstance(v, Recipe) else v) != default]
    return f"{preset}({', '.join(changed)})" if changed else preset
