"""What serving reads of the training data, kept inside the bundle: a deployed bundle never depends on where it
was built (its recorded data directory may be absent, unreadable or another dataset on the serving host).

::

    BUNDLE/popularity.json            {"<item_id>": interactions, ...}: every period of the split (train, valid,
                                      test: what a deployed model may have seen); the no-history fallback's order
    BUNDLE/calibration_histories.json {"source": "validation users", "seed": 1, "histories": [[item, ...], ...]}:
                                      ``CALIBRATION_USERS`` seeded validation users' last ``CALIBRATION_LEN``
                                      items, the traffic ``--spec auto`` times speculation on
    BUNDLE/item_keys.json             {"<item_id>": "<key>", ...}: each item's own id (the split's ``asin``), what
                                      requests and responses may name items by (``recsvc.bundle.keys``)

``recsvc build`` writes them when it finishes (``write_serving_files``), ``recsvc bundle serving-files`` adds
them to a bundle made before they existed. Serving reads them (``read_popularity``,
``read_calibration_histories``) and nothing else of the data; a bundle without them still serves (popular
items in item-id order, calibration on popular items) and ``missing_serving_files`` names what is missing for
the one warning at load (the item keys are optional: a bundle without them serves numbers only).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recsvc.bundle.keys import keys_of_items, write_item_keys
from recsvc.errors import UserError

if TYPE_CHECKING:
    from recsvc.data.split import SplitData

POPULARITY_FILE = "popularity.json"
CALIBRATION_FILE = "calibration_histories.json"
SERVING_FILES = (POPULARITY_FILE, CALIBRATION_FILE)
CALIBRATION_USERS = 8  # validation users sampled (seed 1): what start-up calibration times
CALIBRATION_LEN = 50  # each one's last items
CALIBRATION_SEED = 1


def count_popularity(data: SplitData) -> dict[int, int]:
    """Item -> interactions over train, valid and test (every item of the catalog, 0 when never seen)."""
    counts = dict.fromkeys(data.items, 0)
    for period in (data.train, data.valid, data.test):
        for seq in period.values():
            for item in seq:
                counts[item] = counts.get(item, 0) + 1
    return counts


def calibration_sample(data: SplitData, n: int = CALIBRATION_USERS, max_len: int = CALIBRATION_LEN) -> list[list[int]]:
    """``n`` seeded validation users' last ``max_len`` history items (chronological)."""
    from recsvc.data.sampling import sample_users

    users = sample_users(data.eval_users("valid"), n, seed=CALIBRATION_SEED)
    return [list(u.history[-max_len:]) for u in users if u.history]


def _write_json(path: Path, doc: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, sort_keys=True) + "\n")
    os.chmod(tmp, 0o644)  # the serving user (e.g. the image's uid 10001) reads it
    os.replace(tmp, path)


def write_serving_files(bundle_root: str | Path, data: SplitData) -> dict[str, Any]:
    """Writes BUNDLE/popularity.json, BUNDLE/calibration_histories.json and BUNDLE/item_keys.json from ``data``
    (atomically); returns a small report (a key two items share is left out, and counted)."""
    root = Path(bundle_root)
    counts = count_popularity(data)
    histories = calibration_sample(data)
    _write_json(root / POPULARITY_FILE, {str(i): c for i, c in sorted(counts.items())})
    _write_json(root / CALIBRATION_FILE, {"source": "validation users", "seed": CALIBRATION_SEED,
                                          "max_len": CALIBRATION_LEN, "histories": histories})
    keys, shared = keys_of_items(data.items)
    write_item_keys(root, keys)
    return {"popularity_items": len(counts), "interactions": sum(counts.values()),
            "calibration_histories": len(histories), "item_keys": len(keys),
            **({"item_keys_shared": len(shared)} if shared else {})}


def missing_serving_files(bundle_root: str | Path) -> list[str]:
    """The serving files this bundle lacks (a bundle made before they existed)."""
    return [name for name in SERVING_FILES if not (Path(bundle_root) / name).is_file()]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: cannot be read as JSON ({exc})") from exc


def read_popularity(bundle_root: str | Path) -> dict[int, int] | None:
    """BUNDLE/popularity.json as {item: count}; None when the bundle has none; UserError when malformed."""
    path = Path(bundle_root) / POPULARITY_FILE
    if not path.is_file():
        return None
    doc = _read_json(path)
    try:
        return {int(k): int(v) for k, v in doc.items()}
    except (AttributeError, TypeError, ValueError) as exc:
        raise UserError(f"{path}: expected {{\"<item_id>\": count}} ({exc})") from exc


def read_calibration_histories(bundle_root: str | Path) -> list[list[int]] | None:
    """BUNDLE/calibration_histories.json's histories; None when the bundle has none; UserError when malformed."""
    path = Path(bundle_root) / CALIBRATION_FILE
    if not path.is_file():
        return None
    doc = _read_json(path)
    try:
        return [[int(i) for i in h] for h in doc["histories"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path}: expected {{\"histories\": [[item, ...], ...]}} ({exc})") from exc
