"""The live catalog file: items added to and retired from a bundle's catalog without retraining.

``recsvc catalog add|retire`` writes it (BUNDLE/catalog_live.json by default); a running ``recsvc serve`` reads
it whenever it changes (``recsvc.service.swap.catalog_watch``) and serves the bundle's catalog plus the additions,
minus the retired items. Format (cumulative: each command rewrites the whole file, atomically)::

    {"version": 3,
     "add": [{"item_id": 61, "codes": [12, 200, 7, 31], "vector": [0.013, -0.052, ...], "key": "B00XYZ"}, ...],
     "retire": [12, 34]}

``codes``: the item's semantic id (one code per level, each in [0, codebook size)), unique against the
bundle's ids and every other addition (``tokenizer_rqvae.assign.assign_codes`` gives such codes). ``vector``:
the item's text embedding (the bundle's fresh-item component ranks new items with it, so its length must be
that component's). ``key`` (optional): the item's own id in the team's systems, which requests may name it by
(unique among the additions; the server also refuses one that a bundle item has, ``recsvc.bundle.keys``).
``retire``: items of the bundle or of ``add`` that are never recommended again (they stay valid in histories).
``version``: a counter the commands increase, reported in the server's log.

Worked example: bundle items {1: (0, 0, 0, 1), 2: (0, 0, 0, 2)}; ``{"version": 1, "add": [{"item_id": 3,
"codes": [0, 0, 0, 2], ...}]}`` is rejected (item 2's id), ``"codes": [0, 0, 1, 0]`` is accepted.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recsvc.errors import UserError
from tokenizer_rqvae.ids import SemanticIds

CATALOG_FILE = "catalog_live.json"
MB = 1_000_000
DEFAULT_MAX_MB = 64  # about 7,500 added items with 384-d vectors (about 8.4 KB each as the commands write them)
MAX_MB_ENV = "RECSVC_CATALOG_MAX_MB"
_NUMBERS = {int, float}  # what JSON numbers parse to
FIELDS = ("version", "add", "retire")
ADD_FIELDS = ("item_id", "codes", "vector")  # every addition's; "key" optional


@dataclass(frozen=True)
class LiveCatalog:
    """A validated live catalog: additions (``item_ids`` [m] ascending, ``codes`` [m, L], ``vectors`` [m, d]
    float32, ``keys`` [m] their item keys, "" for none; () when none has one) and ``retired`` [r] item ids
    (ascending)."""

    version: int
    item_ids: np.ndarray
    codes: np.ndarray
    vectors: np.ndarray
    retired: np.ndarray
    keys: tuple[str, ...] = ()

    def key_pairs(self) -> list[tuple[int, str]]:
        """(item, key) of the additions that have a key."""
        if not self.keys:
            return []
        return [(int(i), k) for i, k in zip(self.item_ids.tolist(), self.keys, strict=True) if k]

    @classmethod
    def empty(cls, levels: int = 4, dim: int = 0) -> LiveCatalog:
        return cls(0, np.zeros(0, np.int64), np.zeros((0, levels), np.int64), np.zeros((0, dim), np.float32),
                   np.zeros(0, np.int64))

    def merged_ids(self, base: SemanticIds) -> SemanticIds:
        """The bundle's ids plus the additions (``base`` itself when there are none)."""
        if not len(self.item_ids):
            return base
        ids = np.concatenate([base.item_ids, self.item_ids])  # [n + m]
        order = np.argsort(ids, kind="stable")
        return SemanticIds(ids[order], np.concatenate([base.codes, self.codes])[order], base.codebook_size)

    def same_additions(self, other: LiveCatalog) -> bool:
        """Whether ``other`` adds exactly these items, ids and vectors (its retirements may differ)."""
        if not len(self.item_ids) and not len(other.item_ids):
            return True
        return (np.array_equal(self.item_ids, other.item_ids) and np.array_equal(self.codes, other.codes)
                and np.array_equal(self.vectors, other.vectors) and self.key_pairs() == other.key_pairs())

    def to_json(self) -> dict[str, Any]:
        keys = self.keys or ("",) * len(self.item_ids)
        return {"version": self.version,
                "add": [{"item_id": int(i), "codes": [int(c) for c in row], "vector": [float(v) for v in vec],
                         **({"key": key} if key else {})}
                        for i, row, vec, key in zip(self.item_ids, self.codes, self.vectors, keys, strict=True)],
                "retire": [int(i) for i in self.retired]}

    def save(self, path: str | Path) -> None:
        """Atomic write (a temp file in the same directory, then ``os.replace``): a server polling the file
        never reads half of it."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_json()) + "\n")
        os.replace(tmp, path)


def _int(value: Any, where: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UserError(f"{where} must be an integer >= {low}, got {value!r}")
    return value


def parse_catalog(doc: Any, base: SemanticIds, vector_dim: int | None = None) -> LiveCatalog:
    """Validates a live-catalog document against the bundle's ids ``base``; UserError naming the first bad
    field. ``vector_dim``: the length every ``vector`` must have (None: any, but one length for all)."""
    if not isinstance(doc, dict):
        raise UserError(f"expected a JSON object with {', '.join(FIELDS)}, got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(FIELDS))
    if unknown:
        raise UserError(f"unknown field(s) {', '.join(map(repr, unknown))} (expected {', '.join(FIELDS)})")
    version = _int(doc.get("version", 0), "version")
    adds, retire = doc.get("add", []), doc.get("retire", [])
    if not isinstance(adds, list) or not isinstance(retire, list):
        raise UserError("add and retire must be lists")
    levels, size = base.levels, base.codebook_size
    taken = {tuple(int(c) for c in row): int(i) for i, row in zip(base.item_ids, base.codes, strict=True)}
    items: list[int] = []
    added: set[int] = set()
    keys: list[str] = []
    keyed: dict[str, int] = {}
    codes: list[tuple[int, ...]] = []
    vectors: list[np.ndarray] = []
    dim = vector_dim
    for n, entry in enumerate(adds):
        where = f"add[{n}]"
        if not isinstance(entry, dict) or not set(ADD_FIELDS) <= set(entry) <= {*ADD_FIELDS, "key"}:
            raise UserError(f"{where} must be an object with exactly item_id, codes and vector (and optionally "
                            f"key), got {entry!r:.80}")
        item = _int(entry["item_id"], f"{where}.item_id", 1)
        if item in base:
            raise UserError(f"{where}.item_id: item {item} is already in the bundle's catalog")
        if item in added:
            raise UserError(f"{where}.item_id: item {item} is added twice")
        row = entry["codes"]
        if not isinstance(row, list) or len(row) != levels:
            raise UserError(f"{where}.codes must be a list of {levels} codes, got {row!r:.80}")
        key = tuple(_int(c, f"{where}.codes", 0) for c in row)
        if max(key) >= size:
            raise UserError(f"{where}.codes: codes must lie in [0, {size}), got {list(key)}")
        if key in taken:
            raise UserError(f"{where}.codes: {list(key)} is already item {taken[key]}'s id (ids must be unique)")
        vec = entry["vector"]
        # checked a list at a time (type() leaves bool out): a 30,000-item file holds millions of numbers
        if not isinstance(vec, list) or not vec or not set(map(type, vec)) <= _NUMBERS:
            raise UserError(f"{where}.vector must be a non-empty list of finite numbers")
        try:
            values = np.asarray(vec, dtype=np.float64)  # [d]
        except OverflowError:  # an integer beyond any float
            raise UserError(f"{where}.vector must be a non-empty list of finite numbers") from None
        if not np.isfinite(values).all():
            raise UserError(f"{where}.vector must be a non-empty list of finite numbers")
        if dim is not None and len(vec) != dim:
            raise UserError(f"{where}.vector has {len(vec)} dimensions, the served item embeddings have {dim}")
        name = entry.get("key", "")
        if not isinstance(name, str) or ("key" in entry and not name):
            raise UserError(f"{where}.key must be a non-empty string, got {name!r:.80}")
        if name in keyed:
            raise UserError(f"{where}.key: {name!r} is already item {keyed[name]}'s key (keys must be unique)")
        if name:
            keyed[name] = item
        dim = len(vec)
        taken[key] = item
        keys.append(name)
        added.add(item)
        items.append(item)
        codes.append(key)
        vectors.append(values)
    retired: list[int] = []
    seen: set[int] = set()
    for n, value in enumerate(retire):
        item = _int(value, f"retire[{n}]", 1)
        if item not in base and item not in added:
            raise UserError(f"retire[{n}]: item {item} is in neither the bundle's catalog nor add")
        if item in seen:
            raise UserError(f"retire[{n}]: item {item} is retired twice")
        seen.add(item)
        retired.append(item)
    order = np.argsort(np.asarray(items, dtype=np.int64), kind="stable")
    return LiveCatalog(
        version=version,
        item_ids=np.asarray(items, dtype=np.int64)[order],
        codes=np.asarray(codes, dtype=np.int64).reshape(len(items), levels)[order],
        vectors=(np.stack(vectors).astype(np.float32) if vectors else np.zeros((0, dim or 0), np.float32))[order],
        retired=np.sort(np.asarray(retired, dtype=np.int64)),
        keys=tuple(keys[i] for i in order.tolist()) if keyed else (),
    )


def max_catalog_bytes() -> int:
    """The size limit of a live-catalog file: ``RECSVC_CATALOG_MAX_MB`` (MB, 10^6 bytes) or 64 MB."""
    text = os.environ.get(MAX_MB_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_MB * MB
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"{MAX_MB_ENV}={text!r} is not a number of MB") from None
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"{MAX_MB_ENV}={text!r} must be a positive number of MB")
    return int(value * MB)


def check_size(path: str | Path, max_bytes: int | None = None) -> int:
    """The file's size in bytes, checked against ``max_bytes`` (None: :func:`max_catalog_bytes`) before anything
    reads it; UserError naming the limit when it is over, or when the file is missing."""
    path = Path(path)
    limit = max_catalog_bytes() if max_bytes is None else max_bytes
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise UserError(f"{path}: no such live-catalog file") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if size > limit:
        raise UserError(f"{path}: {size / MB:.1f} MB ({size:,} bytes) is over the live-catalog size limit of "
                        f"{limit / MB:g} MB (not read; `recsvc serve --catalog-max-mb` or {MAX_MB_ENV} sets the "
                        "limit; a catalog that large belongs in the next bundle: `recsvc catalog ids`, then "
                        "`recsvc build --ids`)")
    return size


def read_catalog(path: str | Path, base: SemanticIds, vector_dim: int | None = None,
                 max_bytes: int | None = None) -> LiveCatalog:
    """``parse_catalog`` of a file, size-checked first (:func:`check_size`); UserError (prefixed with the path)
    when it is too large, cannot be read or is invalid. It parses in the calling thread, holding the GIL for
    the whole JSON parse: a server reads through ``recsvc.catalog.reader`` (another process) instead."""
    path = Path(path)
    limit = max_catalog_bytes() if max_bytes is None else max_bytes
    check_size(path, limit)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(limit + 1)  # never more than the limit, even if the file grew after the check
        if len(raw) > limit:
            raise UserError(f"{path}: grew past the live-catalog size limit of {limit / MB:g} MB while it was read")
        doc = json.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: no such live-catalog file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not a readable JSON file ({exc})") from exc
    try:
        return parse_catalog(doc, base, vector_dim)
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from None
