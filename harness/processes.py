"""Ending a child process the tests or drills started: SIGTERM, then SIGKILL when it does not exit in time."""

from __future__ import annotations

import subprocess


def stop(proc: subprocess.Popen, timeout_s: float = 20.0) -> int:
    """Terminate ``proc`` and wait for it (killed after ``timeout_s``) -> its exit code."""
    proc.terminate()
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
