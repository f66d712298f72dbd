"""How the commands write their figures: a JSON record, a markdown table."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: str | Path | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=1))


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """columns: (key, header). Floats get 3 decimals."""
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "| " + " | ".join("---" for _ in columns) + " |"
    body = []
    for r in rows:
        cells = [f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k, _ in columns]
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *body])
