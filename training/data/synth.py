"""A synthetic beauty catalog with learnable sequential structure, written in the split data format.

Catalog: ``n_items`` items spread over leaf categories (e.g. ``Hair Care > Shampoo``); each has a brand, a
variant (scent / shade / finish) and a size, so the title reads "Lavender Shampoo by Acme, 12 oz". Within a
leaf, items have Zipf-like popularity and a fixed *successor*: the leaf's items form a shuffled cycle and
``successor[i]`` is the next item on it (think "refill after the starter kit").

Users: each has 1-2 preferred leaves; the first item is drawn from one of them by popularity, then each step
goes (without repeating an item the user already has)

- 55 %: to the successor of the current item (or the next one on the cycle the user does not have);
- 25 %: to another item of the current leaf (by popularity);
- 15 %: to an item of a preferred leaf;
-  5 %: to a uniformly random item.

So "successor of the last item" predicts about half of the next items, far above popularity. Every
interaction gets a synthetic timestamp (each user is active over a random window of a global clock); the
events are then cut 8:1:1 by global time and users with < 2 train items are dropped, exactly like the real
data (:func:`training.data.time_split.split_by_global_time`). Users are renumbered 1..U; item ids are the catalog
ids 1..n_items (``items.json`` holds every item, including ones nobody bought). Deterministic for a seed.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

from recsvc.data.split import ItemMeta, write_split_dir
from recsvc.errors import UserError
from training.data.time_split import split_by_global_time

# top-level group -> (leaf categories, variants, sizes)
CATALOG: dict[str, tuple[list[str], list[str], list[str]]] = {
    "Hair Care": (["Shampoo", "Conditioner", "Hair Oil", "Styling Gel"],
                  ["Lavender", "Coconut", "Argan", "Tea Tree", "Citrus", "Mint"], ["8 oz", "12 oz", "16 oz"]),
    "Skin Care": (["Face Cream", "Cleanser", "Sunscreen", "Serum"],
                  ["Hydrating", "Vitamin C", "Retinol", "Aloe", "Hyaluronic", "Green Tea"],
                  ["1 oz", "1.7 oz", "3.4 oz"]),
    "Makeup": (["Lipstick", "Mascara", "Foundation", "Eyeliner"],
               ["Ruby Red", "Nude", "Coral", "Plum", "Jet Black", "Ivory"], ["0.1 oz", "0.3 oz", "1 oz"]),
    "Nails": (["Nail Polish", "Nail File", "Cuticle Oil"],
              ["Glossy", "Matte", "Glitter", "Pastel", "Neon"], ["0.5 oz", "Pack of 3", "Pack of 6"]),
    "Fragrance": (["Eau de Parfum", "Body Mist"],
                  ["Vanilla", "Rose", "Sandalwood", "Jasmine", "Ocean"],
                  ["1 fl oz", "1.7 fl oz", "3.4 fl oz"]),
    "Bath & Body": (["Body Lotion", "Shower Gel", "Bath Salts"],
                    ["Shea", "Eucalyptus", "Honey", "Oatmeal", "Cherry Blossom"],
                    ["10 oz", "16 oz", "32 oz"]),
}
BRANDS = ["Acme", "Lumina", "Verdant", "Orchid & Co", "Nordhaven", "Solene", "Kirra", "Maison Bleu",
          "Pure Ridge", "Velvet Fox", "Amberly", "Cobalt Lane"]
P_SUCCESSOR, P_SAME_LEAF, P_PREFERRED = 0.55, 0.25, 0.15  # the rest: a random item


@dataclass(frozen=True)
class UserSequences:
    """How the synthetic users' sequences are drawn (``data synth`` and ``data synth-log``): everything from one
    ``seed``, each user's length uniform in [``min_len``, ``max_len``], then :func:`make_sequence`."""

    seed: int = 0
    min_len: int = 5
    max_len: int = 20

    def check_lengths(self, n_items: int) -> None:
        """UserError unless 2 <= min_len <= max_len <= n_items (a user never repeats an item)."""
        if not 2 <= self.min_len <= self.max_len:
            raise UserError(f"need 2 <= --min-len <= --max-len, got {self.min_len} and {self.max_len}")
        if self.max_len > n_items:
            raise UserError(f"--max-len ({self.max_len}) cannot exceed --items ({n_items}): "
                            "a user never repeats an item")

    def draw(self, cat: Catalog, rng: random.Random) -> list[int]:
        """One user's chronological items."""
        return make_sequence(cat, rng.randint(self.min_len, self.max_len), rng)


@dataclass(frozen=True)
class SynthConfig(UserSequences):
    n_items: int = 300
    n_users: int = 600
    split: tuple[int, int, int] = (8, 1, 1)

    def check(self) -> None:
        if self.n_items < 2:
            raise UserError(f"--items must be >= 2, got {self.n_items}")
        if self.n_users < 1:
            raise UserError(f"--users must be >= 1, got {self.n_users}")
        self.check_lengths(self.n_items)


@dataclass
class Catalog:
    items: dict[int, ItemMeta]  # 1..n
    leaf_of: dict[int, str]
    by_leaf: dict[str, list[int]]  # leaf -> its items, most popular first
    cum_weights: dict[str, list[float]]  # leaf -> cumulative popularity weights (aligned with by_leaf)
    successor: dict[int, int]


