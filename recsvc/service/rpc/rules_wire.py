"""``Recommend.rules`` on the wire -> checked ``recsvc.rules.spec.Rules``, or INVALID_ARGUMENT with a message that
names the field, e.g. ``rules.max_per[1].attribute: unknown attribute 'brnd' (known: brand, category)``."""

from __future__ import annotations

import math
from collections.abc import Sequence

from recsvc.errors import InvalidRequest
from recsvc.recommender.api import Mode, Recommender
from recsvc.rules.catalog import RuleCatalog
from recsvc.rules.spec import Boost, Cap, Rules, ValueFilter, normalize_value
from recsvc.service.gen import recommender_pb2 as pb

MAX_ENTRIES = 16  # caps / filters / boosts per request
MAX_VALUES = 1000  # values per filter
MAX_BOOST = 100.0  # |weight|, in log-probability units
_SHOWN = 6  # known names / values quoted in a message


def _known(names: Sequence[str]) -> str:
    more = ", ..." if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more if names else "none"


def _attribute(field: str, name: str, catalog: RuleCatalog) -> str:
    if not name:
        raise InvalidRequest(f"{field} is empty")
    if name not in catalog.index:
        raise InvalidRequest(f"{field}: unknown attribute {name!r} (known: {_known(catalog.names)})")
    return name


def _value(field: str, attribute: str, value: str, catalog: RuleCatalog, must_exist: bool) -> str:
    norm = normalize_value(value)
    if not norm:
        raise InvalidRequest(f"{field}: empty value")
    if must_exist and not catalog.has_value(attribute, norm):
        raise InvalidRequest(f"{field}: unknown value {value!r} of {attribute!r} "
                             f"(e.g. {_known(catalog.values_of(attribute, _SHOWN + 1))})")
    return norm


def _entries(field: str, entries: Sequence) -> Sequence:
    if len(entries) > MAX_ENTRIES:
        raise InvalidRequest(f"{field} has {len(entries)} entries; the limit is {MAX_ENTRIES}")
    return entries


def _filters(field: str, entries: Sequence[pb.ValueFilter], catalog: RuleCatalog, must_exist: bool
             ) -> tuple[ValueFilter, ...]:
    out = []
    for i, f in enumerate(_entries(field, entries)):
        where = f"{field}[{i}]"
        attribute = _attribute(f"{where}.attribute", f.attribute, catalog)
        if not f.values:
            raise InvalidRequest(f"{where}.values is empty")
        if len(f.values) > MAX_VALUES:
            raise InvalidRequest(f"{where}.values has {len(f.values)} values; the limit is {MAX_VALUES}")
        values = frozenset(_value(f"{where}.values", attribute, v, catalog, must_exist) for v in f.values)
        out.append(ValueFilter(attribute, values))
    return tuple(out)


def rules_from_wire(wire: pb.Rules, recommender: Recommender, mode: Mode) -> Rules | None:
    """Checked rules, or None for an empty message (no rule at all)."""
    if not (wire.max_per or wire.allow or wire.deny or wire.boosts):
        return None
    catalog = recommender.rule_catalog
    if catalog is None:
        raise InvalidRequest("rules: this server has no item attributes (BUNDLE/attributes.json, made by "
                             "`recsvc bundle attributes`)")
    if mode == "relaxed" and (wire.max_per or wire.boosts):
        raise InvalidRequest("rules: max_per and boosts need PLAIN or STRICT_SPECULATIVE mode (RELAXED_SPECULATIVE "
                             "takes allow / deny filters only)")
    caps: list[Cap] = []
    for i, c in enumerate(_entries("rules.max_per", wire.max_per)):
        attribute = _attribute(f"rules.max_per[{i}].attribute", c.attribute, catalog)
        if c.m < 1:
            raise InvalidRequest(f"rules.max_per[{i}].m must be >= 1 (got {c.m})")
        if any(cap.attribute == attribute for cap in caps):
            raise InvalidRequest(f"rules.max_per[{i}]: a second cap on {attribute!r} (one cap per attribute)")
        caps.append(Cap(attribute, int(c.m)))
    boosts: list[Boost] = []
    for i, b in enumerate(_entries("rules.boosts", wire.boosts)):
        attribute = _attribute(f"rules.boosts[{i}].attribute", b.attribute, catalog)
        value = _value(f"rules.boosts[{i}].value", attribute, b.value, catalog, must_exist=True)
        weight = float(b.weight)
        if not (math.isfinite(weight) and abs(weight) <= MAX_BOOST):
            raise InvalidRequest(f"rules.boosts[{i}].weight must be finite and within [-{MAX_BOOST:g}, "
                                 f"{MAX_BOOST:g}] (got {weight:g})")
        boosts.append(Boost(attribute, value, weight))
    return Rules(caps=tuple(caps), allow=_filters("rules.allow", wire.allow, catalog, must_exist=True),
                 deny=_filters("rules.deny", wire.deny, catalog, must_exist=False), boosts=tuple(boosts))
