"""``recsvc catalog add|retire|show``: change a bundle's served catalog without retraining (docs/CATALOG.md).

    recsvc catalog add    --bundle B --items new_items.json [--retire 12,34] [--ids-dir DIR]
    recsvc catalog retire --bundle B --items 12,34
    recsvc catalog show   --bundle B
    recsvc catalog ids    --bundle B --out merged_semantic_ids.json

``add`` embeds the new items' text (items.json format) with the embedding model the ids were built with,
gives each a semantic id from the bundle's RQ-VAE (BUNDLE/ids, or ``--ids-dir``), unique against the bundle's
ids and every earlier addition, and writes the live-catalog file (BUNDLE/catalog_live.json, or ``--catalog``;
``recsvc.catalog.file``) atomically with its version increased; an item's ``asin`` becomes its key (the id
requests may name it by: ``recsvc.bundle.keys``). A running ``recsvc serve`` picks it up
within a second. ``retire`` adds items that are never recommended again. ``ids`` writes the ids served now
(retired items included: they stay in histories) for the next bundle's ``recsvc build --ids``, so a retrained
target learns the new items under the ids they were served with.
"""

from __future__ import annotations

import argparse
import fcntl
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from recsvc.errors import UserError
from recsvc.hardware import DEVICES


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("catalog", help="add / retire items of a served bundle without retraining",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="catalog_command", metavar="ACTION")
    p.set_defaults(func=lambda _args: (p.print_help(), 2)[1])

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--bundle", type=Path, required=True, help="bundle directory")
        q.add_argument("--catalog", type=Path, default=None,
                       help="live-catalog file (default: BUNDLE/catalog_live.json, what `recsvc serve` watches)")

    a = sub.add_parser("add", help="ids for new items, added to the live catalog")
    common(a)
    a.add_argument("--items", type=Path, required=True, help="items.json of the new items ({id: {title, ...}})")
    a.add_argument("--retire", default="", help="also retire these items (comma-separated ids)")
    a.add_argument("--ids-dir", type=Path, default=None,
                   help="directory with the RQ-VAE that made the bundle's ids (default: BUNDLE/ids)")
    a.add_argument("--model", type=Path, default=None,
                   help="embedding model directory (default: the one the ids were built with)")
    a.add_argument("--cache-dir", default=None, help="embedding cache directory")
    a.add_argument("--device", default="cpu", choices=DEVICES)
    a.add_argument("--quiet", action="store_true", help="no progress bars")
    a.set_defaults(func=_add)

    r = sub.add_parser("retire", help="items never recommended again")
    common(r)
    r.add_argument("--items", required=True, help="comma-separated item ids")
    r.set_defaults(func=_retire)

    s = sub.add_parser("show", help="what the live catalog holds")
    common(s)
    s.set_defaults(func=_show)

    e = sub.add_parser("ids", help="write the served ids (the bundle's plus the added ones) as semantic_ids.json, "
                                   "for the next `recsvc build --ids`")
    common(e)
    e.add_argument("--out", type=Path, required=True, help="semantic_ids.json to write")
    e.set_defaults(func=_export_ids)


