"""Structured logs: one JSON object per line (``ts``, ``level``, ``logger``, ``event`` and event fields)."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

# A library does not print by default: without configure_json_logging() records go nowhere (no lastResort).
logging.getLogger("recsvc.service").addHandler(logging.NullHandler())


class JsonFormatter(logging.Formatter):
    """Formats a record as a single JSON line; fields passed via ``extra={"fields": {...}}`` are merged, and
    ``static`` fields (e.g. a ``recsvc serve --processes N`` worker's ``worker`` index and ``pid``) go on every
    line."""

    def __init__(self, static: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
            **self.static,
        }
        entry.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class CurrentStderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever ``sys.stderr`` is when a record is emitted (as logging's own last-resort
    handler does): a server started where stderr was later replaced or closed (a test harness capturing
    output, a daemon re-pointing its streams) keeps logging to the live stream instead of a closed one."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.__init__ assigns it; the live sys.stderr wins
        pass


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Logs ``event`` with structured ``fields`` (cheap when the level is disabled)."""
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={"fields": fields})


class EveryInterval:
    """At most one log line per key and interval: :meth:`admit` returns how many events of ``key`` the line
    about to be written stands for (this one and those left unlogged since the key's last line), or 0 when no
    line is due. Thread-safe; the clock is ``time.monotonic``."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[Hashable, float] = {}
        self._pending: dict[Hashable, int] = {}

    def admit(self, key: Hashable) -> int:
        now = time.monotonic()
        with self._lock:
            pending = self._pending.get(key, 0) + 1
            if now - self._last.get(key, -float("inf")) < self.interval_s:
                self._pending[key] = pending
                return 0
            self._last[key] = now
            self._pending[key] = 0
            return pending


def configure_json_logging(level: str | int = "INFO", stream=None, **static: Any) -> None:
    """Routes the ``recsvc`` loggers to JSON lines on stderr (idempotent); ``static`` fields go on every line."""
    handler = logging.StreamHandler(stream) if stream is not None else CurrentStderrHandler()
    handler.setFormatter(JsonFormatter(static))
    root = logging.getLogger("recsvc")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


# `recsvc serve`'s own lines (start-up steps, calibration, worker processes, draining) share one logger name
SERVE_LOGGER = "recsvc.service.cli"
Step = Callable[..., None]  # step(event, level=INFO, **fields): how start-up reports each step


def log_step(event: str, level: int = logging.INFO, **fields: Any) -> None:
    """A ``recsvc serve`` line (the default ``Step``)."""
    log_event(logging.getLogger(SERVE_LOGGER), event, level, **fields)
