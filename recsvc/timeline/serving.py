"""The item-level target as a service loads it: the model on its device and precision. (Over a live catalog,
whose merged ids number the catalog rows anew, the users' states read the per-item table's rows from the ids the
model was trained over: ``recsvc.timeline.search.user_states``' ``table``.)"""

from __future__ import annotations

from pathlib import Path

import torch

from recsvc.errors import UserError
from recsvc.timeline.model import TimelineModel

SERVED_DEVICES = ("cpu",)  # recsvc.timeline.search builds its tensors on the CPU


def load_timeline(directory: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> TimelineModel:
    """``TimelineModel.load(directory)`` in ``dtype`` on ``device`` (eval mode); UserError for a device the
    search does not run on."""
    if torch.device(device).type not in SERVED_DEVICES:
        raise UserError(f"the item-level target is served on the CPU only (asked: {device}): its search "
                        "(recsvc.timeline.search) builds its tensors there")
    return TimelineModel.load(directory).to(device=device, dtype=dtype).eval()
