"""The sweep's figures (matplotlib's ``Figure``, no pyplot: the caller's backend is left
alone), each written atomically as PNG:

* ``loss_curves.png``: training loss per policy, smoothed, the mean over its seeds;
* ``loss_gap_curves.png``: the training loss relative to ``bf16`` over the steps (the seeds'
  range as a band); ``gap_intervals.png``: the final validation gap with its 95 % interval
  paired by seed; ``gap_vs_size.png`` (with ``sweep.sizes``): that gap against the
  parameter count;
* ``underflow_heatmap.png``, ``sqnr_heatmap.png``: layer x GEMM-operand maps, one panel per
  policy (the mean over the probe steps and seeds; grey: the operand is not quantized).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from experiments.probe_records import layer_order
from experiments.records import read_jsonl
from fp4lab.files import write_atomic
from experiments.stats import paired_gap
from experiments.sweep.result import (RunResult, base_key, finished, groups, label,
                                      val_by_seed)

__all__ = ["write_plots", "plot_losses", "plot_loss_gaps", "plot_gap_intervals",
           "plot_gap_vs_size", "plot_heatmaps", "quantized_operands"]


def write_plots(results: list[RunResult], out: Path) -> None:
    """Every figure of the sweep in ``out`` (none without a finished run; the size plot only
    with sizes); the loss curves read each run's ``out/runs/<name>/metrics.jsonl``."""
    ok = finished(results)
    if not ok:
        return
    plot_losses(ok, out / "runs", out / "loss_curves.png")
    plot_loss_gaps(ok, out / "runs", out / "loss_gap_curves.png")
    plot_gap_intervals(results, out / "gap_intervals.png")
    if any(r.size for r in ok):
        plot_gap_vs_size(results, out / "gap_vs_size.png")
    for metric, fname in (("underflow", "underflow_heatmap.png"),
                          ("sqnr_db", "sqnr_heatmap.png")):
        plot_heatmaps(ok, metric, out / fname)


def _save_png(fig, path: Path):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    write_atomic(path, buf.getvalue())


def _smooth(y, n):
    if len(y) < n:
        return np.asarray(y)
    k = np.ones(n) / n
    return np.convolve(y, k, mode="valid")


def _losses(runs_dir: Path, r: RunResult) -> tuple[np.ndarray, np.ndarray]:
    recs = [x for x in read_jsonl(runs_dir / r.name / "metrics.jsonl") if "loss" in x]
    return np.array([x["step"] for x in recs]), np.array([x["loss"] for x in recs], float)


def _finish(fig, ax, path: Path, **legend):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, **legend)
    fig.tight_layout()
    _save_png(fig, path)


