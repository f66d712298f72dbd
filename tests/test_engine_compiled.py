"""The compiled forward (recsvc.engine.kernels.compiled_stack): inductor's graph of the fast forward's layers gives
the fast forward's results up to float rounding, for plain beam search (batched and single prompts, so both the prompt
prefill with its last-layer pruning and the decode graph run), strict speculation and the user-state cache."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_helpers import TEXT_VOCAB, batch, common_item_gap, random_catalog, random_prompts, tiny_llama

from recsvc.drafters.llama import LlamaDrafter
from recsvc.engine.caches.state_cache import UserStateCache
from recsvc.engine.kernels.compiled_scoring import ExportedScoring
from recsvc.engine.kernels.compiled_stack import CompiledGraph, ExportedGraphs
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.scoring.expand import candidate_scores
from recsvc.engine.scoring.prior import prior_log_mass
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.speculation.strict.speculative import speculative_search
from tokenizer_rqvae.trie import CatalogTrie

L, C = 4, 16
TOL = 1e-4  # the fast forward's documented tolerance

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("gcc") is None,
                                reason="inductor's CPU backend needs a C++ compiler")


@pytest.fixture(scope="module")
def setup():
    trie = CatalogTrie(random_catalog(400, L, C, 31))
    model = tiny_llama(L, C, 31, hidden=64, layers=2)
    fast = EngineModel.build(model, "fp32")
    compiled = EngineModel.build(model, "fp32", forward="compiled")
    return trie, fast, compiled


def test_compiled_is_the_fast_forward_with_compiled_layers(setup) -> None:
    _, fast, compiled = setup
    assert compiled.plan.fast and compiled.forward_name == "compiled"
    assert compiled.fast().compiled_layers is not None and fast.fast().compiled_layers is None
    compiled.set_forward("fast")  # switching back and forth keeps both builds (no recompilation)
    built = compiled.fast()
    assert built.compiled_layers is None
    compiled.set_forward("compiled")
    assert compiled.fast().compiled_layers is not None
    compiled.set_forward("fast")
    assert compiled.fast() is built
    compiled.set_forward("compiled")


def test_compiled_plain_matches_fast(setup) -> None:
    trie, fast, compiled = setup
    prompts = random_prompts(6, 32, min_len=3, max_len=30)
    for group in (prompts, prompts[:1], prompts[1:2]):  # batches of several prompts and of one
        for k in (4, 10):
            a = BeamSearch(fast, trie, TEXT_VOCAB).search(batch(group), k)
            b = BeamSearch(compiled, trie, TEXT_VOCAB).search(batch(group), k)
            assert torch.equal(a.leaves, b.leaves)
            torch.testing.assert_close(a.scores, b.scores, atol=TOL, rtol=0)


def test_two_graphs_serve_every_shape_and_the_bounded_last_step_is_exact(setup) -> None:
    """The exported graphs cover every size of their kind of call: searches of one and several prompts, K = 1 to
    12 and a bounded last step (parts of 4+ rows) compile nothing beyond the prefill graph and the other one. And
    a row's result does not depend on the rows sharing its call: reading the best 3 of 10 beams (the last step
    fed in parts) gives the full search's first 3 items and scores, bit for bit."""
    trie, _, compiled = setup
    engine = BeamSearch(compiled, trie, TEXT_VOCAB)
    prompts = random_prompts(4, 37, min_len=3, max_len=30)
    for group in (prompts, prompts[:1], prompts[2:]):
        for k in (1, 5, 12):
            engine.search(batch(group), k)
        full = engine.search(batch(group), 10)
        top = engine.search(batch(group), 10, top=3)
        assert torch.equal(top.leaves, full.leaves[:, :3]) and torch.equal(top.scores, full.scores[:, :3])
    graphs = compiled.fast().compiled_layers
    assert isinstance(graphs, ExportedGraphs) and graphs.compiled == ["other", "prefill"]
    # on this torch both graphs call their compiled kernel directly (the probe found it and it gave the wrapped
    # call's bits), so the searches above ran through it
    assert all(g.direct for g in graphs._graphs.values())


