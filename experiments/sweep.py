"""Sweep driver: the same model and data under a list of precision policies, seeds, sizes and
variants.

    python -m experiments.sweep [--config sweep] [--out results/sweep] [key=value ...]

For every policy in ``sweep.policies`` and seed in ``sweep.seeds`` it trains one run in
``<out>/runs/<policy>[-seed<s>]/`` (see ``experiments.train``). ``sweep.sizes`` (dicts of
``model`` keys, e.g. ``{"name": "d128", "d_model": 128}``) crossed with ``sweep.variants``
(dicts of dotted config keys with a ``name`` and optionally their own ``policies``, e.g.
``{"name": "late10", "train.bf16_last_fraction": 0.1, "policies": ("nvfp4",)}``) repeat the
grid per point, in ``<out>/runs/<size>-<variant>/``; gaps are taken against the ``bf16``
run of the same point (of the first variant of its size when the point runs no ``bf16``, of
the variant a ``baseline_variant`` key names when the variant's own change is what costs:
``{"name": "fp8res", "model.residual_format": "e4m3", "baseline_variant": "base"}``).
From every run's ``result.json`` it then writes:

* ``results.csv`` and ``results.md``: per policy (and point) the final train and validation
  loss, the validation gap to ``bf16`` in % paired by seed with its 95 % interval, tokens/s
  and its ratio to ``bf16``, mean underflow per layer kind; with variants, also
  ``differences.csv`` and a second table in ``results.md``: how each policy's gap changes
  from the first variant (or size) to the others, paired by seed, with its interval;
* ``loss_curves.png``, ``loss_gap_curves.png`` (relative to ``bf16`` over the steps, the
  seeds' range as a band), ``gap_intervals.png``, ``gap_vs_size.png`` (with sizes);
* ``underflow_heatmap.png`` and ``sqnr_heatmap.png``: layer x GEMM-operand maps, one panel per
  policy (mean over the probe steps and seeds; grey: the operand is not quantized).

This module owns the plan, the loop over it and the reports; every file is written
atomically (``experiments.records.write_atomic``). Before any run trains, the whole plan is
checked (:func:`check_plan`: every run's config, policy and data), so that a mistake in the
last run fails at once. Each run's result is written when it finishes; rerunning the command
skips finished runs (and resumes an interrupted one from its checkpoint), but only those
trained with the same config and under a policy that says the same (its ``config.json``
holds the policy's rules and their hash): after a ``file:`` policy is edited, its runs are
refused, not reported under the new content. A run that fails is recorded with status
``failed`` and its error, and the sweep goes on (``--retry-failed`` runs it again).

Beyond one machine: ``--shard i/n`` runs only the planned runs whose index is ``i`` modulo
``n`` into the shared ``--out`` folder (a job array or several hosts; every run folder
belongs to exactly one shard, and results are written atomically), and ``--report`` merges
what exists into the reports, listing runs without a result as ``missing``; once every shard
has finished, the merged report equals a sequential sweep's.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
import sys
import traceback
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from experiments import policies
from experiments.cli import command
from experiments.configs import apply_overrides
from experiments.data import TextData, load_data
from experiments.probes import KIND_ORDER, layer_order
from experiments.records import read_jsonl, write_atomic, write_json_atomic
from experiments.stats import gap_difference, paired_gap
from experiments.step import model_config
from experiments.train import (check_config, check_data, config_record, describe_changes,
                               resolve_policy, stored_changes, train)

__all__ = ["run_sweep", "check_plan", "collect_results", "planned_runs", "sweep_variants",
           "results_table", "difference_table", "comparison_table", "write_reports", "main"]


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
            policies = plan["policies"]
            plan["policies"] = (policies,) if isinstance(policies, str) else tuple(policies)
        out.append((name, overrides, plan))
    if len({n for n, _, _ in out}) != len(out):
        raise ValueError(f"sweep.{what} has duplicate names: {[n for n, _, _ in out]}")
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
    out = []
    for i, (size, size_over) in enumerate((s, o) for s, o, _ in sizes):
        first, seen = None, {}

        def earlier(name, plan, key):
            if plan[key] not in seen:
                raise ValueError(f"sweep.variants {name!r}: {key}={plan[key]!r} is not an "
                                 f"earlier variant (earlier: {list(seen) or 'none'})")
            return seen[plan[key]]

        for j, (name, over, plan) in enumerate(points):
            full = "-".join(n for n in (size, name) if n)
            clash = set(size_over) & set(over)
            if clash:
                raise ValueError(f"sweep.sizes and sweep.variants both set {sorted(clash)}")
            policies = plan.get("policies") or default
            first = first or (full, policies)
            reference = None if i == 0 and j == 0 else (
                first[0] if j else "-".join(n for n in (sizes[0][0], name) if n))
            base = full if baseline in policies else first[0]
            if "baseline_variant" in plan:
                base, base_policies = earlier(name, plan, "baseline_variant")
                if baseline not in base_policies:
                    raise ValueError(f"sweep.variants {name!r}: baseline_variant="
                                     f"{plan['baseline_variant']!r} runs no {baseline!r}")
            if "reference_variant" in plan:
                reference = earlier(name, plan, "reference_variant")[0]
            seen[name] = (full, policies)
            out.append(Variant(full, {**size_over, **over}, policies, size, base, reference))
    return out


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


def _identity(run: PlannedRun) -> dict:
    """What a result carries of its place in the plan (the reports group and pair by it)."""
    v = run.variant
    return {"name": run.name, "policy": run.policy, "seed": run.seed, "variant": v.name,
            "size": v.size, "base_variant": v.base, "reference_variant": v.reference}


def _read_result(done: Path, run: PlannedRun) -> dict:
    return {**json.loads(done.read_text()), **_identity(run)}


def run_config(config, run: PlannedRun):
    """The config a planned run trains: its variant's changes, policy, seed and name."""
    c = apply_overrides(config.copy_and_resolve_references(),
                        [f"{k}={v!r}" for k, v in run.variant.overrides.items()])
    c.name, c.precision.policy, c.seed = run.name, run.policy, run.seed
    return c


