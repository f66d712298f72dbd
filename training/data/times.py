"""A log's timestamp as epoch seconds: integer (or decimal) epoch seconds or milliseconds, or ISO-8601.

A number at or above 1e11 is read as milliseconds (1e11 seconds would be the year 5138; 1e11 ms is March 1973),
anything smaller as seconds, so one column may mix the two. ISO-8601 text without a zone is UTC. Parquet
timestamp / date columns arrive as ``datetime`` / ``date`` objects.

>>> parse_time("1714564800"), parse_time(1714564800000), parse_time("2024-05-01T12:00:00Z")
(1714564800.0, 1714564800.0, 1714564800.0)
>>> parse_time("2024-05-01 14:00:00+02:00"), parse_time("2024-05-01")
(1714564800.0, 1714521600.0)
>>> parse_time("yesterday") is None, parse_time("") is None, parse_time(float("nan")) is None
(True, True, True)
"""

from __future__ import annotations

import math
import re
from datetime import UTC, date, datetime
from typing import Any

MS_FROM = 1e11
_NUMBER = re.compile(r"[+-]?\d+(\.\d*)?")
EXPECTED = "integer epoch seconds or milliseconds, or ISO-8601 such as 2024-05-01T12:00:00Z"


def parse_time(value: Any) -> float | None:
    """Epoch seconds of ``value``, or None when it is not a time."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return _from_number(float(value))
    if isinstance(value, datetime):
        return _from_datetime(value)
    if isinstance(value, date):
        return _from_datetime(datetime(value.year, value.month, value.day))
    if not isinstance(value, str):
        return None
    text = value.strip()
    if not text:
        return None
    if _NUMBER.fullmatch(text):
        return _from_number(float(text))
    try:
        return _from_datetime(datetime.fromisoformat(text))
    except ValueError:
        return None


def _from_number(value: float) -> float | None:
    if not math.isfinite(value):
        return None
    return value / 1000.0 if abs(value) >= MS_FROM else value


def _from_datetime(value: datetime) -> float:
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.timestamp()
