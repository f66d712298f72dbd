"""Shipped code, docs and the Makefile stand alone: no tracked file outside tests/ cites a path outside the
repository (../shared) or a document the repository does not ship (ALGORITHMS.md, PERFORMANCE.md), or speaks of
the tooling that lent a machine to a benchmark run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CITATIONS = ("../shared", "ALGORITHMS.md", "PERFORMANCE.md")
TOOLING = ("can_start_another", "device tool", "lent to this task")


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout: {exc}")
    return [name for name in out.stdout.decode().split("\0") if name and not name.startswith("tests/")]


def _hits(needles: tuple[str, ...]) -> list[str]:
    hits = []
    for name in _tracked():
        path = REPO / name
        if not path.is_file():  # deleted in the working tree
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # binary
            continue
        for number, line in enumerate(text.splitlines(), 1):
            hits += [f"{name}:{number}: {needle}" for needle in needles if needle in line]
    return hits


def test_no_tracked_file_outside_tests_cites_files_outside_the_repository() -> None:
    hits = _hits(CITATIONS)
    assert not hits, "cited outside the repository:\n" + "\n".join(hits)


def test_no_tracked_file_outside_tests_speaks_of_lent_machines() -> None:
    hits = _hits(TOOLING)
    assert not hits, "\n".join(hits)
