"""How a ``BundleRecommender`` serves its parts: speculation per beam width, the served beam width, exclusions,
the rules' decoding, the user-state cache, prefill-ahead and host-read sampling. One frozen value, resolved
before the recommender is built; a variant is a new recommender over the same parts with other settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from recsvc.engine.caches.state_cache import UserStateCache
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.meters.host_reads import ReadSampler
from recsvc.engine.speculation.relaxed.keep import DEFAULT_KEEP, Keep
from recsvc.errors import UserError
from recsvc.rule_decoding.decode import RuleSettings


@dataclass(frozen=True)
class SpecSettings:
    """Strict speculation's (N, gamma) per beam width: calibrated per width (``per_width``), else fixed."""

    draft_beams: int | None = None  # N; None = the beam width
    gamma: int = 3  # draft depths per round (3 finishes a 4-token id in one round when all are accepted)
    per_width: dict[int, tuple[int, int]] | None = None  # calibrated {beam width: (N, gamma)}; (0, 0): plain
    why_plain: dict[int, str] | None = None  # why per_width holds (0, 0) for a width (default: calibration chose)

    def _tuned(self, width: int) -> int:
        """The calibrated width that serves ``width``: the nearest at or above, else the largest."""
        assert self.per_width
        above = [w for w in sorted(self.per_width) if w >= width]
        return above[0] if above else max(self.per_width)

    def for_width(self, width: int) -> tuple[int, int]:
        """(N, gamma) at this beam width: the calibrated choice (``_tuned``), else the fixed setting."""
        if self.per_width:
            return self.per_width[self._tuned(width)]
        return (self.draft_beams or width, self.gamma)

    def plain_reason(self, width: int) -> str:
        """Why this beam width is not decoded speculatively ("" when it is)."""
        if not self.per_width or self.for_width(width)[0] > 0:
            return ""
        tuned = self._tuned(width)
        return (self.why_plain or {}).get(tuned) or f"calibration: speculation does not pay at beam width {tuned}"


@dataclass(frozen=True)
class RecommenderSettings:
    """``beam_width`` B: plain and strict decoding search B >= k beams and return the first k, so the top-k of a
    request is a prefix of its top-k' for every k <= k' <= B (0: B = k, transformers' num_beams = k).
    ``exclude_history``: never recommend a query's history items (unless the query says otherwise).
    ``states``: the user-state cache (``state_cache_for``; None: off); ``prefill_ahead``: compute a user's next
    request after a write, when the server is idle. ``read_sampler``: counts the host reads of every N-th decode
    (None: off). ``relaxed_keep``: relaxed mode's rule for >= K accepted drafts
    (``recsvc.engine.speculation.relaxed.keep``); default the paper's uniform pick, whose outputs
    tests/data/decoding_golden.json records (draw-order follows the target's sampling more closely:
    docs/SPECULATIVE.md)."""

    spec: SpecSettings = field(default_factory=SpecSettings)
    max_k: int = 50
    exclude_history: bool = False
    beam_width: int = 0
    rules: RuleSettings = field(default_factory=RuleSettings)
    states: UserStateCache | None = None
    prefill_ahead: bool = False
    read_sampler: ReadSampler | None = None
    relaxed_keep: Keep = DEFAULT_KEEP

    def __post_init__(self) -> None:
        if self.beam_width < 0:
            raise UserError(f"beam width must be >= 0 (0 = k), got {self.beam_width}")


def state_cache_for(target: EngineModel | None, budget_bytes: int, version: str = "") -> UserStateCache | None:
    """A user-state cache (``recsvc.engine.caches.state_cache``) of ``budget_bytes`` for this target, None when off (0)
    or when its forward keeps no states (of a token target's forwards only the fast one does: fp32 target, "fp32"
    attention). ``target`` None: an items bundle (no token target), whose item-level target keeps its timeline
    states and search outputs as the cache's keyed rows whatever its precision."""
    if budget_bytes <= 0:
        return None
    return UserStateCache(budget_bytes, version) if target is None or target.plan.fast else None


def read_sampler_for(every: int) -> ReadSampler | None:
    """Host-read sampling of every ``every``-th decode (0: off)."""
    return ReadSampler(every) if every > 0 else None
