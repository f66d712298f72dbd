"""The LLaMA drafter runs on the lean forward (its own EngineModel) and drafts what a plain causal forward drafts,
with one drafter forward per drafted depth at most and no node fed twice."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TEXT_VOCAB, batch, random_catalog, random_prompts, tiny_llama

from recsvc.drafters.llama import LlamaDrafter, LlamaDraftSession
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.kernels.fast import FastCache
from recsvc.engine.kernels.lean import LeanCache
from recsvc.engine.scoring.expand import expand_beams
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.speculation.strict.speculative import speculative_search
from tokenizer_rqvae.trie import CatalogTrie

L, C = 4, 16


class Recording:
    """Wraps a LLaMA draft session: records every round's inputs, drafts and drafter forward calls, and every
    node its cache is fed."""

    closed_tree = False  # a wrapper promises nothing of its inner session's trees

    def __init__(self, inner: LlamaDraftSession) -> None:
        self.inner = inner
        self.rounds: list[tuple[torch.Tensor, torch.Tensor, int, list[torch.Tensor], int]] = []
        self.fed: list[int] = []
        forward = inner.cache._forward

        def recording(nodes: torch.Tensor) -> None:
            self.fed += nodes[nodes >= 1].tolist()
            forward(nodes)

        inner.cache._forward = recording  # type: ignore[method-assign]

    @property
    def calls(self) -> int:
        return self.inner.calls

    def propose(self, roots, root_scores, steps, width, target):
        before = self.inner.calls
        drafts = self.inner.propose(roots, root_scores, steps, width, target)
        self.rounds.append((roots, root_scores, int(steps.max()), drafts, self.inner.calls - before))
        return drafts

    def observe(self, beams):
        self.inner.observe(beams)

    def select_rows(self, rows):
        self.inner.select_rows(rows)


@torch.no_grad()
def reference_drafts(model, trie: CatalogTrie, prompt: list[int], roots: torch.Tensor, scores: torch.Tensor,
                     steps: int, width: int) -> list[torch.Tensor]:
    """The drafter's beam search with transformers' own causal forward of prompt + path per node (the dense
    masked path): roots / scores [1, Kc] -> steps x [1, N]."""
    out, nodes = [], roots
    for _ in range(steps):
        rows = []
        for node in nodes[0].tolist():
            row = torch.zeros(C)
            if node >= 0:
                codes = [c for c in trie.codes_of_nodes(torch.tensor(node)).tolist() if c >= 0]
                toks = prompt + [TEXT_VOCAB + lv * C + c for lv, c in enumerate(codes)]
                logp = torch.log_softmax(model(torch.tensor([toks])).logits[0, -1].float(), -1)
                row = logp[TEXT_VOCAB + len(codes) * C : TEXT_VOCAB + (len(codes) + 1) * C]
            rows.append(row)
        nodes, scores, _ = expand_beams(trie, nodes, scores, torch.stack(rows)[None], width, None)
        out.append(nodes)
    return out


@pytest.mark.parametrize("attention", ["exact", "fp32"])
def test_drafter_on_the_lean_forward_drafts_what_the_causal_forward_drafts(attention: str) -> None:
    trie = CatalogTrie(random_catalog(200, L, C, 11))
    target = EngineModel.build(tiny_llama(L, C, 11), attention)
    drafter = LlamaDrafter(EngineModel.build(tiny_llama(L, C, 12, hidden=16, layers=1), attention), trie, TEXT_VOCAB)
    causal = tiny_llama(L, C, 12, hidden=16, layers=1)  # the same weights, never switched: transformers' SDPA
    engine = BeamSearch(target, trie, TEXT_VOCAB)
    rounds = 0
    for prompt in random_prompts(6, 11, min_len=2, max_len=20):
        pb = batch([prompt])
        for k, n, gamma in ((6, 6, 3), (4, 8, 2), (3, 3, 1)):
            session = Recording(drafter.session(pb, [], None))
            # the drafter runs the engine's forward: fast in fp32 attention mode (fp32 models), else lean
            assert isinstance(session.inner.cache.cache, FastCache if attention == "fp32" else LeanCache)
            spec = speculative_search(target, trie, TEXT_VOCAB, pb, k, session, n, gamma, None, engine.select)
            assert torch.equal(spec.leaves, engine.search(pb, k).leaves)  # strict == plain
            for roots, scores, steps, drafts, calls in session.rounds:
                ref = reference_drafts(causal, trie, prompt, roots, scores, steps, n)
                assert all(torch.equal(a, b) for a, b in zip(drafts, ref, strict=True))
                assert calls <= steps  # one forward per drafted depth at most (the last depth is never fed)
                rounds += 1
            assert len(session.fed) == len(set(session.fed))  # no node fed twice
            assert spec.draft_calls == sum(r[4] for r in session.rounds)
    assert rounds > 18  # several rounds per request on average
