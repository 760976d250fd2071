"""The sweep's tables and report files: per policy (and variant) the losses, the gap to the
baseline paired by seed with its 95 % interval, the speed and the underflow per layer kind;
how gaps change between variants; ``sweep.compare``'s pairs of policies. Cells are formatted
by :mod:`experiments.tables`, the numbers come from :mod:`experiments.stats`.

Every function takes :class:`~experiments.sweep.result.RunResult` values, or dicts (a
``result.json`` as a notebook reads it), which become results in one place
(:func:`~experiments.sweep.result.as_results`).
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import numpy as np

from experiments.probe_records import KIND_ORDER
from fp4lab.files import write_atomic
from experiments.stats import gap_difference, paired_gap
from experiments.sweep import plots
from experiments.sweep.result import (RunResult, as_results, base_key, finished, groups,
                                      val_by_seed)
from experiments.tables import interval_cell, markdown_table, rounded, yes_no

__all__ = ["results_table", "difference_table", "comparison_table", "probe_table",
           "write_reports"]


def _kinds(results: list[RunResult]) -> list[str]:
    found = {k for r in results for k in r.underflow_by_kind}
    return [k for k in KIND_ORDER if k in found] + sorted(found - set(KIND_ORDER))


def _policy_row(runs: list[RunResult], base: list[RunResult], kinds: list[str],
                is_base: bool = False) -> list:
    """One policy's row: means over its seeds, the spread, and the gap to the baseline
    paired by seed with its 95 % interval (experiments.stats)."""
    by_seed = val_by_seed(runs)
    gap = paired_gap(by_seed, val_by_seed(base))
    if is_base:
        gap = gap._replace(low=math.nan, high=math.nan)  # the baseline itself: no interval
    speed = (np.mean([r.tokens_per_s for r in runs]) /
             np.mean([r.tokens_per_s for r in base])) if base else math.nan
    val = np.array(list(by_seed.values()))
    sd = float(val.std(ddof=1)) if val.size > 1 else math.nan
    under = [100 * np.mean([r.underflow_by_kind.get(k, math.nan) for r in runs])
             for k in kinds]
    return ([runs[0].policy, "ok", rounded(np.mean([r.final_train_loss for r in runs]), 4),
             rounded(float(val.mean()), 4), rounded(gap.mean, 2),
             rounded(np.mean([r.tokens_per_s for r in runs]), 0), rounded(speed, 2),
             len(runs), rounded(sd, 4), interval_cell(gap), yes_no(gap.distinguishable)]
            + [rounded(u, 2) for u in under])


def _unfinished_rows(runs: list[RunResult], width: int) -> list[list]:
    """A row per run of the group that did not finish (failed or missing), ``width`` cells."""
    return [[r.policy if r.seed is None or len(runs) == 1 else f"{r.policy} (seed {r.seed})",
             f"{r.status}: {r.error[:60]}"] + [""] * (width - 2)
            for r in runs if not r.ok]


def results_table(results, baseline: str = "bf16") -> tuple[list[str], list[list]]:
    """Header and rows of the results table, one row per policy (and variant, in a sweep
    with variants: a first column then names it; means over its seeds; a failed run gets
    its own row), values rounded for reading. Gaps and speeds are relative to the
    baseline runs of the group's ``base_variant`` (its own variant by default)."""
    results = as_results(results)
    grouped, kinds = groups(results), _kinds(results)
    variants = any(r.variant for r in results)
    header = (["policy", "status", "train loss", "val loss", f"val gap vs {baseline} %",
               "tokens/s", f"speed vs {baseline}", "seeds", "val loss sd",
               "gap 95% CI", "gap != 0"] + [f"underflow % {k}" for k in kinds])
    rows = []
    for key, runs in grouped.items():
        lead = [key[0]] if variants else []
        rows += [lead + row for row in _unfinished_rows(runs, len(header))]
        ok = finished(runs)
        if ok:
            base = base_key(key, runs, baseline)
            rows.append(lead + _policy_row(ok, finished(grouped.get(base, [])), kinds,
                                           is_base=base == key))
    return (["variant"] if variants else []) + header, rows


