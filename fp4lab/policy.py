"""Per-layer precision policies: ordered rules from module paths to recipes.

A :class:`Rule` matches a layer by a regex (``fullmatch`` on the "/"-joined module path), an
optional layer kind, an optional depth selector (``Depth(first=2)``,
``Depth(last_fraction=0.15)``) and ``outside_blocks`` (layers in no block: embeddings, heads,
stems); the first matching rule wins, else the policy's default.

A layer's depth is the block index found in its path by ``block_pattern``. The default finds
the ways Flax and common model code name blocks: a path element ``blocks_3``, ``layers_3``,
``layer3``, ``h_3``, Linen's automatic names of block modules (``Block_3``,
``TransformerBlock_3``, ``DecoderLayer_3``), NNX list attributes (``layers/3``, ``h/3``) and
dotted names (``blocks.3``, ``h.3``). :func:`block_pattern_for` builds the pattern for any
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
``nvfp4_paper`` are registered so), :func:`register_policy_family` a parameterised family of
names (a regex and a factory of its match); ``import experiments`` registers the experiments'
names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import warnings
import types
from collections.abc import Callable, Iterable, Mapping

from fp4lab.recipe import Recipe, get_recipe

__all__ = ["Depth", "Rule", "PrecisionPolicy", "Assignment", "ExplainTable", "explain", "PRESETS",
           "get_policy", "nemotron3", "nvfp4_paper", "all_layers", "policy_to_dict",
           "policy_from_dict", "load_policy", "save_policy", "block_pattern_for",
           "PolicyWarning", "LAYER_KINDS", "OP_KINDS", "check_unused", "register_policy",
           "register_policy_family", "known_policies"]

# a path element naming a block (blocks_3, Block_3, TransformerBlock_3, layers/3, h.3, ...)
DEFAULT_BLOCK_PATTERN = (r"(?:^|/)(?:(?:[A-Za-z]\w*?)?(?:[Bb]locks?|[Ll]ayers?)|h)"
                         r"[_./]?(\d+)(?=/|$)")
# the kinds of GEMM a rule can name: fp4lab.flax's Linen and NNX layer classes, lower case,
# and the calls inside modules that fp4lab.flax intercepts (OP_KINDS)
OP_KINDS = ("lax.dot_general", "jnp.einsum")
LAYER_KINDS = ("dense", "densegeneral", "einsum", "linear", "lineargeneral") + OP_KINDS


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
    from fp4lab.recipe import RECIPES

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

    def assign(self, path: str, kind: str | None = None,
               num_blocks: int | None = None, *, block: int | None = None,
               _op: bool = False) -> Assignment:
        """The recipe for one layer (the first matching rule, else the default); ``block``:
        its block where the path does not say (one of the blocks stacked for a scan)."""
        block = self.block_of(path) if block is None else block
        for i, r in enumerate(self.rules):
            if _op and r.kind != kind:  # an intercepted call: rules of its op kind only
                continue
            if not re.fullmatch(r.pattern, path):
                continue
            if r.kind is not None and r.kind != kind:
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
        return Assignment(path, kind, block, self.default, None)

    def assign_stacked(self, path: str, kind: str | None, num_blocks: int | None,
                       stack: tuple[int, ...]) -> Assignment | None:
        """The one recipe of a layer (or call, for an op kind) stacked over ``stack`` blocks
        (scanned blocks: one traced body runs them all), from the rules for each block;
        refused when they differ, as depth rules make them. ``None``: a call no op rule
        quantizes."""
        op = kind in OP_KINDS
        rows = [self.assign(path, kind, num_blocks, block=i, _op=op)
                for i in range(math.prod(stack))]
        chosen = [None if op and a.rule is None else a.recipe for a in rows]
        if len(set(chosen)) > 1:
            per_block = ", ".join(f"{i}: {'-' if r is None else r.name}"
                                  for i, r in enumerate(chosen))
            raise ValueError(f"policy {self.name}: {path} is {len(rows)} blocks stacked for a "
                             f"scan, which run one recipe, but the rules give them different "
                             f"ones ({per_block}); unstack the blocks (a Python loop over "
                             "them instead of nn.scan / nnx.scan; MaxText: scan_layers=False) "
                             "or drop the depth rule (nemotron3(bf16_tail=0))")
        if chosen[0] is None:
            return None
        return dataclasses.replace(rows[0], block=None, stack=tuple(stack))

    @property
    def uses_blocks(self) -> bool:
        """True when a rule selects by depth or by being outside the blocks: assigning needs
        the model's number of blocks."""
        return any(r.depth is not None or r.outside_blocks for r in self.rules)

    @property
    def governs_ops(self) -> bool:
        """True when a rule names an op kind: calls inside modules are then intercepted."""
        return any(r.kind in OP_KINDS for r in self.rules)

    def assign_op(self, path: str, kind: str, num_blocks: int | None = None
                  ) -> Assignment | None:
        """The recipe for an intercepted call (``jnp.einsum``, ``lax.dot_general``) at
        ``path``: only rules of that op kind apply (never the default, never a layer rule);
        ``None`` when none matches (the call runs unquantized)."""
        a = self.assign(path, kind, num_blocks, _op=True)
        return None if a.rule is None else a

    def recipe_for(self, path: str, kind: str | None = None,
                   num_blocks: int | None = None) -> Recipe:
        return self.assign(path, kind, num_blocks).recipe

    def with_block(self, block: str) -> PrecisionPolicy:
        """This policy with blocks found by :func:`block_pattern_for` ``(block)``."""
        return dataclasses.replace(self, block_pattern=block_pattern_for(block))

    def infer_num_blocks(self, paths: Iterable[str]) -> int | None:
        blocks = [b for b in (self.block_of(p) for p in paths) if b is not None]
        return max(blocks) + 1 if blocks else None


