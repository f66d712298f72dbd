"""The named recipes (each a tuple of stages, in order) and the two ways a caller changes one: a range of its
stages (``select``) and parameter overrides (``override``: ``STAGE.FIELD=VALUE`` or ``FIELD=VALUE`` for every
stage that has the field, each value parsed by the field's type)."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any

from recsvc.errors import UserError
from training.recipe.stages import (
    Ids,
    ItemTarget,
    Stage,
    Target,
    TrainHead,
    TuneDense,
    TuneFresh,
    TuneHistory,
    TuneMix,
    TunePrior,
)

# the tunings every target's recipe runs over it, in order: the prior's fusion and the SASRec mix are scored on every
# validation user, once as served and once with history excluded
TUNINGS: tuple[Stage, ...] = (
    TunePrior(),
    TunePrior(name="prior-excl", exclude_history=True),
    TuneMix(),
    TuneMix(name="mix-excl", exclude_history=True),
    TuneHistory(),
)
# the served recipe (docs/QUALITY.md): ids, the target, then every tuning over it and the draft head
SERVED: tuple[Stage, ...] = (Ids(), Target(), *TUNINGS, TuneDense(), TuneFresh(), TrainHead())

# docs/QUALITY.md "A target too weak for its catalog": the served recipe's target trained for one epoch on the
# served ids, then the tunings that decide whether its fusion falls below its own prior (1,000 validation users)
_WEAK_TUNING = {"trials": 20, "budget_minutes": 8, "users": 1000, "threads": 2}
WEAK: tuple[Stage, ...] = (
    dataclasses.replace(SERVED[1], threads=2, max_minutes=None, fit_budget=False, epochs=1, seed=None,
                        dense_head=None, patience=0),
    dataclasses.replace(SERVED[2], **_WEAK_TUNING),
    dataclasses.replace(SERVED[3], **_WEAK_TUNING),
    dataclasses.replace(SERVED[4], budget_minutes=10, users=1000, threads=2),
    dataclasses.replace(SERVED[5], budget_minutes=10, users=1000, threads=2),
    dataclasses.replace(SERVED[6], threads=2),
)

# the item-level target (docs/QUALITY.md "The item-level target"): the same ids and tunings over a timeline over
# items and a small code decoder (no dense head and no draft head: it has neither)
SERVED_ITEMS: tuple[Stage, ...] = (Ids(), ItemTarget(), *TUNINGS, TuneFresh())

RECIPES: dict[str, tuple[Stage, ...]] = {"served": SERVED, "served-items": SERVED_ITEMS, "weak": WEAK}


def recipe(name: str) -> tuple[Stage, ...]:
    if name not in RECIPES:
        raise UserError(f"unknown recipe {name!r}: expected one of {', '.join(RECIPES)}")
    return RECIPES[name]


def stage(stages: Sequence[Stage], name: str) -> Stage:
    """The stage called ``name``."""
    for s in stages:
        if s.name == name:
            return s
    raise UserError(f"no stage {name!r}: the stages are {', '.join(s.name for s in stages)}")


def select(stages: Sequence[Stage], first: str | None = None, last: str | None = None) -> list[Stage]:
    """The stages from ``first`` through ``last`` (both included; None: the recipe's first / last).

        >>> [s.name for s in select(SERVED, "mix", "history")]
        ['mix', 'mix-excl', 'history']
    """
    names = [s.name for s in stages]
    i = names.index(stage(stages, first).name) if first else 0
    j = names.index(stage(stages, last).name) if last else len(names) - 1
    if i > j:
        raise UserError(f"--from {first} comes after --to {last} in the recipe ({', '.join(names)})")
    return list(stages[i : j + 1])


def override(stages: Sequence[Stage], settings: Sequence[str]) -> list[Stage]:
    """``stages`` with each ``[STAGE.]FIELD=VALUE`` of ``settings`` applied, VALUE parsed by the field's type
    (``none`` clears an optional field); a setting no stage takes is a UserError.

        >>> [s.trials for s in override(SERVED, ["trials=3", "mix.trials=4"]) if hasattr(s, "trials")]
        [3, 3, 4, 3]
    """
    out = list(stages)
    for setting in settings:
        key, sep, text = setting.partition("=")
        if not sep or not key:
            raise UserError(f"--set {setting!r}: expected [STAGE.]FIELD=VALUE")
        where, _, field = key.rpartition(".")
        field = field.replace("-", "_")
        if where:
            stage(out, where)  # names the stages when it is not one
        hit = False
        for i, s in enumerate(out):
            fields = {f.name for f in dataclasses.fields(s)}
            if (where and s.name != where) or field not in fields or field == "name":
                continue
            hint = typing.get_type_hints(type(s))[field]
            out[i] = dataclasses.replace(s, **{field: parse_value(hint, text, setting)})
            hit = True
        if not hit:
            raise UserError(f"--set {setting!r}: no stage{' ' + where if where else ''} has a field {field!r}")
    return out


def parse_value(hint: Any, text: str, setting: str) -> Any:
    """``text`` as a value of the type ``hint`` (int, float, str, bool, a Literal, unions of them, None).

        >>> parse_value(float | None, "25", "x"), parse_value(float, "1.0", "x"), parse_value(int | None, "none", "x")
        (25, 1.0, None)
    """
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    if type(None) in options and text.lower() == "none":
        return None
    for option in options:
        if option is type(None):
            continue
        if typing.get_origin(option) is typing.Literal:
            if text in typing.get_args(option):
                return text
            continue
        if option is bool:
            if text.lower() in ("true", "yes", "1", "false", "no", "0"):
                return text.lower() in ("true", "yes", "1")
            continue
        if option is int or option is float:  # an integer as written stays one ("25", not "25.0")
            for kind in ((int,) if option is int else (int, float)):
                try:
                    return kind(text)
                except ValueError:
                    pass
            continue
        if option is str:
            return text
    raise UserError(f"--set {setting!r}: {text!r} is not a {getattr(hint, '__name__', hint)}")
