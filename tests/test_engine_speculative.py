"""Strict speculative beam search returns exactly the plain constrained beam search's output, with or without an
item prior (recsvc.engine.scoring.prior) fused into the target, the drafter and the plain search alike."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from engine_helpers import (
    SCORE_TOL,
    STRICT_CASES,
    TEXT_VOCAB,
    batch,
    check_strict,
    peaked_probs,
    random_catalog,
    random_prompts,
    tiny_llama,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recsvc.drafters.llama import LlamaDrafter
from recsvc.drafters.oracle import OracleDrafter
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.scoring.prior import prior_log_mass
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.speculation.strict.speculative import accepted_depth, speculative_search
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie

L = 4


@dataclass(frozen=True)
class StrictCase:
    """One random case of STRICT_CASES: a 120-item catalog, its trie, the target (seeded ``seed``) and a one-layer
    drafter (``seed + 1``), N drafted beams, the prompts and the items each request excludes (None: none)."""

    ids: SemanticIds
    trie: CatalogTrie
    model: EngineModel
    drafter: LlamaDrafter
    n: int
    prompts: list[list[int]]
    excluded: list[list[int]] | None

    @classmethod
    def draw(cls, seed: int, codebook: int, k: int, n_rel: str, batch_size: int, with_exclusions: bool,
             device: str = "cpu") -> StrictCase:
        ids = random_catalog(120, L, codebook, seed)
        trie = CatalogTrie(ids).to(device)
        model = EngineModel.build(tiny_llama(L, codebook, seed, device=device))
        drafter = LlamaDrafter(EngineModel.build(tiny_llama(L, codebook, seed + 1, hidden=16, layers=1,
                                                            device=device)), trie, TEXT_VOCAB)
        n = {"less": max(1, k // 2), "equal": k, "more": k + 3}[n_rel]
        prompts = random_prompts(batch_size, seed, min_len=1, max_len=15)
        excluded = None
        if with_exclusions:  # five different items per request
            excluded = [ids.item_ids[(seed + r) % len(ids) :][:5].tolist() for r in range(batch_size)]
        return cls(ids, trie, model, drafter, n, prompts, excluded)

    def check(self, k: int, gamma: int, prior: torch.Tensor | None = None, drafter_prior: bool = True):
        return check_strict(self.model, self.drafter, self.trie, self.prompts, k, self.n, gamma, self.excluded,
                            prior, drafter_prior)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    **STRICT_CASES,
    with_exclusions=st.booleans(),
)
def test_strict_equals_plain_on_random_models(device, seed, codebook, k, n_rel, gamma, batch_size, with_exclusions):
    StrictCase.draw(seed, codebook, k, n_rel, batch_size, with_exclusions, device).check(k, gamma)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    **STRICT_CASES,
    weight=st.sampled_from([0.3, 1.0, 4.0, 50.0]),
    with_exclusions=st.booleans(),
    drafter_prior=st.booleans(),
)
def test_strict_with_prior_equals_plain_with_prior(seed, codebook, k, n_rel, gamma, batch_size, weight,
                                                   with_exclusions, drafter_prior):
    case = StrictCase.draw(seed, codebook, k, n_rel, batch_size, with_exclusions)
    case.check(k, gamma, prior_log_mass(case.trie, peaked_probs(len(case.ids), batch_size, seed), weight),
               drafter_prior)


@pytest.mark.parametrize("weight", [None, 2.0])
def test_oracle_drafter_accepts_everything_in_one_call(device, weight) -> None:
    """With a prior too (``weight``; None: none): the oracle drafts the prior-fused top beams."""
    trie = CatalogTrie(random_catalog(200, L, 16, 3)).to(device)
    model = EngineModel.build(tiny_llama(L, 16, 3, device=device))
    engine = BeamSearch(model, trie, TEXT_VOCAB)
    prior = None if weight is None else prior_log_mass(trie, peaked_probs(len(trie.ids), 3, 4), weight)
    spec = check_strict(model, OracleDrafter(engine, 10), trie, random_prompts(3, 3), 10, 10, 3, None, prior)
    assert spec.target_calls.tolist() == [1, 1, 1]  # prefill + tree verification fused into one forward
    assert spec.accepted.tolist() == [3, 3, 3]  # depths 1-3 accepted, depth 4 comes free


def test_target_as_its_own_drafter_is_always_accepted(device) -> None:
    trie = CatalogTrie(random_catalog(200, L, 16, 4)).to(device)
    model = EngineModel.build(tiny_llama(L, 16, 4, device=device))
    spec = check_strict(model, LlamaDrafter(model, trie, TEXT_VOCAB), trie, random_prompts(2, 4), 5, 5, 2)
    assert spec.target_calls.tolist() == [2, 2]  # gamma 2: depths 1-2 + free 3, then 4


def test_a_bad_drafter_still_gives_the_exact_result(device) -> None:
    trie = CatalogTrie(random_catalog(200, L, 16, 5)).to(device)
    model = EngineModel.build(tiny_llama(L, 16, 5, device=device))
    drafter = LlamaDrafter(EngineModel.build(tiny_llama(L, 16, 99, hidden=8, layers=1, device=device)), trie,
                           TEXT_VOCAB)
    spec = check_strict(model, drafter, trie, random_prompts(3, 5), 10, 1, 3)  # N=1 < K: never accepted
    assert spec.accepted.tolist() == [0, 0, 0] and spec.target_calls.tolist() == [4, 4, 4]


def test_accepted_depth_table() -> None:
    drafted = torch.tensor([[7, 9, 4]])
    assert accepted_depth(torch.tensor([[4, 7]]), drafted).tolist() == [True]  # both drafted
    assert accepted_depth(torch.tensor([[4, 8]]), drafted).tolist() == [False]  # 8 was not drafted
    assert accepted_depth(torch.tensor([[4, -1]]), drafted).tolist() == [True]  # dead beams need no draft


@pytest.mark.parametrize("with_prior", [False, True])
@pytest.mark.parametrize("attention", ["exact", "fp32"])
def test_strict_is_bit_identical_in_bf16(attention: str, with_prior: bool) -> None:
    """Per-token key sets: a node's hidden state does not depend on the tree around it, so even in bf16 the
    speculative result equals plain beam search: bit for bit with exact attention, up to fp32 rounding with
    fp32 split attention (same items, same order); likewise with a prior fused into all three."""
    trie = CatalogTrie(random_catalog(2000, L, 32, 6))
    model = EngineModel.build(tiny_llama(L, 32, 6, hidden=64, init=0.2, dtype=torch.bfloat16), attention)
    drafter = LlamaDrafter(EngineModel.build(tiny_llama(L, 32, 7, hidden=32, layers=1, dtype=torch.bfloat16),
                                             attention), trie, TEXT_VOCAB)
    prompts = random_prompts(5, 6, min_len=3, max_len=40)
    prior = prior_log_mass(trie, peaked_probs(len(trie.ids), 5, 6), 1.0) if with_prior else None
    engine = BeamSearch(model, trie, TEXT_VOCAB)
    for k, n, gamma in ((10, 10, 3), (20, 8, 2), (5, 12, 1)):
        plain = engine.search(batch(prompts), k, prior=prior)
        spec = speculative_search(model, trie, TEXT_VOCAB, batch(prompts), k,
                                  drafter.session(batch(prompts), [], None, prior), n, gamma, None, engine.select,
                                  prior)
        assert torch.equal(spec.leaves, plain.leaves)
        if attention == "exact":  # the very same per-token computation
            assert torch.equal(spec.scores, plain.scores)
        else:  # the prompt part's flash-attention blocks depend on how many tokens share the call
            torch.testing.assert_close(spec.scores, plain.scores, atol=SCORE_TOL, rtol=0)