def test_a_compiled_graph_without_a_reachable_kernel_calls_the_wrapped_graph() -> None:
    """``CompiledGraph.of`` falls back to the wrapped callable when it finds no kernel inside it, and its direct
    call takes the module's arguments (list arguments as lists) like the wrapped one."""
    calls = []

    def wrapped(a, bs):
        calls.append(len(bs))
        return a + sum(bs)

    graph = CompiledGraph.of(wrapped, (torch.ones(2), [torch.ones(2), torch.ones(2)]))
    assert not graph.direct and torch.equal(graph(torch.zeros(2), [torch.ones(2)]), torch.ones(2))
    assert calls == [1]
    direct = CompiledGraph(wrapped, lambda flat: [flat[0] + flat[1] + flat[2]], single=True)
    assert direct.direct and torch.equal(direct(torch.zeros(2), [torch.ones(2), torch.ones(2)]), 2 * torch.ones(2))


def test_decode_steps_score_in_one_compiled_graph_with_the_eager_bits(setup, monkeypatch) -> None:
    """The compiled forward scores decode steps (LM head, log-softmax, trie, exclusions, prior) in one graph that
    gives the eager path's very bits: searches with and without it return the same items and scores, with a prior
    and exclusions, a bounded last step and batches; and the graph serves a larger trie (a live catalog's)."""
    trie, fast, compiled = setup
    assert fast.scoring() is None
    scoring = compiled.scoring()
    assert isinstance(scoring, ExportedScoring) and compiled.scoring() is scoring
    engine = BeamSearch(compiled, trie, TEXT_VOCAB)
    prompts = random_prompts(3, 38, min_len=3, max_len=30)
    gen = torch.Generator().manual_seed(39)
    prior = prior_log_mass(trie, torch.rand(len(prompts), trie.item_path.shape[0], generator=gen), 0.8)
    dead = trie.dead_nodes([[int(i) for i in trie.ids.item_ids[:30]]] * len(prompts))
    cases = [(prompts, None, None, None), (prompts, dead, prior, None), (prompts[:1], dead[:1], prior[:1], 3)]
    with_graph = [engine.search(batch(p), 8, d, pr, top=t) for p, d, pr, t in cases]
    assert scoring.exact is True
    monkeypatch.setattr(compiled, "scoring", lambda: None)  # the eager head and candidate_scores
    for (p, d, pr, t), out in zip(cases, with_graph, strict=True):
        eager = engine.search(batch(p), 8, d, pr, top=t)
        assert torch.equal(out.leaves, eager.leaves) and torch.equal(out.scores, eager.scores)
    monkeypatch.undo()
    big = CatalogTrie(random_catalog(700, L, C, 40))  # more nodes and internal nodes than the first call's trie
    hidden = torch.randn(2, 5, compiled.hidden_size, generator=gen)
    nodes = torch.randint(0, int(big.children.shape[0]), (2, 5), generator=gen)
    scores = -torch.rand(2, 5, generator=gen)
    big_prior = prior_log_mass(big, torch.rand(2, big.item_path.shape[0], generator=gen), 1.0)
    got = scoring(hidden, nodes, scores, big, 2, TEXT_VOCAB, None, big_prior)
    level = torch.full((10,), 2)
    logp = compiled.code_logprobs(hidden.reshape(10, -1), level, TEXT_VOCAB, C).view(2, 5, C)
    want = candidate_scores(big, nodes, scores, logp, None, big_prior)
    assert got is not None and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_strict_equals_plain_on_the_compiled_forward(setup) -> None:
    trie, _, target = setup
    drafter = LlamaDrafter(EngineModel.build(tiny_llama(L, C, 34, hidden=32, layers=1), "fp32"), trie, TEXT_VOCAB)
    engine = BeamSearch(target, trie, TEXT_VOCAB)
    prompts = random_prompts(3, 35, min_len=3, max_len=30)
    plain = engine.search(batch(prompts), 6)
    spec = speculative_search(target, trie, TEXT_VOCAB, batch(prompts), 6,
                              drafter.session(batch(prompts), [], None), 6, 3, None, engine.select)
    assert torch.equal(spec.leaves, plain.leaves)
    torch.testing.assert_close(spec.scores, plain.scores, atol=TOL, rtol=0)


