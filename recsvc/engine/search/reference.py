"""transformers' own constrained beam search: the reference the engine is tested and benchmarked against.

``generate(num_beams=K, num_return_sequences=K, prefix_allowed_tokens_fn=<the trie>)`` with exactly L new
tokens. Its per-beam Python callback and full-vocabulary processing are what the engine avoids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from tokenizer_rqvae.trie import CatalogTrie


@torch.inference_mode()
def generate_topk(model: PreTrainedModel, trie: CatalogTrie, code_offset: int, prompt: Sequence[int], k: int,
                  excluded: Sequence[int] | None = None) -> tuple[list[tuple[int, ...]], list[float]]:
    """One prompt -> (codes of the K ids best first, their summed log-probs)."""
    c, levels = trie.codebook_size, trie.levels
    dead_row = trie.dead_nodes([excluded])[0] if excluded else None
    n_prompt = len(prompt)

    def allowed(batch_id: int, input_ids: torch.Tensor) -> list[int]:
        gen = input_ids[n_prompt:].tolist()
        prefix = [t - code_offset - lv * c for lv, t in enumerate(gen)]
        return [code_offset + len(prefix) * c + x for x in trie.allowed_codes(prefix, dead_row)]

    ids = torch.tensor([list(prompt)], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=k, num_return_sequences=k,
                         max_new_tokens=levels, min_new_tokens=levels, do_sample=False,
                         prefix_allowed_tokens_fn=allowed, output_scores=True, output_logits=True,
                         return_dict_in_generate=True, length_penalty=1.0, pad_token_id=0, eos_token_id=None)
    seqs = out.sequences[:, n_prompt:].tolist()
    codes = [tuple(t - code_offset - lv * c for lv, t in enumerate(s)) for s in seqs]
    if k == 1:  # greedy search: no beam scores; sum the chosen tokens' full-vocabulary log-probs
        chosen = out.sequences[0, n_prompt:]
        steps = [torch.log_softmax(lg.float(), -1)[0, t] for lg, t in zip(out.logits, chosen, strict=True)]
        return codes, [float(sum(steps))]
    return codes, (out.sequences_scores * levels).tolist()  # undo the length penalty (length = L)
