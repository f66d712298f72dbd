"""RQ-VAE: shapes, loss, k-means init, dead-code re-seeding, Sinkhorn, safetensors save/load, resume."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from recsvc.errors import UserError
from tokenizer_rqvae.kmeans import kmeans
from tokenizer_rqvae.rqvae import (
    CKPT_JSON,
    RQVAE,
    RQVAEConfig,
    load_rqvae,
    save_rqvae,
    sinkhorn,
    sq_dists,
    train_rqvae,
)

TINY = RQVAEConfig(in_dim=16, hidden_dims=(32, 16), latent_dim=4, levels=3, codebook_size=8, batch_size=64,
                   epochs=3, checkpoint_every=1, kmeans_iters=5, input_scale=4.0)


def _data(n: int = 200, dim: int = 16, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(10, dim))
    x = centers[rng.integers(0, 10, n)] + 0.3 * rng.normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)  # [n, dim], like embeddings


def test_forward_backward_shapes_and_gradients() -> None:
    torch.manual_seed(0)
    model = RQVAE(TINY)
    x = torch.from_numpy(_data(32))  # [32, 16]
    x_hat, q = model(x)
    assert x_hat.shape == (32, 16)
    assert q.codes.shape == (32, 3) and q.codes.dtype == torch.int64
    assert q.residuals.shape == (32, 3, 4)
    assert int(q.codes.max()) < 8
    loss = ((x_hat - x) ** 2).mean() + q.quant_loss
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert float(model.encoder[0].weight.grad.abs().sum()) > 0  # straight-through reaches the encoder
    assert float(model.codebooks.grad.abs().sum()) > 0  # codebook loss reaches the codes


def test_straight_through_forward_value_is_quantized() -> None:
    model = RQVAE(TINY)
    z = torch.randn(5, 4)
    q = model.quantize(z)
    manual = sum(model.codebooks[lv][q.codes[:, lv]] for lv in range(3))
    torch.testing.assert_close(q.z_q, manual)


def test_training_decreases_loss_and_keeps_codes_alive() -> None:
    res = train_rqvae(_data(), replace(TINY, epochs=15), progress=False)
    first, last = res.history[0], res.history[-1]
    assert last["loss"] < first["loss"]
    assert last["recon"] < first["recon"]
    assert res.epochs_run == 15 and len(res.history) == 15
    enc = res.model.encode(_data())
    assert enc.codes.shape == (200, 3) and enc.dists.shape == (200, 3, 8) and enc.residuals.shape == (200, 3, 4)
    assert len(np.unique(enc.codes[:, 0])) >= 7  # k-means init + re-seeding: (almost) all level-1 codes used
    # the reported distances are those of the residuals to each codebook, and codes are their argmin
    np.testing.assert_array_equal(enc.dists.argmin(-1), enc.codes)


def test_kmeans_shapes_determinism_and_small_n() -> None:
    x = _data(300, 8)
    a, b = kmeans(x, 16, niter=5, seed=3), kmeans(x, 16, niter=5, seed=3)
    assert a.shape == (16, 8) and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    small = kmeans(x[:5], 16, seed=0)  # n < k: the points + noisy copies
    assert small.shape == (16, 8)
    np.testing.assert_array_equal(small[:5], x[:5])
    assert len(np.unique(small, axis=0)) == 16
    same = kmeans(np.repeat(x[:1], 100, axis=0), 4, seed=0)  # identical points: no NaN, distinct centroids
    assert np.isfinite(same).all() and len(np.unique(same, axis=0)) == 4


def test_codebooks_initialised_by_kmeans_of_residuals() -> None:
    torch.manual_seed(0)
    model = RQVAE(TINY)
    x = torch.from_numpy(_data()) * TINY.input_scale
    model.init_codebooks(x, seed=0)
    with torch.no_grad():
        z = model.encoder(x)
    expected = kmeans(z.numpy(), 8, niter=TINY.kmeans_iters, seed=0)
    np.testing.assert_allclose(model.codebooks[0].detach().numpy(), expected, rtol=1e-5, atol=1e-6)
    used = sq_dists(z, model.codebooks[0]).argmin(1).unique().numel()
    assert used == 8


def test_dead_codes_are_reseeded() -> None:
    cfg = replace(TINY, epochs=1)
    x = _data()
    torch.manual_seed(0)
    res = train_rqvae(x, cfg, progress=False)
    assert res.history[0]["used"][0] + res.history[0]["reseeded"][0] == 8
    # a model whose level-0 codes are all far away but one: after an epoch the others are re-seeded
    model = res.model
    with torch.no_grad():
        model.codebooks[0, 1:] = 1e3
    from tokenizer_rqvae.rqvae import _optimizer, _reseed_dead

    usage = torch.zeros(3, 8, dtype=torch.long)
    usage[:, 0] = 1
    counts = _reseed_dead(model, _optimizer(model, cfg), torch.from_numpy(x) * cfg.input_scale, usage,
                          torch.Generator().manual_seed(0))
    assert counts == [7, 7, 7]
    assert float(model.codebooks.detach()[0, 1:].abs().max()) < 1e2


def test_sinkhorn_marginals_and_spread() -> None:
    d = torch.zeros(64, 8)  # every row equally close to every code: Sinkhorn must spread them evenly
    d[:, 0] = -1.0  # ... even though argmin would put all on code 0
    plan = sinkhorn(d, epsilon=0.05, iters=100)
    torch.testing.assert_close(plan.sum(1), torch.full((64,), 1 / 64), rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(plan.sum(0), torch.full((8,), 1 / 8), rtol=1e-3, atol=1e-5)
    res = train_rqvae(_data(), replace(TINY, epochs=2, sinkhorn_last=True), progress=False)
    assert res.history[-1]["used"][-1] >= 6


def test_save_load_roundtrip_safetensors(tmp_path: Path) -> None:
    res = train_rqvae(_data(), replace(TINY, epochs=2), progress=False)
    save_rqvae(res.model, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"rqvae.safetensors", "rqvae_config.json"}
    loaded = load_rqvae(tmp_path)
    assert loaded.config == res.model.config
    a, b = res.model.encode(_data()), loaded.encode(_data())
    np.testing.assert_array_equal(a.codes, b.codes)
    assert a.recon_mse == pytest.approx(b.recon_mse)
    cfg = json.loads((tmp_path / "rqvae_config.json").read_text())
    assert cfg["hidden_dims"] == [32, 16] and cfg["levels"] == 3
    with pytest.raises(UserError, match="not found"):
        load_rqvae(tmp_path / "nope")


def test_resume_continues_exactly(tmp_path: Path) -> None:
    x = _data()
    full = train_rqvae(x, replace(TINY, epochs=4), tmp_path / "a", progress=False)
    part = train_rqvae(x, replace(TINY, epochs=2), tmp_path / "b", progress=False)
    assert json.loads((tmp_path / "b" / CKPT_JSON).read_text())["epoch"] == 2
    resumed = train_rqvae(x, replace(TINY, epochs=4), tmp_path / "b", resume=True, progress=False)
    assert resumed.epochs_run == 2 and len(resumed.history) == 4
    assert part.epochs_run == 2
    for (name, p), q in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
    done = train_rqvae(x, replace(TINY, epochs=4), tmp_path / "b", resume=True, progress=False)
    assert done.epochs_run == 0  # finished checkpoint: nothing left to train
    with pytest.raises(UserError, match="other settings"):
        train_rqvae(x, replace(TINY, epochs=4, latent_dim=5), tmp_path / "b", resume=True, progress=False)
    with pytest.raises(UserError, match="other embeddings"):
        train_rqvae(x[:100], replace(TINY, epochs=4), tmp_path / "b", resume=True, progress=False)


def test_config_validation_and_json() -> None:
    assert RQVAEConfig.from_json(TINY.to_json()) == TINY
    with pytest.raises(UserError):
        RQVAEConfig(levels=0)
    with pytest.raises(UserError, match="unknown keys"):
        RQVAEConfig.from_json({"nope": 1})
    with pytest.raises(UserError, match="shape"):
        train_rqvae(np.zeros((4, 5), np.float32), TINY, progress=False)


def test_auto_settings_are_resolved_and_threads_restored() -> None:
    x = _data()
    before = torch.get_num_threads()
    res = train_rqvae(x, replace(TINY, epochs=1, input_scale=None, precision=None), progress=False)
    assert torch.get_num_threads() == before
    cfg = res.model.config
    assert cfg.input_scale == pytest.approx(1 / np.sqrt(np.mean(x.astype(np.float64) ** 2)), rel=1e-3)
    assert cfg.precision in ("bf16", "fp32")


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_precisions_train_and_encode(precision: str) -> None:
    res = train_rqvae(_data(), replace(TINY, epochs=3, precision=precision), progress=False)
    enc = res.model.encode(_data())
    assert np.isfinite(enc.recon_mse) and enc.codes.shape == (200, 3)
    assert res.history[-1]["loss"] < res.history[0]["loss"]
