"""Per-request random numbers drawn ahead on the host and consumed on the device: ``NoiseStream``.

Seeded sampling draws its noise from one CPU generator per request (``sampling.uniform``), so a request draws the
same numbers on any device. How many numbers a relaxed request draws depends on device values (whether any row
still goes, whether any verifies), which the host would have to read. A ``NoiseStream`` draws a budget of
uniforms per request up front (one host-to-device copy) and keeps a cursor per request on the device: a draw
reads the numbers at the cursor, and the cursor advances by what the draw took only where a device condition
holds (``gated``). A CPU generator's float32 draws are one stream however they are split (``torch.rand(3)`` then
``torch.rand(5)`` equals ``torch.rand(8)``), so a search that advances the cursor exactly where the eager search
draws gets exactly its numbers, without reading anything.

    >>> g = torch.Generator(); _ = g.manual_seed(1)
    >>> eager = torch.rand(5, generator=g)
    >>> g = torch.Generator(); _ = g.manual_seed(1)
    >>> stream = NoiseStream([g], 8, "cpu")
    >>> skipped = stream.take((2,), when=torch.tensor([False]))  # a draw the eager search did not make
    >>> torch.equal(torch.cat([stream.take((2,))[0], stream.take((3,))[0]]), eager)
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


class NoiseStream:
    def __init__(self, gens: Sequence[torch.Generator], budget: int, device: torch.device | str) -> None:
        """``budget`` uniforms per request from each of ``gens`` (request b's from gens[b]), copied to ``device``
        once: at least what the search can draw."""
        self.budget = budget
        self.block = torch.stack([torch.rand(budget, generator=g) for g in gens]).to(device)  # [B, budget]
        self.cursor = torch.zeros(len(gens), dtype=torch.long, device=self.block.device)  # [B]
        self.gate: torch.Tensor | None = None  # [B] bool: rows whose draws count now (None: every row)

    def __len__(self) -> int:
        return self.block.shape[0]

    def take(self, shape: tuple[int, ...], rows: Sequence[int] | None = None, when: torch.Tensor | None = None
             ) -> torch.Tensor:
        """[B, *shape] uniforms at each request's cursor; the cursor moves past them where ``when`` [B] (and the
        stream's gate) hold. ``rows``: every request in order (the sync-free searches never drop one)."""
        if rows is not None and list(rows) != list(range(len(self))):
            raise ValueError("a NoiseStream draws for every request of its batch, in order")
        n = 1
        for d in shape:
            n *= d
        at = self.cursor  # [B]
        cols = (at[:, None] + torch.arange(n, device=at.device)).clamp(max=self.budget - 1)
        u = self.block.gather(1, cols)  # [B, n] (past the budget: see ``overdrawn``)
        step = torch.full_like(at, n)
        for cond in (when, self.gate):
            if cond is not None:
                step = step * cond.long()
        self.cursor = at + step
        return u.view(len(self), *shape)

    def overdrawn(self) -> torch.Tensor:
        """[] bool on the device: some request drew past its budget (its numbers repeat: a bug to report)."""
        return (self.cursor > self.budget).any()

    def mark(self) -> torch.Tensor:
        """The cursors now [B] (to draw two alternatives from the same place: ``rewind``)."""
        return self.cursor.clone()

    def rewind(self, cursor: torch.Tensor) -> None:
        self.cursor = cursor.clone()


@contextmanager
def gated(gens: Sequence[torch.Generator] | NoiseStream, cond: torch.Tensor) -> Iterator[None]:
    """Draws from ``gens`` inside count only for the rows where ``cond`` [B] holds (a NoiseStream; CPU generators
    are drawn from as the code runs, so there is nothing to gate)."""
    if not isinstance(gens, NoiseStream):
        yield
        return
    before = gens.gate
    gens.gate = cond if before is None else before & cond
    try:
        yield
    finally:
        gens.gate = before
