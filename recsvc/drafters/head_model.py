"""A recurrent draft head on the target (ReDrafter style): drafts code tokens with no transformer forward.

The target's final hidden state h at a trie node (a code prefix of depth j, or the prompt's last token for the
root) already fixes its next-code distribution exactly (the target's LM head). The head drafts the depths after
that one. A small recurrent cell consumes the codes one by one, starting from h:

    s_0 = tanh(A h)                                   (a state summarising the target's context)
    s_t = silu(U s_{t-1} + W e(level, code_t) + b)    (the code just drafted, embedded per level)
    z_t = h + MLP([s_t, h])                           (a pseudo hidden state; = h at initialisation)
    log q(next code) = log_softmax(z_t O_level^T + c_level)   over the C codes of the next level

``O_level`` starts as the target's LM-head rows of that level's code tokens, so an untrained head already
predicts "the next code as if h were its context". The head never sees the prompt: the target's hidden state
carries it, which is why it is cheap (a few [M, H] x [H, H] matmuls per drafted depth, M = the draft beams).

Shapes: M rows (draft beams), H the target's hidden size, S the state size, L levels, C codes per level.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from recsvc.errors import UserError

CONFIG, WEIGHTS = "config.json", "model.safetensors"


@dataclass(frozen=True)
class HeadConfig:
    hidden: int  # H: the target's hidden size
    levels: int  # L: codes per item id
    codebook: int  # C: codes per level
    state: int = 0  # S: the recurrent state size (0: = hidden)

    @property
    def state_size(self) -> int:
        return self.state or self.hidden


class DraftHead(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, s, c, n = cfg.hidden, cfg.state_size, cfg.codebook, cfg.levels
        self.start_proj = nn.Linear(h, s)
        self.embed = nn.Embedding(n * c, s)  # (level, code) -> e
        self.u = nn.Linear(s, s, bias=False)
        self.w = nn.Linear(s, s)
        self.mlp = nn.Sequential(nn.Linear(s + h, h), nn.SiLU(), nn.Linear(h, h))
        nn.init.zeros_(self.mlp[2].weight)  # z = h at initialisation
        nn.init.zeros_(self.mlp[2].bias)
        self.out = nn.Parameter(torch.randn(n, c, h) * h ** -0.5)  # [L, C, H]
        self.out_bias = nn.Parameter(torch.zeros(n, c))  # [L, C]

    def init_from_lm_head(self, lm_head: torch.Tensor, code_offset: int) -> None:
        """Copy the target's LM-head rows of every level's code tokens ([V, H] -> out [L, C, H])."""
        cfg = self.cfg
        rows = lm_head.detach().float()[code_offset: code_offset + cfg.levels * cfg.codebook]
        with torch.no_grad():
            self.out.copy_(rows.view(cfg.levels, cfg.codebook, cfg.hidden))

    def start(self, h: torch.Tensor) -> torch.Tensor:  # [M, H] -> [M, S]
        return torch.tanh(self.start_proj(h))

    def step(
        self,
        state: torch.Tensor,  # [M, S]
        h: torch.Tensor,  # [M, H] the target's hidden state at the draft's root
        level: torch.Tensor,  # [M] 0-based level of the code consumed (its node's depth - 1), < L - 1
        code: torch.Tensor,  # [M] the code consumed
        read: bool = True,  # False: no host read (the sync-free searches): the all-levels path whatever the rows
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (state [M, S], log q [M, C] over level + 1's codes)
        e = self.embed(level * self.cfg.codebook + code)
        state = F.silu(self.u(state) + self.w(e))
        z = h + self.mlp(torch.cat([state, h], -1))  # [M, H]
        lo, hi = (int(level.min()), int(level.max())) if read else (0, 1)
        if lo == hi:  # one level for every row (training; most draft steps)
            logits = z @ self.out[lo + 1].T + self.out_bias[lo + 1]  # [M, C]
        else:  # one matmul over all levels' codes, then each row's slice
            c = self.cfg.codebook
            every = z @ self.out.view(-1, z.shape[-1]).T + self.out_bias.view(-1)  # [M, L C]
            logits = every.gather(1, (level + 1)[:, None] * c + torch.arange(c, device=z.device))
        return state, torch.log_softmax(logits.float(), -1)


def save_head(head: DraftHead, out_dir: str | Path, info: dict | None = None) -> None:
    """BUNDLE/head: config.json (the shape and training facts) + model.safetensors (weights only)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}, str(out / WEIGHTS))
    (out / CONFIG).write_text(json.dumps({"head": asdict(head.cfg), **(info or {})}, indent=1, default=str))


def load_head(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> DraftHead:
    from safetensors.torch import load_file

    root = Path(path)
    if not (root / CONFIG).is_file() or not (root / WEIGHTS).is_file():
        raise UserError(f"no draft head in {root}: run `recsvc train head --bundle ...` first")
    cfg = HeadConfig(**json.loads((root / CONFIG).read_text())["head"])
    head = DraftHead(cfg)
    head.load_state_dict(load_file(str(root / WEIGHTS)))
    return head.to(dtype=dtype, device=device).eval()
