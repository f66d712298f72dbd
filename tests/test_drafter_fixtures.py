"""Shared helpers for the drafter-alignment tests (no tests here): a tiny bundle with a random tiny target and
drafter on the synthetic data set, teacher data, and the drafter's per-sequence reference distributions."""

from __future__ import annotations

from pathlib import Path

import torch
from test_train_fixtures import make_data, small_tokenizer, write_ids

from recsvc.bundle.directory import Bundle
from recsvc.bundle.loading import save_causal_lm
from recsvc.bundle.presets import new_model
from recsvc.bundle.serving_files import write_serving_files
from recsvc.data.split import load_split_dir


def tiny_bundle(root: Path, n_users: int = 40) -> Path:
    """BUNDLE with ids, tokenizer, a random "tiny" target and a random "drafter-tiny" drafter."""
    data = make_data(root, n_users=n_users)
    bundle = Bundle.create(root / "b", data=data)
    bundle.ids_dir.mkdir(parents=True, exist_ok=True)
    write_ids(data, bundle.semantic_ids_path)
    tok = small_tokenizer()
    tok.save_pretrained(str(bundle.tokenizer_dir))
    save_causal_lm(new_model("tiny", tok, seed=0), bundle.target_dir)
    save_causal_lm(new_model("drafter-tiny", tok, seed=1), bundle.drafter_dir)
    for stage in ("ids", "tokenizer", "target", "drafter"):
        bundle.mark_done(stage)
    write_serving_files(bundle.root, load_split_dir(data))  # as `recsvc build` does
    return bundle.root


def forced_code_logprobs(model, prompt: list[int], codes: list[int], code_offset: int) -> torch.Tensor:
    """Reference: one plain causal forward over prompt + the 4 code tokens -> [4, 256] log-probs of each
    position's level (full-vocabulary log_softmax, sliced)."""
    toks = prompt + [code_offset + level * 256 + int(c) for level, c in enumerate(codes)]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([toks])).logits[0].float(), -1)
    t = len(prompt)
    return torch.stack([logp[t - 1 + lv, code_offset + lv * 256 : code_offset + (lv + 1) * 256]
                        for lv in range(len(codes))])
