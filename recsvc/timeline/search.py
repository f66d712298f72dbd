"""Trie-constrained beam search over the item-level target's code decoder; the timeline runs once per request.

Step l (l = 1..L) scores every allowed child of each beam with the decoder's log-prob of its code given the
beam's prefix (``TimelineModel.next_code_logprobs``: full-codebook log_softmax, float32) and keeps the best
``width`` candidates of the request: the engine's own step (``recsvc.engine.scoring.expand.expand_beams``: absent
and excluded (``dead``) children at -inf, ties to the lower beam, then the lower code). An optional prior
([B, num_nodes] log-masses, ``recsvc.engine.scoring.prior``: ``prior[child] - prior[node]`` per step) is fused
exactly as the token target's search fuses it, so a finished beam's score is
sum_l log p(c_l | h, c_<l) + w * log P(item).

With ``width`` at least the catalog's size nothing is ever pruned, so the lists equal exhaustive scoring of every
item's code path (``exhaustive_scores``; tests/test_timeline_search.py).

Shapes: B requests, W beams, C codes, L levels, H hidden, T history positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from recsvc.engine.scoring.exclusion import SparseDead
from recsvc.engine.scoring.expand import expand_beams
from recsvc.timeline.model import TimelineModel
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie


@dataclass(frozen=True)
class TimelineOutput:
    leaves: torch.Tensor  # [B, W] trie leaves, best first (-1: fewer than W valid items)
    scores: torch.Tensor  # [B, W] float32 summed log-probs (-inf where leaves == -1)
    decoder_calls: int  # decoder forward calls for the batch (L: one per level)
    # with ``trace``: each step's (nodes [B, w], scores [B, w], parents [B, w]: the column of the beam it extends)
    steps: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...] = ()


def kept_items(trie: CatalogTrie, history: Sequence[int], max_items: int) -> tuple[int, ...]:
    """The items of ``history`` the timeline reads: the last ``max_items`` with a semantic id, oldest first. A
    timeline state depends on nothing else of the history (the user-state cache keys it by them)."""
    ids = trie.ids
    return tuple(int(i) for i in history if i in ids)[-max_items:] if max_items > 0 else ()


def history_tensors(trie: CatalogTrie, histories: Sequence[Sequence[int]], max_items: int,
                    num_item_rows: int = 0, table: SemanticIds | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Item histories (oldest first; ``kept_items`` of each) -> codes [B, T, L] (-1: right padding), per-item
    table rows [B, T], lengths [B] (>= 1: an empty history reads one padding position, the timeline's state of
    "no history"). A table row is the item's row in ``table`` + 1 (the ids the model was trained over; None: the
    trie's own), 0 for padding, for items ``table`` lacks (a live catalog's additions) and for rows at or past
    ``num_item_rows`` (the model has no row of them)."""
    ids, table = trie.ids, table if table is not None else trie.ids
    kept = [kept_items(trie, h, max_items) for h in histories]
    t = max(1, max((len(k) for k in kept), default=1))
    codes = np.full((len(kept), t, ids.levels), -1, dtype=np.int64)  # filled on the host, then one tensor each
    rows = np.zeros((len(kept), t), dtype=np.int64)
    for b, items in enumerate(kept):
        if items:
            codes[b, : len(items)] = ids.codes[[ids.index_of(i) for i in items]]
            own = np.array([table.index_of(i) + 1 if i in table else 0 for i in items], dtype=np.int64)
            rows[b, : len(items)] = np.where(own < num_item_rows, own, 0)
    lengths = torch.tensor([max(1, len(k)) for k in kept], dtype=torch.long)
    return torch.from_numpy(codes), torch.from_numpy(rows), lengths


@torch.inference_mode()
def user_states(model: TimelineModel, trie: CatalogTrie, histories: Sequence[Sequence[int]],
                table: SemanticIds | None = None) -> torch.Tensor:
    """[B, H] the timeline's state after each history's last item: one timeline forward for the batch.
    ``table``: the ids the model's per-item table was trained over (``history_tensors``; None: the trie's)."""
    codes, rows, lengths = history_tensors(trie, histories, model.config.max_items, model.config.num_items, table)
    h = model.states(codes, rows)  # [B, T, H]
    return h[torch.arange(len(lengths)), lengths - 1]


@torch.inference_mode()
def beam_search(model: TimelineModel, trie: CatalogTrie, states: torch.Tensor, width: int,
                dead: torch.Tensor | SparseDead | None = None, prior: torch.Tensor | None = None,
                trace: bool = False) -> TimelineOutput:
    """states [B, H] -> the ``width`` best leaves of each request. ``dead`` [B, num_nodes] bool: excluded nodes
    (or the same as a ``SparseDead``: equal lists);
    ``prior`` [B, num_nodes] float32 log-masses (``prior_log_mass``); ``trace``: keep every step's beams."""
    if width < 1:
        raise ValueError(f"beam width must be >= 1, got {width}")
    b, levels = states.shape[0], trie.levels
    nodes = torch.zeros(b, 1, dtype=torch.long)  # [B, m] the root
    scores = torch.zeros(b, 1)
    prefix = torch.zeros(b, 1, 0, dtype=torch.long)  # [B, m, l] the beams' codes
    rows = torch.arange(b)[:, None]
    steps = []
    first: torch.Tensor | None = None  # [B * m, 1, H] the decoder's first inputs: the same while m stays
    for level in range(levels):
        m = nodes.shape[1]
        if first is None or first.shape[0] != b * m:  # each beam's request state, projected once per beam count
            first = model.decoder_first(states.repeat_interleave(m, 0))
        logp = model.next_code_logprobs(first, prefix.reshape(b * m, level))
        step_dead = dead.into(level + 1) if isinstance(dead, SparseDead) else dead  # None: nothing to block
        nodes, scores, beam = expand_beams(trie, nodes, scores, logp.view(b, m, -1), width, step_dead, None, prior)
        if level + 1 < levels:  # the next step's prefixes (none after the last)
            code = trie.node_code[nodes.clamp(min=0)].clamp(min=0)  # [B, w] each beam's new code (0: dead beams)
            prefix = torch.cat([prefix[rows, beam], code[..., None]], 2)
        if trace:
            steps.append((nodes, scores, beam))
    return TimelineOutput(nodes, scores, levels, tuple(steps))


@torch.inference_mode()
def exhaustive_scores(model: TimelineModel, trie: CatalogTrie, states: torch.Tensor) -> torch.Tensor:
    """states [B, H] -> [B, n] every catalog item's path score (catalog row order): the search's reference."""
    codes = torch.from_numpy(trie.ids.codes)  # [n, L]
    out = [model.path_logprobs(s[None].expand(len(codes), -1), codes) for s in states]
    return torch.stack(out) if out else torch.zeros(0, len(codes))
