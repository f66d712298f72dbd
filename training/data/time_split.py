"""Pipeline steps shared by ``prepare-amazon``, ``import`` and ``synth``: iterative k-core, the global-time split
and the per-user leave-last-out split (the split's files are written and read by ``recsvc/data/split.py``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from recsvc.errors import UserError

U = TypeVar("U", bound=Hashable)
I = TypeVar("I", bound=Hashable)  # noqa: E741


def parse_ratios(text: str) -> tuple[int, int, int]:
    """``"8:1:1" -> (8, 1, 1)``; three non-negative ints, train > 0. ValueError on anything else."""
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"expected TRAIN:VALID:TEST like 8:1:1, got {text!r}")
    try:
        ratios = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"expected three integers like 8:1:1, got {text!r}") from None
    if min(ratios) < 0 or ratios[0] == 0:
        raise ValueError(f"ratios must be >= 0 with a positive train share, got {text!r}")
    return ratios  # type: ignore[return-value]


def kcore(pairs: Sequence[tuple[U, I]], k: int) -> list[tuple[U, I]]:
    """Iterative k-core: drop users and items with < k interactions until every one left has >= k.

    The result is the unique maximal subset with that property (order of ``pairs`` kept).

    >>> kcore([("a", 1), ("a", 2), ("b", 1), ("b", 2), ("c", 1)], 2)
    [('a', 1), ('a', 2), ('b', 1), ('b', 2)]

    ``c`` has one interaction; removing it leaves item 1 with 2 users, so nothing else goes.
    """
    kept = list(pairs)
    if k <= 1:
        return kept
    while True:
        users = Counter(u for u, _ in kept)
        items = Counter(i for _, i in kept)
        nxt = [(u, i) for u, i in kept if users[u] >= k and items[i] >= k]
        if len(nxt) == len(kept):
            return nxt
        kept = nxt


@dataclass
class TimeSplit(Generic[U, I]):
    """Per-user chronological items of each period, only users kept by the min-train rule."""

    train: dict[U, list[I]]
    valid: dict[U, list[I]]
    test: dict[U, list[I]]
    dropped_users: int
    dropped_interactions: int

    def users(self) -> list[U]:
        return sorted(self.train)  # type: ignore[type-var]

    def items(self) -> set[I]:
        """Every item that some kept user interacted with, in any period."""
        return {i for part in (self.train, self.valid, self.test) for seq in part.values() for i in seq}


def split_by_global_time(
    events: Iterable[tuple[float, U, I]],
    ratios: tuple[int, int, int] = (8, 1, 1),
    min_train: int = 2,
) -> TimeSplit[U, I]:
    """Sort events ``(timestamp, user, item)`` globally (ties by user, then item) and cut them by count.

    With ``n`` events and ratios ``r``: the first ``n*r0 // sum(r)`` events are train, up to
    ``n*(r0+r1) // sum(r)`` valid, the rest test. Then users with fewer than ``min_train`` train items are
    dropped (with all their events).

    Worked example (ratios 8:1:1, 10 events): user ``a`` has events at t=0..7 and t=9, ``b`` at t=8 only.
    Sorted, events 0..7 are train (all ``a``), event 8 (``b``, t=8) valid, event 9 (``a``, t=9) test; ``b``
    has 0 train items and is dropped, so valid is empty and ``a`` keeps 8 train + 1 test items.
    """
    ordered = sorted(events)
    total = sum(ratios)
    if total <= 0:
        raise UserError("split ratios must not all be zero")
    n = len(ordered)
    cut1 = n * ratios[0] // total
    cut2 = n * (ratios[0] + ratios[1]) // total
    parts: tuple[dict[U, list[I]], dict[U, list[I]], dict[U, list[I]]] = ({}, {}, {})
    for idx, (_, user, item) in enumerate(ordered):
        part = 0 if idx < cut1 else (1 if idx < cut2 else 2)
        parts[part].setdefault(user, []).append(item)
    all_users = set().union(*parts)
    kept = sorted(u for u in all_users if len(parts[0].get(u, ())) >= min_train)  # type: ignore[type-var]
    kept_set = set(kept)
    dropped_events = sum(len(p[u]) for p in parts for u in p if u not in kept_set)
    train, valid, test = ({u: p.get(u, []) for u in kept} for p in parts)
    return TimeSplit(train=train, valid=valid, test=test, dropped_users=len(all_users) - len(kept),
                     dropped_interactions=dropped_events)


def split_leave_last_out(events: Iterable[tuple[float, U, I]], min_train: int = 2) -> TimeSplit[U, I]:
    """Per user, in time order (ties by item): the last item is test, the one before it valid, the rest train.

    Users with fewer than ``min_train + 2`` events are dropped (with all their events), so every user kept has
    ``min_train`` train items, one valid and one test item.

    >>> s = split_leave_last_out([(3, "a", "z"), (1, "a", "x"), (2, "a", "y"), (4, "a", "w"), (1, "b", "x")])
    >>> s.train, s.valid, s.test, s.dropped_users
    ({'a': ['x', 'y']}, {'a': ['z']}, {'a': ['w']}, 1)
    """
    by_user: dict[U, list[tuple[float, I]]] = {}
    for when, user, item in events:
        by_user.setdefault(user, []).append((when, item))
    train: dict[U, list[I]] = {}
    valid: dict[U, list[I]] = {}
    test: dict[U, list[I]] = {}
    dropped_users = dropped_events = 0
    for user in sorted(by_user):  # type: ignore[type-var]
        seq = [item for _, item in sorted(by_user[user])]  # type: ignore[type-var]
        if len(seq) < min_train + 2:
            dropped_users += 1
            dropped_events += len(seq)
            continue
        train[user], valid[user], test[user] = seq[:-2], [seq[-2]], [seq[-1]]
    return TimeSplit(train=train, valid=valid, test=test, dropped_users=dropped_users,
                     dropped_interactions=dropped_events)
