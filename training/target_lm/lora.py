"""LoRA fine-tuning of a local pretrained LLaMA-family checkpoint (LC-Rec's recipe, fixed).

``load_base_model`` loads the checkpoint and grows its embeddings for the 1024 code tokens; ``wrap_lora``
adds LoRA adapters AND trains full copies of ``embed_tokens`` / ``lm_head`` (peft ``modules_to_save``) —
the new code-token rows must be learnt (the AtSpeed reference code never trains them).
``merge_lora`` folds the adapters in, giving a plain ``LlamaForCausalLM`` that the engine loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from recsvc.errors import UserError


@dataclass(frozen=True)
class LoraSettings:
    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    modules_to_save: tuple[str, ...] = field(default=("embed_tokens", "lm_head"))


def parse_targets(text: str) -> tuple[str, ...]:
    """``"q_proj, v_proj" -> ("q_proj", "v_proj")``."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if not names:
        raise UserError("--lora-targets needs at least one module name (e.g. q_proj,v_proj)")
    return names


def load_base_model(path: str | Path, tokenizer, dtype: str = "fp32"):
    """Pretrained causal LM from ``path`` with embeddings resized to ``len(tokenizer)`` (new rows: mean init)."""
    from transformers import AutoModelForCausalLM

    from recsvc.bundle.loading import torch_dtype

    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"no pretrained model in {path} (expected config.json)")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype), attn_implementation="sdpa")
    old = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > old:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is not None and out.weight is inp.weight:
        # untie: embed_tokens and lm_head are trained as separate copies (modules_to_save), saved separately
        import torch

        out.weight = torch.nn.Parameter(inp.weight.detach().clone())
    model.config.tie_word_embeddings = False
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tokenizer, name) is not None:
            setattr(model.config, name, getattr(tokenizer, name))
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def wrap_lora(model, settings: LoraSettings):
    """A peft model: LoRA on ``settings.targets``, full training of embed_tokens / lm_head."""
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in (*settings.targets, *settings.modules_to_save) if t not in names]
    if missing:
        raise UserError(f"model has no modules named {', '.join(missing)} (LoRA targets / modules to save)")
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.targets),
        modules_to_save=list(settings.modules_to_save),
        task_type="CAUSAL_LM",
        bias="none",
    )
    return get_peft_model(model, config)


def merge_lora(model):
    """Fold the adapters (and the trained embed/lm_head copies) into a plain transformers model."""
    return model.merge_and_unload()


def is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)
