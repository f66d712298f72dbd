"""LoRA on a local "pretrained" LLaMA: code-token rows and adapters train; merge/save/load keeps the logits."""

from __future__ import annotations

import pytest
import torch
from test_train_fixtures import one_thread, random_ids  # noqa: F401 (one_thread: a fixture)
from transformers import LlamaConfig, LlamaForCausalLM

from recsvc.bundle.loading import load_causal_lm, save_causal_lm
from recsvc.bundle.prompt import PromptBuilder
from recsvc.bundle.tokenizer import code_token_offset, from_base_model, train_tokenizer
from training.target_lm.lora import LoraSettings, is_peft, load_base_model, merge_lora, wrap_lora
from training.target_lm.sequences import train_examples
from training.target_lm.train import TrainConfig, fit_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")


def make_pretrained(path) -> None:
    """A tiny LLaMA checkpoint + its own tokenizer (no code tokens), tied embeddings like many small LMs."""
    texts = ["the user bought a lavender shampoo", "predict the next item", "### Response:"] * 20
    tok = train_tokenizer(texts, vocab_size=300, add_codes=False)
    tok.save_pretrained(path)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)


def test_lora_trains_codes_and_merge_roundtrip(tmp_path) -> None:
    make_pretrained(tmp_path / "base")
    tok = from_base_model(tmp_path / "base")
    off = code_token_offset(tok)
    model = load_base_model(tmp_path / "base", tok)
    assert model.get_input_embeddings().weight.shape[0] == len(tok) == off + 1024
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()  # untied
    emb0 = model.get_input_embeddings().weight.detach().clone()
    head0 = model.lm_head.weight.detach().clone()
    q0 = model.model.layers[0].self_attn.q_proj.weight.detach().clone()

    peft_model = wrap_lora(model, LoraSettings(r=4, alpha=8, dropout=0.0, targets=("q_proj", "v_proj")))
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any("modules_to_save" in n for n in trainable)
    assert not any("q_proj.base_layer" in n for n in trainable)

    ids = random_ids(list(range(1, 21)), seed=4)
    builder = PromptBuilder(tok, ids, max_history=4)
    seqs = {u: [(u * 3 + j) % 20 + 1 for j in range(6)] for u in range(1, 13)}
    train = train_examples(builder, seqs)
    cfg = TrainConfig(epochs=1, batch_size=4, lr=1e-2, patience=0, seed=0)
    best, _ = fit_causal_lm(peft_model, train, train[:4], cfg, tmp_path / "ckpt", tok.pad_token_id)
    assert is_peft(best)

    base = best.get_base_model()
    emb = base.get_input_embeddings().modules_to_save["default"].weight.detach()
    head = base.lm_head.modules_to_save["default"].weight.detach()
    assert not torch.allclose(emb[off:off + 1024], emb0[off:off + 1024])  # code-token rows learnt
    assert not torch.allclose(head[off:off + 1024], head0[off:off + 1024])
    lora_b = base.model.layers[0].self_attn.q_proj.lora_B["default"].weight
    assert float(lora_b.detach().abs().sum()) > 0  # lora_B starts at zero
    torch.testing.assert_close(base.model.layers[0].self_attn.q_proj.base_layer.weight, q0)  # frozen

    x = torch.tensor([builder.prompt_ids([1, 2, 3]) + builder.item_token_ids(4)])
    with torch.no_grad():
        ref = best(input_ids=x).logits
        merged = merge_lora(best)
        assert not is_peft(merged)
        torch.testing.assert_close(merged(input_ids=x).logits, ref, rtol=0, atol=1e-5)
        save_causal_lm(merged, tmp_path / "out")
        loaded = load_causal_lm(tmp_path / "out", dtype="fp32")
        torch.testing.assert_close(loaded(input_ids=x).logits, ref, rtol=0, atol=1e-5)
    assert not loaded.config.tie_word_embeddings
