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
from experiments.train import train

__all__ = ["run_sweep", "results_table", "write_reports", "main"]


def run_name(policy: str) -> str:
    """The run's folder name: the policy name with path characters replaced
    (``file:results/auto/policy.json`` -> ``file_results_auto_policy.json``)."""
    return re.sub(r"[^\w.+-]+", "_", policy).strip("_") or "run"


def _run_one(config, policy: str, runs_dir: Path, retry_failed: bool, progress: bool) -> dict:
    name = run_name(policy)
    workdir = runs_dir / name
    c = config.copy_and_resolve_references()
    c.name, c.precision.policy = name, policy
    _check_same_config(c, workdir)
    done = workdir / "result.json"
    if done.exists():
        result = json.loads(done.read_text())
        if result["status"] == "ok" or not retry_failed:
            return result
    try:
        return train(c, workdir, progress=progress)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # recorded, and the sweep goes on
        workdir.mkdir(parents=True, exist_ok=True)
        result = {"name": name, "policy": policy, "status": "failed",
                  "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc(limit=8)}
        write_json_atomic(done, result)
        print(f"run {policy} FAILED: {result['error']}")
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


def run_sweep(config, out: str | Path, *, retry_failed: bool = False,
              progress: bool = True) -> list[dict]:
    """Train every policy of ``config.sweep.policies`` (skipping finished runs), write the
    reports, and return the results in sweep order."""
    policies = list(config.sweep.policies)
    if len({run_name(p) for p in policies}) != len(policies):
        raise ValueError(f"sweep.policies has duplicates (after making folder names): "
                         f"{policies}")
    out = Path(out)
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    results = [_run_one(config, p, runs_dir, retry_failed, progress) for p in policies]
    write_reports(results, out)
    return results


# ----------------------------------------------------------------------------- reports


def results_table(results: list[dict], baseline: str = "bf16") -> tuple[list[str], list[list]]:
    """Header and rows of the results table (values rounded for reading)."""
    base = next((r for r in results if r["policy"] == baseline and r["status"] == "ok"), None)
    kinds = [k for k in KIND_ORDER if any(k in r.get("underflow_by_kind", {}) for r in results)]
    kinds += sorted({k for r in results for k in r.get("underflow_by_kind", {})} - set(kinds))
    header = (["policy", "status", "train loss", "val loss", f"val gap vs {baseline} %",
               "tokens/s", f"speed vs {baseline}"] + [f"underflow % {k}" for k in kinds])
    rows = []
    for r in results:
        if r["status"] != "ok":
            rows.append([r["policy"], f"failed: {r.get('error', '')[:60]}"] +
                        [""] * (len(header) - 2))
            continue
        gap = (100 * (r["val_loss"] - base["val_loss"]) / base["val_loss"]) if base else math.nan
        speed = r["tokens_per_s"] / base["tokens_per_s"] if base else math.nan
        under = [100 * r.get("underflow_by_kind", {}).get(k, math.nan) for k in kinds]
        fmt = lambda v, n: (round(v, n) if n else round(v)) if math.isfinite(v) else ""  # noqa
        rows.append([r["policy"], "ok", fmt(r["final_train_loss"], 4), fmt(r["val_loss"], 4),
                     fmt(gap, 2), fmt(r["tokens_per_s"], 0), fmt(speed, 2)] +
                    [fmt(u, 2) for u in under])
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


def plot_losses(results, runs_dir: Path, path: Path):
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for r in results:
        recs = [x for x in read_jsonl(runs_dir / r["name"] / "metrics.jsonl") if "loss" in x]
        if not recs:
            continue
        n = max(1, len(recs) // 15)
        steps = np.array([x["step"] for x in recs])
        ax.plot(steps[n - 1:], _smooth([x["loss"] for x in recs], n),
                label=f"{r['policy']} (val {r['val_loss']:.3f})",
                lw=2.2 if r["policy"] == "bf16" else 1.2,
                color="black" if r["policy"] == "bf16" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte, smoothed)")
    ax.set_title("loss curves per precision policy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    _save_png(fig, path)


def plot_heatmaps(results, metric: str, path: Path):
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    from fp4lab.recipe import OPERANDS

    panels = [r for r in results if r.get("probe_summary")]
    if not panels:
        return
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    layers = sorted(panels[0]["probe_summary"], key=layer_order)
    fig = Figure(figsize=(2.4 * cols + 2.2, 0.2 * len(layers) * rows + 1.8),
                 layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True)
    is_under = metric == "underflow"
    cmap = matplotlib.colormaps["magma_r" if is_under else "viridis"].with_extremes(
        bad="#dddddd")
    vmin, vmax = (0.0, 100.0) if is_under else (0.0, 40.0)
    im = None
    for ax, r in zip(axes.flat, panels):
        s = r["probe_summary"]
        grid = np.array([[s.get(layer, {}).get(op, {}).get(metric, math.nan) for op in OPERANDS]
                         for layer in layers], float)
        if is_under:
            grid = 100 * grid
        grid = np.where(np.isfinite(grid), np.clip(grid, vmin, vmax), np.nan)
        im = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, vmin=vmin,
                       vmax=vmax)
        ax.set_title(r["policy"], fontsize=9)
        ax.set_xticks(range(len(OPERANDS)), [o.replace("_", "\n") for o in OPERANDS],
                      fontsize=6)
        ax.set_yticks(range(len(layers)), layers, fontsize=6)
        ax.tick_params(axis="y", labelleft=ax in axes[:, 0])
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.colorbar(im, ax=axes, shrink=0.6,
                 label="underflow %" if is_under else "SQNR dB (clipped at 40)")
    fig.suptitle(f"{'underflow' if is_under else 'SQNR'} per layer and GEMM operand "
                 "(mean over probe steps; grey: not quantized)", fontsize=10)
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
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. train.steps=300 "
                    "sweep.policies=\"('bf16','nvfp4')\"")
    args = ap.parse_args(argv)
    config = load_config(args.config, args.overrides)
    try:
        results = run_sweep(config, args.out, retry_failed=args.retry_failed,
                            progress=not args.quiet)
    except KeyboardInterrupt as e:  # TrainingInterrupted: the run in progress saved its state
        print(f"\nsweep interrupted. {e or ''} Finished runs are kept; run the same command "
              "again to continue the sweep.", file=sys.stderr)
        return 130
    print(write_reports(results, Path(args.out)))
    print(f"wrote {args.out}/results.csv, results.md, loss_curves.png, underflow_heatmap.png, "
          "sqnr_heatmap.png")
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
