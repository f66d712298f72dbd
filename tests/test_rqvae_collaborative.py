"""LETTER-style collaborative regularisation of the RQ-VAE: the CF file's loading, the contrastive term, and that
it moves items a SASRec embeds together under one first code, which text alone does not."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from recsvc.cli.main import main
from recsvc.errors import UserError
from tokenizer_rqvae.collaborative import cf_alignment_loss, load_cf_embeddings
from tokenizer_rqvae.rqvae import RQVAEConfig, train_rqvae


def _sasrec_file(path: Path, item_ids: list[int], table: np.ndarray, counts: list[int] | None = None) -> Path:
    """A file in recsvc's SASRec format: item_ids [m], model.item_emb.weight [m + 1, d] (row 0 padding),
    item_counts [m] (interactions in its period)."""
    full = np.concatenate([np.zeros((1, table.shape[1]), np.float32), table.astype(np.float32)])
    tensors = {"item_ids": np.asarray(item_ids, np.int64), "model.item_emb.weight": full}
    if counts is not None:
        tensors["item_counts"] = np.asarray(counts, np.float32)
    save_file(tensors, str(path))
    return path


def test_load_aligns_rows_reduces_and_marks_unknown_items(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    table = rng.normal(size=(5, 6)).astype(np.float32)  # SASRec rows of items 10, 11, 12, 13, 14
    path = _sasrec_file(tmp_path / "s.safetensors", [10, 11, 12, 13, 14, 15], np.concatenate([table, table[:1]]),
                        counts=[3, 1, 2, 1, 5, 0])  # 15: a row, but no interaction in the SASRec's period
    emb, has = load_cf_embeddings(path, np.array([14, 99, 10, 12, 15]), dim=3)  # 99: not in the SASRec at all
    assert emb.shape == (5, 3) and has.tolist() == [True, False, True, True, False] and not emb[4].any()
    emb, has = emb[:4], has[:4]
    assert np.allclose(np.linalg.norm(emb[has], axis=1), 1.0, atol=1e-5) and not emb[1].any()
    # PCA keeps the geometry of the known items: their cosine order agrees with the centred table's projections
    known = table[[4, 0, 2]] - table[[4, 0, 2]].mean(0)
    _, _, vt = np.linalg.svd(known, full_matrices=False)
    ref = known @ vt[:3].T
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    assert np.allclose(emb[has], ref, atol=1e-5)


def test_load_rejects_bad_files(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        load_cf_embeddings(tmp_path / "none.safetensors", np.array([1]), 2)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="not a safetensors"):
        load_cf_embeddings(tmp_path / "junk.safetensors", np.array([1]), 2)
    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(UserError, match="no SASRec item table"):
        load_cf_embeddings(tmp_path / "other.safetensors", np.array([1]), 2)
    path = _sasrec_file(tmp_path / "s.safetensors", [1, 2], np.ones((2, 4), np.float32))
    with pytest.raises(UserError, match="knows 0"):
        load_cf_embeddings(path, np.array([7, 8]), 2)


def test_contrastive_term_prefers_aligned_pairs_and_needs_two_items() -> None:
    torch.manual_seed(0)
    cf = torch.nn.functional.normalize(torch.randn(8, 4), dim=1)
    has = torch.ones(8, dtype=torch.bool)
    aligned = cf_alignment_loss(cf * 3.0, cf, has, 0.1)  # the latent's scale does not matter (normalised)
    shuffled = cf_alignment_loss(cf[torch.randperm(8)], cf, has, 0.1)
    assert float(aligned) < 0.5 < float(shuffled)
    one = torch.zeros(8, dtype=torch.bool)
    one[3] = True
    assert float(cf_alignment_loss(cf, cf, one, 0.1)) == 0.0


def _crossed_data(n: int = 256) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Text: two far clusters (by item parity) and a faint second direction that tells the CF groups apart (first
    half vs second half), which cross the clusters."""
    rng = np.random.default_rng(1)
    text_centres = rng.normal(size=(2, 16))
    faint = rng.normal(size=(2, 16)) * 0.6
    parity = np.arange(n) % 2
    group = (np.arange(n) >= n // 2).astype(int)
    x = text_centres[parity] + faint[group] + 0.2 * rng.normal(size=(n, 16))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    cf = np.zeros((n, 4), np.float32)
    cf[np.arange(n), group] = 1.0  # unit vectors: group 0 -> e0, group 1 -> e1
    return x, cf, group


def _purity(codes: np.ndarray, group: np.ndarray) -> float:
    """Share of items whose first code's majority CF group is their own."""
    hits = 0
    for c in np.unique(codes[:, 0]):
        g = group[codes[:, 0] == c]
        hits += max(int((g == 0).sum()), int((g == 1).sum()))
    return hits / len(group)


def test_collaborative_term_groups_cf_neighbours_under_one_first_code() -> None:
    x, cf, group = _crossed_data()
    cfg = RQVAEConfig(in_dim=16, hidden_dims=(32,), latent_dim=4, levels=2, codebook_size=2, batch_size=64,
                      epochs=40, kmeans_iters=5, precision="fp32", reseed_dead=True)
    has = np.ones(len(x), dtype=bool)
    text_only = train_rqvae(x, cfg, progress=False).model.encode(x).codes
    with_cf = train_rqvae(x, replace(cfg, cf_weight=5.0), progress=False, cf=(cf, has))
    codes = with_cf.model.encode(x).codes
    assert _purity(text_only, group) < 0.6  # text clusters cross the CF groups: a coin flip
    assert _purity(codes, group) > 0.9
    assert with_cf.history[-1]["cf"] < with_cf.history[0]["cf"]


def test_mismatched_cf_shapes_are_a_user_error() -> None:
    x, cf, _ = _crossed_data(32)
    cfg = RQVAEConfig(in_dim=16, hidden_dims=(32,), latent_dim=4, levels=2, codebook_size=2, epochs=1,
                      precision="fp32", cf_weight=1.0)
    with pytest.raises(UserError, match="CF embeddings"):
        train_rqvae(x, cfg, progress=False, cf=(cf[:10], np.ones(10, bool)))


def test_cli_needs_embeddings_for_a_cf_weight(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "items.json").write_text("{}")
    assert main(["tokenizer", "build", "--data", str(tmp_path), "--out", str(tmp_path / "o"),
                 "--cf-weight", "0.5"]) == 2
    assert "--cf-weight needs --cf-embeddings" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["tokenizer", "build", "--data", str(tmp_path), "--out", str(tmp_path / "o"), "--cf-weight", "-1"])
    assert exc.value.code == 2


