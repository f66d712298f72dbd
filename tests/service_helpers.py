"""Shared helpers for the service tests (no tests here): waiting for a condition, an RPC's status."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import grpc


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0, poll_s: float = 0.01) -> None:
    """Polls ``condition`` every ``poll_s`` until it holds; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(poll_s)


def status_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """(code, details) of ``call``'s RPC: OK and "" when it returns, the RpcError's otherwise."""
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def json_line(line: str) -> dict:
    """One line of the service's JSON log as a dict ({} for other libraries' stray lines)."""
    try:
        entry = json.loads(line)
    except json.JSONDecodeError:
        return {}
    return entry if isinstance(entry, dict) else {}


class Records(logging.Handler):
    """Collects the records of the ``recsvc`` loggers (they may not propagate to the root)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
