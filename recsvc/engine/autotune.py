"""Choose the draft width N and depth gamma per K from costs measured on the running hardware.

A CPU has little free verification width (a tree of 160 tokens costs several decode steps), a GPU has a lot,
so (N, gamma) is not copied from the paper: at start-up the engine times strict speculative decoding for each
candidate on a few calibration prompts and keeps the fastest per K (ties: fewer target calls).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

DEFAULT_GRID: tuple[tuple[int, int], ...] = ((1, 1), (1, 3), (0, 1), (0, 2), (0, 3), (-1, 3))
# N relative to K: 0 -> N = K, -1 -> N = 2K, 1 -> N = max(1, K // 2); gamma as given


def grid_for(k: int, grid: Sequence[tuple[int, int]] = DEFAULT_GRID) -> list[tuple[int, int]]:
    """Concrete (N, gamma) candidates for K. Example: grid_for(10) -> [(5, 1), (5, 3), (10, 1), ...]."""
    out = []
    for rel, gamma in grid:
        n = {0: k, -1: 2 * k, 1: max(1, k // 2)}[rel]
        if (n, gamma) not in out:
            out.append((n, gamma))
    return out


def autotune(run: Callable[[int, int, int], object], ks: Sequence[int], repeats: int = 2,
             grid: Sequence[tuple[int, int]] = DEFAULT_GRID) -> dict[int, tuple[int, int]]:
    """run(k, n, gamma) decodes the calibration batch once. Returns {k: (N, gamma)} of the fastest median."""
    choice: dict[int, tuple[int, int]] = {}
    for k in ks:
        best: tuple[float, tuple[int, int]] | None = None
        for n, gamma in grid_for(k, grid):
            run(k, n, gamma)  # warm
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                run(k, n, gamma)
                times.append(time.perf_counter() - start)
            t = sorted(times)[len(times) // 2]
            if best is None or t < best[0]:
                best = (t, (n, gamma))
        assert best is not None
        choice[k] = best[1]
    return choice
