"""The seeded user sample shared by ``recsvc eval``, the baselines, training's early stopping, the benchmarks and
serving's calibration: the same seed draws the same users everywhere."""

from __future__ import annotations

import random
from collections.abc import Sequence

from recsvc.data.split import EvalUser


def sample_users(users: Sequence[EvalUser], max_users: int | None, seed: int = 0) -> list[EvalUser]:
    """A fixed random sample of ``max_users`` users, sorted by user id; every user when ``max_users`` is None or
    not smaller than their number.

    >>> [u.user_id for u in sample_users([EvalUser(i, [], [1]) for i in (3, 1, 2)], None)]
    [3, 1, 2]
    >>> len(sample_users([EvalUser(i, [], [1]) for i in range(10)], 4, seed=1))
    4
    """
    users = list(users)
    if max_users is not None and len(users) > max_users:
        users = sorted(random.Random(seed).sample(users, max_users), key=lambda u: u.user_id)
    return users