class ExplainTable(list):
    """A list of :class:`Assignment` that prints as a table; ``unused`` are the indices of
    the rules that matched no layer."""

    def __init__(self, rows, policy, unused):
        super().__init__(rows)
        self.policy, self.unused = policy, unused

    def __str__(self):
        w = max([len(a.path) for a in self] + [5])
        lines = [f"policy {self.policy.name}: {len(self)} layers",
                 f"{'layer'.ljust(w)}  {'kind':15s}  {'block':>5}  {'recipe':16s}  rule"]
        for a in self:
            rule = "default" if a.rule is None else self.policy.rules[a.rule].label()
            if a.recipe is None:
                rule = "no rule of this op kind: not quantized"
            blk = "-" if a.block is None else str(a.block)
            if a.stack:
                blk = f"0-{math.prod(a.stack) - 1}"
            recipe = "-" if a.recipe is None else a.recipe.name
            lines.append(f"{a.path.ljust(w)}  {a.kind or '-':15s}  {blk:>5}  "
                         f"{recipe:16s}  {rule}")
        for i in self.unused:
            r = self.policy.rules[i]
            what = "UNUSED rule" if r.required else "unused optional rule"
            lines.append(f"{what} {i}: {r.label()}")
        recipes = list({a.recipe.name: a.recipe for a in self if a.recipe is not None}.values())
        if recipes:
            lines.append("recipes, operand by operand:")
        for r in recipes:
            lines += _recipe_lines(r)
        return "\n".join(lines)


def _recipe_lines(r: Recipe) -> list[str]:
    """The six operands of ``r`` (the two forward ones for QAT) and what it does besides."""
    lines = [f"  {r.name}" + (f" ({r.follows})" if r.follows else "")]
    for name, op in r.operands.items():
        if name in r.quantized_operands:
            lines.append(f"    {name:9s} {op.describe()}")
        else:
            lines.append(f"    {name:9s} straight through (QAT)")
    extra = [t for t, on in (("trust mask on the forward's gradient", r.trust),
                             (r.saved_x.describe() if r.saved_x else "", bool(r.saved_x)),
                             ("delayed scaling", r.delayed is not None),
                             ("sign vectors redrawn every call",
                              "random" in (r.signs(o) for o in r.operands.values()))) if on]
    if extra:
        lines.append(f"    {'besides':9s} {'; '.join(extra)}")
    return lines


def check_unused(policy: PrecisionPolicy, assignments, *, strict: bool = False,
                 stacklevel: int = 2, none_found: str = "") -> list[int]:
    """The indices of ``policy``'s rules that no assignment used; warn (:class:`PolicyWarning`)
    about the required ones, and about a policy that governed nothing at all (no
    ``assignments``; ``none_found`` says why that can be), or raise ``ValueError`` with
    ``strict=True``. The message names each rule and, when no layer was in a block, says how
    to name the blocks."""
    assignments = list(assignments)
    used = {a.rule for a in assignments}
    unused = [i for i in range(len(policy.rules)) if i not in used]
    missing = [policy.rules[i] for i in unused if policy.rules[i].required]
    problems = [] if assignments else [f"it found no GEMM to govern in this model{none_found}"]
    if missing:
        names = ", ".join(repr(r.label()) for r in missing)
        problems.append(f"rules matched no layer: {names}")
        if any(r.depth or r.outside_blocks for r in missing) and not any(
                a.block is not None or a.stack for a in assignments):
            problems.append("no layer path has a block index (e.g. blocks_3/..., Block_3/..., "
                            "layers/3/...): pass block='<the block module name>' to "
                            "quantize_model or explain")
    if problems:
        msg = f"policy {policy.name}: " + "; ".join(problems)
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, PolicyWarning, stacklevel=stacklevel + 1)
    return unused


