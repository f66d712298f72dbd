"""The recurrent draft head: its initial state mimics the target's LM head; drafting with it stays exact under
strict verification; distillation on traced beams lowers its loss; weights round-trip through safetensors."""

from __future__ import annotations

import torch
from engine_helpers import TEXT_VOCAB, batch, random_catalog, random_prompts, tiny_llama

from recsvc.drafters.head import HeadDrafter
from recsvc.drafters.head_model import DraftHead, HeadConfig, load_head, save_head
from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.speculation.ports import TargetState
from recsvc.engine.speculation.strict.speculative import speculative_search
from tokenizer_rqvae.trie import CatalogTrie
from training.drafters.head import containment, head_loss
from training.drafters.head_traces import paths, trace_batch

LEVELS, CODEBOOK = 4, 16


def _setup(seed: int = 3, device: str = "cpu"):
    ids = random_catalog(120, LEVELS, CODEBOOK, seed=seed)
    trie = CatalogTrie(ids).to(device)
    llama = tiny_llama(LEVELS, CODEBOOK, seed=seed, device=device)
    target = EngineModel.build(llama)
    head = DraftHead(HeadConfig(hidden=llama.config.hidden_size, levels=LEVELS, codebook=CODEBOOK))
    head.init_from_lm_head(llama.get_output_embeddings().weight, TEXT_VOCAB)
    return ids, trie, llama, target, head.to(device)


def test_untrained_head_scores_codes_as_the_target_head_would() -> None:
    # z = h at initialisation: log q = log_softmax over the next level's codes of the LM head's logits at h
    _, _, llama, _, head = _setup()
    h = torch.randn(5, llama.config.hidden_size)
    level = torch.tensor([0, 1, 2, 0, 1])
    _, logq = head.step(head.start(h), h, level, torch.tensor([3, 0, 15, 7, 2]))
    w = llama.get_output_embeddings().weight
    for m in range(5):
        lo = TEXT_VOCAB + (int(level[m]) + 1) * CODEBOOK
        ref = torch.log_softmax(h[m] @ w[lo:lo + CODEBOOK].T, -1)
        assert torch.allclose(logq[m], ref, atol=1e-5)
    # rows at different levels give the same numbers as rows of one level
    _, same = head.step(head.start(h[:1]), h[:1], level[:1], torch.tensor([3]))
    assert torch.allclose(same[0], logq[0], atol=1e-5)


def test_head_drafts_are_exact_under_strict_verification_and_prefill_is_counted(device) -> None:
    ids, trie, _, target, head = _setup(5, device)
    engine = BeamSearch(target, trie, TEXT_VOCAB)
    prompts = random_prompts(4, seed=5)
    drafter = HeadDrafter(head, trie)
    for k, n, gamma in ((1, 1, 3), (5, 8, 3), (6, 6, 2)):
        plain = engine.search(batch(prompts), k)
        session = drafter.session(batch(prompts), [[]] * 4, None)
        spec = speculative_search(target, trie, TEXT_VOCAB, batch(prompts), k, session, n, gamma, None,
                                  engine.select)
        assert torch.equal(spec.leaves, plain.leaves)
        assert torch.allclose(spec.scores, plain.scores, atol=1e-5)
        assert spec.draft_calls == 0  # no transformer forward drafts
        # the first round's prefill (the root's hidden state) is a target call of its own: >= 2 calls
        assert bool((spec.target_calls >= 2).all())
        assert session.head_steps > 0


def test_first_depth_is_the_target_own_top_n_and_uncached_roots_cost_no_forward() -> None:
    ids, trie, _, target, head = _setup(7)
    prompts = random_prompts(2, seed=7)
    plain = BeamSearch(target, trie, TEXT_VOCAB).search(batch(prompts), 6)
    session = HeadDrafter(head, trie).session(batch(prompts), [[]] * 2, None)
    cache = TreeCache(target, trie, TEXT_VOCAB, batch(prompts))
    state = TargetState(target, cache)
    root = torch.zeros(2, 1, dtype=torch.long)
    drafts = session.propose(root, torch.zeros(2, 1), torch.tensor([2, 2]), 6, state)
    assert cache.calls == 1  # the prompt prefill: the root's hidden state
    assert torch.equal(drafts[0], plain.beams[0])  # depth 1 from the target's own LM head: exact
    # roots the target chose but never fed (a rejected depth's beams): their parents' hidden states are read,
    # the roots themselves are not fed
    cache.feed(plain.beams[0])
    calls = cache.calls
    roots = plain.beams[1]
    assert not bool(state.cached(roots).any())
    drafts = session.propose(roots, torch.zeros(2, 6), torch.tensor([2, 1]), 6, state)
    assert cache.calls == calls and not bool(state.cached(roots).any())
    assert [len(drafts), int((drafts[1][1] >= 0).sum())] == [2, 0]  # row 1 drafts one depth only


