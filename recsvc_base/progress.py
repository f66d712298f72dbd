"""Progress bars that suit where the output goes: every progress bar of the code base is made here.

:func:`progress_bar` takes tqdm's arguments (iterable, ``total``, ``desc``, ``unit``, ``leave``, ...) plus
``enabled`` (the caller's own switch: ``--quiet``, not the main process) and picks one of three forms:

- ``bar``: tqdm's redrawn bar (``\\r`` redraws). The default when the bar's stream (stderr) is a terminal.
- ``line``: plain log lines, for batch runs whose output goes to a file or a pipe: at most one progress line
  per interval (60 s, ``RECSVC_PROGRESS_INTERVAL_S``) across all bars of the process, and a closing line for a
  bar that ran at least that long (``train epoch 1/3: 100% 812/812 [12:03<00:00, 1.12it/s, loss=2.914]``);
  a shorter bar prints nothing. The default when the stream is not a terminal.
- ``off``: nothing.

``RECSVC_PROGRESS=bar|line|off`` (``recsvc --progress ...`` sets it) overrides the choice; ``TQDM_DISABLE=1``
(tqdm's own switch) silences every bar, whatever else is set. ``enabled=False`` is ``off``.
:func:`quiet_library_bars` (the ``recsvc`` console script calls it first) makes the libraries' own bars
follow: off unless the mode is ``bar``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, TextIO

from tqdm import tqdm

MODES = ("auto", "bar", "line", "off")
ENV_MODE = "RECSVC_PROGRESS"
ENV_INTERVAL = "RECSVC_PROGRESS_INTERVAL_S"
DEFAULT_INTERVAL_S = 60.0
_TRUE = ("1", "true", "yes", "on")


def _interval_s() -> float:
    try:
        return max(float(os.environ.get(ENV_INTERVAL, DEFAULT_INTERVAL_S)), 0.0)
    except ValueError:
        return DEFAULT_INTERVAL_S


def progress_mode(stream: TextIO | None = None, enabled: bool = True) -> str:
    """``"bar"``, ``"line"`` or ``"off"`` for a bar writing to ``stream`` (default: stderr)."""
    if not enabled or os.environ.get("TQDM_DISABLE", "").strip().lower() in _TRUE:
        return "off"
    asked = os.environ.get(ENV_MODE, "auto").strip().lower() or "auto"
    if asked in ("0", "false", "no", "none", "quiet"):
        return "off"
    if asked in ("bar", "line", "off"):
        return asked
    stream = stream if stream is not None else sys.stderr
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a real file
        tty = False
    return "bar" if tty else "line"


class _Clock:
    """When the process last printed a progress line (shared by every line-mode bar: one line per interval)."""

    lock = threading.Lock()
    last = -float("inf")

    @classmethod
    def take(cls, now: float, interval: float) -> bool:
        with cls.lock:
            if now - cls.last < interval:
                return False
            cls.last = now
            return True


class LineProgress(tqdm):
    """A tqdm whose display is a plain line at most once per interval (shared by all bars), and a closing line
    when the bar ran for at least an interval; never a ``\\r``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._interval = _interval_s()
        self._began = time.monotonic()
        self._closing = False
        self._written: str | None = None
        # how often an update looks at the clock (a cheap check; the interval decides what is written)
        kwargs["mininterval"] = min(max(float(kwargs.get("mininterval") or 0.1), 1.0), self._interval)
        kwargs.setdefault("dynamic_ncols", False)
        super().__init__(*args, **kwargs)
        # the first line of a bar is not written at start: the stage's own log line says what starts

    def _line(self) -> str:
        fmt = dict(self.format_dict)
        fmt["ncols"] = 0  # no bar, only the figures
        fmt["bar_format"] = None
        return self.format_meter(**fmt).strip()

    def _write(self, text: str) -> None:
        if text and text != self._written:  # the closing line repeats no line just written
            self.fp.write(text + "\n")
            self.fp.flush()
            self._written = text

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if self._closing or self.disable:
            return True
        now = time.monotonic()
        if now - self._began >= self._interval and _Clock.take(now, self._interval):
            self._write(self._line())
        return True

    def close(self) -> None:
        if self.disable or self._closing:
            return
        if time.monotonic() - self._began >= self._interval:
            self._write(self._line())  # the summary of a long bar, whatever the clock says
            with _Clock.lock:
                _Clock.last = time.monotonic()
        self._closing = True
        self.fp = _NULL  # tqdm's close writes a bare '\n' or '\r': nothing of it goes out
        super().close()


class _NullStream:
    def write(self, _text: str) -> None:
        pass

    def flush(self) -> None:
        pass


_NULL = _NullStream()


def quiet_library_bars(stream: TextIO | None = None) -> None:
    """Libraries' own bars (Hugging Face: downloads, transformers' "Writing model shards") follow the same
    choice: they are turned off unless the mode is ``bar`` (their settings are read at import, hence the
    environment variable; an imported module is switched off directly)."""
    if progress_mode(stream) == "bar":
        return
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    hub = sys.modules.get("huggingface_hub.utils")
    if hub is not None:
        hub.disable_progress_bars()
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        hf_logging.disable_progress_bar()


def print_record(record: Any, stream: TextIO | None = None) -> None:
    """A command's result record (a JSON-serialisable dict) on stdout: indented for a reader at a terminal, one
    line when the output goes to a file or a pipe (a batch log stays a few lines per step; ``jq`` reads either)."""
    stream = stream if stream is not None else sys.stdout
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):
        tty = False
    stream.write(json.dumps(record, indent=1 if tty else None, default=str) + "\n")
    stream.flush()


def progress_bar(iterable: Iterable | None = None, *, enabled: bool = True, **kwargs: Any) -> tqdm:
    """A tqdm-compatible progress bar (``update``, ``set_postfix``, iteration, ``close``) in the form that
    :func:`progress_mode` picks for its stream (``file=``, default stderr)."""
    kwargs.pop("disable", None)  # the choice is made here
    mode = progress_mode(kwargs.get("file"), enabled)
    if mode == "line":
        return LineProgress(iterable, **kwargs)
    return tqdm(iterable, disable=mode == "off", **kwargs)
