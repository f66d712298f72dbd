"""The transition drafter: drafts follow the prior's trie masses; strict output stays exact."""

from __future__ import annotations

import torch
from engine_helpers import TEXT_VOCAB, batch, catalog_with_sequences, random_prompts

from recsvc.drafters.transition import TransitionDrafter
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.speculation.strict.speculative import speculative_search
from recsvc.priors.transition import PriorSettings, TransitionPrior
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie


def test_worked_example_from_docstring() -> None:
    # items 7 = (1, 2), 8 = (1, 3), 9 = (2, 0); after item 9: 7 five times, 8 three times, 9 once (beta 0)
    ids = SemanticIds.from_mapping({7: (1, 2), 8: (1, 3), 9: (2, 0)}, codebook_size=4)
    trie = CatalogTrie(ids)
    seqs = [[9, 7]] * 5 + [[9, 8]] * 3 + [[9, 9]] * 1
    prior = TransitionPrior.fit(seqs, [7, 8, 9], PriorSettings(beta=0.0))
    assert torch.allclose(torch.from_numpy(prior.probs([[9]])[0]), torch.tensor([5, 3, 1]) / 9)
    session = TransitionDrafter(prior, trie).session(batch([[1]]), [[9]], None)
    drafts = session.propose(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1), torch.tensor([2]), 2,
                             None)  # type: ignore[arg-type]  # the target's state: unused by this drafter
    assert drafts[0].tolist() == [[1, 2]]  # (1,) holds 0.889 of the mass, (2,) 0.111
    assert trie.leaf_items(drafts[1][0]) == [7, 8]
    # from a beam at depth 1 only its children are drafted, and dead nodes never
    dead = trie.dead_nodes([[7]])
    session = TransitionDrafter(prior, trie).session(batch([[1]]), [[9]], dead)
    drafts = session.propose(torch.tensor([[1, -1]]), torch.tensor([[-0.1, float("-inf")]]), torch.tensor([1]), 2,
                             None)  # type: ignore[arg-type]
    assert trie.leaf_items(drafts[0][0][drafts[0][0] >= 0]) == [8]
    assert session.calls == 0


def test_transition_drafter_is_exact_under_strict_verification(device) -> None:
    trie, model, items, seqs = catalog_with_sequences(seed=9, device=device)
    drafter = TransitionDrafter(TransitionPrior.fit(seqs, items), trie)
    engine = BeamSearch(model, trie, TEXT_VOCAB)
    prompts = random_prompts(3, seed=9)
    histories = [seqs[0][:3], seqs[1][:4], []]
    plain = engine.search(batch(prompts), 6)
    spec = speculative_search(model, trie, TEXT_VOCAB, batch(prompts), 6,
                              drafter.session(batch(prompts), histories, None), 8, 3, None, engine.select)
    assert torch.equal(spec.leaves, plain.leaves)


def test_each_depth_extends_the_nodes_drafted_above_it() -> None:
    """A closed tree: a node whose parent was not drafted is never drafted, even when the prior ranks it highest,
    and its slot goes to a child of a drafted node."""
    # items 7 = (1, 2), 8 = (1, 3), 9 = (2, 0), 10 = (3, 0), 11 = (3, 1); after item 9: 9 five times, 7 and 10 four,
    # 8 and 11 three: (1,) and (3,) hold 7 / 19 each, (2,) 5 / 19, yet 9 is the likeliest single item
    ids = SemanticIds.from_mapping({7: (1, 2), 8: (1, 3), 9: (2, 0), 10: (3, 0), 11: (3, 1)}, codebook_size=4)
    trie = CatalogTrie(ids)
    seqs = [[9, 9]] * 5 + [[9, 7]] * 4 + [[9, 10]] * 4 + [[9, 8]] * 3 + [[9, 11]] * 3
    prior = TransitionPrior.fit(seqs, [7, 8, 9, 10, 11], PriorSettings(beta=0.0))
    session = TransitionDrafter(prior, trie).session(batch([[1]]), [[9]], None)
    assert session.closed_tree
    first, second = session.propose(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1), torch.tensor([2]), 2,
                                    None)  # type: ignore[arg-type]
    assert {int(trie.node_code[n]) for n in first[0].tolist()} == {1, 3}
    assert set(trie.leaf_items(second[0])) == {7, 10}  # not 9: its parent (2,) was not drafted
    assert {int(trie.ancestors[n, 0]) for n in second[0].tolist()} <= set(first[0].tolist())


def test_sync_free_drafts_the_same_sets_without_reading_the_device() -> None:
    """Over a sync-free target (told its depth count) the drafter runs as a beam search over the trie: the same
    drafted set per depth as the per-row path, no host read, and strict over the bucketed forward stays exact."""
    from engine_helpers import tiny_llama

    from recsvc.engine.caches.tree_cache import TreeCache
    from recsvc.engine.kernels.engine_model import EngineModel
    from recsvc.engine.meters.host_reads import HostReads
    from recsvc.engine.speculation.ports import TargetState

    trie, model, items, seqs = catalog_with_sequences(seed=9)
    drafter = TransitionDrafter(TransitionPrior.fit(seqs, items), trie)
    bucketed = EngineModel.build(tiny_llama(trie.levels, trie.codebook_size, 9), "fp32", forward="bucketed")
    prompts = random_prompts(3, seed=9)
    histories = [seqs[0][:3], seqs[1][:4], seqs[2][:2]]
    state = TargetState(bucketed, TreeCache(bucketed, trie, TEXT_VOCAB, batch(prompts)))
    session = drafter.session(batch(prompts), histories, trie.dead_nodes([[], [items[0]], []]))
    for roots, steps in ((torch.zeros(3, 1, dtype=torch.long), torch.tensor([3, 3, 3])),
                         (torch.tensor([[1, 2], [3, 4], [2, 5]]), torch.tensor([3, 2, 0]))):
        scores = torch.zeros(roots.shape, dtype=torch.float32)
        ref = session.propose(roots, scores, steps, 8, None)  # type: ignore[arg-type]
        with HostReads("cpu") as reads:
            out = session.propose(roots, scores, steps, 8, state, depths=3)
        assert reads.total == 0, reads.summary()
        for a, b in zip(out, ref, strict=False):
            for row in range(3):  # the same sets up to ties (the prior's smoothing gives many nodes one mass)
                got, want = a[row][a[row] >= 0], b[row][b[row] >= 0]

                def score(nodes: torch.Tensor, row: int = row, j: int = int(trie.depth[roots[row, 0]])
                          ) -> torch.Tensor:  # log m(node) - log m(its root at depth j)
                    base = trie.ancestors[nodes, j - 1] if j else torch.zeros_like(nodes)
                    return session.log_mass[row, nodes] - session.log_mass[row, base]

                torch.testing.assert_close(score(got).sort().values, score(want).sort().values, atol=1e-5, rtol=0)
                above = want[score(want) > score(want).min() + 1e-5] if len(want) else want  # no tie can swap them
                assert set(above.tolist()) <= set(got.tolist())
    engine = BeamSearch(bucketed, trie, TEXT_VOCAB)
    spec = speculative_search(bucketed, trie, TEXT_VOCAB, batch(prompts), 6,
                              drafter.session(batch(prompts), histories, None), 8, 3, None, engine.select)
    assert torch.equal(spec.leaves, engine.search(batch(prompts), 6).leaves)