def test_user_state_cache_on_the_compiled_forward_gives_identical_outputs(setup) -> None:
    trie, _, compiled = setup
    engine = BeamSearch(compiled, trie, TEXT_VOCAB)
    prompts = random_prompts(3, 36, min_len=5, max_len=30)
    states = UserStateCache(1 << 30, "v1")
    first = engine.search(batch(prompts), 8, states=states)  # fills the cache
    extended = [p + p[-2:] for p in prompts]  # a prompt that extends a cached one: only new tokens computed
    for group in (prompts, extended):
        cold = engine.search(batch(group), 8)
        warm = engine.search(batch(group), 8, states=states)
        assert torch.equal(cold.leaves, warm.leaves)
        torch.testing.assert_close(cold.scores, warm.scores, atol=TOL, rtol=0)
    assert torch.equal(first.leaves, engine.search(batch(prompts), 8).leaves)
    assert states.stats()["hits"] > 0


def test_a_server_built_with_the_compiled_forward_compiles_before_serving(tmp_path) -> None:
    from test_drafter_fixtures import tiny_bundle

    from recsvc.cli.main import build_parser
    from recsvc.recommender.api import RecQuery
    from recsvc.service.startup.settings import ServeSettings, build_recommender

    bundle = tiny_bundle(tmp_path / "b", n_users=20)
    events: list[str] = []

    def settings(forward: str) -> ServeSettings:
        args = build_parser().parse_args(["serve", "--bundle", str(bundle), "--dtype", "fp32", "--spec", "off",
                                          "--forward", forward])
        return ServeSettings.from_args(args)

    rec = build_recommender(settings("compiled"), step=lambda event, **_: events.append(event))
    assert rec.target.forward_name == "compiled"
    assert events.index("compiling_forward") < events.index("forward_compiled")
    scoring = rec.target.scoring()  # the decode steps' scoring graph compiled (and checked) in the warm-up too
    assert scoring is not None and scoring.exact is True
    ref = build_recommender(settings("fast"), step=lambda *_, **__: None)
    assert ref.target.forward_name == "fast"
    history = rec.ids.item_ids[:4].tolist()
    a = rec.recommend([RecQuery(history=history, k=5, mode="plain")])[0]
    b = ref.recommend([RecQuery(history=history, k=5, mode="plain")])[0]
    assert a.item_ids == b.item_ids
    torch.testing.assert_close(torch.tensor(a.scores), torch.tensor(b.scores), atol=TOL, rtol=0)


def test_the_compiled_forward_without_a_cpp_compiler_is_a_clear_error(setup, tmp_path, monkeypatch) -> None:
    from recsvc.errors import UserError

    _, fast, _ = setup
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no compiler on the PATH
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(UserError, match="C\\+\\+ compiler"):
        fast.set_forward("compiled")
    assert fast.forward_name == "fast"  # nothing changed


def test_compiled_bf16_is_as_close_to_fp32_as_the_bf16_fast_forward(setup) -> None:
    """A bf16 model compiles too. Inductor keeps float32 between the ops it fuses (eager rounds to bf16 after
    each), so the graph is compared with the fp32 model: on the items both return, its scores are no further
    from the fp32 model's than the uncompiled bf16 forward's are, and it returns those items as often."""
    import copy

    trie, fast, _ = setup
    half = copy.deepcopy(fast.model).to(torch.bfloat16)
    eager, compiled = EngineModel.build(half, "fp32"), EngineModel.build(half, "fp32", forward="compiled")
    assert compiled.plan.fast and compiled.forward_name == "compiled"
    prompts = batch(random_prompts(6, 37, min_len=3, max_len=30))
    ref, a, b = (BeamSearch(m, trie, TEXT_VOCAB).search(prompts, 8) for m in (fast, eager, compiled))
    (gap_eager, shared_eager), (gap_compiled, shared_compiled) = common_item_gap(ref, a), common_item_gap(ref, b)
    assert gap_compiled <= 1.1 * gap_eager + 0.05 and shared_compiled >= shared_eager - 2
