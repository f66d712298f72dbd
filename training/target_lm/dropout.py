"""Dropout for training the target (``recsvc build --dropout P``).

transformers' LLaMA has no dropout but on the attention probabilities; a small recommender trained for several
epochs on one catalog memorises it, and the sequential recommenders it is compared with train with dropout
(SASRec: on the item embeddings and every block's output). ``TrainingDropout`` adds the original Transformer's
two: on the token embeddings, and on each sub-layer's output (self-attention, MLP) before it joins the residual
stream. It is registered with forward hooks, so the saved model is a plain ``LlamaForCausalLM`` that the engine
serves unchanged, and it is active only in ``model.train()`` mode (validation and serving run without it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from recsvc.errors import UserError


def check_rate(p: float) -> float:
    """``p`` when it lies in [0, 1); a UserError naming ``--dropout`` otherwise."""
    if not 0.0 <= p < 1.0:
        raise UserError(f"--dropout must lie in [0, 1), not {p}")
    return p


@dataclass
class TrainingDropout:
    """Dropout at rate ``p`` on ``model``'s embeddings and every layer's attention and MLP outputs while training.

    ``handles``: the hooks it registered (``remove()``, or leaving its ``with`` block, takes them off)."""

    p: float
    handles: list = field(default_factory=list)

    @classmethod
    def attach(cls, model, p: float) -> TrainingDropout:
        """Hooks on ``model`` (a ``LlamaForCausalLM``, or a peft model around one); ``p`` in [0, 1)."""
        out = cls(check_rate(p))
        if p == 0.0:
            return out
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        decoder = base.model
        out.handles.append(decoder.embed_tokens.register_forward_hook(out._drop))
        for layer in decoder.layers:
            out.handles.append(layer.self_attn.register_forward_hook(out._drop))
            out.handles.append(layer.mlp.register_forward_hook(out._drop))
        return out

    def _drop(self, module: torch.nn.Module, args, output):
        """[B, T, H] (or (attn_output [B, T, H], weights)) -> the same with dropout while ``module`` trains."""
        if not module.training:
            return output
        if isinstance(output, tuple):
            return (F.dropout(output[0], self.p, training=True), *output[1:])
        return F.dropout(output, self.p, training=True)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def __enter__(self) -> TrainingDropout:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
