"""Structured JSON logs: one object per line, and a handler that follows the live sys.stderr."""

from __future__ import annotations

import io
import json
import logging
import sys

from recsvc.service.observability.logs import configure_json_logging, log_event


def test_json_lines_with_static_and_event_fields() -> None:
    out = io.StringIO()
    configure_json_logging("INFO", stream=out, worker=1)
    log_event(logging.getLogger("recsvc.service.test"), "rpc", method="Recommend", ms=1.5)
    entry = json.loads(out.getvalue().strip())
    assert entry["event"] == "rpc" and entry["worker"] == 1 and entry["method"] == "Recommend"
    assert entry["level"] == "info" and entry["logger"] == "recsvc.service.test" and entry["ts"].endswith("Z")
    logging.getLogger("recsvc").handlers[:] = [logging.NullHandler()]


def test_default_handler_follows_replaced_stderr(monkeypatch) -> None:
    """Configured while stderr was one stream that is closed later: records go to the current sys.stderr
    (a closed stream would raise 'I/O operation on closed file' inside logging)."""
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_json_logging("INFO")
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    log_event(logging.getLogger("recsvc.service.test"), "after-close", n=2)
    assert json.loads(second.getvalue().strip())["event"] == "after-close"
    logging.getLogger("recsvc").handlers[:] = [logging.NullHandler()]
