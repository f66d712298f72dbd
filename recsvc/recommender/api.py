"""The recommender's public contract: what the service and the benchmarks call.

A ``Recommender`` (``bundle_recommender.BundleRecommender``: a bundle decoded by the engine) answers batches of
``RecQuery``.
Everything here is plain data; timers and counters live in ``RecStats``, outside the algorithms' results.
``Mode``, ``MODES``, ``DecodedMode`` and ``Decoding`` are the engine's (``recsvc.engine.entry.modes``), named here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from recsvc.engine.entry.modes import MODES, DecodedMode, Decoding, Mode
from recsvc.rules.spec import Rules

SPECULATIVE: tuple[Mode, ...] = ("strict", "relaxed")  # the modes a drafter speculates in

if TYPE_CHECKING:
    from recsvc.engine.caches.state_cache import UserStateCache
    from recsvc.rules.catalog import RuleCatalog

@dataclass(frozen=True)
class RecQuery:
    """One request to the engine (already validated by the caller)."""

    history: Sequence[int]  # chronological item ids; the prompt uses the last `max_history`
    k: int = 10  # items to return
    mode: Mode = "plain"  # plain beam search / strict (lossless) / relaxed (sampling) speculative
    exclude: Sequence[int] = ()  # item ids never returned (e.g. the user's history)
    temperature: float = 1.0  # relaxed mode: sampling temperature
    seed: int | None = None  # relaxed mode: makes the sample reproducible
    rules: Rules | None = None  # caps, allow / deny filters, boosts (recsvc.rules; needs item attributes)
    # leave the history's items out (True) or not (False); None: as the recommender is configured
    exclude_history: bool | None = None


@dataclass(frozen=True)
class RecStats:
    target_calls: int = 0  # target forward calls spent on this request (plain beam search: 4)
    draft_calls: int = 0  # drafter forward calls
    accepted_steps: int = 0  # draft depths accepted (AS), speculative modes only
    rounds: int = 0  # speculative rounds
    host_reads: int = -1  # device-to-host reads of the engine call it was decoded in (-1: not counted; sampled)


@dataclass(frozen=True)
class EngineFacts:
    """What a served engine resolved, for the serving log line and the benches' reports (no model: defaults)."""

    precision: str | None = None  # the weights' dtype as a --dtype name ("fp32", "bf16"); None: no model
    beam_width: int | None = None  # the served beam width B (0: each request's k); None: no beam search
    drafter_loaded: bool = False
    prior_weight: float = 0.0  # the fused prior's weight (0: none)
    fresh_slots: int = 0  # fresh items' tail slots
    speculation_per_width: dict[int, tuple[int, int]] | None = None  # calibrated {width: (N, gamma)}; (0, 0): plain


@dataclass(frozen=True)
class RecResult:
    item_ids: list[int]  # best first; fewer than k only if the catalog (minus exclusions) is smaller
    scores: list[float]  # sum of code-token log-probs (transformers' convention) [+ w * log P(item): fused prior]
    #                      [+ the boosts of the query's rules that match the item]
    stats: RecStats = field(default_factory=RecStats)
    decoding: Decoding | None = None  # None: no decoding ran (e.g. a popularity table answered)
    fresh: int = 0  # the last `fresh` items are fresh-item slots (recsvc.content.fresh); their scores are the
    #                 cosine similarity of the item's text to the history's, not log-probs


Fallback = Literal["", "no_history", "nothing_left", "short"]


@dataclass(frozen=True)
class Answer:
    """A query's answer as its response tells it (``recsvc.recommender.answer`` builds it): the result, why it
    holds fewer than k items, and why no model decoded it when none did."""

    result: RecResult
    reason: str = ""  # why fewer than k items, or no history ("" when neither)
    fallback: Fallback = ""  # the kind of fallback, as counted ("": none)
    not_decoded: str = ""  # why no model decoded it (result.decoding is None): popular items answered


class Recommender(Protocol):
    """What the service calls: anything that answers batches of queries (a bundle's engine, a popularity table).

    Everything a caller reads is declared here, typed: a rename fails at import and in the type checker, not
    silently at a default."""

    @property
    def max_k(self) -> int: ...  # the longest list it returns

    @property
    def max_history(self) -> int: ...  # history items a prompt uses (the last ones)

    @property
    def exclude_history(self) -> bool: ...  # the served choice for queries that do not say (RecQuery.exclude_history)

    @property
    def rule_catalog(self) -> RuleCatalog | None: ...  # item attributes for rules (None: rules refused)

    @property
    def states(self) -> UserStateCache | None: ...  # the user-state cache (None: none; /metrics reads its stats)

    @property
    def prefill_ahead_enabled(self) -> bool: ...  # whether the server should call prefill_ahead after writes

    @property
    def facts(self) -> EngineFacts: ...  # what the engine resolved (the serving log line, benches' reports)

    def known_item(self, item_id: int) -> bool: ...

    def semantic_id(self, item_id: int) -> list[str]: ...

    # the catalog's item keys (the team's own ids; ``recsvc.bundle.keys``): whether it has any, an item's key
    # (None: it has none) and a key's item (None: no item has it)
    @property
    def has_item_keys(self) -> bool: ...

    def key_of(self, item_id: int) -> str | None: ...

    def item_of_key(self, key: str) -> int | None: ...

    def popular_items(self, k: int, exclude: Sequence[int] = (), rules: Rules | None = None) -> list[int]: ...

    def recommend(self, queries: Sequence[RecQuery]) -> list[RecResult]: ...

    # the service's two calls: a query that needs no decoding answered at once (None: it is to be decoded), and a
    # batch decoded, each result with why it is short (``recsvc.recommender.answer``; ``Answering`` gives both)
    def answer_now(self, query: RecQuery) -> Answer | None: ...

    def answers(self, queries: Sequence[RecQuery]) -> list[Answer]: ...

    def prefill_ahead(self, history: Sequence[int]) -> None: ...  # a user's next request computed ahead


class WithoutModel:
    """The engine's part of the ``Recommender`` contract for a recommender without a model (a popularity table,
    a test's stand-in): history kept unless asked, no rules, no state cache, nothing computed ahead, no item
    keys."""

    exclude_history = False
    rule_catalog: RuleCatalog | None = None
    states: UserStateCache | None = None
    prefill_ahead_enabled = False
    facts = EngineFacts()
    has_item_keys = False

    def prefill_ahead(self, history: Sequence[int]) -> None:
        return None

    def key_of(self, item_id: int) -> str | None:
        return None

    def item_of_key(self, key: str) -> int | None:
        return None


__all__ = ["MODES", "Answer", "DecodedMode", "Decoding", "EngineFacts", "Fallback", "Mode", "RecQuery", "RecResult",
           "RecStats", "Recommender", "WithoutModel"]
