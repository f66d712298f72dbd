"""Collision resolution: every item ends with its own id (zero collisions), deterministically.

Rule (no randomness; ties go to the lower row / lower code):

1. Group items by full id. In each group the item whose last-level residual is closest to its own last-level
   code keeps the id; items in no group keep theirs too: they are never changed.
2. The others ("movers") are placed one by one, closest first (by that same distance, then row), each at the
   nearest FREE id that keeps as long a prefix of its id as possible: first a free last code under its
   3-level prefix, ranked by the distance of its last-level residual to the last codebook; if all K ids under
   that prefix are taken, the nearest free (c, d) under its 2-level prefix (ranked by the exact residual error
   ``||r_2 - e_2[c] - e_3[d]||^2``); and so on up to the root. Suffixes of up to ``EXACT_LIMIT`` ids are
   ranked exactly; longer ones greedily, level by level, skipping full sub-trees.
3. Optional (LC-Rec): a Sinkhorn uniform assignment of the movers over the last codebook proposes their last
   code first; a proposal is taken when that id is free, otherwise rule 2 applies.

A free id always exists while items <= K^L, so the result has no collisions; otherwise UserError.

Worked example (K = 4 codes, L = 2 levels): A = (1, 2) at distance 0.1 from code 2, B = (1, 2) at 0.5,
C = (1, 3). Group (1, 2): A stays, B moves. Under prefix (1,) the ids (1, 2) and (1, 3) are taken, so B goes
to (1, 0) or (1, 1), whichever last code is nearer its level-1 residual. Had (1, 0) .. (1, 3) all been taken,
B would move to the nearest free (c, d) anywhere (the root prefix).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from recsvc_base.errors import UserError
from tokenizer_rqvae.rqvae import sinkhorn

EXACT_LIMIT = 1 << 16  # suffix spaces up to this size (K^m) are ranked exactly; 2 levels of 256 codes


@dataclass
class Resolution:
    codes: np.ndarray  # [n, L] int64, all rows distinct
    moved: list[int] = field(default_factory=list)  # rows that got a new id, in placement order
    changed_from_level: dict[int, int] = field(default_factory=dict)  # first changed level -> movers
    collisions_before: int = 0  # items minus distinct ids
    groups_before: int = 0  # ids shared by >= 2 items


class IdSpace:
    """The set of taken ids, indexed by every prefix so "is this sub-tree full?" is O(1).

    >>> s = IdSpace(levels=2, codebook_size=2); s.add((0, 1)); s.add((0, 0))
    >>> s.is_full((0,)), s.is_full(()), s.is_taken((1, 0))
    (True, False, False)
    """

    def __init__(self, levels: int, codebook_size: int) -> None:
        self.levels = levels
        self.k = codebook_size
        self._under: dict[tuple[int, ...], set[tuple[int, ...]]] = {}  # prefix -> taken full ids below it
        self._sums: dict[int, np.ndarray] = {}  # start level -> [K^m, D] sums of codes over the suffix

    def is_taken(self, code: tuple[int, ...]) -> bool:
        return code in self._under.get(code[:-1], ())

    def add(self, code: tuple[int, ...]) -> None:
        for j in range(self.levels):
            self._under.setdefault(code[:j], set()).add(code)

    def taken_under(self, prefix: tuple[int, ...]) -> int:
        return len(self._under.get(prefix, ()))

    def is_full(self, prefix: tuple[int, ...]) -> bool:
        if len(prefix) == self.levels:  # a full id: "full" = taken
            return self.is_taken(prefix)
        return self.taken_under(prefix) >= self.k ** (self.levels - len(prefix))

    def _suffix_sums(self, codebooks: np.ndarray, start: int) -> np.ndarray:
        """codebooks [L, K, D] -> [K^m, D]: row ``s_start * K^(m-1) + ... + s_{L-1}`` = sum of those codes."""
        if start not in self._sums:
            acc = codebooks[start].astype(np.float64)  # [K, D]
            for lv in range(start + 1, self.levels):
                acc = (acc[:, None, :] + codebooks[lv][None, :, :]).reshape(-1, acc.shape[-1])
            self._sums[start] = acc
        return self._sums[start]

    def nearest_free(self, prefix: tuple[int, ...], residual: np.ndarray, codebooks: np.ndarray) -> tuple[int, ...]:
        """Free full id under ``prefix`` (not full) minimizing ``||residual - sum of suffix codes||^2``.

        residual [D] is the residual entering level ``len(prefix)``; codebooks [L, K, D].
        """
        start = len(prefix)
        m = self.levels - start
        if m == 0:
            return prefix
        r = residual.astype(np.float64)
        if self.k**m <= EXACT_LIMIT:
            sums = self._suffix_sums(codebooks, start)  # [K^m, D]
            cost = ((sums - r[None, :]) ** 2).sum(1)  # [K^m]
            for code in self._under.get(prefix, ()):
                flat = 0
                for c in code[start:]:
                    flat = flat * self.k + c
                cost[flat] = np.inf
            best = int(np.argmin(cost))  # first minimum: lowest code on ties
            if not np.isfinite(cost[best]):
                raise AssertionError(f"no free id under {prefix}")  # callers check is_full first
            suffix = np.unravel_index(best, (self.k,) * m)
            return prefix + tuple(int(s) for s in suffix)
        e = codebooks[start].astype(np.float64)  # [K, D]
        d = ((e - r[None, :]) ** 2).sum(1)  # [K]
        for c in np.argsort(d, kind="stable").tolist():
            child = prefix + (int(c),)
            if not self.is_full(child):
                return self.nearest_free(child, r - e[c], codebooks)
        raise AssertionError(f"no free id under {prefix}")


def last_level_distance(codes: np.ndarray, residuals: np.ndarray, codebooks: np.ndarray) -> np.ndarray:
    """codes [n, L], residuals [n, L, D], codebooks [L, K, D] -> [n]: ||r_{L-1} - e_{L-1}[c_{L-1}]||^2."""
    last = codes.shape[1] - 1
    diff = residuals[:, last, :].astype(np.float64) - codebooks[last][codes[:, last]]  # [n, D]
    return (diff**2).sum(1)


def place(
    space: IdSpace,
    codes: np.ndarray,
    residuals: np.ndarray,
    codebooks: np.ndarray,
    order: list[int],
    proposals: dict[int, int] | None = None,
) -> tuple[np.ndarray, list[int], dict[int, int]]:
    """Give each row in ``order`` a free id (its own if free), adding it to ``space``.

    codes [n, L] (only rows in ``order`` are read / rewritten), residuals [n, L, D], codebooks [L, K, D];
    proposals: row -> preferred last code (Sinkhorn). -> (new codes [n, L], moved rows, first changed level
    -> count).
    """
    levels = codes.shape[1]
    out = codes.copy()
    moved: list[int] = []
    changed: dict[int, int] = {}
    for row in order:
        own = tuple(int(c) for c in codes[row])
        if not space.is_taken(own):
            space.add(own)
            continue
        new: tuple[int, ...] | None = None
        if proposals is not None and row in proposals:
            cand = own[:-1] + (int(proposals[row]),)
            if not space.is_taken(cand):
                new = cand
        if new is None:
            for depth in range(levels - 1, -1, -1):
                if not space.is_full(own[:depth]):
                    new = space.nearest_free(own[:depth], residuals[row, depth], codebooks)
                    break
        if new is None:
            raise UserError(f"no free semantic id left: {space.taken_under(())} ids used of "
                            f"{space.k}^{levels}; use more levels or a larger codebook")
        space.add(new)
        out[row] = new
        moved.append(row)
        first = next(lv for lv in range(levels) if new[lv] != own[lv])
        changed[first] = changed.get(first, 0) + 1
    return out, moved, changed


def place_closest_first(space: IdSpace, codes: np.ndarray, residuals: np.ndarray, codebooks: np.ndarray,
                        item_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """Ids for items placed after ``space`` was filled (new or not fitted on), unique against it, closest first
    (last-level residual distance, then item id) by :func:`place`'s rule. codes [m, L], residuals [m, L, D],
    codebooks [L, K, D], item_ids [m] -> (codes [m, L], how many did not get their own raw id)."""
    dist = last_level_distance(codes, residuals, codebooks)  # [m]
    order = sorted(range(len(item_ids)), key=lambda r: (dist[r], int(item_ids[r])))
    out, moved, _ = place(space, codes, residuals, codebooks, order)
    return out, len(moved)


def check_capacity(n: int, levels: int, codebook_size: int) -> None:
    if n > codebook_size**levels:
        raise UserError(f"{n} items cannot get distinct ids from {levels} levels x {codebook_size} codes")


def resolve_collisions(
    codes: np.ndarray,
    residuals: np.ndarray,
    codebooks: np.ndarray,
    sinkhorn_epsilon: float | None = None,
    sinkhorn_iters: int = 50,
) -> Resolution:
    """codes [n, L] int, residuals [n, L, D] (residual entering each level), codebooks [L, K, D]
    -> Resolution with distinct ids; non-colliding items and one item per colliding id keep their ids.
    ``sinkhorn_epsilon`` set: movers first try a Sinkhorn-balanced last code (LC-Rec)."""
    codes = np.asarray(codes, dtype=np.int64)
    n, levels = codes.shape
    k = codebooks.shape[1]
    check_capacity(n, levels, k)
    dist = last_level_distance(codes, residuals, codebooks)  # [n]
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, c in enumerate(codes.tolist()):
        groups.setdefault(tuple(c), []).append(row)
    space = IdSpace(levels, k)
    movers: list[int] = []
    n_groups = 0
    for code, rows in groups.items():
        keep = min(rows, key=lambda r: (dist[r], r))
        space.add(code)
        if len(rows) > 1:
            n_groups += 1
            movers.extend(r for r in rows if r != keep)
    movers.sort(key=lambda r: (dist[r], r))
    proposals = None
    if sinkhorn_epsilon is not None and len(movers) > 1:
        import torch

        last = levels - 1
        r_last = residuals[movers, last, :].astype(np.float64)  # [m, D]
        d = ((r_last[:, None, :] - codebooks[last][None, :, :]) ** 2).sum(-1)  # [m, K]
        plan = sinkhorn(torch.from_numpy(d), sinkhorn_epsilon, sinkhorn_iters)  # [m, K]
        proposals = dict(zip(movers, plan.argmax(1).tolist(), strict=True))
    out, moved, changed = place(space, codes, residuals, codebooks, movers, proposals)
    return Resolution(out, moved, changed, n - len(groups), n_groups)
