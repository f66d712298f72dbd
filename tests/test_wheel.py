"""The wheel ships the product only: ``recsvc/``, ``recsvc_base/``, ``tokenizer_rqvae/`` and ``training/``, no
``bench/``, ``harness/`` or ``tests/`` module (pyproject.toml's ``packages.find``); installed from it, ``recsvc``
reads the table from the wheel's metadata and skips ``recsvc bench``, whose package is not there.

The wheel is built from a copy of the source tree (setuptools writes ``build/`` and ``*.egg-info`` beside the
sources, and a stale ``build/lib`` would add its files to the wheel), offline: ``pip wheel --no-deps
--no-build-isolation`` with the setuptools of this environment.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = {"recsvc", "recsvc_base", "tokenizer_rqvae", "training"}
NOT_SHIPPED = ("bench", "harness", "tests")
RUN_OUTPUT = {"artifacts", "build", "cache", "data", "dist", "logs", "runs"}  # not sources (.gitignore)


def source_copy(dest: Path) -> Path:
    """pyproject.toml, README.md (the project's readme) and every top-level folder that holds Python source."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for d in sorted(ROOT.iterdir()):
        if (d.is_dir() and not d.name.startswith(".") and d.name not in RUN_OUTPUT
                and not d.name.endswith(".egg-info") and next(d.rglob("*.py"), None) is not None):
            shutil.copytree(d, dest / d.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if importlib.util.find_spec("pip") is None or importlib.util.find_spec("setuptools") is None:
        pytest.skip("pip or setuptools is not installed: no wheel can be built offline")
    tmp = tmp_path_factory.mktemp("wheel")
    src = source_copy(tmp / "src")
    assert all((src / name).is_dir() for name in (*PRODUCT, *NOT_SHIPPED))  # the tree holds what must stay out
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(tmp / "dist")],
                          cwd=tmp, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = (tmp / "dist").glob("recsvc-*.whl")
    return built


def test_the_wheel_holds_the_product_and_no_bench_harness_or_tests(wheel) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == PRODUCT
    assert [n for n in names if n.split("/")[0] in NOT_SHIPPED] == []
    for package in ("recsvc/service/rpc/server.py", "recsvc/commands.py", "recsvc_base/__init__.py",
                    "tokenizer_rqvae/trie.py", "training/cli.py", "training/drafters/api.py"):
        assert package in names
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert set(zipfile.ZipFile(wheel).read(top_level).decode().split()) == PRODUCT


PROBE = """
import importlib.util, sys
from recsvc import commands
import recsvc.cli.main as cli
assert commands.source_pyproject() is None, "read the source tree's table"
assert commands.__file__.startswith(sys.argv[1]), commands.__file__
assert importlib.util.find_spec("bench") is None and importlib.util.find_spec("harness") is None
declared = [ep.name for ep in commands.declared(commands.COMMANDS)]
assert "bench" in declared, declared
(action,) = [a for a in cli.build_parser()._actions if a.dest == "command"]
print(" ".join(sorted(action.choices)))
"""


def test_installed_from_the_wheel_recsvc_skips_the_benches(wheel, tmp_path) -> None:
    """The wheel unpacked (what ``pip install`` lays out) ahead of this environment's site-packages, without this
    checkout (no ``.pth`` file is read: ``python -S``): the commands come from the wheel's metadata, ``bench`` is
    declared there and skipped, the others load."""
    installed = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(installed)
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), sysconfig.get_paths()["purelib"]]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-S", "-c", PROBE, str(installed)], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shown = set(proc.stdout.split())
    assert "bench" not in shown
    assert {"serve", "client", "train", "build", "data"} <= shown
