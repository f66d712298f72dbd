"""Ranking a split's users with the item-level target (the epoch choice's validation and ``recsvc eval``'s
"target alone"): the timeline once per user, the decoder's beam search, history items excluded or kept."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recsvc.data.metrics import evaluate_rankings
from recsvc.data.split import EvalUser
from recsvc.timeline.model import TimelineModel
from recsvc.timeline.search import beam_search, user_states
from recsvc_base.progress import progress_bar
from tokenizer_rqvae.trie import CatalogTrie


@torch.inference_mode()
def rank_users(model: TimelineModel, trie: CatalogTrie, users: Sequence[EvalUser], k: int, width: int = 20,
               exclude_history: bool = True, batch_size: int = 256, prior: torch.Tensor | None = None,
               progress: bool = False) -> dict[int, list[int]]:
    """user_id -> the top-k item ids of a beam search of ``max(k, width)`` beams (the first k read, as served).
    ``prior``: [len(users), num_nodes] log-masses fused into the search (None: the target alone)."""
    was_training = model.training
    model.eval()
    out: dict[int, list[int]] = {}
    starts = range(0, len(users), batch_size)
    for s in progress_bar(starts, enabled=progress, desc="rank", unit="batch"):
        part = users[s : s + batch_size]
        histories = [u.history for u in part]
        states = user_states(model, trie, histories)
        dead = trie.dead_nodes(histories) if exclude_history else None
        fused = prior[s : s + batch_size] if prior is not None else None
        res = beam_search(model, trie, states, max(k, width), dead, fused)
        leaves = res.leaves[:, :k].tolist()
        for u, row in zip(part, leaves, strict=True):
            out[u.user_id] = trie.items_of_leaves([x for x in row if x >= 0], u.history if exclude_history else ())
    model.train(was_training)
    return out


def validation_figures(model: TimelineModel, trie: CatalogTrie, users: Sequence[EvalUser], width: int = 20,
                       exclude_history: bool = True) -> dict[str, float]:
    """Recall / NDCG at 5, 10, 20 of the model alone on ``users``."""
    ranked = rank_users(model, trie, users, 20, width, exclude_history)
    return evaluate_rankings(ranked, users, (5, 10, 20))
