"""The engine on a CUDA GPU: bf16 weights and an optional compiled (CUDA-graph) scoring step.

On CUDA the bundle's models load in bf16 (``--dtype auto``: ``recsvc.hardware.resolve_dtype``), the trie,
prompts, exclusions and priors are moved to the model's device once per search, and every tensor of the
searches is made there (``tests/test_device_clean.py`` keeps it so). ``compile_scoring`` is the optional
``torch.compile(mode="reduce-overhead")`` path: it captures the step every decode step and every verification
runs on its hidden states, the LM head + full-vocabulary log_softmax + the level's code slice
(``EngineModel.code_logprobs``), as CUDA graphs (one per shape seen). The transformer layers are not captured:
their tree attention gathers a data-dependent key set per token. It is refused off CUDA (on a CPU the eager
path is the exact, tested one).
"""

from __future__ import annotations

import torch

from recsvc.engine.engine_model import EngineModel
from recsvc.errors import UserError


def _scores(hidden: torch.Tensor, weight: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[M, H] hidden states, [V, H] LM head, [M, C] token ids -> [M, C] float32 log-probs (``code_logprobs``)."""
    logits = torch.nn.functional.linear(hidden, weight).float()
    return torch.log_softmax(logits, dim=-1).gather(1, cols)


def compile_scoring(model: EngineModel) -> EngineModel:
    """Route ``model.code_logprobs`` through a ``torch.compile(mode="reduce-overhead")`` copy of its arithmetic
    (the same ops; outputs cloned, since a CUDA graph's output buffer is reused by its next replay). CUDA only."""
    if model.device.type != "cuda":
        raise UserError(f"compiled decoding needs a CUDA device; the model is on {model.device}")
    weight = model.model.get_output_embeddings().weight.detach()
    compiled = torch.compile(_scores, mode="reduce-overhead", dynamic=False)

    def code_logprobs(hidden: torch.Tensor, level: torch.Tensor, code_offset: int, codebook_size: int
                      ) -> torch.Tensor:  # [M, H], [M] -> [M, C]
        cols = code_offset + level[:, None] * codebook_size + torch.arange(codebook_size, device=hidden.device)
        return compiled(hidden, weight, cols).clone()

    model.code_logprobs = code_logprobs  # type: ignore[method-assign]  # this EngineModel only
    model.compiled = True  # type: ignore[attr-defined]
    return model
