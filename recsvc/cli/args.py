"""Argument helpers shared by the commands: integer lists and torch's thread count."""

from __future__ import annotations

import torch

from recsvc.errors import UserError


def parse_int_list(text: str, flag: str, lo: int = 1, hi: int = 100) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < lo or max(values) > hi:
        raise UserError(f"{flag} values must lie in {lo}..{hi}, got {text!r}")
    return values


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise UserError("--threads must be >= 1")
        torch.set_num_threads(threads)
