"""Greedy list assembly under caps: the rule every strategy ends with, and the capacity test of a beam set.

Walking items best first and taking each one whose every capped value still has room gives, for a single
cap over a single-valued attribute (a partition matroid), a list of the largest possible size, and the best
one in the walk's order. With several caps, or values shared by an item, it is the usual greedy heuristic
(every list it returns still satisfies all caps).

    >>> spec = CapSpec([1], [(np.array([0, 1, 2, 3]), np.array([0, 0, 1]), np.array([0, 0, 1]))])  # 3 rows
    >>> greedy_pick(np.array([1, 0, 2]), spec, k=3)          # rows 1 and 0 share value 0: row 0 is skipped
    [0, 2]
    >>> capacity_prefix([np.array([0, 1]), np.array([2])], spec, k=2)   # 2 rows fit once both groups count
    2
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

Column = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # (indptr [n+1], indices [nnz], single [n] or None)


@dataclass(frozen=True)
class CapSpec:
    """One request's caps: at most m[i] items per value of attribute column i."""

    m: Sequence[int]
    columns: Sequence[Column]

    @classmethod
    def none(cls) -> CapSpec:
        return cls([], [])

    @property
    def empty(self) -> bool:
        return not self.m


class CapCounter:
    """Counts per capped value of the items admitted so far."""

    def __init__(self, spec: CapSpec) -> None:
        self.spec = spec
        self.used: list[dict[int, int]] = [{} for _ in spec.m]
        self.fast = len(spec.m) == 1 and spec.columns[0][2] is not None  # one cap, single-valued attribute

    def _values(self, i: int, row: int) -> np.ndarray:
        indptr, indices, _ = self.spec.columns[i]
        return indices[indptr[row]: indptr[row + 1]]

    def admit(self, row: int) -> bool:
        """Take ``row`` if every capped value it has still has room."""
        values = [self._values(i, row) for i in range(len(self.spec.m))]
        for i, vals in enumerate(values):
            if any(self.used[i].get(int(v), 0) >= self.spec.m[i] for v in vals):
                return False
        for i, vals in enumerate(values):
            for v in vals:
                self.used[i][int(v)] = self.used[i].get(int(v), 0) + 1
        return True

    def admit_group(self, rows: np.ndarray) -> int:
        """Take what fits of a group of rows (their order within the group does not change the count for a
        single cap); returns how many were taken."""
        if not self.spec.m:
            return len(rows)
        if not self.fast:
            return sum(self.admit(int(r)) for r in rows)
        m, used = self.spec.m[0], self.used[0]
        taken = 0
        for v in self.spec.columns[0][2][rows].tolist():  # a prefix's group is small: a Python loop is fastest
            if v < 0:  # items without a value are never capped
                taken += 1
            elif used.get(v, 0) < m:
                used[v] = used.get(v, 0) + 1
                taken += 1
        return taken

    def admit_fast(self, row: int) -> bool:
        """``admit`` for one cap over a single-valued attribute (``self.fast``)."""
        v = int(self.spec.columns[0][2][row])
        if v < 0:
            return True
        used = self.used[0]
        if used.get(v, 0) >= self.spec.m[0]:
            return False
        used[v] = used.get(v, 0) + 1
        return True


def greedy_pick(rows: np.ndarray, spec: CapSpec, k: int, none: int | None = None) -> list[int]:
    """rows [n] catalog rows best first (``none``: skip) -> positions of the (at most k) rows taken."""
    counter = CapCounter(spec)
    admit = counter.admit_fast if counter.fast else counter.admit
    out: list[int] = []
    for pos, row in enumerate(rows.tolist()):
        if row == none or row < 0:
            continue
        if admit(row) if spec.m else True:
            out.append(pos)
            if len(out) == k:
                break
    return out


def fills(groups: Iterable[np.ndarray], spec: CapSpec, k: int) -> bool:
    """Whether the groups (rows of alive items) hold k rows a greedy list can take together under the caps."""
    counter, taken = CapCounter(spec), 0
    for rows in groups:
        taken += counter.admit_group(rows)
        if taken >= k:
            return True
    return False


def capacity_prefix(groups: Iterable[np.ndarray], spec: CapSpec, k: int) -> int:
    """How many groups (candidate prefixes, best first; each the rows of its alive items) a beam must keep so
    that a greedy list of k items can be made from their items: the first t whose groups hold k admissible
    rows, else the t after which no group adds one (the most the candidates can give)."""
    counter = CapCounter(spec)
    taken, last_gain = 0, 0
    for t, rows in enumerate(groups, start=1):
        gain = counter.admit_group(rows)
        if gain:
            taken, last_gain = taken + gain, t
            if taken >= k:
                return t
    return last_gain
