"""``--spec auto`` at start-up: time plain and strict speculative decoding per K on a few histories and serve the
fastest, within the start-up budget; reuse a stored choice when nothing it depends on changed
(``calibration_cache``)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from recsvc.errors import UserError

from .logs import Step, log_step

CALIBRATION_KS = (1, 5, 10, 20)


def torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def calibration_histories(rec, bundle: str | None, n: int = 8, max_len: int = 50) -> tuple[list[list[int]], str]:
    """Histories to time speculation on: ``n`` validation users of the bundle's recorded data (seeded sample;
    their last ``max_len`` items), the traffic the target and drafter were trained for; when that data is not
    readable here, short lists of popular items. Returns (histories, where they came from)."""
    if bundle is not None:
        from recsvc.data.sampling import sample_users
        from recsvc.data.split import load_split_dir
        from recsvc.model.bundle import Bundle

        try:
            data = load_split_dir(Bundle.open(bundle).resolve_data_dir())
            users = sample_users(data.eval_users("valid"), n, seed=1)
            known = [[i for i in u.history[-max_len:] if rec.known_item(i)] for u in users]
            known = [h for h in known if h]
            if known:
                return known, f"{len(known)} validation users"
        except (UserError, OSError):
            pass
    popular = rec.popular_items(40)
    return [popular[i : i + 5 + i % 7] for i in range(0, 3 * n, 3)], "popular items"


class _OutOfBudget(Exception):
    """The start-up budget would be exceeded by the next calibration run."""


def configure_speculation(rec, spec: str, bundle: str | None = None, *, budget_s: float = 60.0,
                          step: Step | None = None, should_stop: Callable[[], bool] | None = None,
                          ks: tuple[int, ...] = CALIBRATION_KS,
                          cache_settings: dict | None = None) -> dict[int, tuple[int, int]]:
    """'auto': time strict speculation per K on calibration histories (``calibration_histories``) and keep the
    fastest (N, gamma) or plain, within ``budget_s`` seconds: a calibration run that would end after the budget
    is not started and the K values not tuned by then are served with plain decoding (logged). 'N:gamma':
    fixed. 'off': plain decoding for every K (no calibration). Returns the per-K choice ({} when fixed, off or
    without a drafter); (0, 0) = plain decoding.

    ``cache_settings`` (the serving settings the timing depends on): reuse the choice stored in
    BUNDLE/calibration.json when it was made on this hardware with these models and settings, and store a
    complete calibration there (``recsvc.service.calibration_cache``); None: always calibrate."""
    from dataclasses import replace

    step = step or log_step
    if spec == "auto":
        if rec.drafter is None:
            step("calibration_skipped", reason="no drafter: plain decoding")
            return {}
        key = None
        if cache_settings is not None and bundle is not None:
            from .calibration_cache import calibration_key, load_choice

            key = calibration_key(bundle, {**cache_settings, "ks": list(ks)})
            stored = load_choice(bundle, key)
            if stored is not None and set(stored) == set(ks):
                rec.spec = replace(rec.spec, per_k=stored)
                step("calibration_reused", file=os.path.join(bundle, "calibration.json"),
                     choice={str(k): "plain" if v[0] == 0 else f"N={v[0]} gamma={v[1]}" for k, v in stored.items()})
                return stored
        from recsvc.engine.autotune import autotune
        from recsvc.recommender.api import RecQuery

        histories, source = calibration_histories(rec, bundle)
        deadline = time.monotonic() + budget_s
        longest = 0.0  # the longest calibration run so far: a run is started only if it can end in time

        def run(k: int, n: int, gamma: int) -> float:
            nonlocal longest
            if (should_stop is not None and should_stop()) or time.monotonic() + longest > deadline:
                raise _OutOfBudget
            rec.spec = replace(rec.spec, per_k={k: (n, gamma)})
            began = time.perf_counter()
            rec.recommend([RecQuery(history=h, k=k, mode="strict") for h in histories])
            took = time.perf_counter() - began
            longest = max(longest, took)
            return took

        step("calibrating", ks=list(ks), histories=source, budget_s=budget_s)
        choice: dict[int, tuple[int, int]] = {}
        why_plain: dict[int, str] = {}  # K served plainly for another reason than calibration's choice
        complete = True
        for i, k in enumerate(ks):
            began = time.monotonic()
            try:
                choice.update(autotune(run, [k]))
            except _OutOfBudget:
                untuned = list(ks[i:])
                choice.update(dict.fromkeys(untuned, (0, 0)))
                why_plain = dict.fromkeys(untuned, f"not calibrated within --startup-budget-s {budget_s:g}")
                step("calibration_budget_exhausted", logging.WARNING, budget_s=budget_s, untuned_ks=untuned,
                     serving="plain decoding for these K")
                complete = False
                break
            n, gamma = choice[k]
            step("calibrated", k=k, choice="plain" if n == 0 else f"N={n} gamma={gamma}",
                 seconds=round(time.monotonic() - began, 3))
        rec.spec = replace(rec.spec, per_k=choice, why_plain=why_plain or None)
        print(f"speculation autotuned per K on {source}: {choice}", flush=True)
        if key is not None and complete:
            from .calibration_cache import save_choice

            if not save_choice(bundle, key, choice):
                step("calibration_not_stored", reason=f"{bundle} is not writable: the next start calibrates again")
        return choice
    if spec == "off":  # the K=1 choice applies to every larger K
        rec.spec = replace(rec.spec, per_k={1: (0, 0)}, why_plain={1: "speculation off (--spec off)"})
        step("speculation_off", serving="plain decoding for every K")
        return {}
    n, _, gamma = spec.partition(":")
    if not (n.isdigit() and gamma.isdigit() and int(n) >= 1 and 1 <= int(gamma) <= 5):
        raise UserError(f"--spec takes 'auto', 'off' or N:gamma (N >= 1, gamma 1..5), got {spec!r}")
    rec.spec = replace(rec.spec, draft_beams=int(n), gamma=int(gamma))
    step("speculation_fixed", draft_beams=int(n), gamma=int(gamma))
    return {}
