"""experiments.tables: the cells and Markdown tables the analyses' reports share."""

import math

from experiments.stats import Interval, mean_interval
from experiments.tables import interval_cell, markdown_table, number_cell, rounded, yes_no


def test_markdown_table_reads_as_the_reports_wrote_it():
    assert markdown_table(["a", "b c"], [[1, ""], ["x", 2.5]]) == (
        "| a | b c |\n|---|---|\n| 1 |  |\n| x | 2.5 |\n")
    assert markdown_table(["only"], []) == "| only |\n|---|\n"


def test_interval_cells_are_empty_without_an_interval():
    iv = Interval(mean=0.5, low=-0.1234, high=1.1234, n=3)
    assert interval_cell(iv) == "[-0.12, 1.12]"
    assert interval_cell(iv, "+.3f") == "[-0.123, +1.123]"
    assert interval_cell(iv, ".2e") == "[-1.23e-01, 1.12e+00]"
    assert interval_cell(mean_interval([1.0])) == ""  # one sample: no interval
    assert interval_cell(mean_interval([])) == ""


def test_yes_no_and_numbers():
    assert [yes_no(v) for v in (True, False, None)] == ["yes", "no", ""]
    assert [yes_no(iv.distinguishable) for iv in (
        Interval(1.0, 0.5, 1.5, 3), Interval(0.0, -1.0, 1.0, 3), Interval(1.0, math.nan,
                                                                           math.nan, 1))] == [
        "yes", "no", ""]
    assert rounded(2.34567, 2) == 2.35 and rounded(1234.6, 0) == 1235
    assert isinstance(rounded(1234.6, 0), int)
    assert rounded(math.nan, 2) == "" and rounded(math.inf, 0) == ""
    assert number_cell(0.123456, ".4f") == "0.1235" and number_cell(math.nan, ".4f") == ""
