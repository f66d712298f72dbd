"""Whether today's bundle replaces yesterday's: two checks on the day's users kept aside (``merge``), each
bundle ranking them as it is served, paired per user (``recsvc eval --against``).

1. **The day itself**, checked before anything is trained. Yesterday's bundle must rank the day's kept-aside
   items at least ``min_day_share`` of the NDCG@10 it reached on its own validation (``reference``). A day that
   yesterday's model, trained on the same catalog's past, cannot read at all is not the catalog's behaviour
   (item keys shuffled or mis-mapped by an export, a test feed): nothing is trained on it.
2. **Today against yesterday.** Today's bundle is kept aside when the paired 95% bootstrap interval of its
   NDCG@10 over yesterday's lies wholly below ``1 - tolerance``: worse beyond the tolerance, and beyond the
   day's noise.

Otherwise today's bundle is published. Both checks are read from the figures alone (no model here), so the rule
is tested on numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class GateRule:
    tolerance: float = 0.0  # today may be worse than yesterday by this share before the interval counts
    min_day_share: float = 0.5  # yesterday's NDCG@10 on the day / its reference, below which the day is refused


@dataclass(frozen=True)
class GateFigures:
    """NDCG@10 of both bundles on the day's kept-aside items (the same users), today / yesterday with its paired
    95% interval, and yesterday's reference (its own validation's NDCG@10; None: unknown, check 1 skipped)."""

    users: int
    today: float | None  # None: the day was refused before today's bundle was trained
    yesterday: float
    ratio: float | None
    ratio_lo: float | None
    ratio_hi: float | None
    reference: float | None

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class GateDecision:
    publish: bool
    reason: str


def check_day(users: int, yesterday: float, reference: float | None,
              rule: GateRule = GateRule()) -> GateDecision | None:
    """Check 1 alone (run before anything is trained: a refused day costs one ranking): the refusal, or None.

        >>> check_day(900, 0.001, 0.022).reason[:31]
        "yesterday's bundle ranks the da"
        >>> check_day(900, 0.020, 0.022) is None
        True
    """
    if users == 0:
        return GateDecision(False, "no user of the day has an item kept aside to score both bundles on")
    if reference is not None and reference > 0 and yesterday < rule.min_day_share * reference:
        return GateDecision(False, (
            f"yesterday's bundle ranks the day's {users} kept-aside items at NDCG@10 {yesterday:.4f}, "
            f"{yesterday / reference:.2f}x its {reference:.4f} on its own validation (below "
            f"{rule.min_day_share:g}x): the appended interactions do not follow the catalog's patterns (item ids "
            "shuffled or mis-keyed?); nothing was trained on them"))
    return None


def decide(f: GateFigures, rule: GateRule = GateRule()) -> GateDecision:
    """The gate's verdict on ``f`` (module docstring), with the figures that decided it.

        >>> decide(GateFigures(900, 0.021, 0.020, 1.05, 0.93, 1.18, 0.022)).publish
        True
        >>> decide(GateFigures(900, 0.012, 0.020, 0.6, 0.48, 0.74, 0.022)).reason[:26]
        "today's bundle is worse th"
    """
    refused = check_day(f.users, f.yesterday, f.reference, rule)
    if refused is not None:
        return refused
    assert f.today is not None
    if f.ratio_hi is not None and f.ratio_hi < 1 - rule.tolerance:
        return GateDecision(False, (
            f"today's bundle is worse than yesterday's on the day's {f.users} kept-aside items: NDCG@10 "
            f"{f.today:.4f} against {f.yesterday:.4f}, {f.ratio:.3f}x [{f.ratio_lo:.3f}, {f.ratio_hi:.3f}], "
            f"wholly below {1 - rule.tolerance:g}"))
    ratio = "undefined" if f.ratio is None else f"{f.ratio:.3f}x"
    interval = "" if f.ratio_lo is None else f" [{f.ratio_lo:.3f}, {f.ratio_hi:.3f}]"
    return GateDecision(True, (f"NDCG@10 {f.today:.4f} against yesterday's {f.yesterday:.4f} on the day's {f.users} "
                               f"kept-aside items: {ratio}{interval}"))
