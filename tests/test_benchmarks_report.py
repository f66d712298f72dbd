"""BENCHMARKS.md stays a short report: the summary table first, at most 400 lines (superseded figures leave for
docs/HISTORY.md, at most 200 lines, or git)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_benchmarks_is_a_short_report_that_opens_with_its_summary() -> None:
    lines = (ROOT / "BENCHMARKS.md").read_text().splitlines()
    assert len(lines) <= 400, f"BENCHMARKS.md has {len(lines)} lines: move superseded figures to docs/HISTORY.md"
    headings = [line for line in lines if line.startswith("## ")]
    assert headings and headings[0] == "## Summary", headings[:3]
    history = (ROOT / "docs" / "HISTORY.md").read_text().splitlines()
    assert len(history) <= 200, f"docs/HISTORY.md has {len(history)} lines"
