"""Bundle layout, bundle.json stages, model save/load."""

from __future__ import annotations

import json

import pytest
import torch
from test_train_fixtures import random_ids, small_tokenizer

from recsvc.bundle.directory import Bundle
from recsvc.bundle.loading import load_causal_lm, save_causal_lm
from recsvc.bundle.presets import new_model
from recsvc.errors import UserError


def test_create_mark_done_reopen(tmp_path) -> None:
    b = Bundle.create(tmp_path / "b", data=tmp_path)
    meta = json.loads((tmp_path / "b" / "bundle.json").read_text())
    assert meta == {"version": 1, "data": str(tmp_path.resolve()), "stages": {}, "target_preset": None,
                    "drafter": None}
    assert not b.is_done("ids")
    b.mark_done("ids", seconds=1.5, items=3)
    again = Bundle.open(tmp_path / "b")
    assert again.is_done("ids") and again.stage_info("ids")["seconds"] == 1.5
    assert again.data_dir() == tmp_path.resolve()
    assert again.ids_dir == tmp_path / "b" / "ids" and again.target_dir.name == "target"
    b.clear_stage("ids")
    assert not b.is_done("ids")
    with pytest.raises(UserError, match="was built from"):
        Bundle.create(tmp_path / "b", data=tmp_path / "other")


def test_errors(tmp_path) -> None:
    with pytest.raises(UserError, match="not a bundle: .* has no bundle.json"):
        Bundle.open(tmp_path)
    (tmp_path / "bundle.json").write_text('{"version": 7}')
    with pytest.raises(UserError, match="unsupported bundle version"):
        Bundle.open(tmp_path)
    b = Bundle.create(tmp_path / "c")
    with pytest.raises(UserError, match="no semantic ids"):
        b.load_ids()
    with pytest.raises(UserError, match="no tokenizer"):
        b.load_tokenizer()
    with pytest.raises(UserError, match="no model"):
        load_causal_lm(tmp_path / "nothing")


def test_ids_tokenizer_model_roundtrip(tmp_path) -> None:
    b = Bundle.create(tmp_path)
    ids = random_ids([1, 2, 3], seed=0)
    b.ids_dir.mkdir()
    ids.save(b.semantic_ids_path)
    assert b.load_ids().codes_of(2) == ids.codes_of(2)
    tok = small_tokenizer()
    tok.save_pretrained(b.tokenizer_dir)
    assert len(b.load_tokenizer()) == len(tok)
    model = new_model("tiny", tok, seed=0).eval()
    save_causal_lm(model, b.target_dir)
    assert (b.target_dir / "model.safetensors").is_file()
    x = torch.tensor([[1, 5, 9, len(tok) - 1]])
    fp32 = b.load_target(dtype="fp32")
    assert not fp32.training and fp32.dtype == torch.float32
    torch.testing.assert_close(fp32(x).logits, model(x).logits, rtol=0, atol=1e-6)
    assert b.load_target(dtype="bf16").dtype == torch.bfloat16
    with pytest.raises(UserError, match="unknown dtype"):
        load_causal_lm(b.target_dir, dtype="int3")
