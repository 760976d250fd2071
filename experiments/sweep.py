"""Sweep driver: the same model, data and seed under a list of precision policies.

    python -m experiments.sweep [--config sweep] [--out results/sweep] [key=value ...]

For every policy in ``sweep.policies`` it trains one run in ``<out>/runs/<policy>/`` (see
``experiments.train``) and then writes, from every run's ``result.json``:

* ``results.csv`` and ``results.md``: final train and validation loss, the validation gap to
  the ``bf16`` run in %, tokens/s and its ratio to ``bf16``, mean underflow per layer kind;
* ``loss_curves.png``: training loss (smoothed) of every run;
* ``underflow_heatmap.png`` and ``sqnr_heatmap.png``: layer x GEMM-operand maps, one panel per
  run (mean over the probe steps; grey: the operand is not quantized).

This module owns the loop over the policies and the reports; every file is written atomically
(``experiments.records.write_atomic``). Each run's result is written when it finishes;
rerunning the command skips finished runs (and resumes an interrupted one from its
checkpoint). A run that fails is recorded with status ``failed`` and its error, and the sweep
goes on (``--retry-failed`` runs it again).

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

import numpy as np

from experiments.configs import config_changes, format_changes
from experiments.probes import KIND_ORDER, layer_order
from experiments.records import read_jsonl, write_atomic, write_json_atomic
from experiments.stats import paired_gap
from experiments.train import train

__all__ = ["run_sweep", "results_table", "write_reports", "main"]


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


def planned_runs(config) -> list[tuple[str, int]]:
    """``(policy, seed)`` of every run, in order: each policy under every seed, or, when
    ``sweep.seeded_policies`` names some, those under every seed and the rest under the
    first one only."""
    seeds, every = sweep_seeds(config), tuple(config.sweep.get("seeded_policies", ()))
    unknown = set(every) - set(config.sweep.policies)
    if unknown:
        raise ValueError(f"sweep.seeded_policies names {sorted(unknown)}, which are not in "
                         f"sweep.policies")
    return [(p, s) for s in seeds for p in config.sweep.policies
            if s == seeds[0] or not every or p in every]


def run_name(policy: str, seed: int | None = None) -> str:
    """The run's folder name: the policy name with path characters replaced
    (``file:results/auto/policy.json`` -> ``file_results_auto_policy.json``), and
    ``-seed<s>`` when the sweep has several seeds."""
    name = re.sub(r"[^\w.+-]+", "_", policy).strip("_") or "run"
    return name if seed is None else f"{name}-seed{seed}"


def _read_result(done: Path, seed: int) -> dict:
    return {**json.loads(done.read_text()), "seed": seed}


def _run_one(config, policy: str, seed: int, name: str, runs_dir: Path, retry_failed: bool,
             progress: bool) -> dict:
    workdir = runs_dir / name
    c = config.copy_and_resolve_references()
    c.name, c.precision.policy, c.seed = name, policy, seed
    _check_same_config(c, workdir)
    done = workdir / "result.json"
    if done.exists():
        result = _read_result(done, seed)
        if result["status"] == "ok" or not retry_failed:
            return result
    try:
        return {**train(c, workdir, progress=progress), "seed": seed}
    except KeyboardInterrupt:
        raise
    except Exception as e:  # recorded, and the sweep goes on
        workdir.mkdir(parents=True, exist_ok=True)
        result = {"name": name, "policy": policy, "seed": seed, "status": "failed",
                  "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc(limit=8)}
        write_json_atomic(done, result)
        print(f"run {name} FAILED: {result['error']}")
        return result


def _check_same_config(c, workdir: Path):
    """A finished or interrupted run is reused only if it was trained with this config."""
    stored = workdir / "config.json"
    if not stored.exists():
        return
    differ = config_changes(json.loads(stored.read_text()), c.to_dict())
    if differ:
        raise ValueError(f"{workdir} holds a run trained with another config "
                         f"({format_changes(differ)}); use another --out or remove that folder")


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)``: shard ``i`` of ``n`` (``0 <= i < n``)."""
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r} must look like i/n, e.g. 0/4") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {text!r}: need 0 <= i < n")
    return i, n


