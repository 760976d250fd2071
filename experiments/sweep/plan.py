"""The plan: which runs a sweep config asks for, and the config each one trains.

``sweep.seeds`` x ``sweep.sizes`` x ``sweep.variants`` x policies, in that order (seeds
outer), each run with its folder name under ``runs/`` and the variant whose ``bf16`` runs its
gaps are taken against (:class:`Variant`). Pure functions of the config: nothing here trains,
loads data or reads a run's files.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from experiments import policies
from experiments.configs import apply_overrides

__all__ = ["Variant", "PlannedRun", "sweep_seeds", "sweep_variants", "planned_runs",
           "run_name", "run_config"]


def sweep_seeds(config) -> list[int]:
    """``sweep.seeds``: a count ``n`` (seeds ``seed, seed + 1, ...``) or a list of seeds."""
    seeds = config.sweep.get("seeds", 1)
    if isinstance(seeds, bool) or not isinstance(seeds, (int, tuple, list)):
        raise ValueError(f"sweep.seeds={seeds!r}: a count or a list of seeds")
    out = list(range(config.seed, config.seed + seeds)) if isinstance(seeds, int) else \
        list(seeds)
    if not out or len(set(out)) != len(out) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in out):
        raise ValueError(f"sweep.seeds={seeds!r} must give distinct seeds >= 0 (at least one)")
    return out


class Variant(NamedTuple):
    """A point of the sweep's grid besides policy and seed: a model size and/or a set of
    config changes (``sweep.sizes`` x ``sweep.variants``)."""

    name: str  # "" for the plain config; the run folders' parent (runs/<name>/...)
    overrides: dict  # {dotted config key: value}
    policies: tuple[str, ...]  # the policies it runs
    size: str  # the size's name ("" without sweep.sizes)
    base: str  # the variant whose baseline (bf16) run its gaps are relative to
    reference: str | None  # the variant its gaps are compared with (None: it is the first)


_VARIANT_KEYS = ("policies", "baseline_variant", "reference_variant")  # not config keys


def _named_points(entries, what: str, *, size: bool) -> list[tuple[str, dict, dict]]:
    """``(name, overrides, plan keys)`` of the ``sweep.sizes`` or ``sweep.variants`` entries
    (dicts of dotted config keys; in a size, a key without a dot is a ``model`` key; ``name``
    and, in a variant, the plan keys ``policies``, ``baseline_variant`` and
    ``reference_variant`` are not config keys)."""
    out = []
    for k, entry in enumerate(entries):
        if not isinstance(entry, dict) or not entry:
            raise ValueError(f"sweep.{what}[{k}]={entry!r} must be a non-empty dict of config "
                             "keys (and a 'name')")
        entry = dict(entry)
        name = entry.pop("name", None)
        plan = {} if size else {k: entry.pop(k) for k in _VARIANT_KEYS if k in entry}
        overrides = {(f"model.{key}" if size and "." not in key else key): v
                     for key, v in entry.items()}
        if name is None:
            if not size:
                raise ValueError(f"sweep.variants[{k}]={entry!r} needs a 'name'")
            name = "-".join(f"{key.split('.')[-1]}{v}" for key, v in overrides.items())
        if not isinstance(name, str) or run_name(name) != name:
            raise ValueError(f"sweep.{what}[{k}]: name {name!r} must be a folder name "
                             "(letters, digits, '_', '.', '+', '-')")
        if "policies" in plan:
            named = plan["policies"]
            plan["policies"] = (named,) if isinstance(named, str) else tuple(named)
        out.append((name, overrides, plan))
    if len({n for n, _, _ in out}) != len(out):
        raise ValueError(f"sweep.{what} has duplicate names: {[n for n, _, _ in out]}")
    return out


def _earlier(seen: dict, name: str, plan: dict, key: str) -> tuple[str, tuple[str, ...]]:
    """``(full name, policies)`` of the earlier variant (of the same size) that the variant
    ``name``'s plan key ``key`` (``baseline_variant`` / ``reference_variant``) names."""
    if plan[key] not in seen:
        raise ValueError(f"sweep.variants {name!r}: {key}={plan[key]!r} is not an "
                         f"earlier variant (earlier: {list(seen) or 'none'})")
    return seen[plan[key]]


