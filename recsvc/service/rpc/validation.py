"""Request validation: turns wire messages into checked values or raises :class:`InvalidRequest`.

Every message names the field, the limit and the offending value, so INVALID_ARGUMENT answers are actionable.

Item keys (the team's own ids, ``recsvc.bundle.keys``) are translated to item numbers here, at the boundary:
a list is sent either as numbers or as keys (``history`` / ``history_keys``, ``exclude_items`` /
``exclude_keys``, ``item_ids`` / ``item_keys``), never both in one request; unknown keys are named.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

from recsvc.errors import InvalidRequest
from recsvc.recommender.api import MODES, Mode, Recommender, RecQuery
from recsvc.rules.spec import Rules
from recsvc.service.gen import recommender_pb2 as pb

from .rules_wire import rules_from_wire

DEFAULT_K = 10
DEFAULT_TEMPERATURE = 1.0
# Accepted sampling temperatures (relaxed mode; checked in every mode). Below 0.05 the tempered log-probs
# overflow float32 (1e-20 gave scores of -4.7e18, 1e-38 no items at all); above 10 sampling is close to uniform
# over the trie and the model no longer matters. Documented in protos/recsvc/v1/recommender.proto.
TEMPERATURE_RANGE = (0.05, 10.0)
_SHOWN_UNKNOWN = 5  # unknown item ids (or keys) named in a message
_SHOWN_KEY_CHARS = 80  # a long unknown key is cut in the message
NO_KEYS = "this bundle has no item keys"

MODE_FROM_WIRE: dict[int, Mode] = {
    pb.STRICT_SPECULATIVE: "strict",
    pb.RELAXED_SPECULATIVE: "relaxed",
    pb.PLAIN: "plain",
}
MODE_TO_WIRE: dict[Mode, int] = {mode: wire for wire, mode in MODE_FROM_WIRE.items()}


@dataclass(frozen=True)
class Limits:
    """Server-side request limits (the effective ``max_k`` is also capped by the engine's)."""

    max_k: int = 50
    max_history: int = 200
    max_exclude: int = 1000
    max_user_id_chars: int = 128
    max_record_items: int = 200


@dataclass(frozen=True)
class RecommendArgs:
    """A validated ``RecommendRequest``."""

    user_id: str
    inline_history: tuple[int, ...]  # empty -> use the stored history
    k: int
    mode: Mode
    exclude: frozenset[int]
    exclude_history: bool | None  # None: as the server is configured
    temperature: float
    seed: int | None
    rules: Rules | None = None

    def query_for(self, history: Sequence[int], served_exclude_history: bool) -> RecQuery:
        """The engine's query for this request over ``history`` (the inline or the stored one): the history's
        items join the exclusions when the request asks for it, else when the server is so configured
        (``served_exclude_history``)."""
        excluding = self.exclude_history if self.exclude_history is not None else served_exclude_history
        exclude = set(self.exclude) | (set(history) if excluding else set())
        return RecQuery(history=tuple(history), k=self.k, mode=self.mode, exclude=tuple(sorted(exclude)),
                        temperature=self.temperature, seed=self.seed, rules=self.rules, exclude_history=excluding)


def check_user_id(user_id: str, limits: Limits) -> str:
    if not user_id:
        raise InvalidRequest("user_id is empty")
    if len(user_id) > limits.max_user_id_chars:
        raise InvalidRequest(
            f"user_id has {len(user_id)} characters; the limit is {limits.max_user_id_chars}"
        )
    if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in user_id):
        raise InvalidRequest("user_id contains control characters")
    return user_id


def check_items(field: str, items: Sequence[int], recommender: Recommender, limit: int) -> tuple[int, ...]:
    """All ids known to the catalog and at most ``limit`` of them."""
    if len(items) > limit:
        raise InvalidRequest(f"{field} has {len(items)} items; the limit is {limit}")
    unknown = [item for item in items if item <= 0 or not recommender.known_item(item)]
    if unknown:
        shown = ", ".join(str(item) for item in unknown[:_SHOWN_UNKNOWN])
        more = f" and {len(unknown) - _SHOWN_UNKNOWN} more" if len(unknown) > _SHOWN_UNKNOWN else ""
        raise InvalidRequest(f"unknown item ids in {field}: {shown}{more}")
    return tuple(int(item) for item in items)


def _named(values: Sequence[str]) -> str:
    """The first few of ``values`` as a message lists them."""
    shown = ", ".join(repr(v[:_SHOWN_KEY_CHARS]) for v in values[:_SHOWN_UNKNOWN])
    return shown + (f" and {len(values) - _SHOWN_UNKNOWN} more" if len(values) > _SHOWN_UNKNOWN else "")


