"""``recsvc refresh replay``: a split's validation period replayed as days, refreshed day by day from the
from-scratch bundle's train-period models, and the last day's bundle set against the from-scratch bundle (trained
on train + valid at once) on the test period.

The split keeps no timestamps, only each user's order, and the validation period is one stretch of global time
(the 10% before test). Each user's validation items are given times drawn uniformly over the period and sorted
(seeded), so each user's order is kept and the days share the period's interactions evenly; day d is the
d-th of ``days`` equal slices. Day 0 is the from-scratch bundle as trained on the train period
(BUNDLE/target-train, its prior's train-period SASRec, the transition counted on train, the fresh set counted on
train). Each day's log is a CSV
as a team's export would be (user, the item's key, time).

With ``corrupt_day``, that day's item keys are shuffled among its rows first (an export that mis-keyed items):
the gate must keep that refresh aside; the day is then refreshed again from its clean log, as a team would once
the export is fixed, so the replay ends on the same data as the from-scratch bundle.

Measured: each refresh's wall time against the from-scratch bundle's recorded target stage (selection + refit)
and tunings (bundle.json), the target's epochs against the from-scratch schedule's, and on the test period
(history = train + valid) NDCG@10 / Recall@10 of the last published bundle against the from-scratch one, as
served and the target alone, paired per user (difference with its standard error, ratio with its 95% interval).
"""

from __future__ import annotations

import csv
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from recsvc.errors import UserError
from training.refresh.gate import GateRule
from training.refresh.models import ContinuePlan

DAY_S = 86400
START = 1_767_225_600  # 2026-01-01T00:00:00Z: the replay's first day (the split has no times of its own)