def check_plan(config, runs: list[PlannedRun], runs_dir: Path) -> dict[str, TextData]:
    """Check every run of the plan before any trains (a mistake fails now, not after hours
    of earlier runs): its config, its policy, its data (loaded once per ``data`` section),
    the devices, and the run stored in its folder, which is reused or resumed only if it was
    trained with the same config and a policy that says the same (its hash). Returns each
    run's data, by run name."""
    named = {r.policy for r in runs}
    for pair in config.sweep.get("compare", ()):
        if len(pair) != 2 or not set(pair) <= named:
            raise ValueError(f"sweep.compare entry {pair!r} must be a pair of policies the "
                             f"sweep runs ({', '.join(sorted(named))})")
    loaded, data = {}, {}
    for run in runs:
        c = run_config(config, run)  # a variant's unknown key fails here
        try:
            check_config(c)
            policy = resolve_policy(c)
            key = json.dumps(c.data.to_dict(), sort_keys=True, default=str)
            if key not in loaded:
                loaded[key] = load_data(c.data)
            data[run.name] = loaded[key]
            check_data(c, data[run.name], jax.device_count())
            model_config(c, data[run.name])  # the model section
        except ValueError as e:
            raise ValueError(f"sweep run {run.name!r}: {e}") from e
        record = config_record(c, data[run.name], policy)
        changes = stored_changes(runs_dir / run.name, record, data[run.name])
        if changes:
            raise ValueError(f"{runs_dir / run.name} holds {describe_changes(changes, run.policy)}"
                             ": its results are not this sweep's. Use another --out, or "
                             "remove that folder to train the run again")
    return data