def resolve_keys(field: str, keys: Sequence[str], recommender: Recommender, limit: int,
                 numbers_field: str) -> tuple[int, ...]:
    """Item keys -> the items' numbers (at most ``limit`` keys); InvalidRequest when the catalog has no keys or
    some key is unknown (the first few named)."""
    if len(keys) > limit:
        raise InvalidRequest(f"{field} has {len(keys)} items; the limit is {limit}")
    if not recommender.has_item_keys:
        raise InvalidRequest(f"{NO_KEYS}: send {numbers_field} instead of {field} (a bundle holds its keys in "
                             "item_keys.json: `recsvc bundle serving-files` adds it to an older bundle)")
    items = [recommender.item_of_key(key) for key in keys]
    unknown = [key for key, item in zip(keys, items, strict=True) if item is None]
    if unknown:
        raise InvalidRequest(f"unknown item keys in {field}: {_named(unknown)}")
    return tuple(int(item) for item in items if item is not None)


def one_way(numbers_field: str, numbers: Sequence[int], keys_field: str, keys: Sequence[str]) -> None:
    """A list is sent as numbers or as keys, not both."""
    if len(numbers) and len(keys):
        raise InvalidRequest(f"{numbers_field} and {keys_field} are both set: send the items one way, as numbers "
                             f"({numbers_field}) or as keys ({keys_field})")


def resolve_mode(wire_mode: int, default: Mode) -> Mode:
    if wire_mode == pb.UNSPECIFIED:
        return default
    mode = MODE_FROM_WIRE.get(wire_mode)
    if mode is None:
        names = ", ".join(["UNSPECIFIED", *(pb.DecodingMode.Name(wire) for wire in MODE_FROM_WIRE)])
        raise InvalidRequest(f"unknown mode {wire_mode} (expected one of {names})")
    return mode


def check_k(request: pb.RecommendRequest, max_k: int) -> int:
    if not request.HasField("k"):
        return min(DEFAULT_K, max_k)
    if not 1 <= request.k <= max_k:
        raise InvalidRequest(f"k must be between 1 and {max_k} (got {request.k})")
    return int(request.k)


def check_temperature(request: pb.RecommendRequest) -> float:
    if not request.HasField("temperature"):
        return DEFAULT_TEMPERATURE
    value = float(request.temperature)
    low, high = TEMPERATURE_RANGE
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidRequest(f"temperature must be between {low} and {high} (got {value:g})")
    return value


def check_rules(wire: pb.Rules, recommender: Recommender, mode: Mode) -> Rules | None:
    """``Recommend.rules`` -> Rules (None when the message is empty); see ``recsvc.service.rpc.rules_wire``."""
    return rules_from_wire(wire, recommender, mode)


def validate_recommend(
    request: pb.RecommendRequest, recommender: Recommender, limits: Limits, default_mode: Mode
) -> RecommendArgs:
    if default_mode not in MODES:
        raise ValueError(f"default mode {default_mode!r} is not one of {MODES}")
    user_id = check_user_id(request.user_id, limits)
    mode = resolve_mode(request.mode, default_mode)
    k = check_k(request, min(limits.max_k, recommender.max_k))
    temperature = check_temperature(request)
    one_way("history", request.history, "history_keys", request.history_keys)
    one_way("exclude_items", request.exclude_items, "exclude_keys", request.exclude_keys)
    if request.history_keys:
        history = resolve_keys("history_keys", request.history_keys, recommender, limits.max_history, "history")
    else:
        history = check_items("history", request.history, recommender, limits.max_history)
    if len(request.exclude_items) > limits.max_exclude:
        raise InvalidRequest(
            f"exclude_items has {len(request.exclude_items)} items; the limit is {limits.max_exclude}"
        )
    exclude = (resolve_keys("exclude_keys", request.exclude_keys, recommender, limits.max_exclude, "exclude_items")
               if request.exclude_keys else request.exclude_items)  # unknown ids are harmless here
    return RecommendArgs(
        user_id=user_id,
        inline_history=history,
        k=k,
        mode=mode,
        exclude=frozenset(int(item) for item in exclude),
        exclude_history=request.exclude_history if request.HasField("exclude_history") else None,
        temperature=temperature,
        seed=int(request.seed) if request.HasField("seed") else None,
        rules=check_rules(request.rules, recommender, mode) if request.HasField("rules") else None,
    )


def validate_record(
    request: pb.RecordInteractionsRequest, recommender: Recommender, limits: Limits
) -> tuple[str, tuple[int, ...]]:
    user_id = check_user_id(request.user_id, limits)
    one_way("item_ids", request.item_ids, "item_keys", request.item_keys)
    if request.item_keys:
        return user_id, resolve_keys("item_keys", request.item_keys, recommender, limits.max_record_items,
                                     "item_ids")
    if not request.item_ids:
        raise InvalidRequest("item_ids is empty")
    return user_id, check_items("item_ids", request.item_ids, recommender, limits.max_record_items)
