"""The item-level target as a service loads and reads it: the model on its device and precision, and the users'
timeline states over a live catalog (``recsvc.recommender.live_catalog``), whose merged ids number the catalog
rows anew while the model's per-item table keeps the rows of the ids it was trained over.

Shapes: B users, T history positions, L levels, H hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from recsvc.errors import UserError
from recsvc.timeline.model import TimelineModel
from recsvc.timeline.search import history_tensors, user_states
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie

SERVED_DEVICES = ("cpu",)  # recsvc.timeline.search builds its tensors on the CPU


def load_timeline(directory: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> TimelineModel:
    """``TimelineModel.load(directory)`` in ``dtype`` on ``device`` (eval mode); UserError for a device the
    search does not run on."""
    if torch.device(device).type not in SERVED_DEVICES:
        raise UserError(f"the item-level target is served on the CPU only (asked: {device}): its search "
                        "(recsvc.timeline.search) builds its tensors there")
    return TimelineModel.load(directory).to(device=device, dtype=dtype).eval()


def kept_items(trie: CatalogTrie, history: Sequence[int], max_items: int) -> tuple[int, ...]:
    """The items of ``history`` the timeline reads: the last ``max_items`` with a semantic id, oldest first
    (``history_tensors``' choice). A timeline state depends on nothing else of the history."""
    ids = trie.ids
    return tuple(int(i) for i in history if i in ids)[-max_items:] if max_items > 0 else ()


@torch.inference_mode()
def states_over(model: TimelineModel, trie: CatalogTrie, histories: Sequence[Sequence[int]],
                table: SemanticIds | None = None) -> torch.Tensor:
    """[B, H] the timeline's state after each history's last item (``user_states``), with the per-item table's
    rows read from ``table``, the ids the model was trained over (None, the trie's own ids, or a model without a
    per-item table: ``user_states`` itself). Items ``table`` lacks (a live catalog's additions) read row 0, the
    table's "unseen item"."""
    c = model.config
    if table is None or table is trie.ids or not c.num_items:
        return user_states(model, trie, histories)
    codes, _, lengths = history_tensors(trie, histories, c.max_items)  # codes [B, T, L], lengths [B]
    rows = torch.zeros(codes.shape[:2], dtype=torch.long)  # [B, T]
    for b, history in enumerate(histories):
        kept = kept_items(trie, history, c.max_items)
        own = [table.index_of(i) + 1 if i in table else 0 for i in kept]
        rows[b, : len(own)] = torch.tensor([r if r < c.num_items else 0 for r in own], dtype=torch.long)
    h = model.states(codes, rows)  # [B, T, H]
    return h[torch.arange(len(lengths)), lengths - 1]
