"""Named LLaMA shapes for the target and the drafter (gpt-fast style: a frozen dataclass + a dict).

| preset        | role    | hidden | layers | heads | ffn  | params (vocab 1,824) | where                       |
| ------------- | ------- | ------ | ------ | ----- | ---- | -------------------- | --------------------------- |
| tiny          | target  | 32     | 2      | 2     | 64   | 0.14M                | tests                       |
| mini          | target  | 128    | 4      | 4     | 512  | 1.5M                 | CPU, ~3x small's epochs     |
| small         | target  | 256    | 4      | 4     | 1024 | 5.1M                 | 2-core CPU, Beauty < 60 min |
| medium        | target  | 384    | 6      | 6     | 1024 | 12.0M                | CPU, the larger-target point |
| base          | target  | 1024   | 12     | 16    | 2816 | 158M                 | GPU                         |
| large         | target  | 2048   | 24     | 16    | 5632 | 1.24B                | GPU, AtSpeed's regime        |
| drafter-tiny  | drafter | 32     | 1      | 2     | 64   | 0.13M                | tests                       |
| drafter-small | drafter | 128    | 2      | 4     | 512  | 1.0M                 | CPU                         |
| llama-68m     | drafter | 768    | 2      | 12    | 3072 | 22M (68M at 32k vocab) | AtSpeed's drafter shape   |

``small`` was sized by timing training steps on the 2-core dev machine (AMD EPYC, AVX512-BF16, no AMX;
Beauty windows, batch 32, while another job kept one core busy): bf16 autocast ~3.9-4.0k tokens/s on one
thread (fp32: ~2.0k); an epoch of Beauty (1.94M tokens) then takes ~8 min, ~5 min with
``--window-stride 5`` (1.3M tokens), i.e. 6-9 epochs in 50 min. hidden 384 (10.8M) ran 3.8k tokens/s bf16
but 1.0k fp32 in the same conditions, too slow for the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from recsvc.errors import UserError

MAX_POSITIONS = 512


@dataclass(frozen=True)
class ModelPreset:
    name: str
    hidden: int  # d_model
    layers: int
    heads: int
    ffn: int  # intermediate size of the SwiGLU MLP
    kv_heads: int | None = None  # grouped-query attention; None = heads
    role: str = "target"  # "target" or "drafter"

    def params(self, vocab_size: int) -> int:
        """Parameter count (untied embeddings, RMSNorm weights included)."""
        head_dim = self.hidden // self.heads
        kv = (self.kv_heads or self.heads) * head_dim
        attn = self.hidden * self.hidden * 2 + self.hidden * kv * 2
        mlp = 3 * self.hidden * self.ffn
        return self.layers * (attn + mlp + 2 * self.hidden) + 2 * vocab_size * self.hidden + self.hidden


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("tiny", hidden=32, layers=2, heads=2, ffn=64),
        ModelPreset("mini", hidden=128, layers=4, heads=4, ffn=512),
        ModelPreset("small", hidden=256, layers=4, heads=4, ffn=1024),
        ModelPreset("medium", hidden=384, layers=6, heads=6, ffn=1024),
        ModelPreset("base", hidden=1024, layers=12, heads=16, ffn=2816),
        ModelPreset("large", hidden=2048, layers=24, heads=16, ffn=5632),
        ModelPreset("drafter-tiny", hidden=32, layers=1, heads=2, ffn=64, role="drafter"),
        ModelPreset("drafter-small", hidden=128, layers=2, heads=4, ffn=512, role="drafter"),
        ModelPreset("llama-68m", hidden=768, layers=2, heads=12, ffn=3072, role="drafter"),
    )
}
TARGET_PRESETS = tuple(n for n, p in PRESETS.items() if p.role == "target")
DRAFTER_PRESETS = tuple(n for n, p in PRESETS.items() if p.role == "drafter")


def get_preset(name: str | ModelPreset) -> ModelPreset:
    if isinstance(name, ModelPreset):
        return name
    if name not in PRESETS:
        raise UserError(f"unknown model preset {name!r}: expected one of {', '.join(PRESETS)}")
    return PRESETS[name]


def llama_config(
    preset: str | ModelPreset,
    vocab_size: int,
    bos_token_id: int | None,
    eos_token_id: int | None,
    pad_token_id: int | None,
):
    """A ``transformers.LlamaConfig`` of the preset's shape (untied embeddings, default RoPE, sdpa)."""
    from transformers import LlamaConfig

    p = get_preset(preset)
    if p.hidden % p.heads:
        raise UserError(f"preset {p.name}: hidden {p.hidden} is not divisible by {p.heads} heads")
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=p.hidden,
        intermediate_size=p.ffn,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads or p.heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        attention_dropout=0.0,
        rms_norm_eps=1e-6,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def new_model(preset: str | ModelPreset, tokenizer, seed: int | None = None):
    """A randomly initialised ``LlamaForCausalLM`` (fp32) for ``tokenizer``'s vocabulary."""
    import torch
    from transformers import LlamaForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    cfg = llama_config(preset, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id,
                       tokenizer.pad_token_id)
    return LlamaForCausalLM(cfg)
