"""A list stage: the batch's decoded lists in, the same number of lists out (one per query, in order)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from recsvc.recommender.api import RecQuery, RecResult


class ListStage(Protocol):
    def __call__(self, queries: Sequence[RecQuery], results: list[RecResult]) -> list[RecResult]: ...
