"""Drafters: the retrieval datastore and its drafts; strict output is exact whatever the drafter proposes."""

from __future__ import annotations

import torch
from engine_helpers import TEXT_VOCAB, batch, catalog_with_sequences, random_prompts

from recsvc.drafters.retrieval import RetrievalDatastore, RetrievalDrafter
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.speculation.strict.speculative import speculative_search
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie


def test_datastore_example_from_docstring() -> None:
    store = RetrievalDatastore([[1, 2, 3], [9, 2, 3], [2, 4]], max_suffix=2)
    assert store.next[(2,)] == {3: 2, 4: 1}
    cands = store.candidates([7, 2], limit=2)
    assert [i for i, _ in cands] == [3, 4]
    assert store.candidates([1, 2], limit=1)[0][0] == 3  # (1, 2) -> 3 matches the longer suffix


def test_retrieval_drafts_follow_candidates_in_the_trie() -> None:
    ids = SemanticIds.from_mapping({3: (0, 1, 2, 3), 4: (0, 1, 5, 6), 5: (7, 7, 7, 7)}, codebook_size=8)
    trie = CatalogTrie(ids)
    drafter = RetrievalDrafter(RetrievalDatastore([[1, 2, 3], [9, 2, 3], [2, 4]]), trie)
    session = drafter.session(batch([[1, 2]]), [[1, 2]], None)
    drafts = session.propose(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1), torch.tensor([3]), 2,
                             None)  # type: ignore[arg-type]  # the target's state: unused by retrieval
    assert trie.codes_of_nodes(drafts[0][:1, :1]).tolist() == [[[0, -1, -1, -1]]]  # items 3 and 4 share <a_0>
    assert trie.codes_of_nodes(drafts[2][0]).tolist()[:2] == [[0, 1, 2, -1], [0, 1, 5, -1]]  # 3 (weight 2) first


def test_retrieval_drafter_is_exact_under_strict_verification(device) -> None:
    trie, model, items, seqs = catalog_with_sequences(seed=8, device=device)
    drafter = RetrievalDrafter(RetrievalDatastore(seqs), trie)
    engine = BeamSearch(model, trie, TEXT_VOCAB)
    prompts = random_prompts(3, seed=8)
    histories = [seqs[0][:3], seqs[1][:4], []]
    plain = engine.search(batch(prompts), 6)
    spec = speculative_search(model, trie, TEXT_VOCAB, batch(prompts), 6, drafter.session(batch(prompts), histories,
                              None), 8, 3, None, engine.select)
    assert torch.equal(spec.leaves, plain.leaves)
