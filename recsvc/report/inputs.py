"""Reading a report input: the JSON file, and which writer made it (by its content, not its name).

- ``eval``: `recsvc eval --json` (``"model"`` with Recall@K / NDCG@K, ``"ks"``, and usually ``"baselines"`` and
  ``"lead"``);
- ``decode`` / ``speculative`` / ``cache`` / ``replay``: `recsvc bench NAME --json` (``"bench": NAME``, ``"rows"``);
- ``serve``: `recsvc bench serve --json` (``"rows"``, ``"serving"``, ``"duration_s"``);
- ``curves``: a training record, ``BUNDLE/target/training.json``, a drafter's ``training.json`` or a draft head's
  ``config.json`` (``"history"``: one row per evaluation, each with its ``"epoch"``); a bundle directory stands for
  its target's record.

Anything else (not a file, not JSON, another layout) is a :class:`recsvc.errors.UserError` (exit 2) naming the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recsvc.errors import UserError

BENCHES = ("decode", "speculative", "cache", "replay")
KINDS = ("eval", *BENCHES, "serve", "curves")
KNOWN = ("a `recsvc eval --json` file, a `recsvc bench decode|speculative|cache|replay|serve --json` file or a "
         "training record (BUNDLE/target/training.json)")


@dataclass(frozen=True)
class Input:
    path: Path
    kind: str  # one of KINDS
    data: dict[str, Any]

    @property
    def stem(self) -> str:
        """The output files' prefix: the file's name, after the folder it lies in for a record's generic name
        (``target_training``, ``sft_training``, ``head_config``)."""
        if self.kind == "curves" and self.path.name in ("training.json", "config.json"):
            return f"{self.path.parent.name}_{self.path.stem}"
        return self.path.stem


def read_input(text: str) -> Input:
    """The file (or a bundle directory's target record) -> its parsed JSON and kind."""
    path = Path(text)
    if path.is_dir():
        record = path / "target" / "training.json"
        if not record.is_file():
            raise UserError(f"{path} is a directory without a target training record ({record} not found)")
        path = record
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text file (expected JSON)") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(data).__name__}; give {KNOWN}")
    return Input(path, classify(path, data), data)


def classify(path: Path, data: dict[str, Any]) -> str:
    bench = data.get("bench")
    if isinstance(bench, str):
        if bench not in BENCHES:
            raise UserError(f"{path}: `recsvc bench {bench}` output has no plot (plotted: "
                            f"{', '.join((*BENCHES, 'serve'))})")
        return bench
    if isinstance(data.get("model"), dict) and "ks" in data:
        return "eval"
    if "baselines" in data and "ks" in data:
        raise UserError(f"{path}: a --baselines-only evaluation (no model to plot beside the baselines)")
    if "serving" in data and "rows" in data and "duration_s" in data:
        return "serve"
    history = data.get("history")
    if isinstance(history, list) and history and all(isinstance(r, dict) and "epoch" in r for r in history):
        return "curves"
    if isinstance(history, list):
        raise UserError(f"{path}: a training record without evaluated epochs (empty or malformed 'history')")
    raise UserError(f"{path}: not a layout `recsvc report` reads; give {KNOWN}")
