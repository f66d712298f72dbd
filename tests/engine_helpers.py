"""Tiny random models and catalogs for engine tests, and the transformers ``generate`` reference."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.search.reference import generate_topk
from recsvc.engine.speculation.strict.speculative import speculative_search
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie

TEXT_VOCAB = 24  # text tokens before the code tokens; code_offset = TEXT_VOCAB
# the random cases of strict == plain: catalog seed and codebook, k, N relative to k, gamma, batch size
STRICT_CASES = dict(seed=st.integers(0, 10_000), codebook=st.sampled_from([8, 16]), k=st.integers(1, 20),
                    n_rel=st.sampled_from(["less", "equal", "more"]), gamma=st.integers(1, 5),
                    batch_size=st.integers(1, 4))
SCORE_TOL = 1e-4  # scores of the tree forward vs step-by-step decoding differ only by float error (fp32)


def tiny_llama(levels: int, codebook: int, seed: int, hidden: int = 32, layers: int = 2,
               init: float = 0.5, dtype: torch.dtype = torch.float32, kv_heads: int = 2,
               device: str = "cpu") -> LlamaForCausalLM:
    """A random LLaMA whose next-token distributions are peaked (large init), so beam ties are rare."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=TEXT_VOCAB + levels * codebook, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
                      max_position_embeddings=256, initializer_range=init, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(dtype).eval()  # initialised on the CPU (the same weights on every device)
    return model.to(device)


def random_catalog(n_items: int, levels: int, codebook: int, seed: int) -> SemanticIds:
    rng = np.random.default_rng(seed)
    seen: set[tuple[int, ...]] = set()
    while len(seen) < n_items:
        seen.add(tuple(int(x) for x in rng.integers(0, codebook, size=levels)))
    items = rng.permutation(np.arange(1, 10 * n_items))[:n_items]
    return SemanticIds.from_mapping(dict(zip(items.tolist(), sorted(seen), strict=True)), codebook_size=codebook)


def random_prompts(n: int, seed: int, min_len: int = 3, max_len: int = 12) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, TEXT_VOCAB, size=int(rng.integers(min_len, max_len + 1))).tolist() for _ in range(n)]


def peaked_probs(n: int, rows: int, seed: int) -> torch.Tensor:
    """[rows, n] random item probabilities with a long tail (rows sum to 1): a prior's input."""
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(rows, n, generator=g)
    return torch.softmax(logits, 1)


def generate_reference(model: LlamaForCausalLM, trie: CatalogTrie, prompt: list[int], k: int,
                       excluded: list[int] | None = None) -> tuple[list[tuple[int, ...]], list[float]]:
    """transformers' own constrained beam search for one prompt (see recsvc.engine.search.reference)."""
    return generate_topk(model, trie, TEXT_VOCAB, prompt, k, excluded)


def engine_codes(trie: CatalogTrie, leaves: torch.Tensor) -> list[list[tuple[int, ...]]]:
    codes = trie.codes_of_nodes(leaves.to(trie.device))  # [B, K, L]
    return [[tuple(r) for r in row if r[0] >= 0] for row in codes.tolist()]


def batch(prompts: list[list[int]]) -> PromptBatch:
    return PromptBatch.from_lists(prompts)


def common_item_gap(a, b) -> tuple[float, int]:
    """Two searches' outputs (``leaves`` / ``scores`` [B, K]) -> the largest score difference over the items both
    return (per row), and how many such items there are."""
    worst, shared = 0.0, 0
    for r in range(a.leaves.shape[0]):
        mine = {int(leaf): float(s) for leaf, s in zip(a.leaves[r], a.scores[r], strict=True) if int(leaf) >= 0}
        for leaf, s in zip(b.leaves[r], b.scores[r], strict=True):
            if int(leaf) in mine:
                worst, shared = max(worst, abs(mine[int(leaf)] - float(s))), shared + 1
    return worst, shared


def check_strict(model, drafter, trie, prompts, k, n, gamma, excluded=None, prior=None, drafter_prior=True):
    """Strict speculation (N = n, ``gamma``) == plain beam search of k beams: the same leaves in the same order,
    the same scores up to SCORE_TOL, 1..L target calls, on the model's device. ``prior`` [B, num_nodes]: fused
    into both (``drafter_prior``: the drafter sees it too). Returns the speculative output."""
    dead = trie.dead_nodes(excluded) if excluded else None
    engine = BeamSearch(model, trie, TEXT_VOCAB)  # model: an EngineModel
    plain = engine.search(batch(prompts), k, dead, prior)
    session = drafter.session(batch(prompts), [], dead, prior if drafter_prior else None)
    spec = speculative_search(model, trie, TEXT_VOCAB, batch(prompts), k, session, n, gamma, dead, engine.select,
                              prior)
    assert torch.equal(spec.leaves, plain.leaves)  # same items, same order
    finite = torch.isfinite(plain.scores)
    assert torch.equal(torch.isfinite(spec.scores), finite)
    torch.testing.assert_close(spec.scores[finite], plain.scores[finite], atol=SCORE_TOL, rtol=0)
    assert (spec.target_calls >= 1).all() and (spec.target_calls <= trie.levels).all()
    assert spec.leaves.device == plain.leaves.device == model.device  # the search stays on the model's device
    return spec


def catalog_with_sequences(seed: int, device: str = "cpu"):
    """A random 150-item catalog (4 levels, codebook 16) on ``device``, a tiny target over it, and 40 training
    sequences of 6 items: (trie, model, item ids, sequences) for the training-free drafters' tests."""
    from recsvc.engine.kernels.engine_model import EngineModel

    ids = random_catalog(150, 4, 16, seed=seed)
    model = EngineModel.build(tiny_llama(4, 16, seed=seed, device=device))
    items = ids.item_ids.tolist()
    seqs = [[items[(i * 7 + j) % len(items)] for j in range(6)] for i in range(40)]
    return CatalogTrie(ids).to(device), model, items, seqs


def counted_request(engine: BeamSearch, drafter, prompts: PromptBatch, mode: str, k: int = 10,
                    seeded: bool = False):
    """(one decoded request, its eager device ops, graph replays, host reads), after one warm-up request; each
    of the three runs is the same request (``seeded``: each prompt's sampling generator seeded by its row)."""
    from recsvc.engine.entry.dispatch import decode
    from recsvc.engine.meters.host_reads import HostReads
    from recsvc.engine.meters.launches import Launches
    from recsvc.engine.search.sampling import make_generators

    def run():
        gens = make_generators(list(range(len(prompts.lengths)))) if seeded else None
        return decode(engine, drafter, prompts, [[]] * len(prompts.lengths), mode, k, (k, 3), generators=gens)

    run()
    with Launches() as ops:
        out = run()
    with HostReads(engine.model.device) as reads:
        run()
    return out, ops.total, ops.replays, reads.total
