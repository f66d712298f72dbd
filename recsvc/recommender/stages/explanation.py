"""A decoded list with its decoding's fallback said: why a strict query was decoded plainly, or that its caps
and boosts were decoded by the rules' list-level search. (Why a list is short is ``recsvc.recommender.answer``'s,
once the pipeline has run.)"""

from __future__ import annotations

from dataclasses import replace

from recsvc.recommender.api import RecQuery, RecResult


def fallback_said(res: RecResult, query: RecQuery, plain_because: str, listed: bool, strategy: str) -> RecResult:
    """``res`` with ``plain_because`` (a strict query decoded plainly: why) or the rules' list-level search
    (``strategy``, unless postfilter) as its decoding's fallback, when the decoding gave none."""
    decoding = res.decoding
    assert decoding is not None
    why = plain_because or decoding.fallback
    if listed and not why and query.mode == "strict" and strategy != "postfilter":
        why = f"caps and boosts are decoded by the rules' list-level search ({strategy})"
    return replace(res, decoding=replace(decoding, fallback=why)) if why != decoding.fallback else res
