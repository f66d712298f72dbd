"""A query's answer as its response tells it: the result, why it holds fewer than k items, and why no model
decoded it when none did.

Two steps around the engine, for any ``Recommender``: :func:`without_decoding` answers, before any batching, the
queries that need no decoding (no history: the popular items; nothing left after the exclusions and rules: an
empty list), and :func:`explained` says why a decoded list came back short. Fewer than k items are never
returned silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from recsvc.recommender.api import Recommender, RecQuery, RecResult

NO_HISTORY_REASON = "no_history: popular items"
NO_DECODING_REASON = "no model decoding: popular items"  # a recommender without a model (a popularity table)
Fallback = Literal["", "no_history", "nothing_left", "short"]


@dataclass(frozen=True)
class Answer:
    result: RecResult
    reason: str = ""  # why fewer than k items, or no history ("" when neither)
    fallback: Fallback = ""  # the kind of fallback, as counted ("": none)
    not_decoded: str = ""  # why no model decoded it (result.decoding is None): popular items answered


def shortfall_reason(returned: int, k: int, remaining: int, rules: bool = False) -> str:
    """Why ``returned`` < ``k`` items: ``remaining`` = how many catalog items the exclusions (and the rules)
    leave, capped at k."""
    after = "exclusions and rules" if rules else "exclusions"
    if remaining <= 0:
        return f"no items remain after {after}"
    if remaining < k:
        return f"only {remaining} items remain after {after}"
    return f"the engine returned {returned} of the {k} items asked for"


def remaining(recommender: Recommender, query: RecQuery) -> int:
    """How many items the query's exclusions (and its rules' filters and caps) leave, capped at k: a walk over the
    catalog in popularity order."""
    rules = query.rules
    if rules is not None and (rules.has_filters or rules.caps):
        return len(recommender.popular_items(query.k, query.exclude, rules))
    return len(recommender.popular_items(query.k, query.exclude)) if query.exclude else query.k


def without_decoding(recommender: Recommender, query: RecQuery) -> Answer | None:
    """The answer of a query that needs no decoding: without history, the popular items (scores 0); with nothing
    left after its exclusions and rules, none. None: the query is to be decoded."""
    left = remaining(recommender, query)
    if query.history and left:
        return None
    rules = query.rules
    items = [] if not left else (recommender.popular_items(query.k, query.exclude, rules) if rules is not None
                                 else recommender.popular_items(query.k, query.exclude))
    result = RecResult(item_ids=list(items), scores=[0.0] * len(items))
    ruled = rules is not None
    if query.history:
        reason, fallback = "", "nothing_left"
        not_decoded = shortfall_reason(0, query.k, 0, ruled)
    else:
        reason = not_decoded = NO_HISTORY_REASON
        fallback = "no_history"
    if len(items) < query.k:
        short = shortfall_reason(len(items), query.k, left, ruled)
        reason = f"{reason}; {short}" if reason else short
    return Answer(result, reason, fallback, not_decoded)


def explained(recommender: Recommender, query: RecQuery, result: RecResult) -> Answer:
    """``result`` (decoded for ``query``) with why it holds fewer than k items, when it does."""
    not_decoded = NO_DECODING_REASON if result.decoding is None else ""
    if len(result.item_ids) >= query.k:
        return Answer(result, not_decoded=not_decoded)
    reason = shortfall_reason(len(result.item_ids), query.k, remaining(recommender, query), query.rules is not None)
    return Answer(result, reason, "short", not_decoded)