def make_catalog(n_items: int, rng: random.Random) -> Catalog:
    """Items 1..n over the leaf categories; ids are shuffled so they do not encode the category."""
    leaves = [(group, leaf) for group, (names, _, _) in CATALOG.items() for leaf in names]
    rng.shuffle(leaves)
    leaves = leaves[:n_items]  # a tiny catalog uses fewer leaves
    ids = list(range(1, n_items + 1))
    rng.shuffle(ids)
    items: dict[int, ItemMeta] = {}
    leaf_of: dict[int, str] = {}
    by_leaf: dict[str, list[int]] = {leaf: [] for _, leaf in leaves}
    seen_titles: set[str] = set()
    for pos, item in enumerate(ids):
        group, leaf = leaves[pos % len(leaves)]
        _, variants, sizes = CATALOG[group]
        for _ in range(20):  # prefer unique titles; accept a duplicate in a catalog too big for them
            brand, variant, size = rng.choice(BRANDS), rng.choice(variants), rng.choice(sizes)
            title = f"{variant} {leaf} by {brand}, {size}"
            if title not in seen_titles:
                break
        seen_titles.add(title)
        items[item] = ItemMeta(asin=f"SYN{item:07d}", title=title, brand=brand,
                               categories=("Beauty", group, leaf))
        leaf_of[item] = leaf
        by_leaf[leaf].append(item)
    cum_weights: dict[str, list[float]] = {}
    successor: dict[int, int] = {}
    for leaf, members in by_leaf.items():
        rng.shuffle(members)  # popularity rank order
        cum_weights[leaf] = list(accumulate(1.0 / (rank + 1) ** 0.8 for rank in range(len(members))))
        cycle = members[:]
        rng.shuffle(cycle)
        for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
            successor[a] = b
    return Catalog(items=items, leaf_of=leaf_of, by_leaf=by_leaf, cum_weights=cum_weights,
                   successor=successor)


def _pick(cat: Catalog, leaf: str, rng: random.Random, avoid: set[int]) -> int | None:
    members = cat.by_leaf[leaf]
    for _ in range(4):
        item = rng.choices(members, cum_weights=cat.cum_weights[leaf])[0]
        if item not in avoid:
            return item
    free = [i for i in members if i not in avoid]
    return free[0] if free else None


def make_sequence(cat: Catalog, length: int, rng: random.Random) -> list[int]:
    """One user's chronological items (no repeats), following the Markov structure above."""
    leaves = list(cat.by_leaf)
    prefs = rng.sample(leaves, k=min(len(leaves), rng.choice((1, 2))))
    n_items = len(cat.items)
    first = _pick(cat, rng.choice(prefs), rng, set())
    seq = [first if first is not None else rng.randint(1, n_items)]
    seen = set(seq)
    while len(seq) < length:
        cur, r = seq[-1], rng.random()
        nxt: int | None = None
        if r < P_SUCCESSOR:  # the next item on the leaf's cycle that the user does not have yet
            nxt = cat.successor[cur]
            for _ in range(len(cat.by_leaf[cat.leaf_of[cur]])):
                if nxt not in seen:
                    break
                nxt = cat.successor[nxt]
        elif r < P_SUCCESSOR + P_SAME_LEAF:
            nxt = _pick(cat, cat.leaf_of[cur], rng, seen)
        elif r < P_SUCCESSOR + P_SAME_LEAF + P_PREFERRED:
            nxt = _pick(cat, rng.choice(prefs), rng, seen)
        while nxt is None or nxt in seen:
            nxt = rng.randint(1, n_items)
        seq.append(nxt)
        seen.add(nxt)
    return seq


Seqs = dict[int, list[int]]


def synthesize(config: SynthConfig) -> tuple[Catalog, Seqs, Seqs, Seqs]:
    """(catalog, train, valid, test) with users renumbered 1..U after the global split."""
    config.check()
    rng = random.Random(config.seed)
    cat = make_catalog(config.n_items, rng)
    horizon = 1_000_000
    events: list[tuple[int, int, int]] = []
    for user in range(config.n_users):
        seq = config.draw(cat, rng)
        start = rng.uniform(0, 0.6 * horizon)
        end = rng.uniform(start + 0.3 * horizon, horizon)
        times = sorted(int(rng.uniform(start, end)) for _ in seq)
        events.extend((t, user, item) for t, item in zip(times, seq, strict=True))
    split = split_by_global_time(events, config.split, min_train=2)
    if not split.train:
        raise UserError("no synthetic user kept 2 train items; raise --users or --min-len")
    renum = {u: idx for idx, u in enumerate(split.users(), start=1)}
    train, valid, test = ({renum[u]: seq for u, seq in part.items()}
                          for part in (split.train, split.valid, split.test))
    return cat, train, valid, test


def write_synth(out: str | Path, config: SynthConfig) -> dict[str, Any]:
    """Generate and write the data directory (+ ``stats.json``); returns the stats."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out exists and is not a directory: {out}")
    cat, train, valid, test = synthesize(config)
    write_split_dir(out, train, valid, test, cat.items)
    parts = {"train": train, "valid": valid, "test": test}
    stats: dict[str, Any] = {
        "users": len(train),
        "items": len(cat.items),
        "interactions": {name: sum(map(len, p.values())) for name, p in parts.items()},
        "users_with_items": {name: sum(1 for s in p.values() if s) for name, p in parts.items()},
        "dropped_users": config.n_users - len(train),
        "params": {**asdict(config), "split": list(config.split)},
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    return stats
