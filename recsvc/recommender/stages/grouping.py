"""A batch's queries grouped for the engine: one group per (mode, beam width, list-level rules), strict queries
that will not speculate joined to the plain ones, and plain queries whose prompt state is cached split off."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from recsvc.engine.entry.dispatch import Mode
from recsvc.recommender.api import RecQuery
from recsvc.recommender.stages.scope import Scope
from recsvc.rules.spec import Rules


@dataclass(frozen=True)
class Group:
    """Queries decoded by one engine call: their indices in the batch, the mode, the beam width, and whether
    their caps and boosts (or postfiltered filters) go to the rules' list-level search."""

    mode: Mode
    width: int
    listed: bool
    rows: tuple[int, ...]


@dataclass(frozen=True)
class Grouped:
    groups: list[Group]
    plain_because: dict[int, str]  # strict queries decoded plainly: why (no drafter, or it does not pay)


def group_queries(scope: Scope, queries: Sequence[RecQuery]) -> Grouped:
    """The batch's engine calls, in first-seen order of their (mode, width, listed)."""
    by_key: dict[tuple[Mode, int, bool], list[int]] = {}
    plain_because: dict[int, str] = {}  # strict queries decoded plainly (they share the plain queries' batch)
    strategy = scope.settings.rules.strategy
    for i, q in enumerate(queries):
        mode = q.mode
        width = scope.width_for(q.k, mode)
        if mode == "strict" and scope.no_speculation(width):
            plain_because[i] = scope.no_speculation(width)  # no drafter, or speculation does not pay here
            mode = "plain"
        listed = q.rules is not None and (q.rules.effective(q.k).list_level or (
            strategy == "postfilter" and _filters_remove_items(scope, q.rules)))
        by_key.setdefault((mode, width, listed), []).append(i)
    groups = [Group(mode, width, listed, tuple(idx)) for (mode, width, listed), idx in by_key.items()]
    return Grouped(groups, plain_because)


def _filters_remove_items(scope: Scope, rules: Rules) -> bool:
    """Whether the allow / deny lists rule out any catalog item (postfilter applies them after decoding)."""
    return rules.has_filters and not bool(scope.catalog().alive_rows(rules, ()).all())


def split_cached(scope: Scope, mode: str, listed: bool, idx: list[int], queries: Sequence[RecQuery]
                 ) -> list[list[int]]:
    """Plain requests whose prompt state is cached run one by one, the others share one batch: a batch that
    mixes them runs every row's decode steps, while alone a cached prompt costs only its decode steps and an
    identical repeat no forward at all. The outputs are the same either way (the fast forward's rows do not
    depend on what shares their forward)."""
    states = scope.settings.states
    if states is None or mode != "plain" or listed or len(idx) == 1:
        return [idx]
    hit: list[int] = []
    rest: list[int] = []
    for i in idx:
        tokens = scope.parts.prompts.prompt_ids(queries[i].history)
        entry, n = states.lookup(tokens, count=False)
        (hit if entry is not None and n == len(tokens) else rest).append(i)
    return [[i] for i in hit] + ([rest] if rest else [])
