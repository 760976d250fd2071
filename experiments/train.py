"""Train the hybrid LM under a precision policy: :func:`train` runs (or resumes) one
experiment in a folder and returns its result; :func:`main` is its command line.

A run's concepts each have their module: its checked specification
(``experiments.run_spec``), its setup (``experiments.setup``), its checkpoints and resume
(``experiments.checkpoints``), the loop with Ctrl-C and divergence (``experiments.loop``)
and several processes (``experiments.processes``). The pure state, optimizer, loss and step
are in ``experiments.step``, the files a run writes in ``experiments.records``, the probe
records in ``experiments.probe_records``; what a run does and records: docs/experiments.md ("One
run").

    python -m experiments.train --config experiments/configs/default.py train.steps=300 \
        precision.policy=nemotron3 --workdir results/runs/nemotron3
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from experiments import runinfo
from experiments.checkpoints import Checkpoints, resume
from experiments.commands import command
from experiments.data import TextData
from experiments.loop import Interval, Loop, StepLog, StopOnInterrupt, TrainingInterrupted
from experiments.probe_records import summarize_probes, underflow_by_kind
from experiments.processes import (DISTRIBUTED_TIMEOUT_S, checked_timeout, connect_collectives,
                                   initialize_distributed, sync)
from experiments.records import RunRecords
from experiments.run_spec import RunSpec, specify
from experiments.run_files import read_run_json
from experiments.setup import Setup, build

__all__ = ["train", "main"]


def start_run_info(records: RunRecords, record: dict, start: int) -> dict:
    """``run_info.json`` of this start of the run (a resumed run keeps the earlier starts'
    under ``earlier``, without their config); returns it."""
    earlier = []
    path = records.out / "run_info.json"
    if start and records.write and path.exists():
        old = read_run_json(records.out, "run_info.json")
        earlier = old.pop("earlier", []) + [{k: v for k, v in old.items() if k != "config"}]
    info = runinfo.collect(record, start_step=start, earlier=earlier)
    records.write_run_info(info)
    return info


_STEP_KEYS = {"step", "loss", "total_loss", "grad_norm", "lr", "tokens_per_s"}


def _result(config, setup: Setup, records: RunRecords, probe_history: list[dict],
            val_loss: float, started: float) -> dict:
    t, d = config.train, config.data
    steps = records.read("loss")
    rates = [r["tokens_per_s"] for r in steps if "tokens_per_s" in r]
    tail = max(1, len(steps) // 10)
    summary = summarize_probes(probe_history)
    return {
        "name": config.name, "policy": config.precision.policy, "status": "ok",
        "policy_sha256": setup.spec.record["precision"]["policy_sha256"],
        "data": setup.spec.data.record(),
        "steps": t.steps, "tokens": t.steps * d.batch_size * d.seq_len,
        "params": int(sum(x.size for x in jax.tree.leaves(setup.params))),
        "final_train_loss": float(np.mean([r["loss"] for r in steps[-tail:]])),
        "val_loss": val_loss,
        "tokens_per_s": float(np.median(rates)) if rates else float("nan"),
        "probes_fused": bool(config.probes.fused and config.probes.every),
        "wall_s": time.perf_counter() - started, "devices": len(setup.place.devices),
        "platform": setup.place.devices[0].platform,
        "underflow_by_kind": underflow_by_kind(summary),
        "probe_summary": summary,
        "layers": {a.path: a.recipe.name if a.recipe else "-"
                   for a in setup.qmodel.explain({"params": setup.params}, setup.sample)},
        "config_changes": records.config_changes(),
        # the mean over the steps of every further per-step metric (mtp_grad_survival, ...)
        "step_metric_means": {k: float(np.mean([r[k] for r in steps if k in r]))
                              for k in sorted({k for r in steps for k in r} - _STEP_KEYS)},
    }


def train(run: RunSpec | object, workdir, *, data: TextData | None = None,
          progress: bool = True, allow_changes=()) -> dict:
    """Run (or resume) one experiment in ``workdir``; returns the result dict, also written
    atomically to ``workdir/result.json``.

    ``run``: a checked :class:`~experiments.run_spec.RunSpec` (a sweep's plan check builds
    one per run), or a config, checked here before anything loads
    (:func:`~experiments.run_spec.specify`; ``data``: its data already loaded). A new
    folder starts the run; a folder holding a checkpoint resumes its latest one bit-exactly
    (batches and stochastic-rounding keys are functions of the step; the metrics written
    after the checkpoint are dropped and recomputed), but only if its ``config.json``
    (:func:`~experiments.run_spec.config_record`) equals this run's record, except for the
    keys (``"train.steps"``) or sections (``"train"``) in ``allow_changes``, which
    ``config_changes.jsonl`` and the result then record; otherwise ValueError naming the
    keys (:func:`~experiments.run_spec.describe_changes`). Every device takes part (data
    parallelism); in a multi-process run (``jax.distributed``) only process 0 writes files
    and every process saves and restores the checkpoints in the shared ``workdir``. A
    non-finite loss or gradient saves the last good state and raises
    :class:`~experiments.loop.TrainingDiverged`; Ctrl-C stops after the step in progress,
    saves and raises :class:`~experiments.loop.TrainingInterrupted`."""
    workdir = Path(workdir).resolve()
    if workdir.exists() and not workdir.is_dir():
        raise NotADirectoryError(f"workdir {str(workdir)!r} is a file: a run's files need a "
                                 "folder (a new one, or the run's to resume it)")
    connect_collectives()  # (jax.distributed initialized by the caller: done here, once)
    spec = run if isinstance(run, RunSpec) else specify(run, data)
    config = spec.config
    if config.compile_cache:
        jax.config.update("jax_compilation_cache_dir", str(Path(config.compile_cache).resolve()))
    setup = build(spec)
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpoints(workdir)
    # process 0 writes the run's files; the others write none and read process 0's
    writer = jax.process_index() == 0
    records = RunRecords(workdir, write=writer)
    if writer:
        ckpt.remove_partial()
    state = resume(ckpt, records, setup, allow_changes)
    start = int(state.step)
    info = start_run_info(records, setup.spec.record, start)
    sync("resumed")  # process 0 has rewritten metrics.jsonl for the others to read
    t, d = config.train, config.data
    with (records,
          tqdm(total=t.steps, initial=start, desc=config.name, unit="step",
               disable=not (progress and writer), dynamic_ncols=True) as bar,
          StopOnInterrupt() as stop):
        log = StepLog(records, bar, d.batch_size * d.seq_len,
                      Interval(start, time.perf_counter()))
        started = time.perf_counter()
        loop = Loop(config, setup, ckpt, records, log, stop, state,
                    probe_history=records.read("probes"))
        val_loss = loop.run(start)
    sync("finished")  # process 0 has written every metric for the others to read
    result = _result(config, setup, records, loop.probe_history, val_loss, started)
    result["run_info"] = info
    records.write_result(result)
    return result


def _parser(default: str):
    import argparse

    from experiments.configs import keys_help

    ap = argparse.ArgumentParser(
        description="Train the hybrid LM under a precision policy.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=keys_help(default))
    ap.add_argument("--config", default=default)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--distributed", action="store_true", help="call "
                    "jax.distributed.initialize() first (one process per host, or several "
                    "on one machine); without the next three options JAX detects the cluster "
                    "(SLURM, Open MPI, TPU, JAX_COORDINATOR_ADDRESS, ...)")
    ap.add_argument("--coordinator", metavar="HOST:PORT",
                    help="with --distributed: process 0's address, e.g. 127.0.0.1:12345")
    ap.add_argument("--num-processes", type=int, metavar="N",
                    help="with --distributed: the number of processes")
    ap.add_argument("--process-id", type=int, metavar="I",
                    help="with --distributed: this process's index, 0 to N-1")
    ap.add_argument("--distributed-timeout", type=float, metavar="SECONDS",
                    help="with --distributed: how long a process waits for the others (to "
                         "start and connect, at the run's barriers: a peer still loading or "
                         f"compiling) before it fails; default {DISTRIBUTED_TIMEOUT_S}")
    ap.add_argument("--allow-changes", default="", metavar="KEYS",
                    help="comma-separated config keys or sections (train.steps, train) that "
                         "may differ from the run in --workdir: continue it with the new "
                         "values (recorded in config_changes.jsonl)")
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. train.steps=300")
    return ap


def _initialize_distributed(args, ap):
    """``--distributed``: join the processes of the run before JAX touches a device
    (:func:`initialize_distributed`; the options not given are auto-detected by JAX; on CPU
    its collectives use gloo)."""
    given = [args.coordinator, args.num_processes, args.process_id, args.distributed_timeout]
    if not args.distributed:
        if any(v is not None for v in given):
            ap.error("--coordinator, --num-processes, --process-id and --distributed-timeout "
                     "need --distributed")
        return
    try:
        timeout_s = checked_timeout(DISTRIBUTED_TIMEOUT_S if args.distributed_timeout is None
                                     else args.distributed_timeout)
    except ValueError as e:
        ap.error(f"--distributed-timeout: {e}")
    initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                           timeout_s=timeout_s)


@command
def main(argv=None) -> int:
    """``python -m experiments.train``: one run (:func:`train`) of ``--config`` with
    ``key=value`` overrides in ``--workdir``; prints the result. Exit status 0, 130 after
    Ctrl-C (the run saved; the same command resumes it), 2 for a user's mistake
    (``experiments.commands.command``)."""
    from experiments.configs import load_config

    default = str(Path(__file__).parent / "configs" / "default.py")
    ap = _parser(default)
    args = ap.parse_args(argv)
    _initialize_distributed(args, ap)
    config = load_config(args.config, args.overrides)
    allow = tuple(k for k in args.allow_changes.split(",") if k)
    try:
        r = train(config, args.workdir, allow_changes=allow)
    except TrainingInterrupted as e:
        print(f"\n{e}", file=sys.stderr)
        return 130
    if jax.process_index() == 0:
        print(json.dumps({k: v for k, v in r.items()
                          if k not in ("probe_summary", "layers", "run_info")},
                         indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
