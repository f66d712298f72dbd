"""What reading an interaction file keeps: the earliest time of each (user, item) pair, and the rows set aside.

Both readers (``amazon_raw.scan_reviews``, ``import_log.scan_log``) dedupe the same way: a user's first
interaction with an item is the one that counts, later ones are counted as duplicates.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field


@dataclass
class PairTimes:
    """``pairs[(user, item)] = earliest time``, the duplicates seen and the rows below the minimum rating."""

    pairs: dict[tuple[str, str], float] = field(default_factory=dict)
    below_min_rating: int = 0
    duplicates: int = 0

    def add(self, user: str, item: str, when: float) -> None:
        """Keep the earlier of ``when`` and the pair's time so far (ids interned: millions of rows repeat them)."""
        key = (sys.intern(user), sys.intern(item))
        old = self.pairs.get(key)
        if old is None:
            self.pairs[key] = when
        else:
            self.duplicates += 1
            if when < old:
                self.pairs[key] = when
