"""Per-layer precision policies: ordered rules from module paths to recipes.

A :class:`Rule` matches a layer by a regex (``fullmatch`` on the "/"-joined module path), an
optional layer kind, and an optional depth selector (``Depth(first=2)``,
``Depth(last_fraction=0.15)``); the first matching rule wins, else the policy's default.
A layer's depth is the block index found in its path by ``block_pattern`` (by default a path
element such as ``blocks_3``, ``layers_3``, ``block3`` or ``layers/3``), out of ``num_blocks``.

:func:`explain` resolves a policy over a model's layers and returns a readable table; with
``strict=True`` a rule that matched nothing is an error (a typo in a regex must not silently
leave a model in the wrong precision).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

from fp4lab.recipe import Recipe, get_recipe

__all__ = ["Depth", "Rule", "PrecisionPolicy", "Assignment", "explain", "PRESETS",
           "get_policy", "nemotron3", "nvfp4_paper", "all_layers", "policy_to_dict",
           "policy_from_dict"]

DEFAULT_BLOCK_PATTERN = r"(?:^|/)(?:blocks?|layers?|h)[_/]?(\d+)(?:/|$)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Depth:
    """Select blocks by depth: the first/last ``n`` blocks or the first/last fraction of them.
    A fraction selects ``ceil(fraction * num_blocks)`` blocks (at least that share)."""

    first: int = 0
    last: int = 0
    first_fraction: float = 0.0
    last_fraction: float = 0.0

    def __post_init__(self):
        for name in ("first", "last", "first_fraction", "last_fraction"):
            if getattr(self, name) < 0:
                raise ValueError(f"Depth {name}={getattr(self, name)} must be >= 0")
        if self.first_fraction > 1 or self.last_fraction > 1:
            raise ValueError("Depth fractions must be in [0, 1]")

    def selects(self, block: int, num_blocks: int) -> bool:
        head = max(self.first, math.ceil(self.first_fraction * num_blocks - 1e-9))
        tail = max(self.last, math.ceil(self.last_fraction * num_blocks - 1e-9))
        return block < head or block >= num_blocks - tail


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    """``recipe`` for layers whose path fullmatches ``pattern`` (and whose kind is ``kind``,
    and whose block is selected by ``depth``, when given)."""

    recipe: str | Recipe
    pattern: str = ".*"
    kind: str | None = None
    depth: Depth | None = None
    name: str = ""

    def __post_init__(self):
        object.__setattr__(self, "recipe", get_recipe(self.recipe))
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"rule pattern {self.pattern!r} is not a valid regex: {e}") from None

    def label(self) -> str:
        if self.name:
            return self.name
        parts = [f"/{self.pattern}/"]
        if self.kind:
            parts.append(f"kind={self.kind}")
        if self.depth:
            parts.append(repr(self.depth).replace("Depth", "depth"))
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Assignment:
    path: str
    kind: str | None
    block: int | None
    recipe: Recipe
    rule: int | None  # index of the rule that matched; None = default


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    rules: tuple[Rule, ...] = ()
    default: str | Recipe = "bf16"
    block_pattern: str = DEFAULT_BLOCK_PATTERN
    name: str = "custom"

    def __post_init__(self):
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "default", get_recipe(self.default))

    def block_of(self, path: str) -> int | None:
        m = re.search(self.block_pattern, path)
        return int(m.group(1)) if m else None

    def assign(self, path: str, kind: str | None = None,
               num_blocks: int | None = None) -> Assignment:
        """The recipe for one layer (the first matching rule, else the default)."""
        block = self.block_of(path)
        for i, r in enumerate(self.rules):
            if not re.fullmatch(r.pattern, path):
                continue
            if r.kind is not None and r.kind != kind:
                continue
            if r.depth is not None:
                if block is None:
                    continue
                if num_blocks is None:
                    raise ValueError(f"rule {r.label()} selects by depth; pass num_blocks= "
                                     f"(layer {path!r} is in block {block})")
                if not r.depth.selects(block, num_blocks):
                    continue
            return Assignment(path, kind, block, r.recipe, i)
        return Assignment(path, kind, block, self.default, None)

    def recipe_for(self, path: str, kind: str | None = None,
                   num_blocks: int | None = None) -> Recipe:
        return self.assign(path, kind, num_blocks).recipe

    def infer_num_blocks(self, paths: Iterable[str]) -> int | None:
        blocks = [b for b in (self.block_of(p) for p in paths) if b is not None]
        return max(blocks) + 1 if blocks else None


class ExplainTable(list):
    """A list of :class:`Assignment` that prints as a table."""

    def __init__(self, rows, policy, unused):
        super().__init__(rows)
        self.policy, self.unused = policy, unused

    def __str__(self):
        w = max([len(a.path) for a in self] + [5])
        lines = [f"policy {self.policy.name}: {len(self)} layers",
                 f"{'layer'.ljust(w)}  {'kind':13s}  {'block':>5}  {'recipe':16s}  rule"]
        for a in self:
            rule = "default" if a.rule is None else self.policy.rules[a.rule].label()
            blk = "-" if a.block is None else str(a.block)
            lines.append(f"{a.path.ljust(w)}  {a.kind or '-':13s}  {blk:>5}  "
                         f"{a.recipe.name:16s}  {rule}")
        for i in self.unused:
            lines.append(f"UNUSED rule {i}: {self.policy.rules[i].label()}")
        return "\n".join(lines)


def explain(policy: PrecisionPolicy, layers, *, num_blocks: int | None = None,
            strict: bool = False) -> ExplainTable:
    """Resolve ``policy`` over ``layers`` and return the assignments (print it for a table).

    ``layers``: an iterable of paths or ``(path, kind)`` pairs, or a model (a Flax NNX module,
    or a Linen params pytree) whose linear layers are found by ``fp4lab.flax.linear_layers``.
    ``num_blocks`` defaults to one more than the largest block index found in the paths.
    """
    if not isinstance(layers, (list, tuple)) or (layers and not isinstance(
            layers[0], (str, tuple))):
        from fp4lab.flax import linear_layers

        layers = linear_layers(layers)
    pairs = [(p, None) if isinstance(p, str) else tuple(p) for p in layers]
    if num_blocks is None:
        num_blocks = policy.infer_num_blocks(p for p, _ in pairs)
    rows = [policy.assign(p, k, num_blocks) for p, k in pairs]
    used = {a.rule for a in rows}
    unused = [i for i in range(len(policy.rules)) if i not in used]
    if strict and unused:
        names = ", ".join(policy.rules[i].label() for i in unused)
        raise ValueError(f"policy {policy.name}: rules matched no layer: {names}")
    return ExplainTable(rows, policy, unused)


# ----------------------------------------------------------------------------- presets


def all_layers(recipe: str | Recipe) -> PrecisionPolicy:
    """Every layer in ``recipe``."""
    r = get_recipe(recipe)
    return PrecisionPolicy(default=r, name=f"all({r.name})")


def nemotron3(default: str | Recipe = "nvfp4", *, mamba_out: str | Recipe | None = "mxfp8",
              bf16_tail: float = 0.15) -> PrecisionPolicy:
    """Nemotron 3 Super's assignment: NVFP4 by default; embeddings, output head and MTP
    layers, attention projections, latent projections and the last 15 % of blocks in BF16;
    Mamba output projections in MXFP8 (NVFP4 underflowed there). ``mamba_out=None`` or
    ``bf16_tail=0`` give the ablations without those rules."""
    rules = [Rule(name="embeddings/head/MTP", recipe="bf16",
                  pattern=r"(?:.*/)?(?:embed\w*|lm_head|head|output|unembed\w*|mtp\w*)(?:/.*)?")]
    if bf16_tail:
        rules.append(Rule(name=f"last {bf16_tail:.0%} of blocks", recipe="bf16",
                          depth=Depth(last_fraction=bf16_tail)))
    rules += [
        Rule(name="attention projections", recipe="bf16",
             pattern=r".*(?:attn|attention)\w*/.*"),
        Rule(name="latent projections", recipe="bf16", pattern=r".*latent\w*.*"),
    ]
    if mamba_out is not None:
        rules.append(Rule(name="mamba out_proj", recipe=mamba_out,
                          pattern=r".*(?:mamba|ssm|mixer)\w*/out_proj\w*"))
    return PrecisionPolicy(rules=tuple(rules), default=default, name="nemotron3")


def nvfp4_paper(num_blocks: int | None = None, default: str | Recipe = "nvfp4"
                ) -> PrecisionPolicy:
    """The NVFP4 paper's 12B setting: the first 2 and last 8 of 62 blocks in BF16, scaled to
    the model's depth (at least one block each): ``2/62`` and ``8/62`` of the blocks."""
    del num_blocks  # the fractions scale with whatever depth explain/assign is given
    return PrecisionPolicy(
        rules=(Rule(name="first 2/62 and last 8/62 of blocks", recipe="bf16",
                    depth=Depth(first=1, last=1, first_fraction=2 / 62,
                                last_fraction=8 / 62)),),
        default=default, name="nvfp4_paper")


