"""Following a `recsvc serve` child's JSON log: every line kept with its arrival time, and a wait for an event."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from dataclasses import dataclass, field


@dataclass
class ServeLog:
    """The JSON log lines of ``proc``'s stderr as (arrival time, entry), read by a daemon thread (``follow``)."""

    proc: subprocess.Popen
    events: list[tuple[float, dict]] = field(default_factory=list)

    def follow(self) -> ServeLog:
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        for line in self.proc.stderr:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(entry, dict):
                self.events.append((time.monotonic(), entry))

    def event(self, name: str, after: int = 0, timeout_s: float = 120.0) -> tuple[float, dict]:
        """The first event ``name`` from the ``after``-th line on -> (its arrival time, the entry); RuntimeError
        when the server exits or ``timeout_s`` passes first (with the last lines)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for at, entry in self.events[after:]:
                if entry.get("event") == name:
                    return at, entry
            if self.proc.poll() is not None:
                raise RuntimeError(f"recsvc serve exited ({self.proc.returncode})")
            time.sleep(0.01)
        raise RuntimeError(f"no {name} event within {timeout_s} s; last: {[e for _, e in self.events[-10:]]}")
