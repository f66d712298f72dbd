"""The recommender's public contract: what the service and the benchmarks call.

A ``Recommender`` (``bundle_recommender.BundleRecommender``: a bundle decoded by the engine) answers batches of
``RecQuery``.
Everything here is plain data; timers and counters live in ``RecStats``, outside the algorithms' results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from recsvc.rules.spec import Rules

if TYPE_CHECKING:
    from recsvc.rules.catalog import RuleCatalog

Mode = Literal["plain", "strict", "relaxed"]
MODES: tuple[Mode, ...] = ("plain", "strict", "relaxed")
# what ran: a requested mode, or "sampling" (relaxed asked for, the target's own sampling beam search answered)
DecodedMode = Literal["plain", "strict", "relaxed", "sampling"]


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
class Decoding:
    """How the engine decoded one query: what it did, which may differ from what the query asked for."""

    mode: DecodedMode  # plain beam search / strict or relaxed speculation / the target's own sampling
    beam_width: int  # beams searched (plain, strict: >= k, the first k returned; sampling modes: k)
    draft_beams: int = 0  # N, beams drafted per round (speculating only)
    gamma: int = 0  # draft depths per round (speculating only)
    fallback: str = ""  # why the query's mode did not run ("" when it did), e.g. "no drafter"


@dataclass(frozen=True)
class RecResult:
    item_ids: list[int]  # best first; fewer than k only if the catalog (minus exclusions) is smaller
    scores: list[float]  # sum of code-token log-probs (transformers' convention) [+ w * log P(item): fused prior]
    #                      [+ the boosts of the query's rules that match the item]
    stats: RecStats = field(default_factory=RecStats)
    decoding: Decoding | None = None  # None: no decoding ran (e.g. a popularity table answered)
    fresh: int = 0  # the last `fresh` items are fresh-item slots (recsvc.model.fresh); their scores are the
    #                 cosine similarity of the item's text to the history's, not log-probs


class Recommender(Protocol):
    """Anything that answers batches of queries (the real engine; tests may add a popularity fallback)."""

    max_k: int
    max_history: int

    def known_item(self, item_id: int) -> bool: ...

    def semantic_id(self, item_id: int) -> list[str]: ...

    def popular_items(self, k: int, exclude: Sequence[int] = (), rules: Rules | None = None) -> list[int]: ...

    @property
    def rule_catalog(self) -> RuleCatalog | None: ...  # item attributes for rules (None: rules refused)

    def recommend(self, queries: Sequence[RecQuery]) -> list[RecResult]: ...