def plot_losses(results: list[RunResult], runs_dir: Path, path: Path):
    """Training loss (smoothed; the mean over a policy's seeds) of every policy."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for key, runs in groups(results).items():
        curves = [_losses(runs_dir, r) for r in runs]
        n_steps = min(len(c[1]) for c in curves)
        if not n_steps:
            continue
        n = max(1, n_steps // 15)
        mean = np.mean([c[1][:n_steps] for c in curves], axis=0)
        val = np.mean([r.val_loss for r in runs])
        plain = key == ("", "bf16")
        ax.plot(curves[0][0][:n_steps][n - 1:], _smooth(mean, n),
                label=f"{label(key)} (val {val:.3f})", lw=2.2 if plain else 1.2,
                color="black" if plain else None)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte, smoothed)")
    ax.set_title("loss curves per precision policy (mean over seeds)")
    _finish(fig, ax, path, ncol=2)


def _relative_gaps(runs: list[RunResult], base: list[RunResult], runs_dir: Path):
    """Per seed both ran: the smoothed relative training-loss difference to the baseline in %
    over the steps; the steps."""
    base = {r.pair_seed: _losses(runs_dir, r) for r in base}
    gaps, steps = [], None
    for r in runs:
        if r.pair_seed not in base:
            continue
        (st, y), (_, yb) = _losses(runs_dir, r), base[r.pair_seed]
        m = min(len(y), len(yb))
        n = max(1, m // 15)
        gaps.append(100 * (_smooth(y[:m], n) - _smooth(yb[:m], n)) / _smooth(yb[:m], n))
        steps = st[:m][n - 1:]
    m = min((len(g) for g in gaps), default=0)
    return np.array([g[:m] for g in gaps]), (steps[:m] if steps is not None else None)


def plot_loss_gaps(results: list[RunResult], runs_dir: Path, path: Path,
                   baseline: str = "bf16"):
    """The relative training-loss difference to the baseline over the steps (as the NVFP4
    paper plots it): the mean over seeds, and the seeds' range as a band."""
    from matplotlib.figure import Figure

    grouped = groups(results)
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for key, runs in grouped.items():
        if base_key(key, runs, baseline) == key:
            continue
        gaps, steps = _relative_gaps(runs, grouped.get(base_key(key, runs, baseline), []),
                                     runs_dir)
        if steps is None or not len(gaps) or not gaps.shape[1]:
            continue
        line, = ax.plot(steps, gaps.mean(0), lw=1.2,
                        label=f"{label(key)} ({len(gaps)} seeds)")
        if len(gaps) > 1:
            ax.fill_between(steps, gaps.min(0), gaps.max(0), color=line.get_color(), alpha=0.15)
    ax.axhline(0, color="black", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss vs {baseline} (%, smoothed)")
    ax.set_title(f"relative loss difference to {baseline} (band: range over seeds)")
    _finish(fig, ax, path, ncol=2)


def plot_gap_intervals(results: list[RunResult], path: Path, baseline: str = "bf16"):
    """The final validation gap to the baseline per policy, paired by seed, with its 95 %
    interval (a dot alone: one seed)."""
    from matplotlib.figure import Figure

    grouped = groups(results)
    rows = []
    for key, runs in grouped.items():
        ok = val_by_seed(runs)
        base = val_by_seed(grouped.get(base_key(key, runs, baseline), []))
        if base_key(key, runs, baseline) != key and ok and base:
            rows.append((label(key), paired_gap(ok, base)))
    if not rows:
        return
    fig = Figure(figsize=(7, 0.35 * len(rows) + 1.5))
    ax = fig.subplots()
    for i, (_, g) in enumerate(rows):
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


def _size_lines(results: list[RunResult], baseline: str) -> dict[str, list]:
    """``{label: [(params, size, gap), ...]}``: per policy (and variant besides the size),
    each size's validation gap to the baseline paired by seed."""
    grouped = groups(results)
    lines: dict[str, list] = {}
    for key, runs in grouped.items():
        ok, size = finished(runs), runs[0].size
        if base_key(key, runs, baseline) == key or not ok or not size or ok[0].params is None:
            continue
        gap = paired_gap(val_by_seed(ok), val_by_seed(grouped.get(
            base_key(key, runs, baseline), [])))
        if gap.n:
            rest = key[0][len(size) + 1:] if key[0].startswith(f"{size}-") else ""
            lines.setdefault(label((rest, key[1])), []).append((ok[0].params, size, gap))
    return lines


def plot_gap_vs_size(results: list[RunResult], path: Path, baseline: str = "bf16"):
    """The final validation gap to the baseline against the model's parameter count (the
    shape of the NVFP4 paper's figure), one line per policy (and variant besides the size),
    with the 95 % intervals paired by seed."""
    from matplotlib.figure import Figure

    lines = _size_lines(results, baseline)
    if not lines:
        return
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for k, (name, points) in enumerate(lines.items()):
        points.sort(key=lambda p: p[0])
        x = np.array([p[0] for p in points], float) * (1 + 0.02 * (k - len(lines) / 2))
        g = [p[2] for p in points]
        mean = np.array([v.mean for v in g])
        err = np.array([[v.mean - v.low, v.high - v.mean] if math.isfinite(v.low) else [0, 0]
                        for v in g]).T
        ax.errorbar(x, mean, yerr=err, fmt="o-", capsize=3, lw=1.2, label=name)
    ax.set_xscale("log")
    ax.axhline(0, color="black", lw=1)
    ax.set_xlabel("parameters")
    ax.set_ylabel(f"validation loss gap vs {baseline} (%)")
    ax.set_title("gap vs model size (95 % intervals paired by seed)")
    _finish(fig, ax, path)


def quantized_operands(layers: Mapping[str, str]):
    """``(layer, operand) -> bool``: whether the recipe ``layers`` (a result's layer path ->
    recipe name) gives that layer quantizes the operand (a pass-through BF16 cast is not
    quantization: its cell is grey)."""
    from fp4lab.gemm.recipe import get_recipe

    def quantized(layer: str, op: str) -> bool:
        try:
            recipe = get_recipe(layers.get(layer))
        except (TypeError, ValueError):  # no layer record, or an unregistered recipe
            return True  # draw what was measured
        return op in recipe.quantized_operands and \
            not recipe.operands[op].format.is_passthrough

    return quantized


def _heat_grid(runs: list[RunResult], layers, metric: str) -> np.ndarray:
    """layer x operand values of ``metric``, the mean over a policy's seeds; NaN (grey) where
    the recipe does not quantize the operand."""
    from fp4lab.gemm.recipe import OPERANDS

    grids = []
    for r in runs:
        s, quantized = r.probe_summary, quantized_operands(r.layers)
        grids.append([[s.get(layer, {}).get(op, {}).get(metric, math.nan)
                       if quantized(layer, op) else math.nan for op in OPERANDS]
                      for layer in layers])
    grids = np.array(grids, float)
    counts = np.isfinite(grids).sum(0)
    total = np.where(np.isfinite(grids), grids, 0.0).sum(0)
    return np.where(counts > 0, total / np.maximum(counts, 1), np.nan)


def _heat_panel(ax, axes, policy: str, runs: list[RunResult], layers, metric: str, cmap):
    """One policy's panel of :func:`plot_heatmaps`; returns its image."""
    from fp4lab.gemm.recipe import OPERANDS

    is_under = metric == "underflow"
    vmin, vmax = (0.0, 100.0) if is_under else (0.0, 40.0)
    grid = _heat_grid(runs, layers, metric) * (100 if is_under else 1)
    grid = np.where(np.isfinite(grid), np.clip(grid, vmin, vmax), np.nan)
    im = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, vmin=vmin,
                   vmax=vmax)
    ax.set_title(policy + (f" ({len(runs)} seeds)" if len(runs) > 1 else ""), fontsize=9)
    ax.set_xticks(range(len(OPERANDS)), [o.replace("_", "\n") for o in OPERANDS],
                  fontsize=6)
    ax.set_yticks(range(len(layers)), layers, fontsize=6)
    ax.tick_params(axis="y", labelleft=ax in axes[:, 0])
    return im