def _named_runs(config) -> list[tuple[str, int, str]]:
    """``(policy, seed, folder name)`` of every planned run (names carry the seed only when
    the sweep has several)."""
    policies = list(config.sweep.policies)
    if len({run_name(p) for p in policies}) != len(policies):
        raise ValueError(f"sweep.policies has duplicates (after making folder names): "
                         f"{policies}")
    several = len(sweep_seeds(config)) > 1
    return [(p, s, run_name(p, s if several else None)) for p, s in planned_runs(config)]


def run_sweep(config, out: str | Path, *, retry_failed: bool = False, progress: bool = True,
              shard: tuple[int, int] | None = None) -> list[dict]:
    """Train every planned run (skipping finished ones), write the reports, and return the
    results in sweep order. ``shard=(i, n)``: only the runs whose index in the plan is
    ``i`` modulo ``n`` (jobs of an array, or hosts, sharing ``out``: each run folder belongs
    to one shard), and no reports: :func:`collect_results` and :func:`write_reports` merge
    what exists (``--report``)."""
    runs = _named_runs(config)
    out = Path(out)
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    if not config.get("compile_cache"):  # the seeds of a policy compile one program
        config = config.copy_and_resolve_references()
        config.compile_cache = str(out / "compile_cache")
    if shard is not None:
        runs = [r for k, r in enumerate(runs) if k % shard[1] == shard[0]]
    results = [_run_one(config, p, s, name, runs_dir, retry_failed, progress)
               for p, s, name in runs]
    if shard is None:
        write_reports(results, out)
    return results


def collect_results(config, out: str | Path) -> list[dict]:
    """The result of every planned run found under ``out/runs``, in sweep order; a run with
    no result yet has status ``missing``."""
    results = []
    for policy, seed, name in _named_runs(config):
        done = Path(out) / "runs" / name / "result.json"
        results.append(_read_result(done, seed) if done.exists() else {
            "name": name, "policy": policy, "seed": seed, "status": "missing",
            "error": "no result yet"})
    return results


# ----------------------------------------------------------------------------- reports


def _by_policy(results: list[dict]) -> dict[str, list[dict]]:
    """The results grouped by policy, in sweep order (the seeds of a policy together)."""
    out: dict[str, list[dict]] = {}
    for r in results:
        out.setdefault(r["policy"], []).append(r)
    return out


def _val_by_seed(runs: list[dict]) -> dict[int, float]:
    """The final validation loss of each finished run, keyed by its seed."""
    return {r.get("seed", 0): r["val_loss"] for r in runs if r["status"] == "ok"}


def _kinds(results: list[dict]) -> list[str]:
    found = {k for r in results for k in r.get("underflow_by_kind", {})}
    return [k for k in KIND_ORDER if k in found] + sorted(found - set(KIND_ORDER))


def _fmt(v, n):
    return (round(v, n) if n else round(v)) if math.isfinite(v) else ""


def _policy_row(runs: list[dict], base: list[dict], kinds: list[str]) -> list:
    """One policy's row: means over its seeds, the spread, and the gap to the baseline
    paired by seed with its 95 % interval (experiments.stats)."""
    by_seed = _val_by_seed(runs)
    gap = paired_gap(by_seed, _val_by_seed(base))
    if runs[0]["policy"] == (base[0]["policy"] if base else None):
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


def results_table(results: list[dict], baseline: str = "bf16") -> tuple[list[str], list[list]]:
    """Header and rows of the results table, one row per policy (means over its seeds; a
    failed run gets its own row), values rounded for reading."""
    groups = _by_policy(results)
    base = [r for r in groups.get(baseline, []) if r["status"] == "ok"]
    kinds = _kinds(results)
    header = (["policy", "status", "train loss", "val loss", f"val gap vs {baseline} %",
               "tokens/s", f"speed vs {baseline}", "seeds", "val loss sd",
               "gap 95% CI", "gap != 0"] + [f"underflow % {k}" for k in kinds])
    rows = []
    for policy, runs in groups.items():
        for r in runs:
            if r["status"] != "ok":
                rows.append([r["policy"] if "seed" not in r or len(runs) == 1 else
                             f"{r['policy']} (seed {r['seed']})",
                             f"{r['status']}: {r.get('error', '')[:60]}"] +
                            [""] * (len(header) - 2))
        ok = [r for r in runs if r["status"] == "ok"]
        if ok:
            rows.append(_policy_row(ok, base, kinds))
    return header, rows


