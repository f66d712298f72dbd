"""Choose the draft width N and depth gamma per beam width from costs measured on the running hardware.

A CPU has little free verification width (a tree of 160 tokens costs several decode steps), a GPU has a lot,
so (N, gamma) is not copied from the paper: at start-up the engine times strict speculative decoding for each
candidate on a few calibration prompts and keeps the fastest per beam width. Plain beam search, (N, gamma) =
(0, 0), is always a candidate: where no draft pays for itself (a weak drafter, a large width), the engine does
not speculate.

Candidates are written with N relative to the beam width K ("K", "2K", "K/2") or as a number.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

DEFAULT_GRID: tuple[tuple[str, int], ...] = (("K/2", 1), ("K/2", 3), ("K", 1), ("K", 2), ("K", 3), ("2K", 3))


def resolve_grid(pairs: Sequence[tuple[str, int]], width: int) -> list[tuple[int, int]]:
    """Concrete (N, gamma) at beam width K = ``width``. Example: resolve_grid([("K", 3), ("2K", 2), ("7", 1)], 10) ->
    [(10, 3), (20, 2), (7, 1)]."""
    size = {"K": width, "2K": 2 * width, "K/2": max(1, width // 2)}
    out: list[tuple[int, int]] = []
    for n, gamma in pairs:
        pair = (size[n] if n in size else int(n), gamma)
        if pair not in out:
            out.append(pair)
    return out


def autotune(run: Callable[[int, int, int], float | None], widths: Sequence[int],
             candidates: Callable[[int], list[tuple[int, int]]] | None = None,
             repeats: int = 2, hopeless: float = 1.3) -> dict[int, tuple[int, int]]:
    """run(width, n, gamma) decodes the calibration batch once at that beam width ((0, 0): plain beam search) and
    may return the seconds it measured itself (else the call is timed); candidates(width) lists the (N, gamma) to
    try besides plain (default: DEFAULT_GRID). Returns {width: (N, gamma)} of the lowest median.

    Only plain and the first candidate get an untimed warm-up run; a candidate whose first timed run is
    ``hopeless`` times slower than the best so far is not repeated (a repeat would not change the choice; it
    only costs start-up time)."""
    choice: dict[int, tuple[int, int]] = {}
    for width in widths:
        best: tuple[float, tuple[int, int]] | None = None
        tried = candidates(width) if candidates else resolve_grid(DEFAULT_GRID, width)
        for i, (n, gamma) in enumerate([(0, 0), *tried]):
            if i < 2:  # warm plain and the first speculative setting (allocations, prefix caches, the drafter)
                run(width, n, gamma)
            times: list[float] = []
            for _ in range(repeats):
                start = time.perf_counter()
                measured = run(width, n, gamma)
                # a run may report its own time (e.g. leaving out an oracle's untimed preparation)
                times.append(float(measured) if isinstance(measured, float) else time.perf_counter() - start)
                if best is not None and times[0] > hopeless * best[0]:
                    break
            t = sorted(times)[len(times) // 2]
            if best is None or t < best[0]:
                best = (t, (n, gamma))
        assert best is not None
        choice[width] = best[1]
    return choice
