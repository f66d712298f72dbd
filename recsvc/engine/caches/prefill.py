"""The prompt prefill of the fast forward, with the user-state cache (``recsvc.engine.caches.state_cache``).

Layout of a request's cache row: its prompt at slots 0..T_b - 1, padding up to the batch's prompt width T, one
scratch slot T (where padding tokens write; never visible), then the generated tokens. Rows whose prompt (or a
prefix of it) is cached get those slots copied in; one forward runs every row's remaining prompt tokens (none:
no forward), each attending its row's slots 0..itself. Only each prompt's last token feeds a head, so the
forward's last layer computes keys / values for every token and the rest (q, attention, o, MLP, final norm)
for that token only (``FastLlama.forward``'s ``keep``).

Shapes: B requests, T prompt width, q tokens computed per row, H hidden, C codebook size.
"""

from __future__ import annotations

import torch

from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.caches.state_cache import UserState, UserStateCache
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.kernels.fast import FastCache


class Prefill:
    """One batch's prompt prefill: ``run`` fills the cache, ``remember`` stores what it computed."""

    prune = True  # the last layer's q / attention / MLP on each prompt's last token only (tests compare)

    def __init__(self, model: EngineModel, cache: FastCache, prompts: PromptBatch,
                 states: UserStateCache | None, count: bool = True) -> None:
        """``count``: whether the cache's lookups count as hits / misses (False: a prefill ahead of demand)."""
        self.model, self.cache, self.prompts, self.states = model, cache, prompts, states
        b = len(prompts.lengths)
        if states is None and model.plan.sync_free:  # nothing to look up: no host read of the prompts
            self.tokens: list[tuple[int, ...]] = []
            self.entries: list[UserState | None] = [None] * b
            self.cached, self.full = [0] * b, [False] * b
            self.calls = 0
            return
        lengths = prompts.lengths.tolist()
        self.tokens = [tuple(prompts.ids[r, :n].tolist()) for r, n in enumerate(lengths)]
        found = [states.lookup(t, count) for t in self.tokens] if states is not None else [(None, 0)] * len(lengths)
        self.entries = [e for e, _ in found]
        self.cached = [n for _, n in found]  # tokens of each prompt taken from the cache
        self.full = [n == t for n, t in zip(self.cached, lengths, strict=True)]
        self.calls = 0

    @property
    def width(self) -> int:
        """Cache slots the prompts occupy (the prompt width + the scratch slot)."""
        return self.prompts.width + 1

    def run(self) -> torch.Tensor:  # [B, H] final hidden state of each prompt's last token
        p = self.prompts
        b, t = len(self.tokens), p.width
        self.cache.reserve(t + 1, b)
        for row, (entry, n) in enumerate(zip(self.entries, self.cached, strict=True)):
            if entry is not None:
                self.cache.load_rows(row, [(k[:, :n], v[:, :n]) for k, v in entry.kv])
        lengths = p.lengths
        dev = lengths.device
        start = torch.tensor(self.cached, dtype=torch.long, device=dev)  # [B]
        # the tokens each row computes: sync-free (nothing cached) the prompt width, padding included (not read)
        q = t if self.model.plan.sync_free and not any(self.cached) else int((lengths - start).max())
        last = torch.zeros(b, self.model.hidden_size, dtype=self.model.dtype, device=self.model.device)
        if q > 0:
            pos = start[:, None] + torch.arange(q, device=dev)[None]  # [B, q] prompt positions computed
            real = pos < lengths[:, None]
            ids = p.ids.gather(1, pos.clamp(max=t - 1))
            slots = torch.where(real, pos, t)
            keys = torch.arange(t + 1, device=dev)[None, None]  # [1, 1, T + 1]
            visible = ((keys <= pos[..., None]) & (keys < lengths[:, None, None]) & real[..., None]) | (
                keys == slots[..., None])  # [B, q, T + 1]
            idx = (lengths - 1 - start).clamp(min=0)  # [B] each row's last prompt token among the q computed
            keep = idx[:, None] if self.prune else None  # the last layer runs q / attention / MLP on it only
            hidden = self.model.forward_masked(self.cache, ids, torch.where(real, pos, 0), slots, visible, keep)
            self.calls = 1
            last = hidden[:, 0].clone() if self.prune else hidden[torch.arange(b, device=hidden.device), idx]
        for row, entry in enumerate(self.entries):
            if self.full[row]:
                assert entry is not None
                last[row] = entry.hidden
        return last

    def cached_first(self) -> torch.Tensor | None:
        """[B, C] the first code's log-probs when every prompt is a full hit that kept them, else None."""
        if all(f and e is not None and e.logp0 is not None for f, e in zip(self.full, self.entries, strict=True)):
            return torch.stack([e.logp0 for e in self.entries if e is not None and e.logp0 is not None])
        return None

    def first_logprobs(self, hidden: torch.Tensor, code_offset: int, codebook_size: int) -> torch.Tensor:
        """[B, H] -> [B, C] the first code's log-probs: cached for full hits, computed for the others."""
        cached = self.cached_first()
        if cached is not None:
            return cached
        level = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)
        return self.model.code_logprobs(hidden, level, code_offset, codebook_size)

    def remember(self, hidden: torch.Tensor, logp0: torch.Tensor | None) -> None:
        """Store the prompts this prefill computed (hidden [B, H], logp0 [B, C] or None)."""
        if self.states is None:
            return
        for row, tokens in enumerate(self.tokens):
            if not self.full[row]:
                self.entries[row] = self.states.store(tokens, self.cache.rows_of(row, len(tokens)),
                                                      hidden[row].clone(),
                                                      logp0[row].clone() if logp0 is not None else None)

    def load_step(self, keys: list[tuple[int, ...]], beams: int, width: int) -> torch.Tensor | None:
        """Plain beam search's decode step over K beams written at slots width..width+K-1, ``keys``: per row,
        the beams' code paths (catalog-independent: a trie's node ids change with the catalog). When every row
        kept exactly these beams under its prompt, their keys / values are copied into those slots and their
        [B, K, H] hidden states returned (no forward); else None."""
        if self.states is None:
            return None
        kept = [e.steps.get(key) if e is not None else None for e, key in zip(self.entries, keys, strict=True)]
        if any(item is None for item in kept):
            return None
        b = len(keys)
        self.cache.reserve(width + beams, b)
        for row, item in enumerate(kept):
            assert item is not None
            kv = item[0]  # [layers, 2, h_kv, K, d]
            for i, layer in enumerate(self.cache.layers):
                layer.k[row, :, width:width + beams] = kv[i, 0]
                layer.v[row, :, width:width + beams] = kv[i, 1]
        return torch.stack([item[1] for item in kept if item is not None])

    def store_step(self, keys: list[tuple[int, ...]], width: int, hidden: torch.Tensor) -> None:
        """Keep a computed decode step (beams with code paths ``keys`` at slots width.., hidden [B, K, H])."""
        if self.states is None:
            return
        beams = hidden.shape[1]
        for row, (entry, key) in enumerate(zip(self.entries, keys, strict=True)):
            if entry is not None:
                slots = slice(width, width + beams)
                kv = torch.stack([torch.stack([layer.k[row, :, slots], layer.v[row, :, slots]])
                                  for layer in self.cache.layers])
                self.states.add_step(entry, key, kv, hidden[row].clone())