PRESETS = {"nemotron3": nemotron3, "nvfp4_paper": nvfp4_paper}


def get_policy(name: str | PrecisionPolicy) -> PrecisionPolicy:
    """A preset by name (``nemotron3``, ``nvfp4_paper``, ``all:<recipe>``), or the policy."""
    if isinstance(name, PrecisionPolicy):
        return name
    if isinstance(name, str):
        if name.startswith("all:"):
            return all_layers(name[4:])
        if name in PRESETS:
            return PRESETS[name]()
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(PRESETS)}, all:<recipe>")


# ----------------------------------------------------------------------------- serialization


def policy_to_dict(policy: PrecisionPolicy) -> dict:
    """A JSON-able description of ``policy`` (recipes by registry name)."""
    from fp4lab.recipe import RECIPES

    def recipe_name(r: Recipe) -> str:
        if RECIPES.get(r.name) != r:
            raise ValueError(f"recipe {r.name!r} is not the registry's; only registered "
                             "recipes can be serialized")
        return r.name

    return {"name": policy.name, "default": recipe_name(policy.default),
            "block_pattern": policy.block_pattern,
            "rules": [{"recipe": recipe_name(r.recipe), "pattern": r.pattern, "kind": r.kind,
                       "name": r.name,
                       "depth": dataclasses.asdict(r.depth) if r.depth else None}
                      for r in policy.rules]}


def policy_from_dict(d: dict) -> PrecisionPolicy:
    """The inverse of :func:`policy_to_dict`."""
    rules = tuple(Rule(recipe=r["recipe"], pattern=r.get("pattern", ".*"), kind=r.get("kind"),
                       name=r.get("name", ""),
                       depth=Depth(**r["depth"]) if r.get("depth") else None)
                  for r in d.get("rules", ()))
    return PrecisionPolicy(rules=rules, default=d.get("default", "bf16"),
                           block_pattern=d.get("block_pattern", DEFAULT_BLOCK_PATTERN),
                           name=d.get("name", "custom"))
