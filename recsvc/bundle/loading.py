"""Load / save causal LMs as safetensors (never pickles)."""

from __future__ import annotations

from pathlib import Path

from recsvc.errors import UserError

PRECISIONS = ("auto", "bf16", "fp32")  # what a command's --dtype offers; auto: bf16 where the hardware has it
DTYPES = (*PRECISIONS, "fp16")  # what loading accepts


def torch_dtype(name: str, device: str = "cpu"):
    import torch

    from recsvc.hardware import resolve_dtype

    name = resolve_dtype(name, device)
    table = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    if name not in table:
        raise UserError(f"unknown dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return table[name]


def load_causal_lm(path: str | Path, dtype: str = "auto", device: str = "cpu"):
    """``AutoModelForCausalLM.from_pretrained(path)`` from safetensors, in eval mode, sdpa attention."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"no model in {path} (expected config.json + model.safetensors)")
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch_dtype(dtype, device), use_safetensors=True, attn_implementation="sdpa"
    )
    return model.to(device).eval()


def save_causal_lm(model, path: str | Path) -> Path:
    """``model.save_pretrained(path, safe_serialization=True)``; returns the directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    return path
