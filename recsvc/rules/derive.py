"""Attributes derived from an item's title, for catalogs whose metadata has no brand or category (the shared
Amazon Beauty split keeps only asin and title). Both are heuristics, recorded as such in attributes.json.

    >>> title_brand("L'Oreal Paris Revitalift Anti-Wrinkle Cream, 1.7 oz"), title_brand("  (OPI) Nail Lacquer")
    ("l'oreal", 'opi')
    >>> title_category("OPI Nail Lacquer, Big Apple Red"), title_category("Olay Regenerist Serum, 1.7 oz")
    ('nail', 'skin')
    >>> title_category("Makeup Brush Set"), title_category("Wooden Comb")
    ('makeup', 'other')
"""

from __future__ import annotations

import re

_EDGE_PUNCT = "()[]{}\"'.,;:!?*-–—&+/"
_WORD = re.compile(r"[a-z]+")

# First matching category wins, in this order (a nail-polish brush is "nail", a makeup brush "makeup").
TITLE_CATEGORIES: tuple[tuple[str, frozenset[str]], ...] = (
    ("nail", frozenset("nail nails polish lacquer manicure pedicure cuticle gelish acrylic stamping".split())),
    ("fragrance", frozenset("eau parfum toilette cologne perfume fragrance edt edp".split())),
    ("hair", frozenset("hair shampoo conditioner dryer curl curling wig keratin scalp hairspray flat straightener "
                       "styling dye blonde extensions".split())),
    ("makeup", frozenset("makeup mascara eyeliner eyeshadow shadow lipstick lip gloss foundation concealer blush "
                         "bronzer palette primer brow lash lashes eyelash eyelashes powder cosmetics liner".split())),
    ("skin", frozenset("skin cream lotion serum moisturizer cleanser cleansing facial face spf sunscreen acne "
                       "wrinkle wrinkles aging mask peel toner moisturizing eye".split())),
    ("bath", frozenset("body bath soap shower wash butter hand scrub deodorant".split())),
    ("tools", frozenset("brush tool tools tweezer tweezers mirror clip bag case kit sponge".split())),
)


def title_brand(title: str | None) -> str | None:
    """The title's first word, outer punctuation stripped, case-folded (None for an empty title)."""
    for word in (title or "").split():
        word = word.strip(_EDGE_PUNCT)
        if word:
            return word.casefold()
    return None


def title_category(title: str | None) -> str | None:
    """A coarse product category from the title's words (``TITLE_CATEGORIES``); "other" when none matches,
    None for an empty title."""
    if not title or not title.strip():
        return None
    words = set(_WORD.findall(title.casefold()))
    for name, keys in TITLE_CATEGORIES:
        if words & keys:
            return name
    return "other"
