"""Cold-start ids: new items -> ids from the trained RQ-VAE, unique against the existing catalog.

Existing ids never change. New items are embedded (cached), encoded, and placed closest-first (distance of
the last-level residual to its last code, then item id) with the same rule as collision resolution: its own id
when free, else the nearest free id keeping the longest prefix (see :mod:`tokenizer_rqvae.collisions`).
Items of the new file that are already in the catalog keep their catalog id (counted as ``known``).

Example: catalog {1: (3, 7, 0, 5)}; new item 2 encodes to (3, 7, 0, 5) too -> it gets (3, 7, 0, d) with d
the free last code nearest its level-3 residual; item 1 keeps (3, 7, 0, 5).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from recsvc_base.errors import UserError
from tokenizer_rqvae.build import IDS_FILE, REPORT_FILE, check_device
from tokenizer_rqvae.collisions import IdSpace, check_capacity, place_closest_first
from tokenizer_rqvae.embed import Embedder, items_texts, load_items, torch_threads
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.rqvae import RQVAE, load_rqvae


def recorded_model(ids_dir: Path) -> Path | None:
    """The embedding model the ids were built with (from report.json), when still present."""
    try:
        path = json.loads((ids_dir / REPORT_FILE).read_text()).get("embedding_model")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return Path(path) if path and Path(path).is_dir() else None


def assign_codes(model: RQVAE, taken: np.ndarray, item_ids: np.ndarray, x: np.ndarray, device: str = "cpu"
                 ) -> tuple[np.ndarray, int]:
    """Collision-free codes for new items: ``taken`` [n, L] the ids already in use, ``item_ids`` [m] the new
    items, ``x`` [m, in] their text embeddings -> (codes [m, L], how many did not get their own raw id).
    Placed closest-first (last-level residual distance, then item id), as :func:`place` resolves collisions."""
    cfg = model.config
    if x.shape[1] != cfg.in_dim:
        raise UserError(f"embedding model gives {x.shape[1]}-d vectors, the RQ-VAE expects {cfg.in_dim}-d "
                        "(use the --model the ids were built with)")
    check_capacity(len(taken) + len(item_ids), cfg.levels, cfg.codebook_size)
    enc = model.encode(x, device=device)
    codebooks = model.codebooks.detach().cpu().numpy()  # [L, K, D]
    space = IdSpace(cfg.levels, cfg.codebook_size)
    for row in np.asarray(taken).tolist():
        space.add(tuple(row))
    codes, moved = place_closest_first(space, enc.codes, enc.residuals, codebooks, item_ids)
    return np.asarray(codes, dtype=np.int64), moved


@torch_threads()
def assign_new_items(
    ids_dir: str | Path,
    items_path: str | Path,
    out_path: str | Path,
    *,
    model_path: str | Path | None = None,
    cache_dir: str | Path | None = None,
    device: str = "cpu",
    progress: bool = True,
    embedder: Embedder | None = None,
) -> dict[str, Any]:
    """Write ``out_path`` = catalog ids (``ids_dir/semantic_ids.json``, unchanged) + ids for the new items of
    ``items_path`` (items.json format); returns a small report."""

    t0 = time.perf_counter()
    ids_dir = Path(ids_dir)
    if not ids_dir.is_dir():
        raise UserError(f"ids directory not found: {ids_dir}")
    device = check_device(device)
    model = load_rqvae(ids_dir, device=device)
    cfg = model.config
    catalog = SemanticIds.load(ids_dir / IDS_FILE, cfg.codebook_size)
    if catalog.levels != cfg.levels or catalog.codebook_size != cfg.codebook_size:
        raise UserError(f"{ids_dir / IDS_FILE} ({catalog.levels} levels x {catalog.codebook_size}) does not "
                        f"match the RQ-VAE ({cfg.levels} x {cfg.codebook_size})")
    if catalog.collisions():
        raise UserError(f"{ids_dir / IDS_FILE} already has {catalog.collisions()} collisions")
    items = load_items(items_path)
    new_items = {i: m for i, m in items.items() if i not in catalog}
    known = len(items) - len(new_items)
    check_capacity(len(catalog) + len(new_items), cfg.levels, cfg.codebook_size)

    mapping = {int(i): tuple(int(c) for c in row) for i, row in zip(catalog.item_ids, catalog.codes, strict=True)}
    moved = 0
    if new_items:
        new_ids, texts = items_texts(new_items)
        emb = embedder or Embedder(model_path or recorded_model(ids_dir), cache_dir, device=device,
                                   progress=progress)
        x = emb.embed(texts)  # [m, dim]
        codes, moved = assign_codes(model, catalog.codes, new_ids, x, device)
        mapping.update({int(i): tuple(int(c) for c in row) for i, row in zip(new_ids, codes, strict=True)})
    merged = SemanticIds.from_mapping(mapping, cfg.codebook_size)
    if merged.collisions():  # place() guarantees this
        raise AssertionError("collisions after assignment")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    merged.save(out)
    return {
        "catalog_items": len(catalog),
        "new_items": len(new_items),
        "known": known,
        "moved": moved,
        "items": len(merged),
        "collisions": merged.collisions(),
        "out": str(out),
        "seconds": time.perf_counter() - t0,
    }