def _assign_any(policy: PrecisionPolicy, path: str, kind, num_blocks) -> Assignment:
    """A layer's assignment, or an intercepted call's (``recipe=None``: not quantized)."""
    if kind in OP_KINDS:
        a = policy.assign_op(path, kind, num_blocks)
        return a or Assignment(path, kind, policy.block_of(path), None, None)
    return policy.assign(path, kind, num_blocks)


def explain(policy: PrecisionPolicy, layers, *, num_blocks: int | None = None,
            strict: bool = False, block: str | None = None) -> ExplainTable:
    """Resolve ``policy`` over ``layers`` and return the assignments (print it for a table).

    ``layers``: an iterable of paths or ``(path, kind)`` pairs (for a model,
    :func:`fp4lab.flax.explain` finds them). ``num_blocks`` defaults to one more than the
    largest block index found in the paths; ``block`` names the block modules when the
    default pattern does not find them (:func:`block_pattern_for`). ``strict=True``: a
    required rule that matched nothing is an error (otherwise it is listed as UNUSED).
    """
    if block is not None:
        policy = policy.with_block(block)
    if isinstance(layers, (str, dict)) or not isinstance(layers, Iterable):
        raise TypeError(f"explain takes layer paths or (path, kind) pairs, not "
                        f"{type(layers).__name__}: for a Flax model use "
                        "fp4lab.flax.explain(policy, model)")
    layers = list(layers)
    bad = [v for v in layers if not isinstance(v, (str, tuple, list))]
    if bad:
        raise TypeError(f"explain takes layer paths or (path, kind) pairs, not "
                        f"{type(bad[0]).__name__}: for a Flax model use "
                        "fp4lab.flax.explain(policy, model)")
    pairs = [(p, None) if isinstance(p, str) else tuple(p) for p in layers]
    if num_blocks is None:
        num_blocks = policy.infer_num_blocks(p for p, _ in pairs)
    rows = [_assign_any(policy, p, k, num_blocks) for p, k in pairs]
    used = {a.rule for a in rows}
    unused = [i for i in range(len(policy.rules)) if i not in used]
    if strict:
        check_unused(policy, rows, strict=True)
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
    ``bf16_tail=0`` give the ablations without those rules.

    Layers are recognised by name in any case (``embed``, ``lm_head``, ``head``, ``output``,
    ``mtp``; any path element containing ``attn``/``attention``, as Linen's
    ``SelfAttention_0`` and ``MultiHeadDotProductAttention_0`` do) and by structure: every
    layer in no block (an auto-named ``Dense_0`` head after ``Block_0 ... Block_7``) is an
    embedding, head or MTP layer and stays in BF16."""
    rules = [Rule(name="outside the blocks (embeddings, head, MTP)", recipe="bf16",
                  outside_blocks=True),
             Rule(name="embeddings/head/MTP by name", recipe="bf16", required=False,
                  pattern=r"(?i)(?:.*/)?(?:embed\w*|lm_head|head|output|unembed\w*|mtp\w*|"
                          r"logits?)(?:_\d+)?(?:/.*)?")]
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


# ----------------------------------------------------------------------------- the policy names
#
# One parser (get_policy) and one registry of names. A fixed name maps to a factory that takes
# no arguments; a family is a regex fullmatched on the name plus a factory of the match (for
# parameterised names such as experiments' <recipe>_bf16_last<k>). The library's presets are
# registered below; experiments/ registers its own names when ``experiments`` is imported.

_NAMES: dict[str, Callable[[], PrecisionPolicy]] = {}
_FAMILIES: dict[str, tuple[re.Pattern, Callable[[re.Match], PrecisionPolicy | None], str]] = {}

# the registered fixed names and their factories (read-only: add with register_policy)
PRESETS: Mapping[str, Callable[[], PrecisionPolicy]] = types.MappingProxyType(_NAMES)


def register_policy(name: str, factory: Callable[[], PrecisionPolicy]) -> None:
    """Make ``get_policy(name)`` return ``factory()``, renamed ``name``.

    ``name`` must not hold ``:`` (``all:`` and ``file:`` are prefixes) nor be a recipe's name
    (a recipe name means every layer in that recipe). Registering a name again with the same
    factory does nothing; with a different factory it is an error (two meanings for one
    name)."""
    from fp4lab.recipe import RECIPES

    if not isinstance(name, str) or not name or name != name.strip() or ":" in name:
        raise ValueError(f"policy name {name!r} must be a non-empty string without ':' or "
                         "surrounding spaces")
    if name in RECIPES:
        raise ValueError(f"policy name {name!r} is a recipe's name, which already means "
                         "every layer in that recipe")
    if not callable(factory):
        raise TypeError(f"the factory of policy {name!r} must be callable, not "
                        f"{type(factory).__name__}")
    if _NAMES.get(name, factory) is not factory:
        raise ValueError(f"policy {name!r} is already registered (factory "
                         f"{_describe(_NAMES[name])}); a second factory "
                         f"({_describe(factory)}) would give one name two meanings")
    _NAMES[name] = factory


def register_policy_family(pattern: str, factory: Callable[[re.Match], PrecisionPolicy | None],
                           *, label: str) -> None:
    """Make every name that ``pattern`` fullmatches a policy: ``get_policy(name)`` returns
    ``factory(match)``, renamed ``name``; a factory returning ``None`` says the match names no
    policy (an unknown recipe, ``k=0``), and the name stays unknown. ``label`` shows the
    family in the list of known policies (``"<recipe>_bf16_last<k>"``).

    Fixed names (:func:`register_policy`), recipe names and the ``all:``/``file:`` prefixes
    come first; families are tried in the order they were registered. Registering a pattern
    again with the same factory does nothing; with a different factory it is an error."""
    try:
        compiled = re.compile(pattern)
    except (re.error, TypeError) as e:
        raise ValueError(f"policy family pattern {pattern!r} is not a valid regex: {e}") from None
    if not callable(factory):
        raise TypeError(f"the factory of policy family {label!r} must be callable, not "
                        f"{type(factory).__name__}")
    if pattern in _FAMILIES and _FAMILIES[pattern][1] is not factory:
        raise ValueError(f"policy family {pattern!r} ({_FAMILIES[pattern][2]}) is already "
                         f"registered with another factory ({_describe(_FAMILIES[pattern][1])})")
    _FAMILIES[pattern] = (compiled, factory, label)


def _describe(factory) -> str:
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', factory)}"


def known_policies() -> str:
    """What :func:`get_policy` accepts, as one line (for error messages and help texts)."""
    from fp4lab.recipe import RECIPES

    parts = [f"names {', '.join(_NAMES)}"] if _NAMES else []
    if _FAMILIES:
        parts.append(f"families {', '.join(label for _, _, label in _FAMILIES.values())}")
    parts += [f"a recipe for every layer ({', '.join(RECIPES)}) or all:<recipe>",
              "file:<policy.json>", "a PrecisionPolicy or Recipe"]
    return "; ".join(parts)


def get_policy(name: str | PrecisionPolicy | Recipe) -> PrecisionPolicy:
    """The one parser of policies; in this order:

    * a :class:`PrecisionPolicy`: itself;
    * a :class:`Recipe`, a recipe's name (``"nvfp4"``) or ``all:<recipe>``: every layer in
      that recipe (:func:`all_layers`);
    * ``file:<path.json>``: the policy in that file (:func:`load_policy`; what
      ``experiments.auto_assign`` and :func:`save_policy` write);
    * a registered name (:func:`register_policy`: the presets ``nemotron3`` and
      ``nvfp4_paper``; ``import experiments`` adds the experiments' names), then a name of a
      registered family (:func:`register_policy_family`: ``import experiments`` adds
      ``<recipe>_bf16_first<k>`` / ``_last<k>``); the policy carries the name it was asked by.

    Anything else is a ``ValueError`` that lists what is known."""
    from fp4lab.recipe import RECIPES

    if isinstance(name, PrecisionPolicy):
        return name
    if isinstance(name, Recipe):
        return all_layers(name)
    if isinstance(name, str):
        if name.startswith("all:"):
            return all_layers(name[4:])
        if name.startswith("file:"):
            return load_policy(name[5:])
        if name in _NAMES:
            return _named(_NAMES[name](), name)
        if name in RECIPES:
            return all_layers(name)
        for compiled, factory, _ in _FAMILIES.values():
            m = compiled.fullmatch(name)
            policy = factory(m) if m else None
            if policy is not None:
                return _named(policy, name)
    raise ValueError(f"unknown policy {name!r}; known: {known_policies()}")


def _named(policy, name: str) -> PrecisionPolicy:
    if not isinstance(policy, PrecisionPolicy):
        raise TypeError(f"the factory of policy {name!r} returned {type(policy).__name__}, "
                        "not a PrecisionPolicy")
    return policy if policy.name == name else dataclasses.replace(policy, name=name)


register_policy("nemotron3", nemotron3)
register_policy("nvfp4_paper", nvfp4_paper)


def load_policy(path) -> PrecisionPolicy:
    """The policy in a JSON file written by :func:`save_policy` (or
    ``experiments.auto_assign``); every key is checked (:func:`policy_from_dict`), and an
    error names the file."""
    import json
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"policy file {str(path)!r} " + (
            "is a folder, not a file" if path.is_dir() else "does not exist"))
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"policy file {str(path)!r} is not JSON: {e}") from None
    try:
        return policy_from_dict(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"policy file {str(path)!r}: {e}") from None


def save_policy(policy: PrecisionPolicy, path) -> None:
    """Write ``policy`` as JSON (atomically: a reader sees the old file or the new one)."""
    import json
    import os
    from pathlib import Path

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(policy_to_dict(policy), indent=1) + "\n")
    os.replace(tmp, path)


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
                       "name": r.name, "outside_blocks": r.outside_blocks,
                       "required": r.required,
                       "depth": dataclasses.asdict(r.depth) if r.depth else None}
                      for r in policy.rules]}


# the keys of a policy file, of each rule and of a rule's depth: name -> (accepted types,
# required). Anything else is an error naming the key: a misspelt "pattern" would otherwise
# leave a rule that matches every layer, a misspelt "default" a BF16 default.
_POLICY_KEYS = {"rules": (list, False), "default": (str, True), "block_pattern": (str, False),
                "name": (str, False)}
_RULE_KEYS = {"recipe": (str, True), "pattern": (str, False), "kind": ((str, type(None)), False),
              "name": (str, False), "outside_blocks": (bool, False), "required": (bool, False),
              "depth": ((dict, type(None)), False)}
_DEPTH_KEYS = {f.name: ((int, float) if "fraction" in f.name else int, False)
               for f in dataclasses.fields(Depth)}


def _checked(d, keys: dict, where: str) -> dict:
    """``d`` (a JSON object) after checking its keys and the types of their values against
    ``keys``; the error names ``where``, the key and the known keys."""
    if not isinstance(d, dict):
        raise TypeError(f"{where} must be a JSON object, not {type(d).__name__} ({d!r:.60})")
    unknown = [k for k in d if k not in keys]
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(keys)}")
    missing = [k for k, (_, required) in keys.items() if required and k not in d]
    if missing:
        raise ValueError(f"{where}: missing key {missing[0]!r}")
    for k, v in d.items():
        types = keys[k][0]
        # bool is an int in Python: a depth of `true` blocks must not pass as 1
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in (
                types if isinstance(types, tuple) else (types,))):
            raise TypeError(f"{where}: {k}={v!r} must be {_type_names(types)}")
    return d


def _type_names(types) -> str:
    names = {"str": "a string", "list": "a list", "bool": "true or false", "int": "an integer",
             "float": "a number", "dict": "an object", "NoneType": "null"}
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(names[t.__name__] for t in types)


def policy_from_dict(d: dict) -> PrecisionPolicy:
    """The inverse of :func:`policy_to_dict`. Every key is checked, at every level: an
    unknown or misspelt key, a missing ``default`` or ``recipe``, or a value of the wrong type
    is an error naming it (never a silently different policy)."""
    _checked(d, _POLICY_KEYS, "policy")
    rules = []
    for i, r in enumerate(d.get("rules", ())):
        where = f"policy rule {i}"
        r = _checked(r, _RULE_KEYS, where)
        depth = r.get("depth")
        with _located(where):
            if depth is not None:
                depth = Depth(**_checked(depth, _DEPTH_KEYS, f"{where} depth"))
            rules.append(Rule(**{**r, "depth": depth}))
    with _located("policy: default"):
        default = get_recipe(d["default"])
    with _located("policy"):
        return PrecisionPolicy(rules=tuple(rules), default=default,
                               block_pattern=d.get("block_pattern", DEFAULT_BLOCK_PATTERN),
                               name=d.get("name", "custom"))


@contextlib.contextmanager
def _located(where: str):
    """Prefix ``where`` to a ValueError raised inside (once: inner errors already say it)."""
    try:
        yield
    except ValueError as e:
        if str(e).startswith(where):
            raise
        raise ValueError(f"{where}: {e}") from None
