"""List-level business rules of one request (docs/RULES.md): caps, allow / deny filters, score boosts.

Plain data, already validated against the catalog's attributes (``recsvc.service.rpc.validation`` checks the wire
message; ``recsvc.rules.catalog.RuleCatalog.check`` the names and values). Attribute values are compared after
``normalize_value`` (case-folded, inner whitespace squashed), on both sides.

    >>> r = Rules(caps=(Cap("brand", 2),), boosts=(Boost("brand", "olay", 0.5),))
    >>> r.effective(k=10) == r, r.effective(k=2).caps
    (True, ())

Semantics, per returned list of k items:
- ``Cap(a, m)``: at most m items share a value of attribute a (an item with several values counts once for
  each; an item without a value is never capped);
- ``ValueFilter`` in ``allow``: only items having at least one of the values; several allow filters all apply;
- ``ValueFilter`` in ``deny``: never an item having one of the values;
- ``Boost(a, v, w)``: w is added to the score (a log-probability) of every item having value v of a; the list
  is ordered by score + boosts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STRATEGIES = ("beam", "cdsl", "cdlh", "postfilter")  # how caps and boosts are decoded (docs/RULES.md)
DEFAULT_STRATEGY = "beam"
VERIFY_MODES = ("beams", "paths")  # cdsl: the target scores the kept beams, or every drafted path
LOOKAHEAD_WHEN = ("needed", "always")  # cdsl / cdlh: where caps keep extra beams, or at every depth


def normalize_value(text: str) -> str:
    """``normalize_value("  L'Oreal   Paris ") == "l'oreal paris"``."""
    return " ".join(str(text).split()).casefold()


@dataclass(frozen=True)
class Cap:
    attribute: str
    m: int  # >= 1


@dataclass(frozen=True)
class ValueFilter:
    attribute: str
    values: frozenset[str]  # normalized, non-empty


@dataclass(frozen=True)
class Boost:
    attribute: str
    value: str  # normalized
    weight: float  # added to the log-probability score


@dataclass(frozen=True)
class Rules:
    caps: tuple[Cap, ...] = ()
    allow: tuple[ValueFilter, ...] = ()
    deny: tuple[ValueFilter, ...] = ()
    boosts: tuple[Boost, ...] = field(default=())

    @property
    def has_filters(self) -> bool:
        return bool(self.allow or self.deny)

    @property
    def list_level(self) -> bool:
        """Caps or boosts: the parts a prefix cannot decide (filters become dead trie nodes instead)."""
        return bool(self.caps or self.boosts)

    def effective(self, k: int) -> Rules:
        """The same rules without the parts that cannot change a list of k items: caps with m >= k and zero
        boosts. A request whose effective rules have no list-level part decodes exactly as without rules."""
        return Rules(caps=tuple(c for c in self.caps if c.m < k), allow=self.allow, deny=self.deny,
                     boosts=tuple(b for b in self.boosts if b.weight != 0.0))

    def attributes(self) -> set[str]:
        return ({c.attribute for c in self.caps} | {f.attribute for f in self.allow + self.deny}
                | {b.attribute for b in self.boosts})
