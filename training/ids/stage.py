"""The ids stage of ``recsvc build``: a bundle's semantic ids, trained by the RQ-VAE
(``tokenizer_rqvae.build``) or copied from a given ``semantic_ids.json`` with its cold-start record and RQ-VAE."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from recsvc.errors import UserError


def stage_ids(bundle, data_dir: Path, ids_file: Path | None) -> dict:
    """Write ``bundle``'s ids/ (from ``ids_file``, else an RQ-VAE run on ``data_dir``, resumed), mark the stage done
    in bundle.json and return the report's scalar fields."""
    from tokenizer_rqvae.ids import SemanticIds

    t0 = time.monotonic()
    bundle.ids_dir.mkdir(parents=True, exist_ok=True)
    later_name = "assigned_later.json"  # the cold-start protocol's items (tokenizer_rqvae.build)
    if ids_file is not None:
        ids = SemanticIds.load(ids_file)  # validates the file
        shutil.copyfile(ids_file, bundle.semantic_ids_path)
        # the cold-start record, and the RQ-VAE that made the ids (with its report, which names the embedding
        # model): a bundle then places new items by itself (`recsvc catalog add`)
        for name in (later_name, "rqvae.safetensors", "rqvae_config.json", "report.json"):
            if (ids_file.parent / name).is_file() and ids_file.parent.resolve() != bundle.ids_dir.resolve():
                shutil.copyfile(ids_file.parent / name, bundle.ids_dir / name)
        report = {"source": str(ids_file.resolve()), "items": len(ids), "collisions": ids.collisions()}
    else:
        from tokenizer_rqvae.build import build_semantic_ids  # heavy (embedder, faiss): imported lazily

        # an interrupted RQ-VAE run left ids/checkpoint/: continue it
        report = build_semantic_ids(data_dir, bundle.ids_dir, resume=(bundle.ids_dir / "checkpoint").is_dir())
        if not bundle.semantic_ids_path.is_file():
            raise UserError(f"the ids stage wrote no {bundle.semantic_ids_path}")
        ids = bundle.load_ids()
    later = bundle.assigned_later()
    bundle.mark_done("ids", seconds=round(time.monotonic() - t0, 1), items=len(ids),
                     collisions=ids.collisions(), source=str(ids_file) if ids_file else "rqvae",
                     assigned_later=len(later["items"]) if later else None,
                     known_through=later["known_through"] if later else None)
    return _summary(report)


def _summary(report) -> dict:
    if not isinstance(report, dict):
        return {}
    return {k: v for k, v in report.items() if isinstance(v, int | float | str | bool) or v is None}
