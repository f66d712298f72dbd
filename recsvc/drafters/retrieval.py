"""The retrieval drafter (REST-style, training-free): continuations of the history's suffix in a datastore.

The datastore maps every item suffix of length 1..max_suffix seen in the training sequences to a count of the
items that followed it. For a request, the longest suffix of its history found in the store gives weighted
candidate next items (shorter suffixes and global popularity fill up to ``max_candidates``). Drafts at depth d
are the depth-d prefixes (trie nodes) of the candidates that extend one of the target's current beams, ranked
by the summed weight of their candidates: a frequency-ranked trie of continuations, as in REST.

Example: sequences [[1, 2, 3], [9, 2, 3], [2, 4]]: suffix (2,) -> {3: 2, 4: 1}; a history ending in 2 drafts
item 3's prefixes first, then item 4's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.speculation.ports import StrictOnly, TargetState
from tokenizer_rqvae.trie import CatalogTrie


class RetrievalDatastore:
    def __init__(self, sequences: Iterable[Sequence[int]], max_suffix: int = 3) -> None:
        self.max_suffix = max_suffix
        self.next: dict[tuple[int, ...], Counter[int]] = {}
        popular: Counter[int] = Counter()
        for seq in sequences:
            seq = list(seq)
            popular.update(seq)
            for t in range(1, len(seq)):
                for m in range(1, min(max_suffix, t) + 1):
                    self.next.setdefault(tuple(seq[t - m : t]), Counter())[seq[t]] += 1
        self.popular = [i for i, _ in popular.most_common(256)]

    def candidates(self, history: Sequence[int], limit: int) -> list[tuple[int, float]]:
        """(item, weight) best first: longest matching suffix first (weight = count * 10^suffix length)."""
        out: dict[int, float] = {}
        for m in range(min(self.max_suffix, len(history)), 0, -1):
            for item, count in self.next.get(tuple(history[-m:]), Counter()).most_common(limit):
                out[item] = out.get(item, 0.0) + count * 10.0**m
        for rank, item in enumerate(self.popular):  # fill with popular items, weakest weights
            if len(out) >= limit:
                break
            out.setdefault(item, 1.0 / (rank + 2))
        return sorted(out.items(), key=lambda kv: -kv[1])[:limit]


class RetrievalDraftSession:
    calls = 0
    closed_tree = False  # its drafts need not hold their parents (the verification reads the tree's size)

    def __init__(self, trie: CatalogTrie, cands: list[list[tuple[int, float]]]) -> None:
        self.trie = trie
        ids = trie.ids
        self.paths = [trie.item_path[[ids.index_of(i) for i, _ in c if i in ids]] if c else
                      torch.zeros(0, trie.levels + 1, dtype=torch.long, device=trie.device)
                      for c in cands]  # per row [M, L+1]
        self.weights = [[w for i, w in c if i in ids] for c in cands]

    def propose(self, roots: torch.Tensor, root_scores: torch.Tensor, steps: torch.Tensor, width: int,
                target: TargetState, depths: int | None = None) -> list[torch.Tensor]:
        b = roots.shape[0]
        g = depths if depths is not None else int(steps.max())
        out = [torch.full((b, width), -1, dtype=torch.long, device=roots.device) for _ in range(g)]
        for row in range(b):
            valid_roots = roots[row][roots[row] >= 0]
            if not len(valid_roots) or not len(self.paths[row]):
                continue
            j = int(self.trie.depth[valid_roots[0]])
            under = torch.isin(self.paths[row][:, j], valid_roots)  # candidates extending a current beam
            for s in range(1, int(steps[row]) + 1):
                score: dict[int, float] = {}
                for node, w, ok in zip(self.paths[row][:, j + s].tolist(), self.weights[row], under.tolist(),
                                       strict=True):
                    if ok:
                        score[node] = score.get(node, 0.0) + w
                best = sorted(score, key=lambda n: -score[n])[:width]
                out[s - 1][row, : len(best)] = torch.tensor(best, dtype=torch.long, device=roots.device)
        return out

    def observe(self, beams: torch.Tensor) -> None:
        pass

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        self.paths = [self.paths[r] for r in keep]
        self.weights = [self.weights[r] for r in keep]


class RetrievalDrafter(StrictOnly):
    name = "retrieval"
    model = None
    draft_head = None

    def __init__(self, store: RetrievalDatastore, trie: CatalogTrie, max_candidates: int = 64) -> None:
        self.store, self.trie, self.max_candidates = store, trie, max_candidates

    def over(self, trie: CatalogTrie) -> RetrievalDrafter:
        return RetrievalDrafter(self.store, trie, self.max_candidates)

    def session(self, prompts: PromptBatch, histories: Sequence[Sequence[int]],
                dead: torch.Tensor | None, prior: torch.Tensor | None = None) -> RetrievalDraftSession:
        """``prior`` (a fused item prior) is not used: the datastore's continuations already rank by counts."""
        return RetrievalDraftSession(self.trie, [self.store.candidates(list(h), self.max_candidates)
                                                 for h in histories])
