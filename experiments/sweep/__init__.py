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
* ``probes.csv`` and a table in ``results.md``: per policy, the forward operands' SQNR, the
  gradient operands' noise ratio, the forward input's block dynamic range and the share of
  blocks Four Over Six maps to 4, averaged over layers, probe steps and seeds;
* ``underflow_heatmap.png`` and ``sqnr_heatmap.png``: layer x GEMM-operand maps, one panel per
  policy (mean over the probe steps and seeds; grey: the operand is not quantized).

The package, one job per module (every file is written atomically,
``experiments.records.write_atomic``):

* :mod:`~experiments.sweep.plan`: which runs a config asks for (seeds, sizes, variants,
  policies) and the config each trains;
* :mod:`~experiments.sweep.run`: checking the plan, training, reusing or resuming stored runs,
  failures, shards, collecting what exists;
* :mod:`~experiments.sweep.result`: :class:`RunResult`, a run's typed result (built from its
  ``result.json`` in one place, with the defaults of keys older results lack), and how
  results group and pair by seed;
* :mod:`~experiments.sweep.report`: the tables and the CSV/Markdown reports (cells by
  :mod:`experiments.tables`); :mod:`~experiments.sweep.plots`: the figures;
* :mod:`~experiments.sweep.cli`: the command line.

Before any run trains, the whole plan is checked (:func:`check_plan`: every run's config,
policy and data), so that a mistake in the last run fails at once. Each run's result is
written when it finishes; rerunning the command skips finished runs (and resumes an
interrupted one from its checkpoint), but only those trained with the same config and under
a policy that says the same (its ``config.json`` holds the policy's rules and their hash):
after a ``file:`` policy is edited, its runs are refused, not reported under the new
content. A run that fails is recorded with status
``failed`` and its error, and the sweep goes on (``--retry-failed`` runs it again).

Beyond one machine: ``--shard i/n`` runs only the planned runs whose index is ``i`` modulo
``n`` into the shared ``--out`` folder (a job array or several hosts; every run folder
belongs to exactly one shard, and results are written atomically), and ``--report`` merges
what exists into the reports, listing runs without a result as ``missing``; once every shard
has finished, the merged report equals a sequential sweep's.
"""

from experiments.probe_records import layer_order
from experiments.sweep.cli import main, parse_shard
from experiments.sweep.plan import (PlannedRun, Variant, planned_runs, run_config, run_name,
                                    sweep_seeds, sweep_variants)
from experiments.sweep.report import (comparison_table, difference_table, probe_table,
                                      results_table, step_metric_table, write_reports)
from experiments.sweep.result import RunResult
from experiments.sweep.run import check_plan, collect_results, run_sweep

__all__ = ["run_sweep", "check_plan", "collect_results", "planned_runs", "sweep_variants",
           "sweep_seeds", "run_name", "run_config", "Variant", "PlannedRun", "RunResult",
           "results_table", "difference_table", "comparison_table", "probe_table",
           "step_metric_table", "write_reports",
           "parse_shard", "layer_order", "main"]
