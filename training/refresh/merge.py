"""Yesterday's split + the appended day -> today's split (``DATA/`` of today's bundle).

What yesterday's served model learnt from (its split's train and valid periods) becomes today's history; the
day's interactions follow each user's history in time order. Each user of the day who has an item before their
last one of the day keeps that last item aside: today's ``valid`` (what the gate scores yesterday's and today's
bundles on, paired); everything else of the day joins ``train`` (what today's models learn from). Tomorrow's
refresh learns from the items kept aside today. The ``test`` period stays as it was: the offline evaluation's,
never trained on. A pair already in the user's history (a repeat) is dropped and counted, as the importer
dedupes pairs.

Users are keyed as the log keys them: ``DATA/users.json`` maps each user's key to the split's number (a split
without the file, such as one written before it existed, keys each user by the number itself, as text); a key
seen for the first time gets the next number.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recsvc.data.split import ItemMeta, SplitData, write_split_dir
from recsvc.errors import UserError
from training.refresh.day_log import DayLog

USERS_FILE = "users.json"


def read_user_keys(data_dir: str | Path, data: SplitData) -> dict[str, int]:
    """user key -> the split's user number (DATA/users.json, or each number as its own key)."""
    path = Path(data_dir) / USERS_FILE
    if not path.is_file():
        return {str(u): u for u in data.train}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        keys = {str(k): int(v) for k, v in doc.items()}
    except (OSError, ValueError, AttributeError) as exc:
        raise UserError(f"{path}: expected {{\"<user key>\": <user number>}} ({exc})") from exc
    missing = sorted(set(data.train) - set(keys.values()))
    if missing:
        raise UserError(f"{path}: users {missing[:5]} of the split have no key")
    return keys


@dataclass(frozen=True)
class MergedDay:
    """Today's split as written, and what the day added."""

    data_dir: Path
    users: int
    items: int
    added: int  # interactions of the day now in today's split (train or valid)
    day_users: int
    new_users: int
    held_out: int  # the day's last items kept aside as today's valid (one per user that has one)
    repeats: int  # pairs already in the user's history, dropped

    def report(self) -> dict[str, Any]:
        return {"users": self.users, "items": self.items, "added": self.added, "day_users": self.day_users,
                "new_users": self.new_users, "held_out": self.held_out, "repeats": self.repeats}


def merge_day(data: SplitData, user_keys: Mapping[str, int], item_of: Mapping[str, int], day: DayLog,
              items: Mapping[int, ItemMeta], out: str | Path) -> MergedDay:
    """Writes today's split to ``out`` (module docstring); ``item_of``: item key -> item number (every key of
    ``day``); ``items``: today's catalog (yesterday's and the additions)."""
    users = dict(user_keys)
    history = {u: list(data.train[u]) + list(data.valid.get(u, [])) for u in data.train}
    seen = {u: set(h) for u, h in history.items()}
    day_items: dict[int, list[int]] = {}
    next_user = max(users.values(), default=0) + 1
    new_users = repeats = 0
    for _, user_key, item_key in day.events:
        user = users.get(user_key)
        if user is None:
            user, next_user, new_users = next_user, next_user + 1, new_users + 1
            users[user_key] = user
            history[user], seen[user] = [], set()
        item = item_of[item_key]
        if item in seen[user]:
            repeats += 1
            continue
        seen[user].add(item)
        day_items.setdefault(user, []).append(item)
    train, valid = {}, {}
    for user, past in history.items():
        new = day_items.get(user, [])
        keep_aside = bool(new) and len(past) + len(new) >= 2
        train[user] = past + (new[:-1] if keep_aside else new)
        valid[user] = [new[-1]] if keep_aside else []
    test = {u: list(data.test.get(u, [])) for u in train}
    root = write_split_dir(out, train, valid, test, dict(items))
    (root / USERS_FILE).write_text(json.dumps(users, sort_keys=True) + "\n", encoding="utf-8")
    held_out = sum(1 for v in valid.values() if v)
    return MergedDay(root, len(train), len(items), sum(map(len, day_items.values())), len(day_items), new_users,
                     held_out, repeats)
