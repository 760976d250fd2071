"""Policy rules and the policy: which recipe each GEMM gets (:meth:`PrecisionPolicy.assign`,
the one place a GEMM gets its recipe), by path regex, kind, depth and block."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

from fp4lab.gemm.recipe import Recipe, get_recipe

__all__ = ["Depth", "Rule", "PrecisionPolicy", "Assignment", "block_pattern_for",
           "PolicyWarning", "LAYER_KINDS", "OP_KINDS", "EXPERT_KINDS", "INTERCEPTED_KINDS",
           "DEFAULT_BLOCK_PATTERN", "ROUTER_PATTERN", "is_router"]

# a path element naming a block (blocks_3, Block_3, TransformerBlock_3, layers/3, h.3, ...),
# never an MoE module inside one (MaxText's MoeBlock_0 is the first MoE block of its layer)
DEFAULT_BLOCK_PATTERN = (r"(?:^|/)(?![^/]*(?i:moe))"
                         r"(?:(?:[A-Za-z]\w*?)?(?:[Bb]locks?|[Ll]ayers?)|h)[_./]?(\d+)(?=/|$)")
# the kinds of GEMM a rule can name: fp4lab.flax's Linen and NNX layer classes, lower case,
# and the calls inside modules that fp4lab.flax intercepts: general calls (OP_KINDS), which
# only rules of their kind quantize (an einsum may be attention's scores), and the grouped
# GEMMs of MoE experts (EXPERT_KINDS), which are always an expert stack's GEMM and are
# assigned as layers are (the policy's rules and its default)
OP_KINDS = ("lax.dot_general", "jnp.einsum")
EXPERT_KINDS = ("lax.ragged_dot", "fp4lab.expert_einsum")
INTERCEPTED_KINDS = OP_KINDS + EXPERT_KINDS
# a rule of kind "experts" names every expert stack, whichever call computes it
EXPERTS = "experts"
LAYER_KINDS = (("dense", "densegeneral", "einsum", "linear", "lineargeneral") + INTERCEPTED_KINDS
               + (EXPERTS,))
# an MoE router, by name: a path element ``router...``, or ``gate`` inside a module whose
# name says MoE (Mixtral's ``block_sparse_moe/gate``, MaxText's ``MoeBlock_0/gate``; a bare
# ``mlp/gate`` or ``experts/gate`` may be a GLU's gate, so DeepSeek's and Qwen-MoE's
# ``mlp/gate`` routers need a rule): the seed systems keep its GEMM and scores in high
# precision, so neither the policy's default nor a catch-all rule reaches it; only a rule
# whose pattern is not a catch-all does
ROUTER_PATTERN = r"(?i)(?:.*/)?(?:router\w*|[^/]*moe[^/]*/gate)(?:_\d+)?(?:/.*)?"
CATCH_ALL_PATTERNS = frozenset({".*", ".+", "(?s).*", "(?s).+"})


def is_router(path: str) -> bool:
    """Whether ``path`` names an MoE router (:data:`ROUTER_PATTERN`)."""
    return re.fullmatch(ROUTER_PATTERN, path) is not None


class PolicyWarning(UserWarning):
    """A policy rule matched no layer of the model it was applied to."""


def block_pattern_for(block: str) -> str:
    """The ``block_pattern`` for blocks named ``block``: a path element ``block_3``,
    ``block3``, ``block.3`` or ``block/3`` is block 3. A string holding a regex group is
    taken as the pattern itself (its first group is the index)."""
    if not isinstance(block, str) or not block:
        raise ValueError(f"block={block!r} must be a path element name such as 'Block' "
                         "(or a regex with one group for the index)")
    if "(" in block:
        pattern = block
    else:
        pattern = r"(?:^|/)" + re.escape(block) + r"[_./]?(\d+)(?=/|$)"
    try:
        if re.compile(pattern).groups < 1:
            raise ValueError(f"block pattern {pattern!r} has no group for the block index")
    except re.error as e:
        raise ValueError(f"block pattern {pattern!r} is not a valid regex: {e}") from None
    return pattern


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

    def __repr__(self) -> str:
        return _short_repr(self)

    def selects(self, block: int, num_blocks: int) -> bool:
        head = max(self.first, math.ceil(self.first_fraction * num_blocks - 1e-9))
        tail = max(self.last, math.ceil(self.last_fraction * num_blocks - 1e-9))
        return block < head or block >= num_blocks - tail


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    """``recipe`` for layers whose path fullmatches ``pattern`` (and whose kind is ``kind``,
    whose block is selected by ``depth``, and which are in no block when ``outside_blocks``,
    where given). ``kind`` is a Flax layer class name, in any case (``"Dense"`` and
    ``"dense"`` are the same kind). ``required=False``: a rule that some models have no
    layer for (it is not warned about when it matches nothing)."""

    recipe: str | Recipe
    pattern: str = ".*"
    kind: str | None = None
    depth: Depth | None = None
    outside_blocks: bool = False
    required: bool = True
    name: str = ""

    def __post_init__(self):
        object.__setattr__(self, "recipe", get_recipe(self.recipe))
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"rule pattern {self.pattern!r} is not a valid regex: {e}") from None
        if self.kind is not None:
            kind = str(self.kind).lower()
            if kind not in LAYER_KINDS:
                raise ValueError(f"rule kind={self.kind!r} is not a layer kind; use one of "
                                 f"{', '.join(LAYER_KINDS)} (any case)")
            object.__setattr__(self, "kind", kind)
        if self.depth is not None and self.outside_blocks:
            raise ValueError("a rule selects blocks by depth or layers outside the blocks, "
                             "not both")

    def __repr__(self) -> str:
        return _short_repr(self)

    def label(self) -> str:
        if self.name:
            return self.name
        parts = [f"/{self.pattern}/"]
        if self.kind:
            parts.append(f"kind={self.kind}")
        if self.depth:
            parts.append(repr(self.depth).replace("Depth", "depth"))
        if self.outside_blocks:
            parts.append("outside blocks")
        return " ".join(parts)


def _short_repr(obj) -> str:
    """``obj``'s dataclass repr without the fields at their defaults, registered recipes by
    name (a recipe's full repr is pages long: ``Recipe.describe()`` shows it)."""
    from fp4lab.gemm.recipe import RECIPES

    def show(v):
        if isinstance(v, Recipe) and RECIPES.get(v.name) == v:
            return repr(v.name)
        return repr(v)

    fields = [f"{f.name}={show(getattr(obj, f.name))}" for f in dataclasses.fields(obj)
              if f.default is dataclasses.MISSING or getattr(obj, f.name) != f.default]
    return f"{type(obj).__name__}({', '.join(fields)})"


@dataclasses.dataclass(frozen=True)
class Assignment:
    path: str
    kind: str | None
    block: int | None
    recipe: Recipe | None  # None: an intercepted call no op rule quantizes
    rule: int | None  # index of the rule that matched; None = default
    stack: tuple[int, ...] = ()  # blocks stacked for a scan, one recipe for all of them
    compute_dtype: str | None = None  # the dtype W had at the GEMM, where a trace saw it


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    rules: tuple[Rule, ...] = ()
    default: str | Recipe = "bf16"
    block_pattern: str = DEFAULT_BLOCK_PATTERN
    name: str = "custom"

    def __post_init__(self):
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "default", get_recipe(self.default))

    def __repr__(self) -> str:
        return _short_repr(self)

    def block_of(self, path: str) -> int | None:
        m = re.search(self.block_pattern, path)
        return int(m.group(1)) if m else None

    def assign(self, path: str, kind: str | None = None, num_blocks: int | None = None, *,
               stack: tuple[int, ...] = ()) -> Assignment:
        """The one place a GEMM gets its recipe: the first matching rule, else the default.
        An intercepted call (``kind`` an op kind: ``jnp.einsum``, ``lax.dot_general``) takes
        rules of that op kind only, never the default or a layer rule; with none matching its
        recipe is ``None`` (it runs unquantized). A ``lax.ragged_dot`` call (an MoE expert
        stack) is assigned as a layer is. An MoE router (:data:`ROUTER_PATTERN`) is reached
        only by a rule whose pattern is not a catch-all; else its recipe is ``None`` too. A
        layer or call whose path has no block and which runs ``stack`` blocks stacked for a
        scan (one traced body) gets the one recipe the rules give every block, or is refused
        where they differ (depth rules)."""
        if stack and self.block_of(path) is None:
            return self._assign_stacked(path, kind, num_blocks or math.prod(stack),
                                        tuple(stack))
        return self._assign_block(path, kind, num_blocks, self.block_of(path))

    def _assign_block(self, path, kind, num_blocks, block) -> Assignment:
        op = kind in OP_KINDS
        router = kind not in INTERCEPTED_KINDS and is_router(path)  # a layer, not a call
        for i, r in enumerate(self.rules):
            if op and r.kind != kind:  # an intercepted call: rules of its op kind only
                continue
            if router and r.pattern in CATCH_ALL_PATTERNS:
                continue  # a router is reached only by a rule that names it
            if not re.fullmatch(r.pattern, path):
                continue
            if r.kind is not None and r.kind != kind and not (
                    r.kind == EXPERTS and kind in EXPERT_KINDS):
                continue
            if r.outside_blocks and (block is not None or num_blocks is None):
                continue  # (a model without blocks has no outside either)
            if r.depth is not None:
                if block is None:
                    continue
                if num_blocks is None:
                    raise ValueError(f"rule {r.label()} selects by depth; pass num_blocks= "
                                     f"(layer {path!r} is in block {block})")
                if not r.depth.selects(block, num_blocks):
                    continue
            return Assignment(path, kind, block, r.recipe, i)
        return Assignment(path, kind, block, None if op or router else self.default, None)

    def _assign_stacked(self, path, kind, num_blocks, stack) -> Assignment:
        rows = [self._assign_block(path, kind, num_blocks, i) for i in range(math.prod(stack))]
        chosen = [a.recipe for a in rows]
        if len(set(chosen)) > 1:
            per_block = ", ".join(f"{i}: {'-' if r is None else r.name}"
                                  for i, r in enumerate(chosen))
            raise ValueError(f"policy {self.name}: {path} is {len(rows)} blocks stacked for a "
                             f"scan, which run one recipe, but the rules give them different "
                             f"ones ({per_block}); unstack the blocks (a Python loop over "
                             "them instead of nn.scan / nnx.scan; MaxText: scan_layers=False) "
                             "or drop the depth rule (nemotron3(bf16_tail=0))")
        return dataclasses.replace(rows[0], block=None, stack=stack)

    @property
    def uses_blocks(self) -> bool:
        """True when a rule selects by depth or by being outside the blocks: assigning needs
        the model's number of blocks."""
        return any(r.depth is not None or r.outside_blocks for r in self.rules)

    @property
    def governs_ops(self) -> bool:
        """True when a rule names an op kind: calls inside modules are then intercepted."""
        return any(r.kind in OP_KINDS for r in self.rules)

    def with_block(self, block: str) -> PrecisionPolicy:
        """This policy with blocks found by :func:`block_pattern_for` ``(block)``."""
        return dataclasses.replace(self, block_pattern=block_pattern_for(block))

    def infer_num_blocks(self, paths: Iterable[str]) -> int | None:
        blocks = [b for b in (self.block_of(p) for p in paths) if b is not None]
        return max(blocks) + 1 if blocks else None
