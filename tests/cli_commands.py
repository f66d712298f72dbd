"""Tests' helper: the real ``recsvc`` entry point limited to the commands named (the others may be mid-edit or slow
to import)."""

from __future__ import annotations

import pytest

from recsvc import commands

DECLARED = commands.declared  # the real table (a later call replaces an earlier limit, as a test's own may)


def only_commands(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """``recsvc`` registers only the declared commands ``names`` (each must be declared in pyproject.toml)."""
    found = {ep.name: ep for ep in DECLARED(commands.COMMANDS)}
    assert set(names) <= found.keys(), f"not declared in pyproject.toml: {sorted(set(names) - found.keys())}"

    def limited(group: str):
        return [found[n] for n in names] if group == commands.COMMANDS else DECLARED(group)

    monkeypatch.setattr(commands, "declared", limited)
