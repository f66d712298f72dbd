"""The bucketed, padded forward over a static KV cache (recsvc.engine.kernels.buckets; CUDA graphs replay it on a GPU):
the same lists as today's fast forward, plain and strict speculative, and its rounds' host reads bounded."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TEXT_VOCAB, batch, counted_request, random_catalog, random_prompts, tiny_llama

from recsvc.drafters.llama import LlamaDrafter
from recsvc.drafters.oracle import OracleDrafter
from recsvc.engine.caches.state_cache import UserStateCache
from recsvc.engine.kernels.buckets import Buckets, StaticCache, pad_inputs
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.meters.host_reads import HostReads, uncounted
from recsvc.engine.meters.ledger import PhaseLedger
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.speculation.strict.speculative import speculative_search
from tokenizer_rqvae.trie import CatalogTrie

L, C = 4, 16
TOL = 1e-4  # the fast forward's own tolerance (fp32): padded key columns change only the summation order


@pytest.fixture(scope="module")
def setup():
    trie = CatalogTrie(random_catalog(400, L, C, 21))
    return trie, tiny_llama(L, C, 21, hidden=64, layers=2), tiny_llama(L, C, 24, hidden=32, layers=1)


def _models(setup, forward: str):
    trie, model, draft = setup
    target = EngineModel.build(model, "fp32", forward=forward)
    drafter = LlamaDrafter(EngineModel.build(draft, "fp32", forward=forward), trie, TEXT_VOCAB)
    return trie, target, drafter, BeamSearch(target, trie, TEXT_VOCAB)


def _same(a, b) -> None:
    assert torch.equal(a.leaves, b.leaves)  # the same items in the same order
    finite = torch.isfinite(a.scores)
    assert torch.equal(finite, torch.isfinite(b.scores))
    torch.testing.assert_close(a.scores[finite], b.scores[finite], atol=TOL, rtol=0)


@pytest.mark.parametrize("k", [1, 5, 10, 20])
def test_bucketed_plain_gives_the_fast_forwards_lists(setup, k: int) -> None:
    _, fast, _, plain_fast = _models(setup, "fast")
    _, bucketed, _, plain_bucketed = _models(setup, "bucketed")
    assert bucketed.forward_name == "bucketed" and bucketed.plan.sync_free and not fast.plan.sync_free
    for n_prompts, seed in ((1, 30), (3, 31), (5, 32)):  # batch sizes padded to 1, 4 and 8 rows
        prompts = batch(random_prompts(n_prompts, seed, min_len=3, max_len=30))
        _same(plain_bucketed.search(prompts, k), plain_fast.search(prompts, k))
    assert bucketed.bucketed().unbucketed == 0  # every forward ran at a bucket's shape


@pytest.mark.parametrize(("k", "n", "gamma", "n_prompts"), [(10, 10, 3, 1), (6, 6, 3, 3), (4, 8, 2, 4),
                                                           (10, 5, 1, 2), (20, 40, 3, 1)])
def test_bucketed_strict_gives_the_fast_forwards_lists(setup, k: int, n: int, gamma: int, n_prompts: int) -> None:
    _, fast, drafter_fast, plain_fast = _models(setup, "fast")
    trie, bucketed, drafter_bucketed, plain_bucketed = _models(setup, "bucketed")
    prompts = batch(random_prompts(n_prompts, 40 + k, min_len=3, max_len=30))
    plain = plain_fast.search(prompts, k)
    before = speculative_search(fast, trie, TEXT_VOCAB, prompts, k, drafter_fast.session(prompts, [], None), n,
                                gamma, None, plain_fast.select)
    after = speculative_search(bucketed, trie, TEXT_VOCAB, prompts, k, drafter_bucketed.session(prompts, [], None),
                               n, gamma, None, plain_bucketed.select)
    _same(before, plain)
    _same(after, plain)  # strict stays lossless on the padded path
    assert torch.equal(after.target_calls, before.target_calls) and torch.equal(after.accepted, before.accepted)


def test_bucketed_strict_with_a_drafter_whose_trees_lack_parents(setup) -> None:
    """The oracle with N < K drafts beams whose parents it did not draft: the verification then feeds its
    general bound (every node's ancestors), and the lists stay the plain search's."""
    trie, bucketed, _, plain = _models(setup, "bucketed")
    prompts = batch(random_prompts(3, 50, min_len=3, max_len=30))
    ref = plain.search(prompts, 10)
    out = speculative_search(bucketed, trie, TEXT_VOCAB, prompts, 10, OracleDrafter(plain, 10).session(
        prompts, [], None), 4, 3, None, plain.select)
    _same(out, ref)


def _count_strict(setup, forward: str, drafter_kind: str):
    trie, target, drafter, plain = _models(setup, forward)
    prompts = batch(random_prompts(1, 60, min_len=8, max_len=20))
    source = OracleDrafter(plain, 10) if drafter_kind == "oracle" else drafter
    session = source.session(prompts, [], None)  # the oracle's own plain search happens here, uncounted
    target.fast(), drafter.model.fast()  # built once per model (its probes read the device), not per request
    ledger = PhaseLedger()
    rounds = _RoundCounter(ledger)
    with HostReads(target.device) as reads:
        out = speculative_search(target, trie, TEXT_VOCAB, prompts, 10, session, 10, 3, None, plain.select,
                                 ledger=rounds)
    return reads, rounds.rounds, out


class _RoundCounter:
    """A ledger that counts the rounds (one "verify" phase each)."""

    def __init__(self, inner: PhaseLedger) -> None:
        self.inner, self.rounds = inner, 0

    def phase(self, name: str):
        self.rounds += name == "verify"
        return self.inner.phase(name)


def test_a_strict_request_reads_the_device_once(setup) -> None:
    """A strict request with the oracle drafter (prefill + verification in one target call, every depth accepted)
    reads the device once on the sync-free path (its counters, at the end), its L rounds unrolled on the device
    (the rounds after the first feed nothing and count no target call); the fast path reads it for the
    verification's token count and key groups, the replay's exit test and the row selection, in one round."""
    after, rounds, out = _count_strict(setup, "bucketed", "oracle")
    before, rounds_before, _ = _count_strict(setup, "fast", "oracle")
    assert rounds == L and rounds_before == 1 and out.target_calls.tolist() == [1]
    assert out.host_counts == ([1], out.accepted.tolist())
    assert after.total == 1, after.summary()
    assert before.total > 10 * after.total, before.summary()


def test_llama_strict_reads_once_per_request(setup) -> None:
    reads, rounds, out = _count_strict(setup, "bucketed", "llama")
    assert rounds == L and 1 <= int(out.target_calls[0]) <= L
    assert reads.total == 1, reads.summary()  # the counters and the closed-tree bound's check, in one read


def test_pad_inputs_padded_tokens_see_only_themselves() -> None:
    ids = torch.tensor([[5, 6, 7]])
    pos = torch.tensor([[3, 4, 4]])
    slots = torch.tensor([[4, 5, 6]])
    visible = torch.zeros(1, 3, 7, dtype=torch.bool)
    visible[0, :, :4] = True
    visible[0, torch.arange(3), slots[0]] = True
    x = pad_inputs(ids, pos, slots, visible, None, rows=2, tokens=4, width=9)
    assert x.ids.shape == (2, 4) and x.visible.shape == (2, 4, 9)
    assert torch.equal(x.ids[0, :3], ids[0]) and torch.equal(x.slots[0, :3], slots[0])
    assert torch.equal(x.visible[0, :3, :7], visible[0]) and not x.visible[0, :3, 7:].any()
    assert x.slots[0, 3] == 7  # a real row's padded token writes past the visible width
    for r, c in ((0, 3), (1, 0), (1, 3)):  # padded tokens / rows: their own slot only
        assert x.visible[r, c].sum() == 1 and x.visible[r, c, x.slots[r, c]]


def test_static_cache_compaction_and_row_selection_keep_the_buffers(setup) -> None:
    _, model, _ = setup
    target = EngineModel.build(model, "fp32", forward="bucketed")
    cache = target.new_cache()
    assert isinstance(cache, StaticCache)
    cache.reserve(10, 3)
    assert cache.leased  # the model's pool: a graph can replay on it
    layer = cache.layers[0]
    ptr = layer.k.data_ptr()
    layer.k[:3, :, :10] = torch.randn(3, layer.k.shape[1], 10, layer.k.shape[3])
    layer.v[:3, :, :10] = torch.randn_like(layer.k[:3, :, :10])
    order = torch.tensor([[0, 2, 4, 6], [1, 3, 5, 7], [9, 8, 7, 6]])
    idx = order[:, None, :, None].expand(-1, layer.k.shape[1], -1, layer.k.shape[3])
    expect = layer.keys.gather(2, idx)
    layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)  # compaction
    assert layer.k.data_ptr() == ptr and torch.equal(layer.keys, expect) and cache.width == 4
    rows = torch.tensor([2, 0])
    expect = layer.keys[rows]
    layer.keys, layer.values = layer.keys[rows], layer.values[rows]  # row selection
    assert layer.k.data_ptr() == ptr and torch.equal(layer.keys, expect) and cache.batch == 2
    other = target.new_cache()  # a second live search: its own buffers (runs uncaptured)
    other.reserve(5, 1)
    assert not other.leased and other.layers[0].k.data_ptr() != ptr


def test_graphs_off_cuda_is_the_bucketed_forward(setup) -> None:
    _, model, _ = setup
    graphs = EngineModel.build(model, "fp32", forward="graphs")
    assert graphs.plan.sync_free and graphs.forward_name == ("graphs" if model.device.type == "cuda" else "bucketed")
    assert graphs.graph_runner is None or model.device.type == "cuda"
    auto = EngineModel.build(model, "fp32", forward="auto")  # the default: graphs on a CUDA GPU, else fast
    assert auto.forward_name == ("graphs" if model.device.type == "cuda" else "fast")
    assert EngineModel.build(model, "exact", forward="auto").forward_name == "lean"  # exact attention: the lean path


def test_buckets_fit() -> None:
    b = Buckets()
    assert b.fit(b.rows, 3) == 4 and b.fit(b.rows, 16) == 16 and b.fit(b.rows, 17) is None
    assert b.fit(b.tokens, 130) == 160 and b.fit(b.widths, 1) == 64


def test_host_reads_counts_what_reads_the_device() -> None:
    x = torch.arange(6)
    with HostReads("cpu") as reads:
        x.sum().item()
        x.tolist()
        bool(x[0] > 1)
        torch.nonzero(x)
        x[x > 2]
        x.repeat_interleave(2)  # no data-dependent size: not a read
        x.repeat_interleave(x)  # the output size depends on the values: a read
        x.max()  # stays a tensor: not a read
        with uncounted():
            int(x[1])
    assert reads.total == 6, reads.summary()
    assert reads.by_op == {"item": 1, "tolist": 1, "__bool__": 1, "nonzero": 1, "__getitem__": 1,
                           "repeat_interleave": 1}
    with HostReads("cuda") as reads:  # only the given device's tensors count
        x.tolist()
    assert reads.total == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_graphs_replay_the_bucketed_forward_on_cuda() -> None:
    trie = CatalogTrie(random_catalog(400, L, C, 21)).to("cuda")
    model = tiny_llama(L, C, 21, hidden=64, layers=2, device="cuda")
    bucketed = EngineModel.build(model, "fp32", forward="bucketed")
    graphs = EngineModel.build(model, "fp32", forward="graphs")
    assert graphs.forward_name == "graphs"
    prompts = batch(random_prompts(3, 70, min_len=3, max_len=30))
    a = BeamSearch(bucketed, trie, TEXT_VOCAB).search(prompts, 10)
    b = BeamSearch(graphs, trie, TEXT_VOCAB).search(prompts, 10)
    _same(a, b)
    runner = graphs.graph_runner
    assert runner is not None and len(runner.graphs) >= 2
    c = BeamSearch(graphs, trie, TEXT_VOCAB).search(prompts, 10)  # replays
    _same(a, c)
    assert runner.summary()["replays"] > 0
    search = BeamSearch(graphs, trie, TEXT_VOCAB)  # each step's head + selection: one captured graph
    for _ in range(2):
        _same(a, search.search(prompts, 10))
    steps = search.step_graphs()
    assert steps is not None and steps.capture and not steps.failed
    assert steps.summary()["graphs"] == L and steps.summary()["replays"] == 2 * L


def test_bucketed_plain_with_the_user_state_cache(setup) -> None:
    """The sync-free step (head + selection as one function) keeps the user-state cache's first-step log-probs:
    a returning prompt (a full hit) gives the same list as the first time and as the fast forward."""
    _, _, _, plain_fast = _models(setup, "fast")
    _, bucketed, _, plain_bucketed = _models(setup, "bucketed")
    assert plain_bucketed.step_graphs() is not None and plain_fast.step_graphs() is None
    prompts = batch(random_prompts(3, 80, min_len=3, max_len=30))
    ref = plain_fast.search(prompts, 10)
    states = UserStateCache(1 << 30)
    first = plain_bucketed.search(prompts, 10, states=states)
    again = plain_bucketed.search(prompts, 10, states=states)
    assert states.hits >= 3  # every prompt came back
    _same(first, ref)
    _same(again, ref)


def test_each_search_in_turn_gets_the_static_pool(setup) -> None:
    """A finished search's cache is freed by reference counting (no cycle), so the next search leases the
    model's pool again (on CUDA: its graphs replay) without waiting for the garbage collector."""
    import gc

    trie, target, drafter, plain = _models(setup, "bucketed")
    prompts = batch(random_prompts(1, 80))
    leases = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(3):
            cache = target.new_cache()
            cache.reserve(8, 1)
            leases.append(cache.leased)
            del cache
            plain.search(prompts, 10)
            speculative_search(target, trie, TEXT_VOCAB, prompts, 10, drafter.session(prompts, [], None), 10, 3,
                               None, plain.select)
            pools = (target.bucketed().pool, drafter.model.bucketed().pool)
            leases.append(all(p._holder is None or p._holder() is None for p in pools))  # released
    finally:
        if enabled:
            gc.enable()
    assert leases == [True, True] * 3


@pytest.mark.parametrize("n_prompts", [1, 3])
def test_a_strict_request_is_a_handful_of_replays_and_one_read(setup, n_prompts: int) -> None:
    """The bench pairing's shape (a LLaMA target, a smaller LLaMA drafter; bucketed forward): a strict request
    launches at most twice plain's eager ops from Python, replays at most 4 graphs more than plain's (L rounds of
    drafting, verification and replay against plain's L forwards and L steps), reads the device at most twice (once
    here), and returns plain's lists."""
    trie, target, drafter, engine = _models(setup, "bucketed")
    prompts = batch(random_prompts(n_prompts, 70 + n_prompts, min_len=3, max_len=30))
    plain, plain_ops, plain_replays, plain_reads = counted_request(engine, None, prompts, "plain")
    strict, ops, replays, reads = counted_request(engine, drafter, prompts, "strict")
    assert strict.decoding.mode == "strict"
    assert torch.equal(strict.leaves, plain.leaves)
    assert ops <= 2 * plain_ops and replays <= plain_replays + 4 and reads <= 2, (ops, plain_ops, replays, reads)
    assert plain_replays == 2 * L and replays == 3 * L and reads == 1 and plain_reads == 0


def test_an_early_exit_check_ends_a_finished_request_in_one_read(setup) -> None:
    """``exit_check=2``: after two rounds one read asks whether every row finished (with the counters): the
    oracle's request (done in its first round) stops there, having read once; a request still running reads once
    more at its end. The lists stay plain's."""
    trie, target, drafter, plain = _models(setup, "bucketed")
    for n_prompts, source in ((1, "oracle"), (3, "llama"), (1, "llama")):
        prompts = batch(random_prompts(n_prompts, 80 + n_prompts, min_len=3, max_len=30))
        ref = plain.search(prompts, 10)
        rounds = _RoundCounter(PhaseLedger())
        session = (OracleDrafter(plain, 10) if source == "oracle" else drafter).session(prompts, [], None)
        with HostReads(target.device) as reads:
            out = speculative_search(target, trie, TEXT_VOCAB, prompts, 10, session, 10, 3, None, plain.select,
                                     ledger=rounds, exit_check=2)
        _same(out, ref)
        assert out.host_counts == (out.target_calls.tolist(), out.accepted.tolist())
        if source == "oracle":
            assert rounds.rounds == 2 and reads.total == 1, reads.summary()
        else:
            assert rounds.rounds in (2, L) and reads.total == (1 if rounds.rounds == 2 else 2), reads.summary()
