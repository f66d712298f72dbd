"""``build_semantic_ids``: items.json -> embeddings (cached) -> RQ-VAE -> collision-free ids + report.

Writes into ``out_dir``: ``semantic_ids.json`` (``SemanticIds.save``), ``rqvae.safetensors``,
``rqvae_config.json``, ``report.json`` and ``checkpoint/`` (for ``--resume``).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from recsvc_base.errors import UserError
from tokenizer_rqvae.collaborative import load_cf_embeddings
from tokenizer_rqvae.collisions import IdSpace, check_capacity, place_closest_first, resolve_collisions
from tokenizer_rqvae.embed import Embedder, items_texts, load_items, torch_threads
from tokenizer_rqvae.ids import LEVEL_NAMES, SemanticIds
from tokenizer_rqvae.rqvae import RQVAEConfig, save_rqvae, train_rqvae

IDS_FILE = "semantic_ids.json"
REPORT_FILE = "report.json"
REFERENCE_FILE = "reference_semantic_ids.json"
CHECKPOINT_DIR = "checkpoint"
ASSIGNED_LATER_FILE = "assigned_later.json"
KNOWN_THROUGH = ("train", "valid")


def known_items(data_dir: Path, through: str) -> set[int]:
    """Items interacted with in the fitting period: ``train`` (selection on valid) or ``train`` + ``valid``
    (the deploy refit). Reads ``sequential_{split}.txt`` directly (``user item item ...`` per line).

    The cold-start protocol fits the RQ-VAE on these items only; every other catalog item gets its id from the
    fitted encoder afterwards, as a new item would in production (``place_closest_first``).
    """
    if through not in KNOWN_THROUGH:
        raise UserError(f"--known-through must be one of {', '.join(KNOWN_THROUGH)}, got {through!r}")
    splits = KNOWN_THROUGH[: KNOWN_THROUGH.index(through) + 1]
    known: set[int] = set()
    for split in splits:
        path = data_dir / f"sequential_{split}.txt"
        if not path.is_file():
            raise UserError(f"--known-through {through}: {path} not found")
        for line in path.read_text().splitlines():
            parts = line.split()
            try:
                known.update(int(p) for p in parts[1:])
            except ValueError as exc:
                raise UserError(f"{path}: not an integer item id in line {line[:80]!r}") from exc
    return known


def check_device(device: str) -> str:
    """'cpu' or 'cuda' (UserError when CUDA is asked for and absent)."""
    import torch

    if device not in ("cpu", "cuda"):
        raise UserError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device available (this torch build / machine has none)")
    return device


def reference_summary(path: Path) -> dict[str, Any]:
    """Usage / collisions of a reference ``semantic_ids.json`` (e.g. the LC-Rec Beauty ids)."""
    ref = SemanticIds.load(path)
    return {
        "path": str(path),
        "items": len(ref),
        "collisions": ref.collisions(),
        "collision_groups": len(ref.collision_groups()),
        "codebook_usage": ref.codebook_usage(),
        "codes_used": [round(u * ref.codebook_size) for u in ref.codebook_usage()],
    }


@torch_threads()
def build_semantic_ids(
    data_dir: str | Path,
    out_dir: str | Path,
    config: RQVAEConfig | None = None,
    *,
    model_path: str | Path | None = None,
    cache_dir: str | Path | None = None,
    resume: bool = False,
    device: str = "cpu",
    sinkhorn_collisions: bool = False,
    progress: bool = True,
    embedder: Embedder | None = None,
    known_through: str | None = None,
    cf_embeddings: str | Path | None = None,
) -> dict[str, Any]:
    """Build the semantic ids of ``data_dir/items.json`` into ``out_dir``; returns the report (also written
    to ``out_dir/report.json``). ``embedder`` overrides ``model_path`` / ``cache_dir`` (tests inject one).

    ``known_through`` ("train" / "valid"): the cold-start protocol. The RQ-VAE and the collision resolution
    see only the items interacted with up to that split; the others are encoded afterwards and placed on free
    ids (``place_closest_first``); their item ids go to ``out_dir/assigned_later.json``.

    ``cf_embeddings``: a fitted SASRec (recsvc's format) whose item table regularises the RQ-VAE towards
    collaborative structure (``tokenizer_rqvae.collaborative``, weight ``config.cf_weight``)."""
    import torch

    t0 = time.perf_counter()
    data = Path(data_dir)
    if not data.is_dir():
        raise UserError(f"data directory not found: {data}")
    config = config or RQVAEConfig()
    if config.levels > len(LEVEL_NAMES):
        raise UserError(f"the id format has at most {len(LEVEL_NAMES)} levels, config asks for {config.levels}")
    device = check_device(device)
    items = load_items(data / "items.json")
    item_ids, texts = items_texts(items)
    check_capacity(len(item_ids), config.levels, config.codebook_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    emb = embedder or Embedder(model_path, cache_dir, device=device, progress=progress)
    t_emb = time.perf_counter()
    x = emb.embed(texts)  # [n, dim]
    seconds_embedding = time.perf_counter() - t_emb
    if x.shape[1] != config.in_dim:
        config = replace(config, in_dim=int(x.shape[1]))

    fit = np.ones(len(item_ids), dtype=bool)  # [n] the rows the RQ-VAE is fitted on
    if known_through is not None:
        known = known_items(data, known_through)
        fit = np.array([int(i) in known for i in item_ids], dtype=bool)
        if not fit.any():
            raise UserError(f"--known-through {known_through}: no catalog item was interacted with")
    cf = None
    if cf_embeddings is not None and config.cf_weight > 0:  # weight 0: text only
        cf_all, cf_has = load_cf_embeddings(cf_embeddings, item_ids, config.latent_dim)
        cf = (cf_all[fit], cf_has[fit])
    trained = train_rqvae(x[fit], config, out / CHECKPOINT_DIR, resume=resume, device=device,
                          progress=progress, cf=cf)
    model = trained.model
    enc = model.encode(x, device=device)
    codebooks = model.codebooks.detach().cpu().numpy()  # [L, K, D]
    before = SemanticIds(item_ids, enc.codes, config.codebook_size)
    res = resolve_collisions(enc.codes[fit], enc.residuals[fit], codebooks,
                             sinkhorn_epsilon=config.sinkhorn_epsilon if sinkhorn_collisions else None,
                             sinkhorn_iters=config.sinkhorn_iters)
    codes = enc.codes.copy()
    codes[fit] = res.codes
    later_ids = item_ids[~fit]
    moved_later = 0
    if len(later_ids):
        space = IdSpace(config.levels, config.codebook_size)
        for row in res.codes.tolist():
            space.add(tuple(row))
        codes[~fit], moved_later = place_closest_first(space, enc.codes[~fit], enc.residuals[~fit], codebooks,
                                                       later_ids)
    after = SemanticIds(item_ids, codes, config.codebook_size)
    if after.collisions() != 0:  # resolve_collisions guarantees this; never write colliding ids
        raise AssertionError(f"{after.collisions()} collisions left after resolution")

    after.save(out / "semantic_ids.json")
    later_path = out / ASSIGNED_LATER_FILE
    if known_through is not None:
        later_path.write_text(json.dumps({"known_through": known_through,
                                          "items": sorted(int(i) for i in later_ids)}))
    elif later_path.exists():
        later_path.unlink()
    save_rqvae(model, out)
    last = trained.history[-1] if trained.history else {}
    report: dict[str, Any] = {
        "items": len(after),
        "collisions_before": before.collisions(),
        "collision_groups_before": len(before.collision_groups()),
        "collisions_after": after.collisions(),
        "moved": len(res.moved),
        "known_through": known_through,
        "fit_items": int(fit.sum()),
        "assigned_later": int(len(later_ids)),
        "assigned_later_moved": moved_later,
        "moved_first_changed_level": {LEVEL_NAMES[lv]: c for lv, c in sorted(res.changed_from_level.items())},
        "codebook_usage": after.codebook_usage(),
        "codes_used": [round(u * config.codebook_size) for u in after.codebook_usage()],
        "codebook_usage_before": before.codebook_usage(),
        "recon_mse": enc.recon_mse,
        "seconds": None,  # filled below
        "seconds_embedding": seconds_embedding,
        "seconds_training": trained.seconds,
        "embeddings_cached": emb.stats.cached,
        "embeddings_computed": emb.stats.computed,
        "embedding_model": str(emb.model_path),
        "epochs": config.epochs,
        "epochs_run": trained.epochs_run,
        "final_epoch": last,
        "final_reseeded": trained.final_reseeded,
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "sinkhorn_collisions": sinkhorn_collisions,
        "cf_embeddings": None if cf is None else {"file": str(cf_embeddings), "items": int(cf[1].sum())},
        "config": model.config.to_json(),
    }
    ref_path = data / REFERENCE_FILE
    if ref_path.is_file():
        report["reference"] = reference_summary(ref_path)
    report["seconds"] = time.perf_counter() - t0
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    return report


def summary_line(report: dict[str, Any]) -> str:
    """One human line for the CLI."""
    ref = report.get("reference")
    ref_part = f"; reference level-1 codes used {ref['codes_used'][0]}" if ref else ""
    return (f"{report['items']} items: collisions {report['collisions_before']} -> {report['collisions_after']}, "
            f"codes used per level {report['codes_used']}{ref_part}, recon_mse {report['recon_mse']:.4g}, "
            f"{report['seconds']:.1f}s (embedding {report['seconds_embedding']:.1f}s, "
            f"{report['embeddings_computed']} embedded, {report['embeddings_cached']} cached)")
