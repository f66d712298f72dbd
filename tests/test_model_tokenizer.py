"""The tokenizer: small BPE text part + 1024 contiguous level-major code tokens."""

from __future__ import annotations

import pytest
from test_train_fixtures import small_tokenizer
from transformers import AutoTokenizer

from recsvc.bundle.tokenizer import add_code_tokens, code_token_offset, from_base_model, load_tokenizer
from recsvc.errors import UserError
from tokenizer_rqvae.ids import all_code_tokens, code_token


@pytest.fixture(scope="module")
def tok():
    return small_tokenizer()


def test_code_tokens_are_contiguous_level_major(tok) -> None:
    off = code_token_offset(tok)
    assert 256 < off <= 400  # text vocab (bytes + merges, at most 400) first, codes after it
    for level, code in [(0, 0), (0, 255), (1, 0), (2, 17), (3, 255)]:
        assert tok.convert_tokens_to_ids(code_token(level, code)) == off + level * 256 + code
    assert len(tok) == off + 1024


def test_code_tokens_are_single_tokens_and_decode(tok) -> None:
    ids = tok.encode("<a_3><b_200><c_0><d_255>", add_special_tokens=False)
    off = code_token_offset(tok)
    assert ids == [off + 3, off + 256 + 200, off + 512, off + 768 + 255]
    assert tok.decode(ids) == "<a_3><b_200><c_0><d_255>"


def test_specials(tok) -> None:
    assert tok.pad_token == "<pad>" and tok.bos_token == "<s>" and tok.eos_token == "</s>"
    assert tok.unk_token == "<unk>"
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}) == 4


def test_save_load_roundtrip(tok, tmp_path) -> None:
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    text = "### Response:\nLavender Shampoo <a_5><b_6>"
    assert again.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert code_token_offset(again) == code_token_offset(tok)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token_id == tok.pad_token_id


def test_offset_rejects_non_contiguous_and_missing(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"<unk>": 0, "x": 1}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    bare = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    with pytest.raises(UserError, match="no code tokens"):
        code_token_offset(bare)
    shuffled = all_code_tokens()
    shuffled[0], shuffled[1] = shuffled[1], shuffled[0]  # <a_1> before <a_0>
    bare.add_tokens(shuffled)
    with pytest.raises(UserError, match="not contiguous"):
        code_token_offset(bare)
    with pytest.raises(UserError, match="already contains"):
        add_code_tokens(bare)
    with pytest.raises(UserError, match="no tokenizer"):
        load_tokenizer(tmp_path / "missing")


def test_from_base_model_adds_codes_and_pad(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate("the user item next".split())}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    base = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    base.save_pretrained(tmp_path)
    tok = from_base_model(tmp_path)
    assert code_token_offset(tok) == len(vocab)
    assert tok.pad_token_id == 0  # falls back to unk, as LC-Rec does
    with pytest.raises(UserError, match="not found"):
        from_base_model(tmp_path / "nope")