def _run_one(config, run: PlannedRun, runs_dir: Path, data: TextData, retry_failed: bool,
             progress: bool) -> dict:
    workdir = runs_dir / run.name
    done = workdir / "result.json"
    if done.exists():
        result = _read_result(done, run)
        if result["status"] == "ok" or not retry_failed:
            return result
    try:
        return {**train(run_config(config, run), workdir, data=data, progress=progress),
                **_identity(run)}
    except KeyboardInterrupt:
        raise
    except Exception as e:  # recorded, and the sweep goes on
        workdir.mkdir(parents=True, exist_ok=True)
        result = {**_identity(run), "status": "failed", "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc(limit=8)}
        write_json_atomic(done, result)
        print(f"run {run.name} FAILED: {result['error']}")
        return result


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)``: shard ``i`` of ``n``, counted from 0 (``0 <= i < n``)."""
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r} must look like I/N (shard I of N, counted from "
                         "0), e.g. 0/4") from None
    if n < 1:
        raise ValueError(f"--shard {text!r}: the number of shards must be >= 1")
    if not 0 <= i < n:
        raise ValueError(f"--shard {text!r}: the shard index must be in 0..{n - 1} (shards "
                         f"are counted from 0: {', '.join(f'{k}/{n}' for k in range(min(n, 3)))}"
                         f"{', ...' if n > 3 else ''})")
    return i, n


def run_sweep(config, out: str | Path, *, retry_failed: bool = False, progress: bool = True,
              shard: tuple[int, int] | None = None) -> list[dict]:
    """Train every planned run (skipping finished ones), write the reports, and return the
    results in sweep order. ``shard=(i, n)``: only the runs whose index in the plan is
    ``i`` modulo ``n`` (jobs of an array, or hosts, sharing ``out``: each run folder belongs
    to one shard), and no reports: :func:`collect_results` and :func:`write_reports` merge
    what exists (``--report``)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"the sweep's output {str(out)!r} is a file, not a folder")
    runs, runs_dir = planned_runs(config), out / "runs"
    data = check_plan(config, runs, runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    if not config.get("compile_cache"):  # the seeds of a policy compile one program
        config = config.copy_and_resolve_references()
        config.compile_cache = str(out / "compile_cache")
    if shard is not None:
        runs = [r for k, r in enumerate(runs) if k % shard[1] == shard[0]]
    results = [_run_one(config, r, runs_dir, data[r.name], retry_failed, progress)
               for r in runs]
    if shard is None:
        write_reports(results, out, config.sweep.get("compare", ()))
    return results


def collect_results(config, out: str | Path) -> list[dict]:
    """The result of every planned run found under ``out/runs``, in sweep order; a run with
    no result yet has status ``missing``."""
    results = []
    for run in planned_runs(config):
        done = Path(out) / "runs" / run.name / "result.json"
        results.append(_read_result(done, run) if done.exists() else {
            **_identity(run), "status": "missing", "error": "no result yet"})
    return results


# ----------------------------------------------------------------------------- reports


def _groups(results: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """The results grouped by (variant, policy), in sweep order (the seeds of a policy
    together)."""
    out: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        out.setdefault((r.get("variant", ""), r["policy"]), []).append(r)
    return out


def _label(key: tuple[str, str]) -> str:
    """``policy`` or ``policy @ variant``."""
    return f"{key[1]} @ {key[0]}" if key[0] else key[1]


def _base_key(key: tuple[str, str], runs: list[dict], baseline: str) -> tuple[str, str]:
    """The (variant, policy) of the baseline runs the group's gaps are relative to."""
    return (runs[0].get("base_variant") or key[0], baseline)


def _ok(runs: list[dict]) -> list[dict]:
    return [r for r in runs if r["status"] == "ok"]


def _val_by_seed(runs: list[dict]) -> dict[int, float]:
    """The final validation loss of each finished run, keyed by its seed."""
    return {r.get("seed", 0): r["val_loss"] for r in _ok(runs)}


def _kinds(results: list[dict]) -> list[str]:
    found = {k for r in results for k in r.get("underflow_by_kind", {})}
    return [k for k in KIND_ORDER if k in found] + sorted(found - set(KIND_ORDER))


def _fmt(v, n):
    return (round(v, n) if n else round(v)) if math.isfinite(v) else ""


def _policy_row(runs: list[dict], base: list[dict], kinds: list[str],
                is_base: bool = False) -> list:
    """One policy's row: means over its seeds, the spread, and the gap to the baseline
    paired by seed with its 95 % interval (experiments.stats)."""
    by_seed = _val_by_seed(runs)
    gap = paired_gap(by_seed, _val_by_seed(base))
    if is_base:
        gap = gap._replace(low=math.nan, high=math.nan)  # the baseline itself: no interval
    speed = (np.mean([r["tokens_per_s"] for r in runs]) /
             np.mean([r["tokens_per_s"] for r in base])) if base else math.nan
    val = np.array(list(by_seed.values()))
    sd = float(val.std(ddof=1)) if val.size > 1 else math.nan
    under = [100 * np.mean([r.get("underflow_by_kind", {}).get(k, math.nan) for r in runs])
             for k in kinds]
    ci = f"[{gap.low:.2f}, {gap.high:.2f}]" if math.isfinite(gap.low) else ""
    differs = {True: "yes", False: "no", None: ""}[gap.distinguishable]
    return ([runs[0]["policy"], "ok", _fmt(np.mean([r["final_train_loss"] for r in runs]), 4),
             _fmt(float(val.mean()), 4), _fmt(gap.mean, 2),
             _fmt(np.mean([r["tokens_per_s"] for r in runs]), 0), _fmt(speed, 2),
             len(runs), _fmt(sd, 4), ci, differs] + [_fmt(u, 2) for u in under])


def _has_variants(results: list[dict]) -> bool:
    return any(r.get("variant") for r in results)


def results_table(results: list[dict], baseline: str = "bf16") -> tuple[list[str], list[list]]:
    """Header and rows of the results table, one row per policy (and variant, in a sweep
    with variants: a first column then names it; means over its seeds; a failed run gets
    its own row), values rounded for reading. Gaps and speeds are relative to the
    baseline runs of the group's ``base_variant`` (its own variant by default)."""
    groups = _groups(results)
    kinds = _kinds(results)
    variants = _has_variants(results)
    header = (["policy", "status", "train loss", "val loss", f"val gap vs {baseline} %",
               "tokens/s", f"speed vs {baseline}", "seeds", "val loss sd",
               "gap 95% CI", "gap != 0"] + [f"underflow % {k}" for k in kinds])
    rows = []
    for key, runs in groups.items():
        lead = [key[0]] if variants else []
        for r in runs:
            if r["status"] != "ok":
                rows.append(lead + [r["policy"] if "seed" not in r or len(runs) == 1 else
                                    f"{r['policy']} (seed {r['seed']})",
                                    f"{r['status']}: {r.get('error', '')[:60]}"] +
                            [""] * (len(header) - 2))
        ok = _ok(runs)
        if ok:
            base_key = _base_key(key, runs, baseline)
            rows.append(lead + _policy_row(ok, _ok(groups.get(base_key, [])), kinds,
                                           is_base=base_key == key))
    return (["variant"] if variants else []) + header, rows


def difference_table(results: list[dict], baseline: str = "bf16") -> tuple[list[str],
                                                                           list[list]]:
    """How a policy's gap to the baseline changes between variants (a later size, the late
    BF16 switch, another optimizer): per policy and variant with a ``reference_variant``,
    the gap there minus the gap in the reference, paired by seed over the seeds all four
    runs have, with its 95 % interval (:func:`experiments.stats.gap_difference`). Empty
    without variants."""
    groups = _groups(results)
    header = ["policy", "variant", "vs variant", "gap %", "gap there %", "difference %",
              "difference 95% CI", "difference != 0", "seeds"]
    rows = []
    for (variant, policy), runs in groups.items():
        ref = runs[0].get("reference_variant")
        if (_base_key((variant, policy), runs, baseline) == (variant, policy) or ref is None
                or (ref, policy) not in groups):
            continue
        there = groups[(ref, policy)]
        d = gap_difference(
            _val_by_seed(runs), _val_by_seed(groups.get(_base_key((variant, policy), runs,
                                                                  baseline), [])),
            _val_by_seed(there), _val_by_seed(groups.get(_base_key((ref, policy), there,
                                                                   baseline), [])))
        if not d.difference.n:
            continue
        ci = (f"[{d.difference.low:.2f}, {d.difference.high:.2f}]"
              if math.isfinite(d.difference.low) else "")
        rows.append([policy, variant, ref, _fmt(d.gap, 2), _fmt(d.gap_there, 2),
                     _fmt(d.difference.mean, 2), ci,
                     {True: "yes", False: "no", None: ""}[d.difference.distinguishable],
                     d.difference.n])
    return header, rows


def comparison_table(results: list[dict], pairs) -> tuple[list[str], list[list]]:
    """``sweep.compare``: for each ``(a, b)`` pair of policies and each variant that ran
    both, the final validation loss of ``a`` relative to ``b`` in %, paired by seed, with its
    95 % interval (``a`` better than ``b``: negative)."""
    groups = _groups(results)
    header = ["policy", "vs policy", "variant", "difference %", "difference 95% CI",
              "difference != 0", "seeds"]
    rows = []
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"sweep.compare entry {pair!r} must be a pair of policies")
        a, b = pair
        for variant in dict.fromkeys(v for v, _ in groups):
            if (variant, a) not in groups or (variant, b) not in groups:
                continue
            g = paired_gap(_val_by_seed(groups[(variant, a)]),
                           _val_by_seed(groups[(variant, b)]))
            if not g.n:
                continue
            ci = f"[{g.low:.2f}, {g.high:.2f}]" if math.isfinite(g.low) else ""
            rows.append([a, b, variant, _fmt(g.mean, 2), ci,
                         {True: "yes", False: "no", None: ""}[g.distinguishable], g.n])
    return header, rows


def _markdown(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_reports(results: list[dict], out: Path, compare=()) -> str:
    """Write results.csv/.md (and, with variants, differences.csv and the difference table
    in results.md; with ``compare``, ``sweep.compare``'s pairs of policies, the comparison
    table) and the plots; return the Markdown."""
    out = Path(out)
    header, rows = results_table(results)
    buf = io.StringIO()
    csv.writer(buf).writerows([header] + rows)
    write_atomic(out / "results.csv", buf.getvalue())
    md = _markdown(header, rows)
    d_header, d_rows = difference_table(results)
    if d_rows:
        buf = io.StringIO()
        csv.writer(buf).writerows([d_header] + d_rows)
        write_atomic(out / "differences.csv", buf.getvalue())
        md += ("\nGap differences between variants (each gap against its variant's baseline "
               "runs, or its baseline_variant's, paired by seed):\n\n"
               + _markdown(d_header, d_rows))
    c_header, c_rows = comparison_table(results, compare)
    if c_rows:
        md += ("\nPaired comparisons between policies (relative difference of the final "
               "validation loss, paired by seed):\n\n" + _markdown(c_header, c_rows))
    write_atomic(out / "results.md", md)
    ok = _ok(results)
    if ok:
        plot_losses(ok, out / "runs", out / "loss_curves.png")
        plot_loss_gaps(ok, out / "runs", out / "loss_gap_curves.png")
        plot_gap_intervals(results, out / "gap_intervals.png")
        if any(r.get("size") for r in ok):
            plot_gap_vs_size(results, out / "gap_vs_size.png")
        for metric, fname in (("underflow", "underflow_heatmap.png"),
                              ("sqnr_db", "sqnr_heatmap.png")):
            plot_heatmaps(ok, metric, out / fname)
    return md


def _save_png(fig, path: Path):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    write_atomic(path, buf.getvalue())


def _smooth(y, n):
    if len(y) < n:
        return np.asarray(y)
    k = np.ones(n) / n
    return np.convolve(y, k, mode="valid")


def _losses(runs_dir: Path, r: dict) -> tuple[np.ndarray, np.ndarray]:
    recs = [x for x in read_jsonl(runs_dir / r["name"] / "metrics.jsonl") if "loss" in x]
    return np.array([x["step"] for x in recs]), np.array([x["loss"] for x in recs], float)


def plot_losses(results, runs_dir: Path, path: Path):
    """Training loss (smoothed; the mean over a policy's seeds) of every policy."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for key, runs in _groups(results).items():
        curves = [_losses(runs_dir, r) for r in runs]
        n_steps = min(len(c[1]) for c in curves)
        if not n_steps:
            continue
        n = max(1, n_steps // 15)
        mean = np.mean([c[1][:n_steps] for c in curves], axis=0)
        val = np.mean([r["val_loss"] for r in runs])
        plain = key == ("", "bf16")
        ax.plot(curves[0][0][:n_steps][n - 1:], _smooth(mean, n),
                label=f"{_label(key)} (val {val:.3f})", lw=2.2 if plain else 1.2,
                color="black" if plain else None)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte, smoothed)")
    ax.set_title("loss curves per precision policy (mean over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    _save_png(fig, path)


def _relative_gaps(runs, base, runs_dir: Path):
    """Per seed both ran: the smoothed relative training-loss difference to the baseline in %
    over the steps; the steps."""
    base = {r.get("seed", 0): _losses(runs_dir, r) for r in base}
    gaps, steps = [], None
    for r in runs:
        if r.get("seed", 0) not in base:
            continue
        (st, y), (_, yb) = _losses(runs_dir, r), base[r.get("seed", 0)]
        m = min(len(y), len(yb))
        n = max(1, m // 15)
        gaps.append(100 * (_smooth(y[:m], n) - _smooth(yb[:m], n)) / _smooth(yb[:m], n))
        steps = st[:m][n - 1:]
    m = min((len(g) for g in gaps), default=0)
    return np.array([g[:m] for g in gaps]), (steps[:m] if steps is not None else None)


def plot_loss_gaps(results, runs_dir: Path, path: Path, baseline: str = "bf16"):
    """The relative training-loss difference to the baseline over the steps (as the NVFP4
    paper plots it): the mean over seeds, and the seeds' range as a band."""
    from matplotlib.figure import Figure

    groups = _groups(results)
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for key, runs in groups.items():
        if _base_key(key, runs, baseline) == key:
            continue
        gaps, steps = _relative_gaps(runs, groups.get(_base_key(key, runs, baseline), []),
                                     runs_dir)
        if steps is None or not len(gaps) or not gaps.shape[1]:
            continue
        line, = ax.plot(steps, gaps.mean(0), lw=1.2,
                        label=f"{_label(key)} ({len(gaps)} seeds)")
        if len(gaps) > 1:
            ax.fill_between(steps, gaps.min(0), gaps.max(0), color=line.get_color(), alpha=0.15)
    ax.axhline(0, color="black", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss vs {baseline} (%, smoothed)")
    ax.set_title(f"relative loss difference to {baseline} (band: range over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    _save_png(fig, path)


def plot_gap_intervals(results, path: Path, baseline: str = "bf16"):
    """The final validation gap to the baseline per policy, paired by seed, with its 95 %
    interval (a dot alone: one seed)."""
    from matplotlib.figure import Figure

    groups = _groups(results)
    rows = []
    for key, runs in groups.items():
        ok = _val_by_seed(runs)
        base = _val_by_seed(groups.get(_base_key(key, runs, baseline), []))
        if _base_key(key, runs, baseline) != key and ok and base:
            rows.append((_label(key), paired_gap(ok, base)))
    if not rows:
        return
    fig = Figure(figsize=(7, 0.35 * len(rows) + 1.5))
    ax = fig.subplots()
    for i, (policy, g) in enumerate(rows):
        if math.isfinite(g.low):
            ax.errorbar(g.mean, i, xerr=[[g.mean - g.low], [g.high - g.mean]], fmt="o",
                        capsize=3, color="C0" if g.distinguishable else "C7")
        else:
            ax.plot(g.mean, i, "o", color="C7")
    ax.set_yticks(range(len(rows)), [f"{p} (n={g.n})" for p, g in rows], fontsize=7)
    ax.axvline(0, color="black", lw=1)
    ax.set_xlabel(f"validation loss gap vs {baseline} (%), 95 % interval paired by seed")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    _save_png(fig, path)


def plot_gap_vs_size(results, path: Path, baseline: str = "bf16"):
    """The final validation gap to the baseline against the model's parameter count (the
    shape of the NVFP4 paper's figure), one line per policy (and variant besides the size),
    with the 95 % intervals paired by seed."""
    from matplotlib.figure import Figure

    groups = _groups(results)
    lines: dict[str, list] = {}
    for key, runs in groups.items():
        ok, size = _ok(runs), runs[0].get("size", "")
        if _base_key(key, runs, baseline) == key or not ok or not size or "params" not in ok[0]:
            continue
        gap = paired_gap(_val_by_seed(ok), _val_by_seed(groups.get(
            _base_key(key, runs, baseline), [])))
        if gap.n:
            rest = key[0][len(size) + 1:] if key[0].startswith(f"{size}-") else ""
            lines.setdefault(_label((rest, key[1])), []).append((ok[0]["params"], size, gap))
    if not lines:
        return
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for k, (label, points) in enumerate(lines.items()):
        points.sort(key=lambda p: p[0])
        x = np.array([p[0] for p in points], float) * (1 + 0.02 * (k - len(lines) / 2))
        g = [p[2] for p in points]
        mean = np.array([v.mean for v in g])
        err = np.array([[v.mean - v.low, v.high - v.mean] if math.isfinite(v.low) else [0, 0]
                        for v in g]).T
        ax.errorbar(x, mean, yerr=err, fmt="o-", capsize=3, lw=1.2, label=label)
    ax.set_xscale("log")
    ax.axhline(0, color="black", lw=1)
    ax.set_xlabel("parameters")
    ax.set_ylabel(f"validation loss gap vs {baseline} (%)")
    ax.set_title("gap vs model size (95 % intervals paired by seed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    _save_png(fig, path)


def _quantized_operands(result: dict):
    """``(layer, operand) -> bool``: whether the run's recipe for that layer quantizes the
    operand (a pass-through BF16 cast is not quantization: its cell is grey)."""
    from fp4lab.recipe import get_recipe

    recipes = result.get("layers", {})

    def quantized(layer: str, op: str) -> bool:
        try:
            recipe = get_recipe(recipes.get(layer))
        except (TypeError, ValueError):  # no layer record, or an unregistered recipe
            return True  # draw what was measured
        return op in recipe.quantized_operands and \
            not recipe.operands[op].format.is_passthrough

    return quantized


def _heat_grid(runs: list[dict], layers, metric: str) -> np.ndarray:
    """layer x operand values of ``metric``, the mean over a policy's seeds; NaN (grey) where
    the recipe does not quantize the operand."""
    from fp4lab.recipe import OPERANDS

    grids = []
    for r in runs:
        s, quantized = r["probe_summary"], _quantized_operands(r)
        grids.append([[s.get(layer, {}).get(op, {}).get(metric, math.nan)
                       if quantized(layer, op) else math.nan for op in OPERANDS]
                      for layer in layers])
    grids = np.array(grids, float)
    counts = np.isfinite(grids).sum(0)
    total = np.where(np.isfinite(grids), grids, 0.0).sum(0)
    return np.where(counts > 0, total / np.maximum(counts, 1), np.nan)


def plot_heatmaps(results, metric: str, path: Path):
    """One panel per policy (the mean over its seeds) of the layer x GEMM-operand map."""
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    from fp4lab.recipe import OPERANDS

    panels = [(_label(key), [r for r in runs if r.get("probe_summary")])
              for key, runs in _groups(results).items()]
    panels = [(p, runs) for p, runs in panels if runs]
    if not panels:
        return
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    layers = sorted({name for _, runs in panels for r in runs for name in r["probe_summary"]},
                    key=layer_order)  # every size's layers (a shallower model's: grey)
    fig = Figure(figsize=(2.4 * cols + 2.2, 0.2 * len(layers) * rows + 1.8),
                 layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True)
    is_under = metric == "underflow"
    cmap = matplotlib.colormaps["magma_r" if is_under else "viridis"].with_extremes(
        bad="#dddddd")
    vmin, vmax = (0.0, 100.0) if is_under else (0.0, 40.0)
    im = None
    for ax, (policy, runs) in zip(axes.flat, panels):
        grid = _heat_grid(runs, layers, metric) * (100 if is_under else 1)
        grid = np.where(np.isfinite(grid), np.clip(grid, vmin, vmax), np.nan)
        im = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, vmin=vmin,
                       vmax=vmax)
        ax.set_title(policy + (f" ({len(runs)} seeds)" if len(runs) > 1 else ""), fontsize=9)
        ax.set_xticks(range(len(OPERANDS)), [o.replace("_", "\n") for o in OPERANDS],
                      fontsize=6)
        ax.set_yticks(range(len(layers)), layers, fontsize=6)
        ax.tick_params(axis="y", labelleft=ax in axes[:, 0])
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.colorbar(im, ax=axes, shrink=0.6,
                 label="underflow %" if is_under else "SQNR dB (clipped at 40)")
    fig.suptitle(f"{'underflow' if is_under else 'SQNR'} per layer and GEMM operand "
                 "(mean over probe steps and seeds; grey: not quantized)", fontsize=10)
    _save_png(fig, path)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.sweep",
                                 description="Train one model under several precision "
                                             "policies and compare.")
    ap.add_argument("--config", default="sweep", help="a config file or a name in "
                    "experiments/configs (default: sweep)")
    ap.add_argument("--out", default="results/sweep", help="output folder (default: "
                    "results/sweep)")
    ap.add_argument("--retry-failed", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--shard", default=None, metavar="I/N",
                    help="run only shard I of N of the planned runs (0 <= I < N) into the "
                    "shared --out folder, and write no report")
    ap.add_argument("--report", action="store_true", help="train nothing: merge the results "
                    "found in --out (from shards, or an unfinished sweep) into the reports")
    # (a test runs this example through the parser and the plan of the default config)
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. train.steps=300 "
                    "sweep.policies=\"('bf16','nvfp4')\"")
    return ap


@command
def main(argv=None):
    from experiments.configs import load_config

    ap = _parser()
    args = ap.parse_args(argv)
    try:
        shard = None if args.shard is None else parse_shard(args.shard)
    except ValueError as e:
        ap.error(str(e))
    if args.report and shard:
        ap.error("--report merges the shards' results: give it without --shard")
    if args.report and not Path(args.out).is_dir():
        raise FileNotFoundError(f"--report: no folder {args.out!r} to merge the results of "
                                "(give the --out the sweep or its shards wrote to)")
    config = load_config(args.config, args.overrides)
    try:
        results = collect_results(config, args.out) if args.report else run_sweep(
            config, args.out, retry_failed=args.retry_failed, progress=not args.quiet,
            shard=shard)
    except KeyboardInterrupt as e:  # TrainingInterrupted: the run in progress saved its state
        print(f"\nsweep interrupted. {e or ''} Finished runs are kept; run the same command "
              "again to continue the sweep.", file=sys.stderr)
        return 130
    if shard:
        print(f"shard {shard[0]}/{shard[1]}: {len(results)} runs done; merge with "
              f"--report when every shard has finished")
        return 0 if all(r["status"] == "ok" for r in results) else 1
    print(write_reports(results, Path(args.out), config.sweep.get("compare", ())))
    print(f"wrote {args.out}/results.csv, results.md, loss_curves.png, loss_gap_curves.png, "
          "gap_intervals.png, underflow_heatmap.png, sqnr_heatmap.png")
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
