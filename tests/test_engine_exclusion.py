"""Sparse exclusions (recsvc.engine.scoring.exclusion.SparseDead): the same dead nodes as the dense rows of
``CatalogTrie.dead_nodes`` (``CatalogTrie.dead_of``), and a step over them scores every candidate exactly as the
dense step does, at every depth, with colliding ids, unknown ids and a whole catalog excluded."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsvc.engine.scoring.exclusion import SparseDead
from recsvc.engine.scoring.expand import candidate_scores, expand_beams
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie

LEVELS, CODES = 3, 4


@st.composite
def catalogs(draw) -> SemanticIds:
    """Up to 40 items over 3 levels of 4 codes: ids may collide (several items on one leaf)."""
    ids = draw(st.lists(st.tuples(*[st.integers(0, CODES - 1)] * LEVELS), min_size=1, max_size=40))
    items = draw(st.lists(st.integers(1, 10_000), min_size=len(ids), max_size=len(ids), unique=True))
    return SemanticIds.from_mapping(dict(zip(items, ids, strict=True)), codebook_size=CODES)


@st.composite
def exclusions(draw, ids: SemanticIds) -> list[list[int]]:
    """1-3 requests' excluded items: some of the catalog's (or all of it), and ids it does not hold."""
    known = ids.item_ids.tolist()
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        every = draw(st.booleans()) and draw(st.booleans())
        items = known if every else draw(st.lists(st.sampled_from(known), max_size=len(known)))
        rows.append(list(items) + draw(st.lists(st.integers(20_000, 20_010), max_size=2)))
    return rows


def _beams(trie: CatalogTrie, depth: int, b: int, rng: np.random.Generator) -> torch.Tensor:
    """[B, 6] beams at ``depth``: nodes of that depth and a dead beam (-1)."""
    at = (trie.depth == depth).nonzero().reshape(-1).numpy()
    return torch.from_numpy(np.where(rng.random((b, 6)) < 0.2, -1, rng.choice(at, size=(b, 6))))


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_sparse_dead_blocks_what_the_dense_rows_block(data: st.DataObject) -> None:
    ids = data.draw(catalogs())
    trie = CatalogTrie(ids)
    excluded = data.draw(exclusions(ids))
    dense = trie.dead_nodes(excluded)  # [B, num_nodes]
    for b, items in enumerate(excluded):
        assert trie.dead_of(items).tolist() == dense[b].nonzero().reshape(-1).tolist()
    sparse = SparseDead.of(trie, excluded)
    if sparse is None:  # nothing but the root (or nothing) dead: no step is blocked
        assert not dense[:, 1:].any()
        return
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    for depth in range(LEVELS + 1):  # beams at ``depth``, their children at depth + 1 (leaves: none)
        nodes = _beams(trie, depth, len(excluded), rng)
        scores = torch.from_numpy(rng.standard_normal(nodes.shape).astype(np.float32))
        logp = torch.log_softmax(torch.from_numpy(rng.standard_normal((*nodes.shape, CODES)).astype(np.float32)), -1)
        want = candidate_scores(trie, nodes, scores, logp, dense, None)
        for dead in (sparse, sparse.into(depth + 1)):  # the step's own view: None when nothing dies there
            got = candidate_scores(trie, nodes, scores, logp, dead, None)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        for got, ref in zip(expand_beams(trie, nodes, scores, logp, 5, sparse),
                            expand_beams(trie, nodes, scores, logp, 5, dense), strict=True):
            assert torch.equal(got, ref)


def test_worked_example() -> None:
    """Items 7 and 8 excluded (the trie's docstring): leaves 3 and 4 and their parent, node 1, are dead; only
    node 1 blocks a step from the root (code 1), the leaves a step from node 1 (codes 2 and 3)."""
    trie = CatalogTrie(SemanticIds.from_mapping({7: (1, 2), 8: (1, 3), 9: (2, 0)}, codebook_size=4))
    assert trie.dead_of([7, 8, 99]).tolist() == [1, 3, 4]
    sparse = SparseDead.of(trie, [[7, 8]])
    assert sparse is not None and sparse.depths == {1, 2}
    assert sparse.alive(torch.tensor([[0, 1, 2, -1]]), 4).tolist() == [[
        [True, False, True, True], [True, True, False, False], [True, True, True, True], [True, True, True, True]]]
    assert SparseDead.of(trie, [[], [12345]]) is None  # nothing in the trie excluded
    everything = SparseDead.of(trie, [[7, 8, 9]])  # the root is dead too, but it is nobody's child
    assert everything is not None and everything.depths == {1, 2} and everything.into(3) is None