def _markdown(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_reports(results: list[dict], out: Path) -> str:
    """Write results.csv/.md and the plots; return the Markdown table."""
    out = Path(out)
    header, rows = results_table(results)
    buf = io.StringIO()
    csv.writer(buf).writerows([header] + rows)
    write_atomic(out / "results.csv", buf.getvalue())
    md = _markdown(header, rows)
    write_atomic(out / "results.md", md)
    ok = [r for r in results if r["status"] == "ok"]
    if ok:
        plot_losses(ok, out / "runs", out / "loss_curves.png")
        plot_loss_gaps(ok, out / "runs", out / "loss_gap_curves.png")
        plot_gap_intervals(results, out / "gap_intervals.png")
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
    for policy, runs in _by_policy(results).items():
        curves = [_losses(runs_dir, r) for r in runs]
        n_steps = min(len(c[1]) for c in curves)
        if not n_steps:
            continue
        n = max(1, n_steps // 15)
        mean = np.mean([c[1][:n_steps] for c in curves], axis=0)
        val = np.mean([r["val_loss"] for r in runs])
        ax.plot(curves[0][0][:n_steps][n - 1:], _smooth(mean, n),
                label=f"{policy} (val {val:.3f})", lw=2.2 if policy == "bf16" else 1.2,
                color="black" if policy == "bf16" else None)
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

    groups = _by_policy(results)
    base = groups.get(baseline, [])
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for policy, runs in groups.items():
        gaps, steps = _relative_gaps(runs, base, runs_dir) if policy != baseline else ([], None)
        if steps is None or not len(gaps) or not gaps.shape[1]:
            continue
        line, = ax.plot(steps, gaps.mean(0), lw=1.2, label=f"{policy} ({len(gaps)} seeds)")
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

    groups = _by_policy(results)
    base = _val_by_seed(groups.get(baseline, []))
    rows = []
    for policy, runs in groups.items():
        ok = _val_by_seed(runs)
        if policy != baseline and ok and base:
            rows.append((policy, paired_gap(ok, base)))
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

    panels = [(p, [r for r in runs if r.get("probe_summary")])
              for p, runs in _by_policy(results).items()]
    panels = [(p, runs) for p, runs in panels if runs]
    if not panels:
        return
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    layers = sorted(panels[0][1][0]["probe_summary"], key=layer_order)
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


def main(argv=None):
    from experiments.configs import load_config

    ap = argparse.ArgumentParser(description="Train one model under several precision "
                                             "policies and compare.")
    ap.add_argument("--config", default="sweep", help="a config file or a name in "
                    "experiments/configs (default: sweep)")
    ap.add_argument("--out", default="results/sweep", help="output folder (default: "
                    "results/sweep)")
    ap.add_argument("--retry-failed", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--shard", type=parse_shard, default=None, metavar="I/N",
                    help="run only shard I of N of the planned runs (0 <= I < N) into the "
                    "shared --out folder, and write no report")
    ap.add_argument("--report", action="store_true", help="train nothing: merge the results "
                    "found in --out (from shards, or an unfinished sweep) into the reports")
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. train.steps=300 "
                    "sweep.policies=\"('bf16','nvfp4')\"")
    args = ap.parse_args(argv)
    config = load_config(args.config, args.overrides)
    if args.report and args.shard:
        ap.error("--report merges the shards' results: give it without --shard")
    try:
        results = collect_results(config, args.out) if args.report else run_sweep(
            config, args.out, retry_failed=args.retry_failed, progress=not args.quiet,
            shard=args.shard)
    except KeyboardInterrupt as e:  # TrainingInterrupted: the run in progress saved its state
        print(f"\nsweep interrupted. {e or ''} Finished runs are kept; run the same command "
              "again to continue the sweep.", file=sys.stderr)
        return 130
    if args.shard:
        print(f"shard {args.shard[0]}/{args.shard[1]}: {len(results)} runs done; merge with "
              f"--report when every shard has finished")
        return 0 if all(r["status"] == "ok" for r in results) else 1
    print(write_reports(results, Path(args.out)))
    print(f"wrote {args.out}/results.csv, results.md, loss_curves.png, loss_gap_curves.png, "
          "gap_intervals.png, underflow_heatmap.png, sqnr_heatmap.png")
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
