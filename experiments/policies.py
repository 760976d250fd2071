"""Named precision policies for experiments, registered with fp4lab's one parser.

Importing this module (``import experiments`` does) registers, with
:func:`fp4lab.policy.register_policy` and :func:`fp4lab.policy.register_policy_family`:

* ``bf16_mlp_saved_fp8``: BF16, the MLP layers' inputs saved for backward as E4M3 1x128
  (Kimi K2's activation storage); ``bf16_attn_out_saved_fp8`` / ``_e5m6`` / ``_e5m6_pow2``:
  the attention output (the input of attention/out) saved as E4M3, E5M6 or E5M6 with
  power-of-two scales (DeepSeek-V3);
* the sweep's names: ``nemotron3_no_mxfp8`` (Mamba out_proj left in NVFP4),
  ``nemotron3_no_tail`` (no BF16 last 15 %), ``nemotron3_latent_nvfp4`` (its LatentMoE's
  latent projections in NVFP4, not BF16), ``nvfp4_experts`` / ``nvfp4_mlp`` (NVFP4 on the
  expert stacks / the dense MLPs only, the rest BF16), ``nvfp4_experts_shared`` (as
  ``nvfp4_experts``, one global scale per stack: ``nvfp4_shared_scale``);
* ``<recipe>_bf16_first<k>`` / ``<recipe>_bf16_last<k>``: every layer in the recipe except
  those of the first / last ``k`` blocks, in BF16 (``nvfp4_bf16_last2``: the NVFP4 paper's
  ablation of which blocks to keep in high precision).

Every policy string is then parsed by :func:`fp4lab.policy.get_policy` (re-exported here;
``get`` is the same function), wherever it is given (``quantize_model``, ``fp4lab.export``,
configs' ``precision.policy``): besides these names, the library's presets (``nemotron3``,
``nvfp4_paper``), any recipe name (``bf16``, ``nvfp4``, ``nvfp4_no_rht``, ``mxfp8``, ...:
every layer in that recipe), ``all:<recipe>``, and ``file:<path.json>`` (a policy written by
``experiments.auto_assign`` or ``fp4lab.policy.save_policy``).

A policy is identified by what it says, not by its name: :func:`fingerprint` hashes its
rules (a run's ``config.json`` records them and the hash, and a run is resumed or reused only
under a policy with the same hash).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from fp4lab.policy import (Depth, PrecisionPolicy, Rule, get_policy, nemotron3,
                           policy_to_dict, register_policy, register_policy_family)
from fp4lab.gemm.recipe import RECIPES

__all__ = ["get_policy", "get", "NAMED", "BF16_ENDS", "fingerprint", "without_outcontrol"]

NAMED = {
    # Kimi K2: BF16 compute, the MLP inputs stored for the backward pass as E4M3 1x128
    "bf16_mlp_saved_fp8": lambda: PrecisionPolicy(
        rules=(Rule(name="MLP inputs saved in FP8", recipe="bf16_saved_fp8",
                    pattern=r"(?:.*/)?mlp/\w+"),), default="bf16"),
    # DeepSeek-V3: the attention output (the input of attention's out projection) saved in
    # E4M3 or in E5M6
    "bf16_attn_out_saved_fp8": lambda: PrecisionPolicy(
        rules=(Rule(name="attention output saved in FP8", recipe="bf16_saved_fp8",
                    pattern=r"(?:.*/)?attention/out"),), default="bf16"),
    "bf16_attn_out_saved_e5m6": lambda: PrecisionPolicy(
        rules=(Rule(name="attention output saved in E5M6", recipe="bf16_saved_e5m6",
                    pattern=r"(?:.*/)?attention/out"),), default="bf16"),
    # ... with power-of-two scales, DeepSeek-V3's (model.attention_saved names the same
    # format to make the attention's backward use this one stored copy)
    "bf16_attn_out_saved_e5m6_pow2": lambda: PrecisionPolicy(
        rules=(Rule(name="attention output saved in E5M6 (power-of-two scales)",
                    recipe="bf16_saved_e5m6_pow2", pattern=r"(?:.*/)?attention/out"),),
        default="bf16"),
    "nemotron3_no_mxfp8": lambda: nemotron3(mamba_out=None),
    "nemotron3_no_tail": lambda: nemotron3(bf16_tail=0.0),
    # the MoE sweep's: Nemotron 3 with its LatentMoE's latent projections in NVFP4 too
    "nemotron3_latent_nvfp4": lambda: dataclasses.replace(nemotron3(), rules=tuple(
        r for r in nemotron3().rules if r.name != "latent projections")),
    # NVFP4 on the expert stacks alone / on the dense MLPs alone, everything else BF16
    "nvfp4_experts": lambda: PrecisionPolicy(
        rules=(Rule(name="expert stacks", recipe="nvfp4", kind="experts"),),
        default="bf16"),
    # the same with one NVFP4 global scale per expert stack and operand, not one per expert
    "nvfp4_experts_shared": lambda: PrecisionPolicy(
        rules=(Rule(name="expert stacks", recipe="nvfp4_shared_scale",
                    kind="experts"),), default="bf16"),
    "nvfp4_mlp": lambda: PrecisionPolicy(
        rules=(Rule(name="MLP layers", recipe="nvfp4", pattern=r"(?:.*/)?mlp/\w+"),),
        default="bf16"),
}


# <recipe>_bf16_first<k> / <recipe>_bf16_last<k>
BF16_ENDS = r"(\w+?)_bf16_(first|last)(\d+)"


def _bf16_ends(m) -> PrecisionPolicy | None:
    """Every layer in recipe ``m[1]`` but those of the first / last ``m[3]`` blocks, in BF16;
    ``None`` for an unknown recipe or no blocks."""
    if m[1] not in RECIPES or int(m[3]) == 0:
        return None
    return PrecisionPolicy(rules=(Rule(name=f"{m[2]} {m[3]} blocks", recipe="bf16",
                                       depth=Depth(**{m[2]: int(m[3])})),), default=m[1])


for _name, _factory in NAMED.items():
    register_policy(_name, _factory)
register_policy_family(BF16_ENDS, _bf16_ends,
                       label="<recipe>_bf16_first<k>, <recipe>_bf16_last<k>")

get = get_policy  # the name experiments' call sites use


def fingerprint(policy: PrecisionPolicy) -> str:
    """The SHA-256 of what ``policy`` says (``fp4lab.policy.policy_to_dict``: its rules,
    default and block pattern, recipes by name) without its name: two policies with one
    fingerprint assign every layer the same recipe."""
    said = {k: v for k, v in policy_to_dict(policy).items() if k != "name"}
    return hashlib.sha256(json.dumps(said, sort_keys=True).encode()).hexdigest()


def without_outcontrol(policy: PrecisionPolicy, what: str) -> PrecisionPolicy:
    """``policy``, for ``what`` (an analysis that restores a run's parameters only), or an
    error if one of its recipes has OutControl: that split is chosen from channel norms kept
    in the training state, and without them the layers would run unsplit, silently."""
    named = [r.name for r in (policy.default, *(rule.recipe for rule in policy.rules))
             if r.outliers is not None]
    if named:
        raise ValueError(f"{what}: policy {policy.name!r} uses {', '.join(sorted(set(named)))}"
                         ", whose OutControl split lives in the training state (the channel "
                         "norms), not in the parameters this reads; it is not supported here")
    return policy
