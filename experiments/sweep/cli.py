"""The sweep's command line (``python -m experiments.sweep``): train the plan (or a shard of
it) and write the reports, or (``--report``) merge the results found into the reports."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.commands import command
from experiments.sweep.report import write_reports
from experiments.sweep.run import collect_results, run_sweep

__all__ = ["parse_shard", "parser", "main"]


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


def parser() -> argparse.ArgumentParser:
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


def _arguments(argv):
    """The parsed command line and its shard (``None``: all runs); a contradiction or a
    missing ``--report`` folder is the user's mistake."""
    ap = parser()
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
    return args, shard


@command
def main(argv=None):
    from experiments.configs import load_config

    args, shard = _arguments(argv)
    config = load_config(args.config, args.overrides)
    try:
        results = collect_results(config, args.out) if args.report else run_sweep(
            config, args.out, retry_failed=args.retry_failed, progress=not args.quiet,
            shard=shard)
    except KeyboardInterrupt as e:  # TrainingInterrupted: the run in progress saved its state
        print(f"\nsweep interrupted. {e or ''} Finished runs are kept; run the same command "
              "again to continue the sweep.", file=sys.stderr)
        return 130
    status = 0 if all(r.ok for r in results) else 1
    if shard:
        print(f"shard {shard[0]}/{shard[1]}: {len(results)} runs done; merge with "
              f"--report when every shard has finished")
        return status
    print(write_reports(results, Path(args.out), config.sweep.get("compare", ())))
    print(f"wrote {args.out}/results.csv, results.md, loss_curves.png, loss_gap_curves.png, "
          "gap_intervals.png, underflow_heatmap.png, sqnr_heatmap.png")
    return status
