"""A torchrun worker of a recsvc command leaves with its command's exit code and its output flushed, without the
interpreter's teardown; a plain process is left alone."""

from __future__ import annotations

import os
import subprocess
import sys

from recsvc.cli.worker_exit import finish_worker, is_torchrun_worker

PROGRAM = ("import atexit, sys; from recsvc.cli.worker_exit import finish_worker; "
           "atexit.register(lambda: print('teardown ran')); print('written', end=''); "
           "sys.stderr.write('and logged'); finish_worker(3); print(' and returned')")


def _run(world_size: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WORLD_SIZE": world_size}
    return subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=60)


def test_a_worker_exits_with_its_code_and_flushed_output() -> None:
    proc = _run("2")
    assert proc.returncode == 3
    assert proc.stdout == "written" and proc.stderr == "and logged"  # flushed; no teardown, no return


def test_a_single_process_returns_and_tears_down_normally() -> None:
    proc = _run("1")
    assert proc.returncode == 0
    assert proc.stdout == "written and returned\nteardown ran\n"
    if not is_torchrun_worker():  # this pytest process (not under torchrun): finish_worker returns
        assert finish_worker(0) is None
