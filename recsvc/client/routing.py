"""Sticky routing by user id: a consistent-hash ring over server targets.

Each target owns ``vnodes`` points on a 64-bit ring (blake2b of ``"target#i"``); a user id hashes to a point and
belongs to the next target point clockwise. The same user always reaches the same server (per-user state kept
in process stays useful), targets get about equal shares, and adding or removing a target moves only the users
of that target. Hashes are stable across processes and machines (no Python ``hash()``), so every client that
uses the same target list routes a user to the same server.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


class HashRing:
    """``order(key)``: every target, the key's owner first, then the others in ring order (the fallbacks)."""

    def __init__(self, targets: Sequence[str], vnodes: int = 64) -> None:
        if not targets or len(set(targets)) != len(targets):
            raise ValueError(f"a hash ring needs distinct targets, got {list(targets)!r}")
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        self.targets = list(targets)
        points = sorted((_point(f"{target}#{i}"), target) for target in targets for i in range(vnodes))
        self._points = [p for p, _ in points]
        self._owners = [t for _, t in points]

    def owner(self, key: str) -> str:
        return self.order(key)[0]

    def order(self, key: str) -> list[str]:
        start = bisect.bisect_right(self._points, _point(key)) % len(self._points)
        seen: list[str] = []
        for i in range(len(self._owners)):
            target = self._owners[(start + i) % len(self._owners)]
            if target not in seen:
                seen.append(target)
                if len(seen) == len(self.targets):
                    break
        return seen
