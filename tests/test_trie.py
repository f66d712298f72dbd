"""CatalogTrie: enumerates exactly the catalog's ids; exclusions remove exactly the excluded items."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie

# the Amazon Beauty split directory (with its reference_semantic_ids.json), when RECSVC_BEAUTY_DIR names one
BEAUTY = Path(os.environ["RECSVC_BEAUTY_DIR"]) if os.environ.get("RECSVC_BEAUTY_DIR") else None


@st.composite
def catalogs(draw, max_items: int = 40, levels: int = 3, codebook: int = 4):
    ids = draw(st.lists(st.tuples(*[st.integers(0, codebook - 1)] * levels), min_size=1, max_size=max_items))
    items = draw(st.lists(st.integers(1, 10_000), min_size=len(ids), max_size=len(ids), unique=True))
    return SemanticIds.from_mapping(dict(zip(items, ids, strict=True)), codebook_size=codebook)


def test_worked_example_from_docstring() -> None:
    ids = SemanticIds.from_mapping({7: (1, 2), 8: (1, 3), 9: (2, 0)}, codebook_size=4)
    trie = CatalogTrie(ids)
    assert trie.children[0].tolist() == [-1, 1, 2, -1]
    assert trie.children[1].tolist() == [-1, -1, 3, 4]
    assert trie.children[2].tolist() == [5, -1, -1, -1]
    assert trie.leaf_items(torch.tensor([3, 4, 5])) == [7, 8, 9]
    dead = trie.dead_nodes([[7, 8]])[0]
    assert dead.nonzero().reshape(-1).tolist() == [1, 3, 4]
    mask, child = trie.allowed(torch.tensor([0]), dead[None], torch.tensor([0]))
    assert mask[0].tolist() == [False, False, True, False]  # prefix (1,) is dead: only code 2 is left


@settings(max_examples=60, deadline=None)
@given(catalogs())
def test_enumerates_exactly_the_catalog(ids: SemanticIds) -> None:
    trie = CatalogTrie(ids)
    assert trie.enumerate_ids() == {tuple(r) for r in ids.codes.tolist()}


@settings(max_examples=60, deadline=None)
@given(catalogs(), st.data())
def test_exclusions_remove_exactly_the_excluded(ids: SemanticIds, data: st.DataObject) -> None:
    trie = CatalogTrie(ids)
    excluded = data.draw(st.sets(st.sampled_from(ids.item_ids.tolist())))
    dead = trie.dead_nodes([sorted(excluded)])[0]
    remaining = {tuple(ids.codes_of(i)) for i in ids.item_ids.tolist() if i not in excluded}
    assert trie.enumerate_ids(dead) == remaining


@settings(max_examples=40, deadline=None)
@given(catalogs(), st.data())
def test_batched_lookup_matches_scalar(ids: SemanticIds, data: st.DataObject) -> None:
    trie = CatalogTrie(ids)
    nodes = torch.tensor(data.draw(st.lists(st.integers(0, trie.num_internal - 1), min_size=1, max_size=8)))
    mask, child = trie.allowed(nodes)
    for node, row_mask, row_child in zip(nodes.tolist(), mask, child, strict=True):
        assert row_mask.nonzero().reshape(-1).tolist() == (trie.children[node] >= 0).nonzero().reshape(-1).tolist()
        assert (row_child[row_mask] >= 0).all()


def test_unknown_prefix_has_no_codes() -> None:
    trie = CatalogTrie(SemanticIds.from_mapping({1: (0, 0), 2: (0, 1)}, codebook_size=4))
    assert trie.allowed_codes([3]) == []
    assert trie.allowed_codes([0, 1]) == []  # a full id: nothing follows
    assert trie.node_of_prefix([9]) == -1


def check_collisions(ids: SemanticIds, collisions: int) -> None:
    """A catalog whose ids collide: one leaf per distinct id, answered by the group's lowest item id, the next
    one when that is excluded; excluding the whole group kills its leaf."""
    trie = CatalogTrie(ids)
    assert ids.collisions() == collisions
    assert len(trie.enumerate_ids()) == len(ids) - collisions
    group = ids.collision_groups()[0]
    leaf = trie.item_path[ids.index_of(group[0]), -1]
    assert trie.leaf_items(leaf[None]) == [min(group)]
    assert trie.leaf_items(leaf[None], excluded=[min(group)]) == [sorted(group)[1]]
    dead = trie.dead_nodes([group])[0]
    assert bool(dead[leaf]) and int(np.asarray(dead).sum()) >= 1


def test_accepts_ids_with_collisions() -> None:
    # items 5, 9 and 12 share (1, 2); 3 and 4 share (0, 1); 7 is alone: 3 collisions, 3 leaves
    ids = SemanticIds.from_mapping({12: (1, 2), 9: (1, 2), 5: (1, 2), 4: (0, 1), 3: (0, 1), 7: (2, 3)},
                                   codebook_size=4)
    check_collisions(ids, 3)


@pytest.mark.skipif(BEAUTY is None, reason="set RECSVC_BEAUTY_DIR to the Amazon Beauty split directory to check "
                                           "its reference ids (the small catalog above checks the same behaviour)")
def test_accepts_reference_ids_with_collisions() -> None:
    assert BEAUTY is not None
    check_collisions(SemanticIds.load(BEAUTY / "reference_semantic_ids.json"), 12)


def test_parent_ancestors_and_codes_of_nodes() -> None:
    ids = SemanticIds.from_mapping({7: (1, 2), 8: (1, 3), 9: (2, 0)}, codebook_size=4)
    trie = CatalogTrie(ids)
    assert trie.parent.tolist() == [-1, 0, 0, 1, 1, 2]
    assert trie.ancestors[4].tolist() == [1, 4] and trie.ancestors[2].tolist() == [2, -1]
    assert trie.codes_of_nodes(torch.tensor([4, 2, -1])).tolist() == [[1, 3], [2, -1], [-1, -1]]
    mask, child = trie.allowed(torch.tensor([-1, 0]))
    assert not mask[0].any() and (child[0] == -1).all() and mask[1].sum() == 2


def test_to_moves_the_tensors_once_per_device() -> None:
    trie = CatalogTrie(SemanticIds.from_mapping({7: [1, 2], 8: [1, 3], 9: [2, 0]}, codebook_size=4))
    assert trie.to("cpu") is trie  # already there: no copy
    meta = trie.to("meta")  # a device with no data: only placement is checked
    assert meta is trie.to("meta")  # made once, then kept
    assert meta.device.type == "meta" and all(getattr(meta, n).device.type == "meta" for n in CatalogTrie._TENSORS)
    assert (meta.num_nodes, meta.levels, meta.ids) == (trie.num_nodes, trie.levels, trie.ids)
    assert trie.device.type == "cpu"  # the original stays where it was
