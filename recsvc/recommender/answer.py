"""A query's answer as its response tells it: the result, why it holds fewer than k items, and why no model
decoded it when none did.

Two steps around the engine, for any ``Recommender``: :func:`without_decoding` answers, before any batching, the
queries that need no decoding (no history: the popular items; nothing left after the exclusions and rules: an
empty list), and :func:`explained` says why a decoded list came back short. Fewer than k items are never
returned silently. A recommender answers with them (``Recommender.answer_now`` / ``answers``): the one that
decoded a list is the one that says why it is short, as an engine reports why a generation stopped.
"""

from __future__ import annotations

from collections.abc import Sequence

from recsvc.recommender.api import Answer, Fallback, Recommender, RecQuery, RecResult

NO_HISTORY_REASON = "no_history: popular items"
NO_DECODING_REASON = "no model decoding: popular items"  # a recommender without a model (a popularity table)


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


def explained_all(recommender: Recommender, queries: Sequence[RecQuery],
                  results: Sequence[RecResult]) -> list[Answer]:
    """Each of ``results`` (decoded for ``queries``, in order) explained."""
    if len(results) != len(queries):
        raise RuntimeError(f"engine returned {len(results)} results for {len(queries)} queries")
    return [explained(recommender, q, r) for q, r in zip(queries, results, strict=True)]


class Answering:
    """The ``Recommender``'s ``answer_now`` / ``answers`` over the class's own ``recommend`` and ``popular_items``
    (a mixin: a popularity table, the live catalog's recommender, tests' stand-ins)."""

    def answer_now(self: Recommender, query: RecQuery) -> Answer | None:
        return without_decoding(self, query)

    def answers(self: Recommender, queries: Sequence[RecQuery]) -> list[Answer]:
        return explained_all(self, queries, self.recommend(queries))


__all__ = ["NO_DECODING_REASON", "NO_HISTORY_REASON", "Answer", "Answering", "Fallback", "explained", "explained_all",
           "remaining", "shortfall_reason", "without_decoding"]
