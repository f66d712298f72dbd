"""The record of how a query was decoded (torch-free: the service reads it without loading the engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["plain", "strict", "relaxed"]
MODES: tuple[Mode, ...] = ("plain", "strict", "relaxed")
# what ran: a requested mode, or "sampling" (relaxed asked for, the target's own sampling beam search answered)
DecodedMode = Literal["plain", "strict", "relaxed", "sampling"]


@dataclass(frozen=True)
class Decoding:
    """How the engine decoded one query: what it did, which may differ from what the query asked for."""

    mode: DecodedMode  # plain beam search / strict or relaxed speculation / the target's own sampling
    beam_width: int  # beams searched (plain, strict: >= k, the first k returned; sampling modes: k)
    draft_beams: int = 0  # N, beams drafted per round (speculating only)
    gamma: int = 0  # draft depths per round (speculating only)
    fallback: str = ""  # why the query's mode did not run ("" when it did), e.g. "no drafter"
