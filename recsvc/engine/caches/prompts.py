"""A batch of prompts, right-padded into one tensor (the prefill's key sets: ``TreeGroups.prompt_lengths``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptBatch:
    ids: torch.Tensor  # [B, T] right-padded token ids (pad = the row's first token)
    lengths: torch.Tensor  # [B] real prompt lengths
    valid: torch.Tensor  # [B, T] bool, True on real prompt slots

    @classmethod
    def from_lists(cls, prompts: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> PromptBatch:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        t = max(len(p) for p in prompts)
        ids = torch.tensor([list(p) + [p[0]] * (t - len(p)) for p in prompts], dtype=torch.long, device=device)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
        valid = torch.arange(t, device=device)[None, :] < lengths[:, None]
        return cls(ids, lengths, valid)

    def to(self, device: torch.device | str) -> PromptBatch:
        """The batch on ``device`` (``self`` when it is there already): the searches move prompts to their
        model's device once, at the start."""
        if self.ids.device == torch.device(device):
            return self
        return PromptBatch(self.ids.to(device), self.lengths.to(device), self.valid.to(device))

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])

    def positions(self) -> torch.Tensor:
        return torch.arange(self.width, device=self.ids.device)[None].expand(len(self.lengths), -1)
