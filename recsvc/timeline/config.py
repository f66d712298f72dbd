"""The item-level target's shape and file names (torch-free: the CLI's flags read the defaults)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from recsvc.errors import UserError

CONFIG_FILE = "timeline.json"
WEIGHTS_FILE = "timeline.safetensors"


@dataclass(frozen=True)
class TimelineConfig:
    """The item-level target's shape. ``levels`` / ``codebook_size``: the semantic ids'; ``num_items``: rows of the
    per-item table (0: no per-item embedding); ``text_dim``: the text embeddings' width (0: no text input)."""

    levels: int = 4
    codebook_size: int = 256
    hidden: int = 128
    layers: int = 2
    heads: int = 2
    ffn: int = 256
    decoder_layers: int = 1
    max_items: int = 50  # history positions the timeline reads (the most recent)
    dropout: float = 0.2  # on the item inputs and the state the decoder reads (training only)
    num_items: int = 0
    text_dim: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> TimelineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise UserError(f"{CONFIG_FILE}: unknown fields {unknown}")
        return cls(**raw)
