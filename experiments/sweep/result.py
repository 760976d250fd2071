"""A sweep run's result as the reports read it, and how results group and pair.

:class:`RunResult` is built in one place, :meth:`RunResult.from_record`, from a run's stored
``result.json`` (or the dict ``experiments.train.train`` returns) and its place in the plan.
The keys that results stored by older versions lack take the defaults of the dataclass's
fields, nowhere else:

* ``name``, ``seed``, ``variant``, ``size``, ``base_variant``, ``reference_variant``: a
  ``result.json`` read without its plan (a notebook), or stored before sweeps had seeds and
  variants: no seed (its runs pair as seed 0), the plain variant, gaps against its own
  variant's baseline runs (a ``None`` in the record, too, is its field's default);
* ``params``, ``underflow_by_kind``, ``probe_summary``, ``layers``: written by later
  versions of ``train``: no parameter count (no gap-vs-size point), no underflow columns, no
  heatmap panel, every operand drawn as quantized;
* ``error``: only failed and missing runs have one.

A finished run (``status`` ``"ok"``) must have ``val_loss``, ``final_train_loss`` and
``tokens_per_s`` (every version wrote them); one without is refused, naming the run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from experiments.sweep.plan import PlannedRun

__all__ = ["RunResult", "identity", "as_results", "Key", "groups", "label", "base_key",
           "finished", "val_by_seed"]

_REQUIRED_OK = ("val_loss", "final_train_loss", "tokens_per_s")


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """One planned run's outcome: what the tables and plots read (``record``: all of it)."""

    policy: str
    status: str  # "ok", "failed" (``error`` says why) or "missing" (no result.json yet)
    name: str = ""  # its folder under runs/ ("": read without its plan)
    seed: int | None = None  # None: read without its plan (pairs as seed 0)
    variant: str = ""  # "" for the plain config
    size: str = ""  # the size's name ("" without sweep.sizes)
    base_variant: str = ""  # whose baseline runs its gaps are against ("": its own)
    reference_variant: str | None = None  # the variant its gaps are compared with
    error: str = ""
    val_loss: float = math.nan
    final_train_loss: float = math.nan
    tokens_per_s: float = math.nan
    params: int | None = None
    underflow_by_kind: Mapping[str, float] = field(default_factory=dict)
    probe_summary: Mapping[str, Any] = field(default_factory=dict)  # layer -> operand -> metrics
    layers: Mapping[str, str] = field(default_factory=dict)  # layer path -> recipe name
    record: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_record(cls, record: Mapping, run: PlannedRun | None = None) -> RunResult:
        """The result of a stored ``result.json`` (or train's dict) ``record``; ``run``: its
        place in the plan, which overrides what the record says of it. Keys the record lacks
        take the fields' defaults (see the module docstring)."""
        record = {**record, **(identity(run) if run is not None else {})}
        missing = [k for k in ("policy", "status") if k not in record]
        if record.get("status") == "ok":
            missing += [k for k in _REQUIRED_OK if k not in record]
        if missing:
            raise ValueError(f"run result {record.get('name', record)!r} has no {missing}")
        known = {f.name for f in fields(cls)} - {"record"}
        return cls(**{k: v for k, v in record.items() if k in known and v is not None},
                   record=record)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def pair_seed(self) -> int:
        """The seed it pairs by with other policies' runs (0 when the record has none)."""
        return 0 if self.seed is None else self.seed


def identity(run: PlannedRun) -> dict:
    """What a result carries of its place in the plan (the reports group and pair by it)."""
    v = run.variant
    return {"name": run.name, "policy": run.policy, "seed": run.seed, "variant": v.name,
            "size": v.size, "base_variant": v.base, "reference_variant": v.reference}


def as_results(results: Iterable[RunResult | Mapping]) -> list[RunResult]:
    """``results`` as :class:`RunResult` (a dict, e.g. a ``result.json`` a notebook read,
    through :meth:`RunResult.from_record`)."""
    return [r if isinstance(r, RunResult) else RunResult.from_record(r) for r in results]


Key = tuple[str, str]  # (variant, policy)


def groups(results: list[RunResult]) -> dict[Key, list[RunResult]]:
    """The results grouped by (variant, policy), in sweep order (the seeds of a policy
    together)."""
    out: dict[Key, list[RunResult]] = {}
    for r in results:
        out.setdefault((r.variant, r.policy), []).append(r)
    return out


def label(key: Key) -> str:
    """``policy`` or ``policy @ variant``."""
    return f"{key[1]} @ {key[0]}" if key[0] else key[1]


def base_key(key: Key, runs: list[RunResult], baseline: str) -> Key:
    """The (variant, policy) of the baseline runs the group's gaps are relative to."""
    return (runs[0].base_variant or key[0], baseline)


def finished(runs: list[RunResult]) -> list[RunResult]:
    """The runs with status ``ok``."""
    return [r for r in runs if r.ok]


def val_by_seed(runs: list[RunResult]) -> dict[int, float]:
    """The final validation loss of each finished run, keyed by its seed."""
    return {r.pair_seed: r.val_loss for r in finished(runs)}
