"""Counting the eager device operations of a search (recsvc.engine.meters.launches): what a GPU launches from Python."""

from __future__ import annotations

import torch
from engine_helpers import TEXT_VOCAB, batch, random_catalog, random_prompts, tiny_llama

from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.meters.launches import Launches, replayable
from recsvc.engine.search.beam_search import BeamSearch
from tokenizer_rqvae.trie import CatalogTrie


def test_views_launch_nothing_and_a_replayable_block_counts_once() -> None:
    x = torch.ones(4, 4)
    with Launches() as n:
        x.view(16).reshape(2, 8).t()  # views and metadata only
    assert n.total == 0 and n.replays == 0
    with Launches() as n:
        _ = x + 1
        with replayable():  # what a GPU replays as one graph: its operations are not counted
            _ = (x * 2).sum()
            with replayable():  # nested: still the one replay
                _ = x.exp()
    assert n.total == 1 and n.by_op["add"] == 1 and n.replays == 1


def test_a_sync_free_plain_search_launches_its_forwards_and_steps_as_replays() -> None:
    """The bucketed (CUDA graphs' stand-in) plain search: each of its L forwards and L head + selection steps is
    one replay, and far fewer operations run eagerly than in the fast forward's search."""
    levels, codes = 4, 16
    trie = CatalogTrie(random_catalog(300, levels, codes, 5))
    model = tiny_llama(levels, codes, 5, hidden=32, layers=1)
    prompts = batch(random_prompts(1, 6, min_len=3, max_len=20))
    counts = {}
    for forward in ("fast", "bucketed"):
        search = BeamSearch(EngineModel.build(model, "fp32", forward=forward), trie, TEXT_VOCAB)
        search.search(prompts, 10)  # first use (buckets, caches)
        with Launches() as n:
            search.search(prompts, 10)
        counts[forward] = n
    assert counts["bucketed"].replays == 2 * levels and counts["fast"].replays == 0
    assert counts["bucketed"].total < counts["fast"].total / 2