def test_train_sasrec_feeds_a_cf_regularised_build(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`recsvc train sasrec` writes a file `tokenizer build --cf-embeddings` reads; the build records it."""
    from test_rqvae_build import HashEmbedder
    from test_train_fixtures import make_data

    from tokenizer_rqvae.build import build_semantic_ids

    data = make_data(tmp_path, n_users=40)
    out = tmp_path / "sasrec"
    argv = ["train", "sasrec", "--data", str(data), "--out", str(out), "--max-minutes", "0.02", "--threads", "1",
            "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["fit_on"] == "train"
    cfg = RQVAEConfig(hidden_dims=(64,), latent_dim=8, levels=3, codebook_size=8, epochs=3, batch_size=32,
                      precision="fp32", cf_weight=0.5)
    report = build_semantic_ids(data, tmp_path / "ids", cfg, embedder=HashEmbedder(cache_dir=tmp_path / "emb",
                                progress=False), progress=False, known_through="train",
                                cf_embeddings=out / "model.safetensors")
    assert report["collisions_after"] == 0 and report["cf_embeddings"]["items"] == report["fit_items"]
    assert "cf" in report["final_epoch"]
    assert main(["train", "sasrec", "--data", str(tmp_path / "none"), "--out", str(out)]) == 2
    assert "data directory not found" in capsys.readouterr().err
