"""Model presets -> LlamaConfig."""

from __future__ import annotations

import pytest
from transformers import LlamaForCausalLM

from recsvc.bundle.presets import DRAFTER_PRESETS, PRESETS, TARGET_PRESETS, get_preset, llama_config
from recsvc.errors import UserError

VOCAB = 1824  # our tokenizer: ~800 text tokens + 1024 code tokens


@pytest.mark.parametrize("name", ["tiny", "drafter-tiny"])
def test_param_count_matches_transformers(name: str) -> None:
    cfg = llama_config(name, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == PRESETS[name].params(VOCAB)


def test_config_fields() -> None:
    cfg = llama_config("small", vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (256, 4, 4)
    assert cfg.max_position_embeddings == 512 and cfg.tie_word_embeddings is False
    assert cfg._attn_implementation == "sdpa" and cfg.pad_token_id == 0
    assert llama_config("tiny", VOCAB, 1, 2, 0).hidden_size == 32


def test_sizes_and_roles() -> None:
    assert set(TARGET_PRESETS) == {"tiny", "mini", "small", "medium", "base", "large"}
    sizes = [PRESETS[n].params(VOCAB) for n in ("mini", "small", "medium", "base", "large")]
    assert sizes == sorted(sizes)
    assert 1.1e9 < PRESETS["large"].params(VOCAB) < 1.3e9 and PRESETS["large"].layers == 24
    assert set(DRAFTER_PRESETS) == {"drafter-tiny", "drafter-small", "llama-68m"}
    assert 140e6 < PRESETS["base"].params(VOCAB) < 170e6
    m68 = PRESETS["llama-68m"]
    assert (m68.hidden, m68.layers, m68.heads, m68.ffn) == (768, 2, 12, 3072)


def test_unknown_preset() -> None:
    with pytest.raises(UserError, match="unknown model preset 'huge'"):
        get_preset("huge")
