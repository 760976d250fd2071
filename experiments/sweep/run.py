"""Running the plan: check it whole, train each run (or reuse its stored result, or resume
it), record failures and go on; shards of the plan; collecting what exists for a report.

Before any run trains, the whole plan is checked (:func:`check_plan`: every run's config,
policy and data, and the run stored in its folder). Each run's ``result.json`` is written
when it finishes; rerunning skips finished runs (and resumes an interrupted one from its
checkpoint), but only those trained with the same config and a policy that says the same. A
run that fails is recorded with status ``failed`` and its error (``retry_failed`` runs it
again). ``shard=(i, n)`` runs only the planned runs whose index is ``i`` modulo ``n``.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import jax

from experiments.data import load_data
from experiments.records import write_json_atomic
from experiments.run_spec import RunSpec, describe_changes, specify, stored_changes
from experiments.run_files import read_run_json
from experiments.sweep.plan import PlannedRun, planned_runs, run_config
from experiments.sweep.report import write_reports
from experiments.sweep.result import RunResult, identity
from experiments.train import train

__all__ = ["check_plan", "run_sweep", "collect_results"]


def _check_compare(config, runs: list[PlannedRun]) -> None:
    """``sweep.compare``: every entry a pair of policies the sweep runs."""
    named = {r.policy for r in runs}
    for pair in config.sweep.get("compare", ()):
        if len(pair) != 2 or not set(pair) <= named:
            raise ValueError(f"sweep.compare entry {pair!r} must be a pair of policies the "
                             f"sweep runs ({', '.join(sorted(named))})")


def check_plan(config, runs: list[PlannedRun], runs_dir: Path) -> dict[str, RunSpec]:
    """Check every run of the plan before any trains (a mistake fails now, not after hours
    of earlier runs): its config, its policy, its data (loaded once per ``data`` section),
    the devices, and the run stored in its folder, which is reused or resumed only if it was
    trained with the same config and a policy that says the same (its hash). Returns each
    run's checked :class:`~experiments.run_spec.RunSpec`, by run name: what ``train`` takes."""
    _check_compare(config, runs)
    loaded, specs = {}, {}

    def load_once(d):  # the data of each data section, loaded once
        key = json.dumps(d.to_dict(), sort_keys=True, default=str)
        if key not in loaded:
            loaded[key] = load_data(d)
        return loaded[key]

    for run in runs:
        c = run_config(config, run)  # a variant's unknown key fails here
        try:
            spec = specify(c, load=load_once)
        except ValueError as e:
            raise ValueError(f"sweep run {run.name!r}: {e}") from e
        changes = stored_changes(runs_dir / run.name, spec.record, spec.data)
        if changes:
            raise ValueError(f"{runs_dir / run.name} holds {describe_changes(changes, run.policy)}"
                             ": its results are not this sweep's. Use another --out, or "
                             "remove that folder to train the run again")
        specs[run.name] = spec
    return specs


def _stored(done: Path, run: PlannedRun) -> RunResult:
    """The result the run's folder holds (``done``: its ``result.json``)."""
    return RunResult.from_record(read_run_json(done.parent, done.name), run)


def _run_one(spec: RunSpec, run: PlannedRun, runs_dir: Path, retry_failed: bool,
             progress: bool) -> RunResult:
    """The run's stored result (a failed one only without ``retry_failed``), or train it (or
    resume it from its checkpoint); a run that raises is recorded as failed."""
    workdir = runs_dir / run.name
    done = workdir / "result.json"
    if done.exists():
        result = _stored(done, run)
        if result.ok or not retry_failed:
            return result
    try:
        return RunResult.from_record(train(spec, workdir, progress=progress), run)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # recorded, and the sweep goes on
        workdir.mkdir(parents=True, exist_ok=True)
        record = {**identity(run), "status": "failed", "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc(limit=8)}
        write_json_atomic(done, record)
        print(f"run {run.name} FAILED: {record['error']}")
        return RunResult.from_record(record)


def run_sweep(config, out: str | Path, *, retry_failed: bool = False, progress: bool = True,
              shard: tuple[int, int] | None = None) -> list[RunResult]:
    """Train every planned run (skipping finished ones), write the reports, and return the
    results in sweep order. ``shard=(i, n)``: only the runs whose index in the plan is
    ``i`` modulo ``n`` (jobs of an array, or hosts, sharing ``out``: each run folder belongs
    to one shard), and no reports: :func:`collect_results` and
    :func:`experiments.sweep.report.write_reports` merge what exists (``--report``)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"the sweep's output {str(out)!r} is a file, not a folder")
    if not config.get("compile_cache") and not jax.config.jax_compilation_cache_dir:
        # the seeds of a policy compile one program (JAX's own cache, where one is set, serves)
        config = config.copy_and_resolve_references()
        config.compile_cache = str(out / "compile_cache")
    runs, runs_dir = planned_runs(config), out / "runs"
    specs = check_plan(config, runs, runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    if shard is not None:
        runs = [r for k, r in enumerate(runs) if k % shard[1] == shard[0]]
    results = [_run_one(specs[r.name], r, runs_dir, retry_failed, progress) for r in runs]
    if shard is None:
        write_reports(results, out, config.sweep.get("compare", ()))
    return results


def collect_results(config, out: str | Path) -> list[RunResult]:
    """The result of every planned run found under ``out/runs``, in sweep order; a run with
    no result yet has status ``missing``."""
    results = []
    for run in planned_runs(config):
        done = Path(out) / "runs" / run.name / "result.json"
        results.append(_stored(done, run) if done.exists() else RunResult.from_record(
            {"status": "missing", "error": "no result yet"}, run))
    return results
