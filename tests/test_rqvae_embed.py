"""Item text, items.json validation, and the embedding cache (real packaged MiniLM on a few texts)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from recsvc.errors import UserError
from tokenizer_rqvae.embed import Embedder, item_text, items_texts, load_items, resolve_cache_dir


def test_item_text_format() -> None:
    meta = {"asin": "B0", "title": " Rose Soap ", "brand": "Acme", "categories": [["Beauty", "Bath"], ["Beauty"]],
            "description": "x" * 400}
    text = item_text(1, meta)
    assert text.startswith("Title: Rose Soap; Brand: Acme; Categories: Beauty, Bath; Description: ")
    assert text.endswith("x" * 300) and "x" * 301 not in text
    assert item_text(2, {"asin": "B1", "title": None}) == "Title: unknown item B1"
    assert item_text(3, {"title": "T", "categories": "Skin"}) == "Title: T; Categories: Skin"


def test_load_items_validates(tmp_path: Path) -> None:
    p = tmp_path / "items.json"
    p.write_text(json.dumps({"2": {"asin": "b", "title": "B"}, "1": {"asin": "a", "title": None}}))
    items = load_items(p)
    assert list(items) == [1, 2]
    ids, texts = items_texts(items)
    assert ids.tolist() == [1, 2] and texts == ["Title: unknown item a", "Title: B"]
    bad = {"[1, 2]": "expected a non-empty object", '{"x": {"title": "a"}}': "not a positive integer",
           '{"1": "title"}': "expected an object", '{"1": {"title": 5}}': "string or null", "{oops": "valid JSON"}
    for content, msg in bad.items():
        p.write_text(content)
        with pytest.raises(UserError, match=msg):
            load_items(p)
    with pytest.raises(UserError, match="not found"):
        load_items(tmp_path / "missing.json")


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RECSVC_CACHE_DIR", raising=False)
    assert resolve_cache_dir() == Path("~/.cache/recsvc/embeddings").expanduser()
    monkeypatch.setenv("RECSVC_CACHE_DIR", str(tmp_path / "env"))
    assert resolve_cache_dir() == tmp_path / "env"
    assert resolve_cache_dir(tmp_path / "flag") == tmp_path / "flag"


def test_minilm_embeddings_are_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    texts = [f"Title: product number {i}; Brand: Acme" for i in range(20)] + ["Title: product number 0; Brand: Acme"]
    emb = Embedder(cache_dir=tmp_path, progress=False)
    x = emb.embed(texts)
    assert x.shape == (21, 384) and x.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(x[0], x[20])
    assert emb.stats.computed == 20 and emb.stats.cached == 0
    assert list(tmp_path.glob("*.safetensors"))

    again = Embedder(cache_dir=tmp_path, progress=False)
    monkeypatch.setattr(again, "_encode", lambda t: pytest.fail("cache miss: the model was called"))
    np.testing.assert_array_equal(again.embed(texts), x)
    assert again.stats.cached == 21 and again.stats.computed == 0

    mixed = Embedder(cache_dir=tmp_path, progress=False)
    y = mixed.embed(["Title: something new", texts[3]])
    assert mixed.stats.computed == 1 and mixed.stats.cached == 1
    np.testing.assert_array_equal(y[1], x[3])


def test_bad_model_dir_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        Embedder(model_path=tmp_path / "nope", cache_dir=tmp_path)
    with pytest.raises(UserError, match="not a sentence-transformers model"):
        Embedder(model_path=tmp_path, cache_dir=tmp_path)
