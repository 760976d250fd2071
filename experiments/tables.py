"""The cells and Markdown tables every analysis report writes (the sweep, rollout, residual,
ssm_state): one home for how an interval, a yes/no verdict, a rounded number and a table
read, so that the reports (and the README/docs tables generated from them) agree.

* :func:`markdown_table`: a GitHub table, ``| a | b |`` lines under a ``|---|---|`` rule;
* :func:`interval_cell`: ``[low, high]`` of an :class:`experiments.stats.Interval` in a
  format spec, empty where there is no interval (fewer than two samples);
* :func:`yes_no`: ``yes`` / ``no``, empty for ``None`` (no verdict);
* :func:`rounded`: a number rounded for a table or CSV, empty where it is not finite;
* :func:`number_cell`: a number in a format spec, empty where it is not finite.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["markdown_table", "interval_cell", "yes_no", "rounded", "number_cell"]


def markdown_table(header: Sequence, rows: Iterable[Sequence]) -> str:
    """The Markdown table of ``header`` and ``rows`` (each cell through ``str``), one line
    each and a final newline; a row is not checked against the header's length."""
    lines = ["| " + " | ".join(str(v) for v in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def interval_cell(interval, spec: str = ".2f") -> str:
    """``[low, high]`` of ``interval`` (anything with ``low`` and ``high``, e.g.
    :class:`experiments.stats.Interval`), both in the format ``spec`` (``".2f"``,
    ``"+.3f"``, ``".2e"``); ``""`` when ``low`` is not finite (no interval: one sample)."""
    if not math.isfinite(interval.low):
        return ""
    return f"[{interval.low:{spec}}, {interval.high:{spec}}]"


def yes_no(flag: bool | None) -> str:
    """``"yes"`` for a true ``flag``, ``"no"`` for a false one, ``""`` for ``None`` (no
    verdict, e.g. :attr:`experiments.stats.Interval.distinguishable` without an interval)."""
    if flag is None:
        return ""
    return "yes" if flag else "no"


def rounded(value, digits: int):
    """``value`` rounded to ``digits`` decimals (``round``: a number, kept numeric for CSV;
    ``digits=0``: an integer), or ``""`` when it is not finite."""
    if not math.isfinite(value):
        return ""
    return round(value, digits) if digits else round(value)


def number_cell(value, spec: str) -> str:
    """``value`` in the format ``spec`` (``".4f"``), or ``""`` when it is not finite."""
    return f"{value:{spec}}" if math.isfinite(value) else ""