def replay(scratch: Path, out: Path, days: int, plan: ContinuePlan, rule: GateRule,
           corrupt_day: int | None = None, seed: int = 0) -> dict[str, Any]:
    from recsvc.data.split import load_split_dir
    from training.refresh.run import RefreshRequest, publish, refresh

    data = load_split_dir(_scratch_bundle(scratch).resolve_data_dir())
    out.mkdir(parents=True, exist_ok=True)
    current = out / "current"
    day0 = out / "day0"
    if not (day0 / "bundle.json").is_file():
        make_day0(scratch, day0)
    if not current.is_symlink():
        publish(current, day0)
    logs = write_days(data, out / "days", days, seed)
    runs: list[dict[str, Any]] = []
    for d in range(1, days + 1):
        tries = [("corrupt", corrupt_log(logs[d], out / "days" / f"day{d}-corrupt.csv", seed))] \
            if d == corrupt_day else []
        for label, log in [*tries, ("clean", logs[d])]:
            dest = out / (f"day{d}" if label == "clean" else f"day{d}-{label}")
            t0 = time.monotonic()
            record = _resumed(dest) or refresh(RefreshRequest(current, log, dest, current, plan=plan, rule=rule))
            runs.append({"day": d, "log": label, "bundle": str(dest), "passed": record["passed"],
                         "reason": record["reason"], "seconds": record["seconds"], "gate": record["gate"],
                         "data": record["data"], "wall_s": round(time.monotonic() - t0, 1)})
            print(json.dumps({"day": d, "log": label, "passed": record["passed"],
                              "seconds": record["seconds"]["total"], "ndcg@10": record["gate"]["today"],
                              "yesterday": record["gate"]["yesterday"], "reason": record["reason"]}), flush=True)
    final = current.resolve()
    result = {"days": days, "plan": plan.__dict__, "rule": rule.__dict__, "runs": runs,
              "scratch": scratch_cost(scratch), "test": compare_on_test(final, scratch)}
    result["summary"] = summary(result)
    (out / "replay.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _scratch_bundle(scratch: Path):
    from recsvc.bundle.directory import Bundle

    b = Bundle.open(scratch)
    if b.architecture != "items" or b.read().get("protocol") != "deploy" or not b.train_only_target_dir.is_dir():
        raise UserError(f"{scratch}: the replay starts from an items bundle of the deploy protocol (with "
                        "BUNDLE/target-train): `recsvc build --recipe served-items`")
    return b


def _resumed(dest: Path) -> dict[str, Any] | None:
    """A finished refresh's record (a re-run of the replay skips it)."""
    meta = dest / "bundle.json"
    if not meta.is_file():
        return None
    return json.loads(meta.read_text()).get("refresh")


def make_day0(scratch: Path, out: Path) -> None:
    """The from-scratch bundle as trained on the train period: target-train served, the prior's train-period
    SASRec, the transition counted on train; its split's valid period empty (the days bring it)."""
    from recsvc.bundle.directory import Bundle
    from recsvc.bundle.serving_files import write_serving_files
    from recsvc.data.split import load_split_dir, write_split_dir
    from recsvc.priors.mixed import MIX_FILE, SEQUENCE_DIR
    from recsvc.priors.transition import TransitionPrior
    from training.refresh.models import refresh_fresh
    from training.refresh.run import NOT_COPIED

    src = _scratch_bundle(scratch)
    data = load_split_dir(src.resolve_data_dir())
    shutil.copytree(src.root, out, ignore=lambda d, names: [n for n in names if Path(d) == src.root
                                                                  and n in NOT_COPIED])
    for name in ("target", "target-train"):  # served, and what the gate scores under the paper protocol
        shutil.copytree(src.train_only_target_dir, out / name, ignore=shutil.ignore_patterns("checkpoint*"))
    day0_data = write_split_dir(out / "data", data.train, {}, data.test, data.items)
    ids = src.load_ids()
    for name in ("prior", "prior-excl"):
        prior = src.root / name
        if not (prior / "prior.json").is_file():
            continue
        settings = TransitionPrior.load(prior).settings
        TransitionPrior.fit(data.train.values(), ids.item_ids.tolist(), settings, fitted_on="train+valid").save(
            out / name)
        if (prior / "sequence-train").is_dir():
            for seq in ("sequence", "sequence-train"):
                shutil.copytree(prior / "sequence-train", out / name / seq)
            shutil.copy2(prior / SEQUENCE_DIR / MIX_FILE, out / name / SEQUENCE_DIR / MIX_FILE)
    b = Bundle(out)
    b.update(data=str(day0_data.resolve()), protocol="deploy", replay_day0_of=str(src.root))
    if src.has_fresh():
        refresh_fresh(src.fresh_dir, load_split_dir(day0_data), ids, b.fresh_dir)
    write_serving_files(out, load_split_dir(day0_data))


def write_days(data, out: Path, days: int, seed: int) -> dict[int, Path]:
    """The validation period as ``days`` CSV logs (user_id, item_id = the item's key, timestamp)."""
    from recsvc.bundle.keys import keys_of_items

    keys = keys_of_items(data.items)[0]
    rng = np.random.default_rng(seed)
    rows: dict[int, list[tuple[int, str, str]]] = {d: [] for d in range(1, days + 1)}
    for user in sorted(data.valid):
        items = [i for i in data.valid[user] if i in keys]
        times = np.sort(rng.random(len(items)))  # [n] fractions of the period, in the user's order
        for item, t in zip(items, times, strict=True):
            d = min(days, int(t * days) + 1)
            rows[d].append((START + int(t * days * DAY_S), str(user), keys[item]))
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for d, day_rows in rows.items():
        paths[d] = out / f"day{d}.csv"
        with paths[d].open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["user_id", "item_id", "timestamp"])
            w.writerows((u, k, t) for t, u, k in sorted(day_rows))
    return paths


