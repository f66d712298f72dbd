"""The recommender's tokenizer: a small byte-level BPE for the prompt text + 1024 code tokens.

Two ways to get one (both return a ``transformers.PreTrainedTokenizerFast``, saved with ``save_pretrained``
and loaded with ``AutoTokenizer.from_pretrained``):

- ``train_tokenizer(texts)``: our own byte-level BPE (``tokenizers`` library) trained on the prompt templates
  and the item texts, ~800 text tokens (the model is small; the prompt text is a fixed template), plus the
  specials ``<s> </s> <pad> <unk>``.
- ``from_base_model(path)``: the tokenizer of a local pretrained LLaMA-family checkpoint (LoRA fine-tuning).

Either way the 4 x 256 code tokens are then added **level-major**, so their ids are contiguous::

    id("<a_0>") == offset, id("<b_0>") == offset + 256, id("<d_255>") == offset + 1023
    id(code_token(level, code)) == offset + level * 256 + code

``code_token_offset(tok)`` returns ``offset`` and checks that layout (the engine relies on it to slice the
logits of a level: ``logits[..., offset + level*256 : offset + (level+1)*256]``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from recsvc.errors import UserError
from tokenizer_rqvae.ids import CODEBOOK_SIZE, LEVELS, all_code_tokens

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]  # ids 0..3 in our own tokenizer
DEFAULT_TEXT_VOCAB = 800  # text part, byte alphabet (256) + specials included


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_TEXT_VOCAB, add_codes: bool = True):
    """Train a byte-level BPE on ``texts`` (+ the code tokens unless ``add_codes=False``).

    Returns a PreTrainedTokenizerFast; the text part may end below ``vocab_size`` on a small corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise UserError(f"text vocabulary size must be >= 300 (byte alphabet + merges), got {vocab_size}")
    core = Tokenizer(models.BPE(unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )
    if add_codes:
        add_code_tokens(tok)
    return tok


def from_base_model(path: str | Path):
    """The tokenizer of a local pretrained checkpoint + code tokens (pad falls back to unk, then eos)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise UserError(f"base model directory not found: {path}")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load a tokenizer from {path}: {exc}") from exc
    if not getattr(tok, "is_fast", False):
        raise UserError(f"{path}: a fast tokenizer (tokenizer.json) is required")
    if tok.pad_token is None:
        tok.pad_token = tok.unk_token if tok.unk_token is not None else tok.eos_token
    if tok.convert_tokens_to_ids("<a_0>") not in (None, tok.unk_token_id):
        code_token_offset(tok)  # already has the code tokens: just check them
        return tok
    add_code_tokens(tok)
    return tok


def add_code_tokens(tok) -> int:
    """Append ``<a_0>..<d_255>`` in level-major order as single, non-special tokens; returns the offset."""
    from tokenizers import AddedToken

    tokens = all_code_tokens()
    present = [t for t in tokens if t in tok.get_vocab()]
    if present:
        raise UserError(f"tokenizer already contains code tokens (e.g. {present[0]}); cannot add them again")
    tok.add_tokens([AddedToken(t, single_word=False, lstrip=False, rstrip=False, normalized=False)
                    for t in tokens])
    return code_token_offset(tok)


def code_token_offset(tok) -> int:
    """Id of ``<a_0>``; raises UserError unless all 1024 code tokens have contiguous level-major ids."""
    tokens = all_code_tokens()
    ids = tok.convert_tokens_to_ids(tokens)
    offset = ids[0]
    if offset is None or offset == tok.unk_token_id:
        raise UserError("tokenizer has no code tokens (<a_0> is unknown)")
    expected = list(range(offset, offset + LEVELS * CODEBOOK_SIZE))
    if ids != expected:
        bad = next(t for t, i, e in zip(tokens, ids, expected, strict=True) if i != e)
        raise UserError(f"code token ids are not contiguous level-major from {offset}: {bad} has id "
                        f"{tok.convert_tokens_to_ids(bad)}")
    return int(offset)


def load_tokenizer(path: str | Path):
    """``AutoTokenizer.from_pretrained(path)`` with the code-token layout checked."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer_config.json").is_file():
        raise UserError(f"no tokenizer in {path} (expected tokenizer_config.json)")
    tok = AutoTokenizer.from_pretrained(str(path))
    code_token_offset(tok)
    return tok


def tokenizer_texts(item_texts: Iterable[str], templates: Iterable[str], template_weight: int = 200):
    """Training corpus: the prompt templates (repeated, so their words become single tokens) + item texts."""
    templates = list(templates)
    for _ in range(template_weight):
        yield from templates
    yield from item_texts