def _size_variants(sizes, i: int, points, default: tuple[str, ...],
                   baseline: str) -> list[Variant]:
    """The variants of the ``i``-th size (``sizes[i]``), in the order of ``points``."""
    size, size_over, _ = sizes[i]
    first, seen, out = None, {}, []
    for j, (name, over, plan) in enumerate(points):
        full = "-".join(n for n in (size, name) if n)
        clash = set(size_over) & set(over)
        if clash:
            raise ValueError(f"sweep.sizes and sweep.variants both set {sorted(clash)}")
        runs = plan.get("policies") or default
        first = first or (full, runs)
        reference = None if i == 0 and j == 0 else (
            first[0] if j else "-".join(n for n in (sizes[0][0], name) if n))
        base = full if baseline in runs else first[0]
        if "baseline_variant" in plan:
            base, base_policies = _earlier(seen, name, plan, "baseline_variant")
            if baseline not in base_policies:
                raise ValueError(f"sweep.variants {name!r}: baseline_variant="
                                 f"{plan['baseline_variant']!r} runs no {baseline!r}")
        if "reference_variant" in plan:
            reference = _earlier(seen, name, plan, "reference_variant")[0]
        seen[name] = (full, runs)
        out.append(Variant(full, {**size_over, **over}, runs, size, base, reference))
    return out


def sweep_variants(config, baseline: str = "bf16") -> list[Variant]:
    """Every size crossed with every variant (sizes outer), with their names joined by
    ``-``; no sizes and no variants: one plain variant named ``""``.

    A variant's gaps are taken against the baseline run of its own point; of the first
    variant of its size when its policies do not include the baseline (none there: no
    gaps); of the variant named by its ``baseline_variant`` key when it has one (a change
    whose cost is the question: an FP8 residual stream, measured against the plain model's
    ``bf16`` runs). A later variant's gaps are compared with the first variant's of its
    size, or with its ``reference_variant``'s, and the first variant of a later size with
    the first size's. Both keys name earlier variants (without the size)."""
    sizes = _named_points(config.sweep.get("sizes", ()), "sizes", size=True) or [("", {}, {})]
    points = _named_points(config.sweep.get("variants", ()), "variants", size=False) or [
        ("", {}, {})]
    default = tuple(config.sweep.policies)
    return [v for i in range(len(sizes))
            for v in _size_variants(sizes, i, points, default, baseline)]


class PlannedRun(NamedTuple):
    policy: str
    seed: int
    variant: Variant
    name: str  # its folder under runs/: [<variant>/]<policy>[-seed<s>]


def planned_runs(config) -> list[PlannedRun]:
    """Every run, in order (seeds outer, then variants, then policies): each policy under
    every seed, or, when ``sweep.seeded_policies`` names some, those under every seed and
    the rest under the first one only. A seeded policy that the sweep does not run selects
    nothing (``sweep.policies`` can be narrowed on the command line), but must be a policy."""
    seeds, every = sweep_seeds(config), tuple(config.sweep.get("seeded_policies", ()))
    variants = sweep_variants(config)
    for name in sorted(set(every) - {p for v in variants for p in v.policies}):
        try:
            policies.get(name)
        except ValueError as e:
            raise ValueError(f"sweep.seeded_policies: {e}") from None
    for v in variants:
        if len({run_name(p) for p in v.policies}) != len(v.policies):
            raise ValueError(f"sweep.policies has duplicates (after making folder names): "
                             f"{list(v.policies)}")
    several = len(seeds) > 1
    return [PlannedRun(p, s, v, "/".join(n for n in (v.name, run_name(
        p, s if several else None)) if n))
            for s in seeds for v in variants for p in v.policies
            if s == seeds[0] or not every or p in every]


def run_name(policy: str, seed: int | None = None) -> str:
    """The run's folder name: the policy name with path characters replaced
    (``file:results/auto/policy.json`` -> ``file_results_auto_policy.json``), and
    ``-seed<s>`` when the sweep has several seeds."""
    name = re.sub(r"[^\w.+-]+", "_", policy).strip("_") or "run"
    return name if seed is None else f"{name}-seed{seed}"


def run_config(config, run: PlannedRun):
    """The config a planned run trains: its variant's changes, policy, seed and name."""
    c = apply_overrides(config.copy_and_resolve_references(),
                        [f"{k}={v!r}" for k, v in run.variant.overrides.items()])
    c.name, c.precision.policy, c.seed = run.name, run.policy, run.seed
    return c