def corrupt_log(log: Path, out: Path, seed: int) -> Path:
    """``log`` with its item column shuffled among its rows."""
    with log.open(newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    keys = [r[1] for r in body]
    np.random.default_rng(seed + 1).shuffle(keys)
    with out.open("w", newline="") as f:
        csv.writer(f).writerows([header, *([r[0], k, r[2]] for r, k in zip(body, keys, strict=True))])
    return out


def scratch_cost(scratch: Path) -> dict[str, Any]:
    """The from-scratch bundle's recorded cost: its target stage (selection + refit epochs and seconds) and the
    tunings it ran (bundle.json's recipe records and tuning blocks). Not counted: the ids stage and the SASRec
    fits the mix tuning took from the baselines' cache, which a from-scratch build pays too (so the ratio is an
    upper bound)."""
    meta = json.loads((scratch / "bundle.json").read_text())
    target = meta["stages"]["target"]
    sel, refit = target.get("selection", {}), target.get("refit", {})
    sel_epochs = len(json.loads((scratch / "target-train" / "training.json").read_text())["epochs"])
    tunings = {name: rec["seconds"] for name, rec in meta.get("recipe", {}).items() if rec.get("done")}
    for name, rec in meta.get("tuning", {}).items():  # tunings run by hand beside the recipe's records
        if name not in tunings and isinstance(rec, dict) and "seconds" in rec:
            tunings[name] = rec["seconds"]
    seconds = float(sel.get("seconds", 0)) + float(refit.get("seconds", 0)) + sum(tunings.values())
    return {"target_epochs": sel_epochs + int(refit.get("epochs", 0)), "target_seconds":
            round(float(sel.get("seconds", 0)) + float(refit.get("seconds", 0)), 1), "tunings": tunings,
            "seconds": round(seconds, 1)}


def compare_on_test(final: Path, scratch: Path) -> dict[str, Any]:
    """The last published bundle against the from-scratch one on the test period, as served and the targets
    alone; both read the last bundle's split (its train + valid are the scratch split's, in each user's order)."""
    from recsvc.bundle.directory import Bundle
    from training.evaluation.bundle_ranking import Parts, rank_bundle
    from training.evaluation.lead import paired_lead
    from training.evaluation.paired import slice_scores

    data_dir = Bundle.open(final).resolve_data_dir()
    excl = Bundle.open(scratch).serves_excluding_history()
    out: dict[str, Any] = {"users": 0}
    for label, parts in (("served", Parts()), ("target", Parts(prior=False))):
        a = rank_bundle(final, "test", [10], data_dir=data_dir, exclude_history=excl, parts=parts)
        b = rank_bundle(scratch, "test", [10], data_dir=data_dir, exclude_history=excl, parts=parts)
        assert a is not None and b is not None
        users = {"all": [u for u in a.users if u.targets]}
        out["users"] = len(users["all"])
        mine, theirs = slice_scores(a.lists, users, [10])["all"], slice_scores(b.lists, users, [10])["all"]
        out[label] = {key: paired_lead(mine[key], theirs[key]) for key in ("ndcg@10", "recall@10")}
    return out


def summary(result: dict[str, Any]) -> dict[str, Any]:
    scratch = result["scratch"]
    clean = [r for r in result["runs"] if r["log"] == "clean"]
    worst = max(r["seconds"]["total"] for r in clean)
    test = result["test"]
    return {"refresh_seconds": [r["seconds"]["total"] for r in clean], "scratch_seconds": scratch["seconds"],
            "worst_ratio": round(worst / scratch["seconds"], 3) if scratch["seconds"] else None,
            "target_epochs": f"{result['plan']['target_epochs']} per refresh, {scratch['target_epochs']} from scratch",
            "published": [(r["day"], r["log"], r["passed"]) for r in result["runs"]],
            "kept_aside": [r["reason"] for r in result["runs"] if not r["passed"]],
            "test_ndcg@10": {k: {f: (round(v, 5) if isinstance(v, float) else v)
                                 for f, v in test[k]["ndcg@10"].items()} for k in ("served", "target")},
            "within_one_se": {k: test[k]["ndcg@10"]["diff"] >= -test[k]["ndcg@10"]["diff_se"]
                              for k in ("served", "target")}}