def difference_table(results, baseline: str = "bf16") -> tuple[list[str], list[list]]:
    """How a policy's gap to the baseline changes between variants (a later size, the late
    BF16 switch, another optimizer): per policy and variant with a ``reference_variant``,
    the gap there minus the gap in the reference, paired by seed over the seeds all four
    runs have, with its 95 % interval (:func:`experiments.stats.gap_difference`). Empty
    without variants."""
    grouped = groups(as_results(results))
    header = ["policy", "variant", "vs variant", "gap %", "gap there %", "difference %",
              "difference 95% CI", "difference != 0", "seeds"]
    rows = []
    for (variant, policy), runs in grouped.items():
        ref = runs[0].reference_variant
        if (base_key((variant, policy), runs, baseline) == (variant, policy) or ref is None
                or (ref, policy) not in grouped):
            continue
        there = grouped[(ref, policy)]
        d = gap_difference(
            val_by_seed(runs), val_by_seed(grouped.get(base_key((variant, policy), runs,
                                                                baseline), [])),
            val_by_seed(there), val_by_seed(grouped.get(base_key((ref, policy), there,
                                                                 baseline), [])))
        if not d.difference.n:
            continue
        rows.append([policy, variant, ref, rounded(d.gap, 2), rounded(d.gap_there, 2),
                     rounded(d.difference.mean, 2), interval_cell(d.difference),
                     yes_no(d.difference.distinguishable), d.difference.n])
    return header, rows


def comparison_table(results, pairs) -> tuple[list[str], list[list]]:
    """``sweep.compare``: for each ``(a, b)`` pair of policies and each variant that ran
    both, the final validation loss of ``a`` relative to ``b`` in %, paired by seed, with its
    95 % interval (``a`` better than ``b``: negative)."""
    grouped = groups(as_results(results))
    header = ["policy", "vs policy", "variant", "difference %", "difference 95% CI",
              "difference != 0", "seeds"]
    rows = []
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"sweep.compare entry {pair!r} must be a pair of policies")
        a, b = pair
        for variant in dict.fromkeys(v for v, _ in grouped):
            if (variant, a) not in grouped or (variant, b) not in grouped:
                continue
            g = paired_gap(val_by_seed(grouped[(variant, a)]),
                           val_by_seed(grouped[(variant, b)]))
            if g.n:
                rows.append([a, b, variant, rounded(g.mean, 2), interval_cell(g),
                             yes_no(g.distinguishable), g.n])
    return header, rows


# the probe columns of probe_table: (operand, metric, header)
PROBE_COLUMNS = (("fprop_x", "sqnr_db", "fprop_x SQNR dB"), ("fprop_w", "sqnr_db",
                 "fprop_w SQNR dB"), ("dgrad_dy", "noise_ratio", "dgrad_dy noise ratio"),
                 ("wgrad_dy", "noise_ratio", "wgrad_dy noise ratio"),
                 ("fprop_x", "block_dynamic_range", "fprop_x block range log2"),
                 ("fprop_x", "map4_share", "fprop_x 4/6 share %"),
                 ("fprop_w", "map4_share", "fprop_w 4/6 share %"))


