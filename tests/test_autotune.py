"""The autotuner's choice and its cost: plain and the first candidate are warmed, hopeless candidates are timed
once, the fastest median wins (run functions report their own seconds, as the oracle bench does)."""

from __future__ import annotations

from recsvc.engine.speculation.autotune import autotune, resolve_grid


def test_autotune_picks_the_fastest_and_skips_repeats_of_hopeless_settings() -> None:
    cost = {(0, 0): 1.0, (5, 1): 3.0, (10, 3): 0.8, (20, 3): 1.1}
    calls: dict[tuple[int, int], int] = {}

    def run(k: int, n: int, gamma: int) -> float:
        calls[(n, gamma)] = calls.get((n, gamma), 0) + 1
        return cost[(n, gamma)]

    choice = autotune(run, [10], lambda k: [(5, 1), (10, 3), (20, 3)], repeats=2)
    assert choice == {10: (10, 3)}
    assert calls[(0, 0)] == 3 and calls[(5, 1)] == 2  # warm + 2 timed; warm + 1 timed (3.0 > 1.3 x 1.0)
    assert calls[(10, 3)] == 2 and calls[(20, 3)] == 1  # no warm-up after the first candidate; 1.1 > 1.3 x 0.8


def test_plain_wins_when_no_setting_pays() -> None:
    choice = autotune(lambda k, n, g: 1.0 if n == 0 else 1.2, [1, 5], lambda k: resolve_grid([("K", 3)], k))
    assert choice == {1: (0, 0), 5: (0, 0)}
