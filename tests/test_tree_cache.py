"""Tree flattening, key sets (the attention pattern), positions and KV compaction, on tiny literal examples.

Catalog (L = 2, codebook 4): item 7 = (1, 2), item 8 = (1, 3), item 9 = (2, 0). Trie nodes: root 0; depth 1:
node 1 = (1,), node 2 = (2,); leaves 3 = (1, 2), 4 = (1, 3), 5 = (2, 0).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import tiny_llama

from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.kernels.engine_model import EngineModel
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie

OFFSET = 24  # engine_helpers.TEXT_VOCAB


@pytest.fixture
def trie() -> CatalogTrie:
    return CatalogTrie(SemanticIds.from_mapping({7: (1, 2), 8: (1, 3), 9: (2, 0)}, codebook_size=4))


@pytest.fixture
def model():
    return EngineModel.build(tiny_llama(2, 4, seed=0), "exact")


def cache_for(model, trie, prompts) -> TreeCache:
    return TreeCache(model, trie, OFFSET, PromptBatch.from_lists(prompts))


@pytest.mark.parametrize(
    "nodes, cached, expected",
    [
        ([[3, 4]], [], [[1, 3, 4]]),  # two leaves share parent 1: flattened once, parents first
        ([[3, 5]], [], [[1, 2, 3, 5]]),  # two branches: depth 1 nodes before depth 2 nodes
        ([[3, 4]], [1], [[3, 4]]),  # parent already cached: only the new leaves
        ([[4, -1, 4]], [], [[1, 4]]),  # padding and repeats ignored
        ([[3], [5]], [], [[1, 3], [2, 5]]),  # per request (rows)
    ],
)
def test_missing_flattens_the_tree(trie, model, nodes, cached, expected) -> None:
    cache = cache_for(model, trie, [[5, 6]] * len(nodes))
    for node in cached:
        cache.slot_of_node[:, node] = 0  # pretend it is cached
    assert cache.missing(torch.tensor(nodes)).tolist() == expected


def test_token_ids_and_positions(trie, model) -> None:
    cache = cache_for(model, trie, [[5, 6, 7]])
    # token id = offset + (depth - 1) * C + code: node 1 = <a_1>, node 4 = <b_3>
    assert cache.tokens_of(torch.tensor([[1, 4, -1]])).tolist() == [[OFFSET + 1, OFFSET + 4 + 3, OFFSET]]


def test_key_sets_are_prompt_then_ancestors_then_self(trie, model) -> None:
    """The attention pattern of a tree forward: node 3 (depth 2) attends the prompt, node 1, itself."""
    cache = cache_for(model, trie, [[5, 6, 7], [5, 6]])
    seen = {}
    real = cache._groups

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.setdefault("groups", out)
        return out

    cache._groups = spy
    cache.feed(torch.tensor([[3, 5], [4, -1]]))  # the first call: prompts + the trees, one forward
    groups = seen["groups"]
    assert groups.prompt_lengths == [3, 2]
    # width: prompt 3 (padded), then the flattened trees: row 0 = [1, 2, 3, 5], row 1 = [1, 4] (+ padding)
    keys = {(int(r), int(q)): k.tolist()
            for rows, qs, ks in groups.groups for r, q, k in zip(rows, qs, ks, strict=True)}
    assert keys[(0, 3)] == [0, 1, 2, 3]  # node 1 (slot 3): prompt slots 0-2 + itself
    assert keys[(0, 5)] == [0, 1, 2, 3, 5]  # node 3 (slot 5): prompt, node 1 (slot 3), itself
    assert keys[(0, 6)] == [0, 1, 2, 4, 6]  # node 5 (slot 6): prompt, node 2 (slot 4), itself
    assert keys[(1, 4)] == [0, 1, 3, 4]  # row 1: prompt slots 0-1 (slot 2 is padding), node 1, node 4 itself
    assert cache.slot_of_node[0, [1, 2, 3, 5]].tolist() == [3, 4, 5, 6]
    assert cache.slot_of_node[1, [1, 4]].tolist() == [3, 4]


def test_compact_keeps_prompt_and_surviving_paths(trie, model) -> None:
    cache = cache_for(model, trie, [[5, 6, 7]])
    cache.feed(torch.tensor([[1, 2]]))  # prompt (slots 0-2) + nodes 1, 2 (slots 3, 4)
    hidden_1 = cache.hidden_at(torch.tensor([[1]]))
    keys_before = cache.cache.layers[0].keys[0, :, 3].clone()
    cache.compact(torch.tensor([[3]]))  # the beam (1, 2) survives: keep node 1, drop node 2
    assert cache.width == 4 and cache.prompt_slot[0].tolist() == [True, True, True, False]
    assert cache.slot_of_node[0, 1] == 3 and cache.slot_of_node[0, 2] == -1
    assert torch.equal(cache.cache.layers[0].keys[0, :, 3], keys_before)
    assert torch.equal(cache.hidden_at(torch.tensor([[1]])), hidden_1)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_node_is_the_same_whether_fed_alone_or_in_a_tree(trie, threads) -> None:
    """Exact tree attention, bf16: node 3's hidden state does not depend on its siblings / cousins in the call
    (bf16 linear layers are row-independent on this CPU; fp32 GEMMs are not, across thread partitions)."""
    model = EngineModel.build(tiny_llama(2, 4, seed=0, dtype=torch.bfloat16), "exact")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_same(model, trie)
    finally:
        torch.set_num_threads(before)


def _check_same(model, trie) -> None:
    alone = cache_for(model, trie, [[5, 6, 7]])
    alone.feed(torch.tensor([[3]]))
    tree = cache_for(model, trie, [[5, 6, 7]])
    tree.feed(torch.tensor([[3, 4, 5]]))
    assert torch.equal(alone.hidden_at(torch.tensor([[3]])), tree.hidden_at(torch.tensor([[3]])))


def test_compact_with_descendants_keeps_the_cached_subtrees_of_the_beams(trie, model) -> None:
    """A drafter keeps what it drafted under the target's new beams: beam 1 keeps leaves 3, 4; node 2 and its
    leaf 5 go."""
    cache = cache_for(model, trie, [[5, 6, 7]])
    cache.feed(torch.tensor([[3, 4, 5]]))  # prompt (slots 0-2) + nodes 1, 2, 3, 4, 5
    hidden = cache.hidden_at(torch.tensor([[1, 3, 4]]))
    cache.compact(torch.tensor([[1, -1]]), descendants=True)
    assert cache.width == 6 and cache.node_of_slot[0].tolist() == [-1, -1, -1, 1, 3, 4]
    assert (cache.slot_of_node[0, [2, 5]] == -1).all()
    assert torch.equal(cache.hidden_at(torch.tensor([[1, 3, 4]])), hidden)
    assert cache.missing(torch.tensor([[3, 4]])).shape[1] == 0  # nothing to feed again
    cache.compact(torch.tensor([[3]]))  # without descendants: the path to the beam only
    assert cache.node_of_slot[0].tolist() == [-1, -1, -1, 1, 3]
