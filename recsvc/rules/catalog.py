"""The catalog's item attributes laid over the trie, and a batch of requests' rules compiled against it.

Leaves are numbered in code order (``tokenizer_rqvae.trie``), so the leaves under any node form one contiguous
range ``[leaf_lo[node], leaf_hi[node])``: the items a prefix can still become are known exactly, and so are
their attributes, even though the prefix itself decides none of them (docs/RULES.md, "What the trie knows").

Worked example (the trie of ``tokenizer_rqvae.trie``: items 7 = (1, 2), 8 = (1, 3), 9 = (2, 0); nodes 0 root,
1 = (1,), 2 = (2,), leaves 3, 4, 5 = leaf indices 0, 1, 2)::

    leaf_lo = [0, 0, 2, 0, 1, 2]    leaf_hi = [3, 2, 3, 1, 2, 3]     (node 1 holds leaves 0..1: items 7, 8)

Shapes: B requests, n catalog items (rows of ``trie.ids``, ascending item id), NL leaves, N trie nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from recsvc.rules.attributes import ItemAttributes
from recsvc.rules.greedy import CapSpec
from recsvc.rules.spec import Rules
from tokenizer_rqvae.trie import CatalogTrie


@dataclass(frozen=True)
class AttributeIndex:
    """One attribute over the catalog rows, as CSR: row r has values ``indices[indptr[r]:indptr[r + 1]]``."""

    vocab: list[str]  # value id -> value
    ids: dict[str, int]  # value -> value id
    indptr: np.ndarray  # [n + 1] int64
    indices: np.ndarray  # [nnz] int64 value ids
    single: np.ndarray | None  # [n] the row's only value id (-1: none) when no row has two values, else None

    def rows_with(self, values: Sequence[str]) -> np.ndarray:
        """[n] bool: rows having at least one of ``values`` (unknown values match nothing)."""
        wanted = np.zeros(len(self.vocab) + 1, dtype=bool)
        wanted[[self.ids[v] for v in values if v in self.ids]] = True
        hits = np.concatenate([[0], np.cumsum(wanted[self.indices])])  # hits among the first j values
        return hits[self.indptr[1:]] > hits[self.indptr[:-1]]


def _index(attrs: ItemAttributes, name: str, item_ids: np.ndarray) -> AttributeIndex:
    vocab = attrs.vocabulary(name)
    ids = {v: i for i, v in enumerate(vocab)}
    per_item = attrs.values[name]
    lists = [[ids[v] for v in per_item.get(int(item), ())] for item in item_ids]
    indptr = np.zeros(len(lists) + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(v) for v in lists])
    indices = np.array([v for vals in lists for v in vals], dtype=np.int64)
    single = None
    if all(len(v) <= 1 for v in lists):
        single = np.array([v[0] if v else -1 for v in lists], dtype=np.int64)
    return AttributeIndex(vocab, ids, indptr, indices, single)


@dataclass
class BatchRules:
    """Rules of a batch of requests, compiled (``RuleCatalog.compile``)."""

    dead: torch.Tensor | None  # [B, N] bool: prefixes with no item left (exclusions + filters); None: none
    leaf_row: torch.Tensor  # [B, NL] the catalog row a leaf returns (lowest alive item id; n: none alive)
    leaf_boost: torch.Tensor  # [B, NL] float32 boost of that item
    node_bonus: torch.Tensor | None  # [B, N] the largest boost of an alive item under each node; None: no boosts
    caps: list[CapSpec]  # per request (CapSpec.none(): no caps)
    excluded: list[list[int]]  # per request: excluded item ids (exclusions + filtered), for collided leaves

    def bonus(self, nodes: torch.Tensor) -> torch.Tensor:
        """[B, m] trie nodes (-1 none) -> [B, m] the optimistic boost of each (0 without boosts)."""
        if self.node_bonus is None:
            return torch.zeros(nodes.shape, device=nodes.device)
        return self.node_bonus.gather(1, nodes.clamp(min=0))


class RuleCatalog:
    def __init__(self, attrs: ItemAttributes, trie: CatalogTrie) -> None:
        self.attrs, self.trie = attrs, trie
        item_ids = trie.ids.item_ids
        self.n = len(item_ids)
        self.index = {name: _index(attrs, name, item_ids) for name in attrs.names}
        leaves = trie.item_path[:, trie.levels] - trie.num_internal  # [n] leaf index of every row
        self.leaf_of_row = leaves
        nl = trie.num_nodes - trie.num_internal
        dev = trie.device  # the trie's (the model's) device: compiled rules are read beside the beams
        lo = torch.full((trie.num_nodes,), nl, dtype=torch.long, device=dev)
        hi = torch.zeros(trie.num_nodes, dtype=torch.long, device=dev)
        for d in range(trie.levels + 1):
            lo.scatter_reduce_(0, trie.item_path[:, d], leaves, "amin")
            hi.scatter_reduce_(0, trie.item_path[:, d], leaves + 1, "amax")
        self.leaf_lo, self.leaf_hi = lo, hi  # [N]
        self._lo, self._hi = lo.tolist(), hi.tolist()  # the same as Python ints: read per candidate prefix
        first = torch.full((nl,), self.n, dtype=torch.long, device=dev)  # lowest row (= lowest item id) of each leaf
        first.scatter_reduce_(0, leaves, torch.arange(self.n, device=dev), "amin")
        self.static_leaf_row = first
        self.collided = bool(len(torch.unique(leaves)) != self.n)

    # ---- what validation asks ----------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return sorted(self.index)

    def has_value(self, attribute: str, value: str) -> bool:
        return value in self.index[attribute].ids

    def values_of(self, attribute: str, limit: int = 8) -> list[str]:
        return self.index[attribute].vocab[:limit]

    # ---- compiling a batch ---------------------------------------------------------------------------------
    def alive_rows(self, rules: Rules, excluded: Sequence[int]) -> np.ndarray:
        """[n] bool: items neither excluded nor filtered out by the rules' allow / deny lists."""
        alive = np.ones(self.n, dtype=bool)
        for f in rules.allow:
            alive &= self._rows_with(f.attribute, sorted(f.values))
        for f in rules.deny:
            alive &= ~self._rows_with(f.attribute, sorted(f.values))
        rows = [self.trie.ids.index_of(i) for i in set(int(x) for x in excluded) if i in self.trie.ids]
        alive[rows] = False
        return alive

    def _rows_with(self, attribute: str, values: Sequence[str]) -> np.ndarray:
        if attribute not in self.index:  # removed by a refresh after validation: no item has it
            return np.zeros(self.n, dtype=bool)
        return self.index[attribute].rows_with(values)

    def item_boost(self, rules: Rules) -> np.ndarray:
        """[n] float32: the sum of the rules' boosts each item matches."""
        boost = np.zeros(self.n, dtype=np.float32)
        for b in rules.boosts:
            boost += np.float32(b.weight) * self._rows_with(b.attribute, [b.value])
        return boost

    def cap_spec(self, rules: Rules) -> CapSpec:
        caps = [(c.m, self.index[c.attribute]) for c in rules.caps if c.attribute in self.index]
        return CapSpec([m for m, _ in caps], [(ix.indptr, ix.indices, ix.single) for _, ix in caps])

    def compile(self, rules: Sequence[Rules], excluded: Sequence[Sequence[int]]) -> BatchRules:
        """Per request: dead prefixes, each leaf's item and boost, the optimistic boost of every node, caps."""
        trie = self.trie
        dev = trie.device
        alive = torch.as_tensor(np.stack([self.alive_rows(r, ex) for r, ex in zip(rules, excluded, strict=True)]),
                                device=dev)
        b = alive.shape[0]
        path = trie.item_path.T.reshape(1, -1).expand(b, -1)  # [B, (L+1) n] every item's path, depth-major
        count = torch.zeros(b, trie.num_nodes, dtype=torch.long, device=dev)
        count.scatter_add_(1, path, alive.long().repeat(1, trie.levels + 1))
        dead = count == 0
        if self.collided:
            rows = torch.where(alive, torch.arange(self.n, device=dev), self.n)  # [B, n]
            leaf_row = torch.full((b, len(self.static_leaf_row)), self.n, dtype=torch.long, device=dev)
            leaf_row.scatter_reduce_(1, self.leaf_of_row.expand(b, -1), rows, "amin")
        else:
            leaf_row = torch.where(dead[:, trie.num_internal:], self.n, self.static_leaf_row[None])
        boosts = torch.as_tensor(np.stack([self.item_boost(r) for r in rules]), device=dev)  # [B, n]
        padded = torch.cat([boosts, torch.zeros(b, 1, device=dev)], 1)  # row n: no item
        leaf_boost = padded.gather(1, leaf_row)
        node_bonus = None
        if any(r.boosts for r in rules):
            masked = torch.where(alive, boosts, float("-inf")).repeat(1, trie.levels + 1)
            node_bonus = torch.full((b, trie.num_nodes), float("-inf"), device=dev)
            node_bonus.scatter_reduce_(1, path, masked, "amax")
            node_bonus[:, trie.num_internal:] = leaf_boost  # a leaf returns one item: its own boost
            node_bonus = torch.where(dead, 0.0, node_bonus)
        excluded_ids = [list(ex) + trie.ids.item_ids[~row.cpu().numpy()].tolist() if self.collided else list(ex)
                        for ex, row in zip(excluded, alive, strict=True)]
        return BatchRules(dead if bool(dead.any()) else None, leaf_row, leaf_boost, node_bonus,
                          [self.cap_spec(r) for r in rules], excluded_ids)

    def leaves_under(self, node: int, leaf_row: np.ndarray) -> np.ndarray:
        """Catalog rows of the alive leaves under ``node`` (one request's ``leaf_row`` [NL] as numpy), in code
        order."""
        rows = leaf_row[self._lo[node]: self._hi[node]]
        return rows[rows < self.n]
