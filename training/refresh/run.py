"""``recsvc refresh run``: yesterday's bundle + the interactions appended since -> today's bundle, published only
when the gate lets it through.

1. the day's log is read by the catalog's item keys (``day_log``); the items yesterday's live catalog added
   (``recsvc catalog add``: coded by the bundle's RQ-VAE, keyed) join today's ids, and retired items stay retired;
2. today's split: yesterday's history + the day, each day-user's last item kept aside (``merge``);
3. the gate scores yesterday's bundle on the kept-aside items before anything is trained (a day it cannot read is
   refused at the cost of one ranking), then today's beside it, paired (``scoring``, ``gate``);
4. today's models continue from yesterday's (``models``): the item-level target, the prior's SASRec, the
   transition counts; the tunings' choices (fusion weights, mix, history rule) are yesterday's;
5. published (``publish``: a symlink such as the one ``recsvc serve --bundle`` follows, flipped atomically) or
   kept aside with the reason; bundle.json's ``"refresh"`` records what was done, and one JSON line says it.

A re-run with the same bundle, log and ``--out`` resumes: the target continues from its checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from recsvc.errors import UserError
from training.data.columns import Columns
from training.data.import_log import LOG_COLUMNS
from training.refresh.gate import GateFigures, GateRule, check_day, decide
from training.refresh.models import ContinuePlan

# what today's bundle does not copy from yesterday's (top level): remade, or not today's
NOT_COPIED = frozenset({"target", "target-train", "prior", "prior-excl", "fresh", "tune", "checkpoints", "baselines",
                        "data", "catalog_live.json", "bundle.json.tmp"})
KEPT_ASIDE = 3  # the exit code of a refresh the gate kept aside


@dataclass(frozen=True)
class RefreshRequest:
    yesterday: Path
    log: Path
    out: Path
    publish: Path | None = None
    catalog: Path | None = None  # yesterday's live catalog (None: BUNDLE/catalog_live.json, `recsvc catalog add`'s)
    cols: Columns = LOG_COLUMNS
    min_rating: float | None = None
    missing_items: str = "drop"
    plan: ContinuePlan = field(default_factory=ContinuePlan)
    rule: GateRule = field(default_factory=GateRule)


def refresh(req: RefreshRequest) -> dict[str, Any]:
    """Run one refresh (module docstring) -> bundle.json's ``"refresh"`` record."""
    from recsvc.bundle.directory import Bundle
    from recsvc.bundle.keys import keys_of_items
    from recsvc.bundle.serving_files import write_serving_files
    from recsvc.catalog.file import CATALOG_FILE, read_catalog
    from recsvc.data.split import ItemMeta, load_split_dir
    from training.refresh.day_log import read_day_log
    from training.refresh.merge import merge_day, read_user_keys
    from training.refresh.models import continue_prior, continue_target, refresh_fresh
    from training.refresh.scoring import day_scores, gate_figures, reference_ndcg

    t0 = time.monotonic()
    y = Bundle.open(req.yesterday.resolve())
    if y.architecture != "items":
        raise UserError(f"{req.yesterday} is a {y.architecture} bundle: `recsvc refresh` continues the item-level "
                        "target (architecture items); rebuild a token bundle with `recsvc build --recipe served`")
    y_meta = y.read()
    y_data_dir = y.resolve_data_dir()
    y_data = load_split_dir(y_data_dir)
    ids = y.load_ids()
    items = dict(y_data.items)
    key_pairs = dict(keys_of_items(items)[0])
    retired: list[int] = []
    added: tuple[list[int], Any] | None = None
    live = req.catalog if req.catalog is not None else y.root / CATALOG_FILE
    if live.is_file():  # the items added to yesterday's live catalog become today's catalog items
        catalog = read_catalog(live, ids)
        ids = catalog.merged_ids(ids)
        for i, key in zip(catalog.item_ids.tolist(), catalog.keys or ("",) * len(catalog.item_ids), strict=True):
            items[int(i)] = ItemMeta(asin=key or None)
            if key:
                key_pairs[int(i)] = key
        retired = catalog.retired.tolist()
        added = (catalog.item_ids.tolist(), catalog.vectors)
    item_of = {key: item for item, key in key_pairs.items()}
    day = read_day_log(req.log, set(item_of), req.cols, req.min_rating, req.missing_items)
    if not day.events:
        raise UserError(f"{req.log}: no interaction with a catalog item ({day.rows} rows, {day.unknown_item_rows} "
                        f"with keys the catalog does not have)")

    out = _prepare_out(req, y)
    today = Bundle.open(out)
    steps: dict[str, float] = {}
    s = time.monotonic()
    merged = merge_day(y_data, read_user_keys(y_data_dir, y_data), item_of, day, items, out / "data")
    ids.save(today.semantic_ids_path)
    data = load_split_dir(merged.data_dir)
    today.update(data=str(merged.data_dir.resolve()), protocol="deploy")
    steps["data"] = time.monotonic() - s

    s = time.monotonic()
    excl = y.serves_excluding_history()  # today's bundle.json is yesterday's: the same history rule
    users, theirs = day_scores(y.root, merged.data_dir, excl)  # the day checked before anything is trained
    reference = reference_ndcg(y_meta)
    refused = check_day(len(users), float(theirs.mean()) if len(users) else 0.0, reference, req.rule)
    steps["gate"] = time.monotonic() - s
    target: dict[str, Any] | None = None
    priors: dict[str, Any] = {}
    fresh: dict[str, Any] | None = None
    if refused is None:
        s = time.monotonic()
        target = continue_target(y.target_dir, data, ids, today.train_only_target_dir, req.plan)
        shutil.rmtree(today.target_dir, ignore_errors=True)
        shutil.copytree(today.train_only_target_dir, today.target_dir)
        steps["target"] = time.monotonic() - s
        s = time.monotonic()
        priors = {name: continue_prior(y.root / name, data, ids, out / name, req.plan)
                  for name in ("prior", "prior-excl") if (y.root / name / "prior.json").is_file()}
        fresh = refresh_fresh(y.fresh_dir, data, ids, today.fresh_dir, added) if y.has_fresh() else None
        write_serving_files(out, data)
        if retired:
            (out / CATALOG_FILE).write_text(json.dumps({"version": 1, "add": [], "retire": retired}) + "\n")
        steps["prior"] = time.monotonic() - s
        s = time.monotonic()
        _, mine = day_scores(out, merged.data_dir, excl)
        figures = gate_figures(users, mine, theirs, reference)
        decision = decide(figures, req.rule)
        steps["gate"] += time.monotonic() - s
    else:
        figures = GateFigures(len(users), None, float(theirs.mean()) if len(users) else 0.0, None, None, None,
                              reference)
        decision = refused
    published = bool(decision.publish and req.publish is not None)
    if published:
        assert req.publish is not None
        publish(req.publish, out)
    record = {"from": str(y.root), "log": str(req.log.resolve()), "day": day.counts(), "data": merged.report(),
              "new_items": len(ids) - len(y.load_ids()), "plan": asdict(req.plan), "target": target,
              "priors": priors, "fresh": fresh, "gate": {**figures.to_json(), "rule": asdict(req.rule)},
              "passed": decision.publish,
              "published": str(req.publish) if published else None, "reason": decision.reason,
              "seconds": {k: round(v, 1) for k, v in steps.items()} | {"total": round(time.monotonic() - t0, 1)},
              "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    today.update(refresh=record, refreshes=[*y_meta.get("refreshes", []), _summary(record)])
    return record


def _summary(record: dict[str, Any]) -> dict[str, Any]:
    """The line of one refresh in bundle.json's ``"refreshes"`` history (yesterday's carried over)."""
    return {"finished_at": record["finished_at"], "added": record["data"]["added"], "passed": record["passed"],
            "ndcg@10": record["gate"]["today"], "yesterday": record["gate"]["yesterday"],
            "seconds": record["seconds"]["total"]}


def _prepare_out(req: RefreshRequest, y: Any) -> Path:
    """``req.out`` with yesterday's files that carry over: a new directory, or the same refresh's (resumed)."""
    from recsvc.bundle.directory import Bundle

    out = req.out
    if out.resolve() == y.root:
        raise UserError(f"--out {out} is yesterday's bundle: write today's beside it")
    if out.exists() and any(out.iterdir()):
        meta = Bundle.open(out).read() if (out / "bundle.json").is_file() else {}
        if meta.get("refreshing") != {"from": str(y.root), "log": str(req.log.resolve())}:
            raise UserError(f"--out {out} exists and is not this refresh's: give a new directory")
        return out
    shutil.copytree(y.root, out, dirs_exist_ok=True,
                    ignore=lambda src, names: [n for n in names if Path(src) == y.root and n in NOT_COPIED])
    meta = Bundle.open(out).read()
    meta.pop("refresh", None)
    meta["refreshing"] = {"from": str(y.root), "log": str(req.log.resolve())}
    Bundle(out).write(meta)
    return out


def publish(link: Path, bundle: Path) -> None:
    """Point ``link`` at ``bundle`` with one rename (what ``recsvc serve --bundle LINK`` follows)."""
    if link.exists() and not link.is_symlink():
        raise UserError(f"--publish {link} exists and is not a symlink: name the link the server follows")
    tmp = link.with_name(link.name + ".tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(bundle.resolve(), tmp)
    os.replace(tmp, link)


def log_line(record: dict[str, Any], out: Path) -> str:
    """The one line a refresh prints (JSON)."""
    return json.dumps({"event": "refresh", "bundle": str(out), "passed": record["passed"],
                       "published": record["published"], "added": record["data"]["added"],
                       "new_items": record["new_items"], "target_epochs": (record["target"] or {}).get("epochs", 0),
                       "ndcg@10": record["gate"]["today"], "yesterday": record["gate"]["yesterday"],
                       "ratio": record["gate"]["ratio"], "seconds": record["seconds"]["total"],
                       "reason": record["reason"]})