def test_traces_and_distillation_lower_the_loss(tmp_path) -> None:
    ids, trie, _, target, head = _setup(11)
    prompts = random_prompts(24, seed=11)
    gt = trie.item_path[torch.arange(24) % len(ids.item_ids), -1]
    tr = trace_batch(target, trie, TEXT_VOCAB, batch(prompts), gt, 5, None, None)
    assert tr["hidden"].shape == (24, 6, LEVELS - 1, head.cfg.hidden)
    assert tr["lp"].shape == (24, 6, LEVELS, CODEBOOK)
    ctx, codes = paths(trie, tr["leaf"])
    # the traced hidden state of a context equals a fresh cache's, and the last sequence is the truth
    cache = TreeCache(target, trie, TEXT_VOCAB, batch(prompts[:1]))
    cache.feed(ctx[:1, 0, 1:3])
    assert torch.allclose(cache.hidden_at(ctx[:1, 0, :3]).float(), tr["hidden"][:1, 0], atol=1e-5)
    assert torch.equal(tr["leaf"][:, -1], gt)
    assert bool((codes[:, -1] >= 0).all())
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss, _ = head_loss(head, tr, trie, "wordkd", 1.0, 5)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    hits, pairs = containment(head, tr, trie, 5)
    assert pairs > 0 and hits / pairs > 0.9
    save_head(head, tmp_path / "head", {"method": "wordkd"})
    again = load_head(tmp_path / "head")
    h = tr["hidden"][:3, 0, 0]
    zero = torch.zeros(3, dtype=torch.long)
    assert torch.equal(head.step(head.start(h), h, zero, zero)[1], again.step(again.start(h), h, zero, zero)[1])


def test_head_samples_for_relaxed_verification() -> None:
    from recsvc.engine.search.sampling import make_generators
    from recsvc.engine.speculation.relaxed.relaxed import relaxed_speculative_search

    ids, trie, _, target, head = _setup(13)
    prompts = random_prompts(3, seed=13)
    drafter = HeadDrafter(head, trie)
    assert drafter.samples
    out = relaxed_speculative_search(target, trie, TEXT_VOCAB, batch(prompts), 5,
                                     drafter.sampling_session(batch(prompts), [[]] * 3, None), 8, 3,
                                     torch.ones(3), make_generators([1, 2, 3]))
    for row in out.leaves:
        items = trie.leaf_items(row[row >= 0])
        assert len(items) == 5 and len(set(items)) == 5
    assert bool((out.target_calls >= 2).all()) and out.draft_calls == 0
    # the same seeds give the same sample
    again = relaxed_speculative_search(target, trie, TEXT_VOCAB, batch(prompts), 5,
                                       drafter.sampling_session(batch(prompts), [[]] * 3, None), 8, 3,
                                       torch.ones(3), make_generators([1, 2, 3]))
    assert torch.equal(out.leaves, again.leaves)


def test_head_drafts_without_host_reads_over_the_bucketed_forward() -> None:
    """Over a sync-free target (the bucketed / CUDA-graph forwards) the head reads nothing from the device: both
    sides of each choice are computed, so a strict round reads once (the rows' depths), and the lists stay the
    plain search's, as over the fast forward (where the head reads to skip work)."""
    from recsvc.engine.meters.host_reads import HostReads

    ids, trie, llama, _, head = _setup(7)
    bucketed = EngineModel.build(llama, "fp32", forward="bucketed")
    fast = EngineModel.build(llama, "fp32", forward="fast")
    prompts = batch(random_prompts(3, seed=7))
    for k, n in ((10, 10), (5, 8)):
        plain = BeamSearch(fast, trie, TEXT_VOCAB).search(prompts, k)
        engine = BeamSearch(bucketed, trie, TEXT_VOCAB)
        session = HeadDrafter(head, trie).session(prompts, [[]] * 3, None)
        assert session.closed_tree  # the verification feeds its bound
        bucketed.fast()  # built once per model (its probes read the device), not per request
        with HostReads("cpu") as reads:
            spec = speculative_search(bucketed, trie, TEXT_VOCAB, prompts, k, session, n, 3, None, engine.select)
        assert torch.equal(spec.leaves, plain.leaves)
        assert torch.allclose(spec.scores, plain.scores, atol=1e-4)
        head_reads = {s: c for s, c in reads.by_site.items() if s.startswith("recsvc/drafters/")}
        assert head_reads == {}, head_reads
        assert session.head_steps > 0
        # the request's rounds unrolled on the device, each round's drafting, verification and replay one unit
        # (one CUDA graph each on a GPU, a replay here), with or without the search's step graphs (decode's path):
        # the same lists, the eager ops of the setup only, and at most 3 replays a round
        from recsvc.engine.meters.launches import Launches

        for graphs in (None, engine.step_graphs()):
            with Launches() as ops:
                out = speculative_search(bucketed, trie, TEXT_VOCAB, prompts, k,
                                         HeadDrafter(head, trie).session(prompts, [[]] * 3, None), n, 3, None,
                                         engine.select, graphs=graphs)
            assert torch.equal(out.leaves, plain.leaves)
            assert ops.total <= 30 and ops.replays == 3 * LEVELS, ops.summary()
