"""The commands ``recsvc`` is made of: the entry points that ``pyproject.toml`` declares.

Two groups: ``recsvc.commands`` (the subcommands, ``name = "module:register"``; ``register(subparsers)`` adds the
command) and ``recsvc.benches`` (``recsvc bench NAME``, ``name = "module"``; the module's ``HELP``,
``add_args(parser)`` and ``run(args)``). ``recsvc`` never imports ``training/`` itself: training's commands
declare themselves in these groups, and one whose package is not installed (a service image without
``training/``; ``bench/``, which the wheel does not ship, outside a source tree) is skipped.

Where the entry points are read: run from a source tree (a checkout on ``PYTHONPATH``, an editable install), the
``pyproject.toml`` beside the ``recsvc`` package, so the table always matches the code being run; installed from
a wheel, the installed package's metadata (``importlib.metadata``), which ``pip install`` writes from the same
table.
"""

from __future__ import annotations

import tomllib
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

COMMANDS = "recsvc.commands"
BENCHES = "recsvc.benches"
PROJECT = "recsvc"


def source_pyproject() -> Path | None:
    """The ``pyproject.toml`` of the source tree this ``recsvc`` package was imported from; None when installed."""
    path = Path(__file__).resolve().parents[1] / "pyproject.toml"
    if not path.is_file():
        return None
    with path.open("rb") as f:
        project = tomllib.load(f).get("project", {})
    return path if project.get("name") == PROJECT else None


def from_pyproject(path: Path, group: str) -> list[EntryPoint]:
    """The entry points of ``group`` as ``path``'s ``[project.entry-points."GROUP"]`` table declares them."""
    with path.open("rb") as f:
        table = tomllib.load(f)["project"].get("entry-points", {}).get(group, {})
    return [EntryPoint(name=name, value=value, group=group) for name, value in table.items()]


def declared(group: str) -> list[EntryPoint]:
    """The entry points of ``group``, by name: the source tree's table, else the installed metadata's."""
    source = source_pyproject()
    found = from_pyproject(source, group) if source is not None else list(entry_points(group=group))
    return sorted(found, key=lambda ep: ep.name)


def load(group: str, name: str | None = None) -> list[tuple[str, Any]]:
    """(name, loaded object) of each entry point of ``group`` (only ``name`` when given) whose package is
    installed; one whose package is missing is skipped, any other import error is raised."""
    out: list[tuple[str, Any]] = []
    for ep in declared(group):
        if name is not None and ep.name != name:
            continue
        try:
            obj = ep.load()
        except ModuleNotFoundError as exc:  # a stage not installed must not break the others
            if exc.name and (ep.module == exc.name or ep.module.startswith(exc.name + ".")):
                continue
            raise
        out.append((ep.name, obj))
    return out