def plot_heatmaps(results: list[RunResult], metric: str, path: Path):
    """One panel per policy (the mean over its seeds) of the layer x GEMM-operand map."""
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    panels = [(label(key), [r for r in runs if r.probe_summary])
              for key, runs in groups(results).items()]
    panels = [(p, runs) for p, runs in panels if runs]
    if not panels:
        return
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    layers = sorted({name for _, runs in panels for r in runs for name in r.probe_summary},
                    key=layer_order)  # every size's layers (a shallower model's: grey)
    fig = Figure(figsize=(2.4 * cols + 2.2, 0.2 * len(layers) * rows + 1.8),
                 layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True)
    is_under = metric == "underflow"
    cmap = matplotlib.colormaps["magma_r" if is_under else "viridis"].with_extremes(
        bad="#dddddd")
    im = None
    for ax, (policy, runs) in zip(axes.flat, panels, strict=False):  # the grid's spare cells: hidden below
        im = _heat_panel(ax, axes, policy, runs, layers, metric, cmap)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.colorbar(im, ax=axes, shrink=0.6,
                 label="underflow %" if is_under else "SQNR dB (clipped at 40)")
    fig.suptitle(f"{'underflow' if is_under else 'SQNR'} per layer and GEMM operand "
                 "(mean over probe steps and seeds; grey: not quantized)", fontsize=10)
    _save_png(fig, path)