def parse_ids(text: str, flag: str) -> list[int]:
    """``"12, 34"`` -> [12, 34]; UserError for anything but positive integers."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise UserError(f"{flag}: {part!r} is not a positive item id")
        out.append(int(part))
    return out


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialises read-modify-write of the catalog file between commands (a lock file beside it)."""
    if not path.parent.is_dir():
        raise UserError(f"directory not found: {path.parent}")
    with open(path.with_name(f".{path.name}.lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _current(path: Path, base, dim: int | None = None):
    from recsvc.catalog.file import LiveCatalog, read_catalog

    if not path.is_file():
        return LiveCatalog.empty(base.levels, dim or 0)
    try:
        return read_catalog(path, base)
    except UserError as exc:
        raise UserError(f"{exc} (fix or remove the file first)") from None


def _write(path: Path, doc: dict[str, Any], base, dim: int | None):
    """Validates the new document exactly as the server will, then writes it atomically."""
    from recsvc.catalog.file import parse_catalog

    catalog = parse_catalog(doc, base, dim)
    catalog.save(path)
    return catalog


def _fresh_dim(bundle) -> int | None:
    """The dimension of BUNDLE/fresh's item vectors (what the server checks new vectors against)."""
    if not bundle.has_fresh():
        return None
    from recsvc.content.fresh import EMBEDDINGS_FILE, ItemVectors

    return int(ItemVectors.load(bundle.fresh_dir / EMBEDDINGS_FILE).vectors.shape[1])


def _check_ids_dir(ids_dir: Path, base) -> Any:
    """The RQ-VAE of ``ids_dir``, checked against the bundle's ids."""
    import numpy as np

    from tokenizer_rqvae.ids import SemanticIds
    from tokenizer_rqvae.rqvae import CONFIG_FILE, MODEL_FILE, load_rqvae

    if not ids_dir.is_dir() or not (ids_dir / MODEL_FILE).is_file() or not (ids_dir / CONFIG_FILE).is_file():
        raise UserError(f"{ids_dir} holds no RQ-VAE ({MODEL_FILE}, {CONFIG_FILE}): pass --ids-dir, the directory "
                        "`recsvc tokenizer build` wrote the bundle's ids to")
    model = load_rqvae(ids_dir)
    cfg = model.config
    if cfg.levels != base.levels or cfg.codebook_size > base.codebook_size:
        raise UserError(f"the RQ-VAE in {ids_dir} ({cfg.levels} levels x {cfg.codebook_size} codes) does not match "
                        f"the bundle's ids ({base.levels} levels)")
    made = ids_dir / "semantic_ids.json"
    if made.is_file():
        theirs = SemanticIds.load(made)
        common = np.intersect1d(theirs.item_ids, base.item_ids)
        rows_a = [theirs.index_of(i) for i in common]
        rows_b = [base.index_of(i) for i in common]
        if not len(common) or not np.array_equal(theirs.codes[rows_a], base.codes[rows_b]):
            raise UserError(f"the ids in {made} are not the bundle's: its RQ-VAE did not make them (--ids-dir)")
    return model


def _new_keys(items: dict[int, dict[str, Any]], taken: dict[str, int]) -> dict[int, str]:
    """item -> key (its ``asin``) of the new items that have one; UserError when a key is another item's
    (``taken``: the served keys) or two new items share one."""
    out: dict[int, str] = {}
    owners = dict(taken)
    for item, meta in items.items():
        asin = meta.get("asin")
        if asin is None or asin == "":
            continue
        if not isinstance(asin, str | int) or isinstance(asin, bool):
            raise UserError(f"item {item}: asin must be a string, got {asin!r}")
        key = str(asin)
        if key in owners:
            raise UserError(f"item {item}: its asin {key!r} is already item {owners[key]}'s key")
        owners[key] = item
        out[item] = key
    return out


def add_items(bundle_dir: str | Path, items_path: str | Path, retire: Sequence[int] = (), *,
              catalog_path: str | Path | None = None, ids_dir: str | Path | None = None,
              model_path: str | Path | None = None, cache_dir: str | Path | None = None, device: str = "cpu",
              progress: bool = True, embedder: Any = None) -> dict[str, Any]:
    """``recsvc catalog add`` (``embedder``: a ``tokenizer_rqvae.embed.Embedder`` to use instead of loading
    one); returns a small report."""
    import numpy as np

    from recsvc.bundle.directory import Bundle
    from recsvc.bundle.keys import read_item_keys
    from recsvc.catalog.file import CATALOG_FILE
    from tokenizer_rqvae.assign import assign_codes, recorded_model
    from tokenizer_rqvae.build import check_device
    from tokenizer_rqvae.embed import Embedder, items_texts, load_items, torch_threads

    bundle = Bundle.open(bundle_dir)
    base = bundle.load_ids()
    path = Path(catalog_path) if catalog_path is not None else bundle.root / CATALOG_FILE
    ids_dir = Path(ids_dir) if ids_dir is not None else bundle.ids_dir
    device = check_device(device)
    items = load_items(items_path)
    dim = _fresh_dim(bundle)
    model = _check_ids_dir(ids_dir, base)
    with _locked(path):
        current = _current(path, base)
        added = set(current.item_ids.tolist())
        known = sorted(i for i in items if i in base or i in added)
        if known:
            raise UserError(f"{len(known)} item(s) of {items_path} are already in the catalog: {known[:10]}")
        served = read_item_keys(bundle.root)
        taken = {**(dict(served.by_key) if served is not None else {}),
                 **{k: i for i, k in current.key_pairs()}}
        keys = _new_keys(items, taken)
        new_ids, texts = items_texts(items)
        emb = embedder or Embedder(model_path or recorded_model(ids_dir), cache_dir, device=device, progress=progress)
        x = emb.embed(texts)  # [m, in]
        if dim is not None and x.shape[1] != dim:
            raise UserError(f"the embedding model gives {x.shape[1]}-d vectors, the bundle's fresh items "
                            f"(BUNDLE/fresh) have {dim}-d ones: use the model they were made with (--model)")
        if len(current.item_ids) and current.vectors.shape[1] != x.shape[1]:
            raise UserError(f"the embedding model gives {x.shape[1]}-d vectors, earlier additions have "
                            f"{current.vectors.shape[1]}-d ones (--model)")
        taken = np.concatenate([base.codes, current.codes])  # [n + m0, L]
        with torch_threads():
            codes, moved = assign_codes(model, taken, new_ids, x, device)
        doc = current.to_json()
        doc["version"] = current.version + 1
        doc["add"] += [{"item_id": int(i), "codes": [int(c) for c in row], "vector": [round(float(v), 7) for v in vec],
                        **({"key": keys[int(i)]} if int(i) in keys else {})}
                       for i, row, vec in zip(new_ids, codes, x, strict=True)]
        _add_retired(doc, retire, base)
        catalog = _write(path, doc, base, dim)
    return {"file": str(path), "version": catalog.version, "added": len(new_ids), "moved": moved,
            "keys": len(keys), "retired": len(retire), "added_total": len(catalog.item_ids),
            "retired_total": len(catalog.retired)}


def _add_retired(doc: dict[str, Any], retire: Sequence[int], base) -> None:
    added = {entry["item_id"] for entry in doc["add"]}
    unknown = sorted(i for i in set(retire) if i not in base and i not in added)
    if unknown:
        raise UserError(f"cannot retire unknown item(s) {unknown[:10]}: in neither the bundle's catalog nor the "
                        "added items")
    already = sorted(set(retire) & set(doc["retire"]))
    if already:
        raise UserError(f"item(s) {already[:10]} are retired already")
    if len(set(retire)) != len(retire):
        raise UserError("an item is listed twice in the items to retire")
    doc["retire"] += [int(i) for i in retire]


def retire_items(bundle_dir: str | Path, retire: Sequence[int], catalog_path: str | Path | None = None
                 ) -> dict[str, Any]:
    """``recsvc catalog retire``; returns a small report."""
    from recsvc.bundle.directory import Bundle
    from recsvc.catalog.file import CATALOG_FILE

    if not retire:
        raise UserError("no items to retire")
    bundle = Bundle.open(bundle_dir)
    base = bundle.load_ids()
    path = Path(catalog_path) if catalog_path is not None else bundle.root / CATALOG_FILE
    with _locked(path):
        current = _current(path, base)
        doc = current.to_json()
        doc["version"] = current.version + 1
        _add_retired(doc, retire, base)
        catalog = _write(path, doc, base, None)
    return {"file": str(path), "version": catalog.version, "retired": len(retire),
            "added_total": len(catalog.item_ids), "retired_total": len(catalog.retired)}


def _add(args: argparse.Namespace) -> int:
    report = add_items(args.bundle, args.items, parse_ids(args.retire, "--retire"), catalog_path=args.catalog,
                       ids_dir=args.ids_dir, model_path=args.model, cache_dir=args.cache_dir, device=args.device,
                       progress=not args.quiet)
    print(json.dumps(report))
    return 0


def _retire(args: argparse.Namespace) -> int:
    print(json.dumps(retire_items(args.bundle, parse_ids(args.items, "--items"), args.catalog)))
    return 0


def _show(args: argparse.Namespace) -> int:
    from recsvc.bundle.directory import Bundle
    from recsvc.catalog.file import CATALOG_FILE

    bundle = Bundle.open(args.bundle)
    base = bundle.load_ids()
    path = args.catalog or bundle.root / CATALOG_FILE
    current = _current(path, base)
    print(json.dumps({"file": str(path), "exists": path.is_file(), "version": current.version,
                      "bundle_items": len(base), "added": current.item_ids.tolist(),
                      "retired": current.retired.tolist(),
                      "items": len(base) + len(current.item_ids) - len(current.retired)}))
    return 0


def _export_ids(args: argparse.Namespace) -> int:
    from recsvc.bundle.directory import Bundle
    from recsvc.catalog.file import CATALOG_FILE

    bundle = Bundle.open(args.bundle)
    base = bundle.load_ids()
    current = _current(args.catalog or bundle.root / CATALOG_FILE, base)
    merged = current.merged_ids(base)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    merged.save(args.out)
    print(json.dumps({"out": str(args.out), "items": len(merged), "added": len(current.item_ids),
                      "version": current.version}))
    return 0
