"""``--spec auto`` at start-up: time plain and strict speculative decoding at each beam width the server decodes
on a few histories and serve the fastest, within the start-up budget; reuse a stored choice when nothing it
depends on changed (``calibration_cache``). The choice is returned: the recommender is built with it."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from recsvc.errors import UserError
from recsvc.service.observability.logs import Step, log_step

if TYPE_CHECKING:
    from recsvc.recommender.bundle_recommender import BundleRecommender, SpecSettings

CALIBRATION_KS = (1, 5, 10, 20)  # list lengths; calibrated at the beam widths they decode


def torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def calibration_clock(device: str, threads: int) -> Callable[[], float]:
    """What a calibration run is timed with: the calling thread's CPU time when the decode runs entirely in it
    (the CPU, one torch thread), so that neither a bundle swap's loader throttle (it sleeps between slices while
    calls are answered: ``recsvc.service.swap.loader_throttle``) nor the requests served meanwhile count; else wall
    time (torch's worker threads, a GPU's asynchronous work). What is left of the throttle in CPU time is its
    profile function's own cost, larger for speculation's more Python calls: a small lean toward plain decoding,
    the lossless choice.

    >>> calibration_clock("cpu", 1) is time.thread_time, calibration_clock("cuda", 1) is time.perf_counter
    (True, True)
    """
    return time.thread_time if device == "cpu" and threads == 1 else time.perf_counter


def calibration_histories(rec: BundleRecommender, bundle: str | None, n: int = 8,
                          max_len: int = 50) -> tuple[list[list[int]], str]:
    """Histories to time speculation on: the first ``n`` of the bundle's calibration histories
    (BUNDLE/calibration_histories.json: seeded validation users, the traffic the target and drafter were
    trained for; ``recsvc.bundle.serving_files``), their last ``max_len`` known items; for a bundle without
    them, short lists of popular items. The bundle's recorded data directory is never opened. Returns
    (histories, where they came from)."""
    if bundle is not None:
        from recsvc.bundle.serving_files import read_calibration_histories

        stored = read_calibration_histories(bundle) if os.path.isdir(bundle) else None
        known = [[i for i in h[-max_len:] if rec.known_item(i)] for h in (stored or [])[:n]]
        known = [h for h in known if h]
        if known:
            return known, f"{len(known)} validation users"
    popular = rec.popular_items(40)
    return [popular[i : i + 5 + i % 7] for i in range(0, 3 * n, 3)], "popular items"


class _OutOfBudget(Exception):
    """The start-up budget would be exceeded by the next calibration run."""


def calibrate_speculation(rec: BundleRecommender, spec: str, bundle: str | None = None, *, budget_s: float = 60.0,
                          step: Step | None = None, should_stop: Callable[[], bool] | None = None,
                          ks: tuple[int, ...] = CALIBRATION_KS, cache_settings: dict | None = None,
                          clock: Callable[[], float] = time.perf_counter) -> SpecSettings:
    """The speculation settings to serve ``rec`` with (``rec`` itself is not modified: the caller builds the
    served recommender with the choice, ``rec.variant(spec=...)``).

    'auto': time strict speculation at each beam width that requests of ``ks`` items decode
    (``rec.served_widths(ks)``: with a served width B >= every k, B alone) on calibration histories
    (``calibration_histories``) and keep the fastest (N, gamma) or plain, within ``budget_s`` seconds: a
    calibration run that would end after the budget is not started and the widths not tuned by then are served
    with plain decoding (logged). 'N:gamma': fixed. 'off': plain decoding at every width (no calibration). In the
    choice, (0, 0) = plain decoding.

    ``cache_settings`` (the serving settings the timing depends on): reuse the choice stored in
    BUNDLE/calibration.json when it was made on this hardware with these models and settings, and store a
    complete calibration there (``calibration_cache``); None: always calibrate. ``clock``: what each
    run is timed with (``calibration_clock``; the budget is wall time)."""
    step = step or log_step
    if spec == "off":  # the width-1 choice applies to every larger width
        step("speculation_off", serving="plain decoding for every K")
        return replace(rec.spec, per_width={1: (0, 0)}, why_plain={1: "speculation off (--spec off)"})
    if spec != "auto":
        n, _, gamma = spec.partition(":")
        if not (n.isdigit() and gamma.isdigit() and int(n) >= 1 and 1 <= int(gamma) <= 5):
            raise UserError(f"--spec takes 'auto', 'off' or N:gamma (N >= 1, gamma 1..5), got {spec!r}")
        step("speculation_fixed", draft_beams=int(n), gamma=int(gamma))
        return replace(rec.spec, draft_beams=int(n), gamma=int(gamma))
    if rec.drafter is None:
        step("calibration_skipped", reason="no drafter: plain decoding")
        return rec.spec
    widths = rec.served_widths(ks)
    key = None
    if cache_settings is not None and bundle is not None:
        from .calibration_cache import calibration_key, load_choice

        key = calibration_key(bundle, {**cache_settings, "widths": widths})
        stored = load_choice(bundle, key)
        if stored is not None and set(stored) == set(widths):
            step("calibration_reused", file=os.path.join(bundle, "calibration.json"),
                 choice={str(w): "plain" if v[0] == 0 else f"N={v[0]} gamma={v[1]}" for w, v in stored.items()})
            return replace(rec.spec, per_width=stored)
    from recsvc.engine.speculation.autotune import autotune
    from recsvc.recommender.api import RecQuery

    histories, source = calibration_histories(rec, bundle)
    deadline = time.monotonic() + budget_s
    longest = 0.0  # the longest calibration run so far: a run is started only if it can end in time

    def run(width: int, n: int, gamma: int) -> float:
        nonlocal longest
        if (should_stop is not None and should_stop()) or time.monotonic() + longest > deadline:
            raise _OutOfBudget
        trial = rec.variant(spec=replace(rec.spec, per_width={width: (n, gamma)}))
        began, wall = clock(), time.monotonic()
        trial.recommend([RecQuery(history=h, k=width, mode="strict") for h in histories])  # k = width: no wider
        took = clock() - began
        longest = max(longest, time.monotonic() - wall)  # the budget is wall time
        return took

    step("calibrating", widths=widths, histories=source, budget_s=budget_s)
    choice: dict[int, tuple[int, int]] = {}
    why_plain: dict[int, str] = {}  # widths served plainly for another reason than calibration's choice
    complete = True
    for i, width in enumerate(widths):
        began = time.monotonic()
        try:
            choice.update(autotune(run, [width]))
        except _OutOfBudget:
            untuned = list(widths[i:])
            choice.update(dict.fromkeys(untuned, (0, 0)))
            why_plain = dict.fromkeys(untuned, f"not calibrated within --startup-budget-s {budget_s:g}")
            step("calibration_budget_exhausted", logging.WARNING, budget_s=budget_s, untuned_widths=untuned,
                 serving="plain decoding at these beam widths")
            complete = False
            break
        n, gamma = choice[width]
        step("calibrated", width=width, choice="plain" if n == 0 else f"N={n} gamma={gamma}",
             seconds=round(time.monotonic() - began, 3))
    said = {w: (f"plain ({why_plain[w]})" if w in why_plain else "plain (calibration chose it)" if n == 0
                else f"N={n} gamma={g}") for w, (n, g) in choice.items()}
    print(f"speculation per beam width, calibrated on {source}: "
          + ", ".join(f"width {w}: {v}" for w, v in said.items()), flush=True)
    if key is not None and complete:
        from .calibration_cache import save_choice

        if not save_choice(bundle, key, choice):
            step("calibration_not_stored", reason=f"{bundle} is not writable: the next start calibrates again")
    return replace(rec.spec, per_width=choice, why_plain=why_plain or None)
