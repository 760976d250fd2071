"""The explain table: a policy resolved over a model's layers, each recipe described once
(:meth:`fp4lab.gemm.recipe.Recipe.notes`), and the rules that matched nothing."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

from fp4lab.policy.rules import OP_KINDS, PolicyWarning, PrecisionPolicy
from fp4lab.gemm.recipe import Recipe

__all__ = ["ExplainTable", "explain", "check_unused", "param_layers"]


class ExplainTable(list):
    """A list of :class:`Assignment` that prints as a table; ``unused`` are the indices of
    the rules that matched no layer."""

    def __init__(self, rows, policy, unused):
        super().__init__(rows)
        self.policy, self.unused = policy, unused

    def __str__(self):
        w = max([len(a.path) for a in self] + [5])
        names = [_recipe_label(a.recipe) for a in self]
        rw = max([len(n) for n in names] + [16])
        kw = max([len(a.kind or "-") for a in self] + [15])
        lines = [f"policy {self.policy.name}: {len(self)} layers",
                 f"{'layer'.ljust(w)}  {'kind'.ljust(kw)}  {'block':>5}  "
                 f"{'recipe'.ljust(rw)}  rule"]
        for a, name in zip(self, names, strict=True):
            rule = "default" if a.rule is None else self.policy.rules[a.rule].label()
            if a.recipe is None:
                rule = ("no rule of this op kind: not quantized" if a.kind in OP_KINDS else
                        "a router: not quantized unless a rule names it")
            blk = "-" if a.block is None else str(a.block)
            if a.stack:
                blk = f"0-{math.prod(a.stack) - 1}"
            lines.append(f"{a.path.ljust(w)}  {(a.kind or '-').ljust(kw)}  {blk:>5}  "
                         f"{name.ljust(rw)}  {rule}")
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


def _recipe_label(r: Recipe | None) -> str:
    """A row's recipe: its name, marked where the layer splits K (OutControl)."""
    if r is None:
        return "-"
    return r.name + (" (splits K)" if r.outliers else "")


def _recipe_lines(r: Recipe) -> list[str]:
    """The six operands of ``r`` (the two forward ones for QAT) and what it does besides."""
    lines = [f"  {r.name}" + (f" ({r.follows})" if r.follows else "")]
    for name, op in r.operands.items():
        if name in r.quantized_operands:
            lines.append(f"    {name:9s} {op.describe()}")
        else:
            lines.append(f"    {name:9s} straight through (QAT)")
    if r.notes():
        lines.append(f"    {'besides':9s} {'; '.join(r.notes())}")
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
    rows = [policy.assign(p, k, num_blocks) for p, k in pairs]
    used = {a.rule for a in rows}
    unused = [i for i in range(len(policy.rules)) if i not in used]
    if strict:
        check_unused(policy, rows, strict=True)
    return ExplainTable(rows, policy, unused)


def param_layers(variables) -> list[tuple[str, None]]:
    """``(path, None)`` for every sub-dict of a parameter tree (Linen variables, with their
    ``"params"`` or without; an NNX model's pure dict) holding a ``kernel`` of rank >= 2: the
    linear layers a policy governs, without their kinds (the module types are not in the
    parameters: ``QuantizedLinen.layers`` and ``fp4lab.flax.linear_layers`` find them)."""
    params = variables.get("params", variables)
    out = []

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                if "kernel" in v and getattr(v["kernel"], "ndim", 0) >= 2:
                    out.append(("/".join(prefix + [k]), None))
                walk(v, prefix + [k])

    walk(params, [])
    return out
