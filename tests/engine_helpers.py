"""Tiny random models and catalogs for engine tests, and the transformers ``generate`` reference."""

from __future__ import annotations

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from recsvc.engine.prompts import PromptBatch
from recsvc.engine.reference import generate_topk
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie

TEXT_VOCAB = 24  # text tokens before the code tokens; code_offset = TEXT_VOCAB


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


def generate_reference(model: LlamaForCausalLM, trie: CatalogTrie, prompt: list[int], k: int,
                       excluded: list[int] | None = None) -> tuple[list[tuple[int, ...]], list[float]]:
    """transformers' own constrained beam search for one prompt (see recsvc.engine.reference)."""
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
