"""The files experiments write: one atomic writer, JSON Lines, and a run's records.

* :func:`write_atomic` is the one way an experiment replaces a file (a report, a plot, a
  result, a rewritten log): a reader sees the old file or the new one, never a partial one.
  :func:`write_json_atomic` and :func:`rewrite_jsonl` are built on it;
* :func:`append_jsonl` / :func:`read_jsonl`: one JSON object per line;
* :class:`RunRecords`: the files of one training run in its folder, ``metrics.jsonl`` (step,
  ``val_loss`` and ``probes`` lines), ``config_changes.jsonl``, ``config.json``,
  ``result.json``, ``run_info.json`` (what the run ran on: ``experiments.runinfo``) and the
  TensorBoard event files under ``tb/`` (tensorboardX). A multi-process run has one writer
  (process 0); the other processes' records (``write=False``) write nothing and read the
  writer's files.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from fp4lab.files import write_atomic

__all__ = ["write_json_atomic", "append_jsonl", "read_jsonl", "rewrite_jsonl",
           "RunRecords"]


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON so that a reader sees the old file or the new one, never a partial one."""
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True, default=float) + "\n")


def write_report(out, name: str, records: list[dict], markdown: str) -> None:
    """An analysis's results in ``out``: ``<name>.json`` (every record) and ``<name>.md``
    (its summary), each written atomically; the summary is printed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / f"{name}.json", records)
    write_atomic(out / f"{name}.md", markdown)
    print(markdown)


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_jsonl(path: Path, *records: dict) -> None:
    with Path(path).open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def rewrite_jsonl(path: Path, records: list[dict]) -> None:
    """Replace a JSON Lines file by ``records`` atomically."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


def _writes(method):
    """A method that writes: it does nothing on records that do not write."""
    @functools.wraps(method)
    def write(self, *args, **kwargs):
        if self.write:
            return method(self, *args, **kwargs)
        return None

    return write


class RunRecords:
    """What one run writes in its folder ``out``. ``with records:`` opens the TensorBoard
    writer (``out/tb``) and closes it on the way out; the JSON files need no opening.

    ``write=False``: the records of a process that is not the run's writer (a multi-process
    run's processes other than 0): every write is skipped, reads read the writer's files."""

    def __init__(self, out: Path, *, write: bool = True):
        self.out = Path(out)
        self.write = write
        self.metrics_path = self.out / "metrics.jsonl"
        self.changes_path = self.out / "config_changes.jsonl"
        self._tb = None

    # ---- the start of a run
    @_writes
    def start_fresh(self) -> None:
        """A new run: drop the logs a previous run without a checkpoint left behind."""
        for stale in (self.metrics_path, self.changes_path):
            stale.unlink(missing_ok=True)

    @_writes
    def keep_before(self, step: int) -> None:
        """A resumed run: drop the metrics written after its checkpoint (they are recomputed)."""
        rewrite_jsonl(self.metrics_path, [r for r in read_jsonl(self.metrics_path)
                                          if r["step"] < step])

    @_writes
    def write_config(self, config: dict, step: int, changes: dict) -> None:
        write_json_atomic(self.out / "config.json", config)
        if changes:
            append_jsonl(self.changes_path, {"step": step, "changes": changes})

    # ---- during the run
    @_writes
    def write_run_info(self, info: dict) -> None:
        """``run_info.json``: what the run runs on (``experiments.runinfo.collect``)."""
        write_json_atomic(self.out / "run_info.json", info)

    def __enter__(self):
        if self.write:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.out / "tb"))
        return self

    def __exit__(self, *exc):
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    @_writes
    def scalar(self, tag: str, value: float, step: int) -> None:
        self._tb.add_scalar(tag, value, step)

    @_writes
    def steps(self, records: list[dict]) -> None:
        """Step lines (``{"step", "loss", ...}``), each value also a ``train/`` scalar."""
        append_jsonl(self.metrics_path, *records)
        for rec in records:
            for k, x in rec.items():
                if k not in ("step", "tokens_per_s"):
                    self.scalar(f"train/{k}", x, rec["step"])

    @_writes
    def val_loss(self, step: int, value: float, tb_step: int) -> None:
        append_jsonl(self.metrics_path, {"step": step, "val_loss": value})
        self.scalar("val/loss", value, tb_step)

    @_writes
    def probes(self, rec: dict) -> None:
        """A probe line ``{"step", "probes": {layer: {operand: {metric: value}}}}``; its
        underflow and SQNR are scalars too (NaN: not quantized and inf dB: exact, left out)."""
        for layer, ops in rec["probes"].items():
            for op, m in ops.items():
                for metric in ("underflow", "sqnr_db"):
                    if np.isfinite(m[metric]):
                        self.scalar(f"{metric}/{layer}/{op}", m[metric], rec["step"])
        append_jsonl(self.metrics_path, rec)

    # ---- reading back, and the end of the run
    def read(self, key: str) -> list[dict]:
        """The lines of ``metrics.jsonl`` that hold ``key`` (``"loss"``, ``"probes"``)."""
        return [r for r in read_jsonl(self.metrics_path) if key in r]

    def config_changes(self) -> list[dict]:
        return read_jsonl(self.changes_path)

    @_writes
    def write_result(self, result: dict) -> None:
        write_json_atomic(self.out / "result.json", result)