def probe_table(results) -> tuple[list[str], list[list]]:
    """Per policy (and variant): the probes the published recipes argue from, averaged over
    the layers, the probe steps and the seeds: the forward operands' SQNR, the gradient
    operands' noise ratio (FP4 All the Way's gradient-to-noise criterion, ``noise_ratio``),
    the forward input's largest per-block dynamic range and the share of blocks Four Over Six
    maps to 4. Empty when no run has probes."""
    grouped = groups(as_results(results))
    variants = any(v for v, _ in grouped)
    header = (["variant"] if variants else []) + ["policy", "seeds"] + [
        h for _, _, h in PROBE_COLUMNS]
    rows = []
    for (variant, policy), runs in grouped.items():
        ok = [r for r in finished(runs) if r.probe_summary]
        if not ok:
            continue
        cells = []
        for op, metric, h in PROBE_COLUMNS:
            v = np.array([m[op][metric] for r in ok for m in r.probe_summary.values()
                          if op in m and metric in m[op]], float)
            v = v[np.isfinite(v)]
            scale = 100 if h.endswith("%") else 1
            cells.append(rounded(scale * float(v.mean()), 2) if v.size else "")
        rows.append(([variant] if variants else []) + [policy, len(ok)] + cells)
    return header, rows


def step_metric_table(results) -> tuple[list[str], list[list]]:
    """Per policy (and variant): each further per-step metric that its runs logged (the
    result's ``step_metric_means``: an MoE model's ``moe_load_max`` / ``moe_load_min``, the
    most and least loaded experts' share of an even load, ``mtp_grad_survival``...),
    averaged over the steps and then the seeds. Empty when no run logged one."""
    grouped = groups(as_results(results))
    names = sorted({k for runs in grouped.values() for r in finished(runs)
                    for k in r.record.get("step_metric_means", {})})
    if not names:
        return [], []
    variants = any(v for v, _ in grouped)
    header = (["variant"] if variants else []) + ["policy", "seeds"] + names
    rows = []
    for (variant, policy), runs in grouped.items():
        means = [r.record.get("step_metric_means", {}) for r in finished(runs)]
        if not means:
            continue
        cells = []
        for k in names:
            v = [m[k] for m in means if k in m and math.isfinite(m[k])]
            cells.append(rounded(float(np.mean(v)), 3) if v else "")
        rows.append(([variant] if variants else []) + [policy, len(means)] + cells)
    return header, rows


def _csv(header, rows) -> str:
    buf = io.StringIO()
    csv.writer(buf).writerows([header] + rows)
    return buf.getvalue()


def write_reports(results, out: Path, compare=()) -> str:
    """Write results.csv/.md (and, with variants, differences.csv and the difference table
    in results.md; with ``compare``, ``sweep.compare``'s pairs of policies, the comparison
    table) and the plots (:mod:`experiments.sweep.plots`); return the Markdown."""
    out, results = Path(out), as_results(results)
    header, rows = results_table(results)
    write_atomic(out / "results.csv", _csv(header, rows))
    md = markdown_table(header, rows)
    d_header, d_rows = difference_table(results)
    if d_rows:
        write_atomic(out / "differences.csv", _csv(d_header, d_rows))
        md += ("\nGap differences between variants (each gap against its variant's baseline "
               "runs, or its baseline_variant's, paired by seed):\n\n"
               + markdown_table(d_header, d_rows))
    c_header, c_rows = comparison_table(results, compare)
    if c_rows:
        md += ("\nPaired comparisons between policies (relative difference of the final "
               "validation loss, paired by seed):\n\n" + markdown_table(c_header, c_rows))
    s_header, s_rows = step_metric_table(results)
    if s_rows:
        md += ("\nPer-step metrics, averaged over the steps and seeds (moe_load_max / _min: "
               "the most / least loaded expert's tokens over an even share, per MoE block):"
               "\n\n" + markdown_table(s_header, s_rows))
    p_header, p_rows = probe_table(results)
    if p_rows:
        write_atomic(out / "probes.csv", _csv(p_header, p_rows))
        md += ("\nProbes, averaged over layers, probe steps and seeds (noise ratio: a "
               "gradient's norm over its stochastic-rounding noise, FP4 All the Way's "
               "sqrt(3) criterion; block range: the largest log2 max/min of a block):\n\n"
               + markdown_table(p_header, p_rows))
    write_atomic(out / "results.md", md)
    plots.write_plots(results, out)
    return md
