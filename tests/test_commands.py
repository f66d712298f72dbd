"""The commands and benches ``recsvc`` is made of are entry points (pyproject.toml): every one declared loads and
registers, the table is what an install writes into the package metadata (and is read from there when there is
no source tree), and a command whose package is missing is skipped while any other import error is raised."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import EntryPoint, distributions
from pathlib import Path

import pytest

import recsvc.cli.main as cli
from recsvc import commands
from recsvc.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
PROJECT_PACKAGES = ("recsvc", "training", "tokenizer_rqvae", "bench")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def subcommand_names(parser: argparse.ArgumentParser) -> list[str]:
    return list(subcommands(parser))


def test_every_declared_command_and_bench_is_registered() -> None:
    assert commands.source_pyproject() == ROOT / "pyproject.toml"  # run from the source tree: its own table
    declared = {group: [ep.name for ep in commands.declared(group)] for group in (commands.COMMANDS, commands.BENCHES)}
    assert {"bench", "build", "serve", "train", "client"} <= set(declared[commands.COMMANDS])
    assert {"decode", "drafters", "gpu-accept", "speculative"} <= set(declared[commands.BENCHES])
    for group in declared:
        assert all(ep.module.split(".")[0] in PROJECT_PACKAGES for ep in commands.declared(group))
    parser = cli.build_parser()
    assert subcommand_names(parser) == declared[commands.COMMANDS]
    assert subcommand_names(subcommands(parser)["bench"]) == declared[commands.BENCHES]
    for name, module in commands.load(commands.BENCHES):
        assert isinstance(module.HELP, str) and module.HELP and callable(module.add_args) and callable(module.run), name


def test_the_table_is_what_an_install_writes_and_is_read_from_the_metadata(tmp_path, monkeypatch) -> None:
    proc = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "egg_info",
                           "--egg-base", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (dist,) = [d for d in distributions(path=[str(tmp_path)]) if d.metadata["Name"] == "recsvc"]
    for group in (commands.COMMANDS, commands.BENCHES):
        written = sorted((ep.name, ep.value) for ep in dist.entry_points.select(group=group))
        assert written == [(ep.name, ep.value) for ep in commands.declared(group)]
    # an installed package (no source tree beside it) reads the metadata: here the one just written comes first
    monkeypatch.setattr(commands, "source_pyproject", lambda: None)
    monkeypatch.syspath_prepend(str(tmp_path))
    from_metadata = [(ep.name, ep.value) for ep in commands.declared(commands.COMMANDS)]
    monkeypatch.undo()
    assert from_metadata == [(ep.name, ep.value) for ep in commands.declared(commands.COMMANDS)]


def test_a_missing_package_is_skipped_and_a_broken_command_raises(tmp_path, monkeypatch) -> None:
    (tmp_path / "broken_command.py").write_text("import no_such_dependency_of_recsvc\n\n\ndef register(sub):\n"
                                                "    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    real = commands.declared(commands.COMMANDS)
    ghost = EntryPoint(name="ghost", value="no_such_package_of_recsvc.cli:register", group=commands.COMMANDS)
    monkeypatch.setattr(commands, "declared", lambda group: [*real, ghost] if group == commands.COMMANDS else [])
    assert "ghost" not in subcommand_names(cli.build_parser())  # its package is not installed: skipped
    broken = EntryPoint(name="broken", value="broken_command:register", group=commands.COMMANDS)
    monkeypatch.setattr(commands, "declared", lambda group: [broken])
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_of_recsvc"):  # installed but broken: raised
        cli.build_parser()


def test_one_command_alone_and_an_unknown_one() -> None:
    parser = argparse.ArgumentParser(prog="recsvc")
    sub = parser.add_subparsers(dest="command")
    cli.register_command("prior", sub)
    assert list(sub.choices) == ["prior"]
    with pytest.raises(UserError, match="no command 'nope' is installed"):
        cli.register_command("nope", sub)
