"""Shared helpers for the model / training tests (no tests here): a small synthetic data set, random semantic
ids, our tokenizer. Kept tiny so every test runs in seconds on 2 shared cores."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recsvc.bundle.prompt import TEMPLATES
from recsvc.bundle.tokenizer import tokenizer_texts, train_tokenizer
from recsvc.data.split import load_split_dir
from tokenizer_rqvae.ids import SemanticIds
from training.data.synth import SynthConfig, write_synth

N_ITEMS = 60


def make_data(root: Path, n_users: int = 80, seed: int = 0) -> Path:
    """A synthetic split directory (training.data.synth) under ``root/data``."""
    out = root / "data"
    write_synth(out, SynthConfig(n_items=N_ITEMS, n_users=n_users, seed=seed, min_len=4, max_len=30))
    return out


def random_ids(item_ids: list[int], seed: int = 0, codebook: int = 256) -> SemanticIds:
    """Collision-free random 4-level ids for ``item_ids``."""
    rng = np.random.default_rng(seed)
    seen: set[tuple[int, ...]] = set()
    while len(seen) < len(item_ids):
        seen.add(tuple(int(x) for x in rng.integers(0, codebook, size=4)))
    order = rng.permutation(len(item_ids))
    codes = sorted(seen)
    return SemanticIds.from_mapping({int(item_ids[i]): codes[j] for j, i in enumerate(order)})


def write_ids(data_dir: Path, path: Path, seed: int = 0) -> Path:
    items = sorted(load_split_dir(data_dir).items)
    random_ids(items, seed).save(path)
    return path


def tiny_build_argv(tmp_path: Path) -> tuple[list[str], Path]:
    """(`recsvc build` argv, bundle dir): a one-epoch tiny target on 30 users, deploy protocol with a one-epoch
    scratch refit, chosen on Recall@10 of 10 users (the options' end-to-end tests add their flag)."""
    d = make_data(tmp_path, n_users=30)
    ids_path = write_ids(d, tmp_path / "ids.json")
    out = tmp_path / "bundle"
    return ["build", "--data", str(d), "--out", str(out), "--ids", str(ids_path), "--preset", "tiny",
            "--batch-size", "8", "--eval-users", "10", "--bf16", "off", "--protocol", "deploy", "--refit", "scratch",
            "--refit-epochs", "1", "--patience", "0", "--epochs", "1", "--recall-users", "10"], out


def small_tokenizer(texts: list[str] | None = None, vocab_size: int = 400):
    texts = texts or ["Lavender Shampoo by Acme, 12 oz", "Ruby Red Lipstick by Kirra, 0.1 oz"]
    return train_tokenizer(tokenizer_texts(texts, TEMPLATES, template_weight=20), vocab_size)


@pytest.fixture(scope="module", autouse=False)
def one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread avoids OpenMP barrier stalls when
    another process holds a core (measured: 2 threads ran 3x slower than 1 under such contention)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
