"""Per-layer precision policies: ordered rules from module paths to recipes.

A :class:`Rule` matches a layer by a regex (``fullmatch`` on the "/"-joined module path), an
optional layer kind, an optional depth selector (``Depth(first=2)``,
``Depth(last_fraction=0.15)``) and ``outside_blocks`` (layers in no block: embeddings, heads,
stems); the first matching rule wins, else the policy's default.

A layer's depth is the block index found in its path by ``block_pattern``. The default finds
the ways Flax and common model code name blocks: a path element ``blocks_3``, ``layers_3``,
``layer3``, ``h_3``, Linen's automatic names of block modules (``Block_3``,
``TransformerBlock_3``, ``DecoderLayer_3``), NNX list attributes (``layers/3``, ``h/3``) and
dotted names (``blocks.3``, ``h.3``); never an MoE module inside a block (an element whose
name contains "moe", MaxText's ``MoeBlock_0``). :func:`block_pattern_for` builds the pattern for any
other block name (``quantize_model(..., block="Stage")``).

:func:`explain` resolves a policy over a model's layers and returns a readable table. A rule
that matched nothing is reported: ``UNUSED`` in the table, a :class:`PolicyWarning` from
``fp4lab.flax.quantize_model``, an error with ``strict=True`` (a typo in a regex must not
silently leave a model in the wrong precision). Presets mark the rules that only some
architectures need (Mamba, latent projections) ``required=False``: they are listed, not
warned about.

:func:`get_policy` is the one parser of policy strings, wherever a policy is given by name
(``quantize_model``, ``explain``, ``fp4lab.export``, the MaxText integration, experiments'
configs): a recipe's name or ``all:<recipe>`` (every layer), ``file:<policy.json>``, or a
registered name. :func:`register_policy` adds a fixed name (the presets ``nemotron3`` and
``nvfp4_paper`` and the MoE systems' of :data:`MOE_PRESETS`, ``deepseek_v4``, ``kimi_k3`` and
``gpt_oss``, are registered so), :func:`register_policy_family` a parameterised family of
names (a regex and a factory of its match); ``import experiments`` registers the experiments'
names.
"""

from fp4lab.policy.presets import MOE_PRESETS, all_layers, moe_preset, nemotron3, nvfp4_paper
from fp4lab.policy.registry import (PRESETS, get_policy, known_policies, register_policy,
                                    register_policy_family)
from fp4lab.policy.rules import (EXPERT_KINDS, INTERCEPTED_KINDS, LAYER_KINDS, OP_KINDS,
                                 Assignment, Depth, PolicyWarning, PrecisionPolicy, Rule,
                                 block_pattern_for)
from fp4lab.policy.serialization import (load_policy, policy_from_dict, policy_to_dict,
                                         save_policy)
from fp4lab.policy.table import ExplainTable, check_unused, explain, param_layers

__all__ = ["Depth", "Rule", "PrecisionPolicy", "Assignment", "ExplainTable", "explain", "PRESETS",
           "get_policy", "nemotron3", "nvfp4_paper", "moe_preset", "MOE_PRESETS", "all_layers", "policy_to_dict",
           "policy_from_dict", "load_policy", "save_policy", "block_pattern_for",
           "PolicyWarning", "LAYER_KINDS", "OP_KINDS", "EXPERT_KINDS", "INTERCEPTED_KINDS",
           "check_unused", "register_policy", "register_policy_family", "known_policies",
           "param_layers"]
