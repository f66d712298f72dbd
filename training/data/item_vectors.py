"""A data directory's items as text embeddings: what the dense head trains towards and the fresh slots rank by."""

from __future__ import annotations

from pathlib import Path


def item_vectors(data_dir: Path, cache_dir: str | None = None):
    """Every catalog item's text embedding (``ItemVectors``), with the texts the semantic ids were built from."""
    from recsvc.content.fresh import ItemVectors
    from tokenizer_rqvae.embed import Embedder, items_texts, load_items

    ids, texts = items_texts(load_items(data_dir / "items.json"))
    return ItemVectors.from_arrays(ids, Embedder(None, cache_dir, progress=False).embed(texts))
