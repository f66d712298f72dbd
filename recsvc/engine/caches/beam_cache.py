"""The KV cache of plain beam search: each beam's key slots follow from its parent's.

One cache row per request: ``[prompt (padded to T) | K slots of step 1 | K slots of step 2 | ...]``. Beam j of
step d sits at slot ``T + (d - 1) K + j`` and attends its request's prompt slots and the slots of its path
(its parent's path + itself), exactly the keys a beam of transformers' ``generate`` holds in its own cache row,
so it goes through the same tree attention as ``TreeCache`` (bit-identical hidden states). What ``TreeCache``
adds for speculative decoding (nodes of any tree, reuse across rounds, compaction) is not needed here: the
beams' paths are carried along by the parent indices the selection returns.

Shapes: B requests, K beams, T padded prompt width, d depth, H hidden size.
"""

from __future__ import annotations

import torch

from recsvc.engine.caches.prefill import Prefill
from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.caches.state_cache import UserStateCache
from recsvc.engine.kernels.attention import TreeGroups
from recsvc.engine.kernels.engine_model import EngineModel
from tokenizer_rqvae.trie import CatalogTrie


class BeamCache:
    def __init__(self, model: EngineModel, trie: CatalogTrie, code_offset: int, prompts: PromptBatch,
                 states: UserStateCache | None = None, count: bool = True) -> None:
        trie, prompts = trie.to(model.device), prompts.to(model.device)  # once, at the start of a search
        self.model, self.trie, self.code_offset, self.prompts = model, trie, code_offset, prompts
        self.cache = model.new_cache()
        # the fast forward's prefill (recsvc.engine.caches.prefill), with the user-state cache when one is given
        self.fast_prefill = Prefill(model, self.cache, prompts, states, count=count) if model.plan.fast else None
        self.fp32 = model.fp32
        self._lengths: list[int] | None = None  # read on first use (``lengths``)
        self.path: torch.Tensor | None = None  # [B, K, d] cache slots of each beam's path (depth 1..d)
        self.width = 0  # slots in the cache
        self._last: tuple[torch.Tensor, ...] | None = None  # feed_part's step inputs (ids, positions, slots, mask)
        self.calls = 0

    @property
    def lengths(self) -> list[int]:
        """The prompts' lengths on the host (the lean forward's key groups; the fast forward never reads them)."""
        if self._lengths is None:
            self._lengths = self.prompts.lengths.tolist()
        return self._lengths

    @property
    def keeps_steps(self) -> bool:
        """Decode steps go to (and come from) the user-state cache: they must be fed whole."""
        return self.fast_prefill is not None and self.fast_prefill.states is not None

    def prefill(self) -> torch.Tensor:
        """Run the prompts: [B, H] hidden state of each prompt's last token (the first code's distribution)."""
        p = self.prompts
        if self.fast_prefill is not None:
            last = self.fast_prefill.run()
            self.width, self.calls = self.fast_prefill.width, self.calls + self.fast_prefill.calls
            return last
        tree = TreeGroups(prompt_lengths=self.lengths, groups=[], upcast=self.fp32,
                          split=[] if self.fp32 else None)
        hidden = self.model.forward(self.cache, p.ids, p.positions(), tree)  # [B, T, H]
        self.width, self.calls = p.width, self.calls + 1
        return hidden[torch.arange(len(self.lengths), device=hidden.device), p.lengths - 1]

    def feed(self, nodes: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """Feed the beams ``nodes`` [B, K] (trie nodes of depth d, -1 = dead) whose parents are beams
        ``parents`` [B, K] of the previous step (ignored at depth 1): their [B, K, H] hidden states."""
        b, beams = nodes.shape
        path, ids, positions = self._step_inputs(nodes, parents)
        width = self.width + beams
        pre = self.fast_prefill if self.keeps_steps else None
        keys = ([tuple(row) for row in self.trie.codes_of_nodes(nodes).reshape(b, -1).tolist()]
                if pre is not None else [])  # per row: the beams' code paths
        kept = pre.load_step(keys, beams, self.width) if pre is not None else None  # an identical request's step
        if kept is not None:
            self.path, self.width = path, width
            return kept
        if self.model.plan.fast:  # the step's mask built directly (the same mask ``tree_mask`` builds from groups)
            slots, visible = self._mask(path)
            hidden = self.model.forward_masked(self.cache, ids, positions, slots, visible)  # [B, K, H]
        else:
            hidden = self.model.forward(self.cache, ids, positions, self._groups(path))  # [B, K, H]
        if pre is not None:
            pre.store_step(keys, self.width, hidden)
        self.path, self.width, self.calls = path, width, self.calls + 1
        return hidden

    def feed_part(self, nodes: torch.Tensor, parents: torch.Tensor, first: int, stop: int) -> torch.Tensor:
        """The last step fed in parts (``recsvc.engine.search.last_step``; fast forward): beams first..stop-1 of
        ``nodes`` [B, K] -> their [B, stop - first, H] hidden states. Each part runs at the whole step's slots
        and with its key width (the slots of beams not fed are never visible), so a beam's hidden state is the one
        ``feed`` computes for the whole step, bit for bit. The step's inputs and mask are built on the first
        part, for the same ``nodes`` / ``parents`` throughout."""
        if self._last is None:
            path, ids, positions = self._step_inputs(nodes, parents)
            self._last = (ids, positions, *self._mask(path))
        ids, positions, slots, visible = self._last
        part = slice(first, stop)
        self.calls += 1
        return self.model.forward_masked(self.cache, ids[:, part], positions[:, part], slots[:, part],
                                         visible[:, part])

    def _step_inputs(self, nodes: torch.Tensor, parents: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(path [B, K, d] cache slots of each beam's path, token ids [B, K], positions [B, K]) of a step."""
        b, beams = nodes.shape
        own = (self.width + torch.arange(beams, device=nodes.device))[None, :, None].expand(b, beams, 1)  # [B, K, 1]
        if self.path is None:
            path = own
        else:
            path = torch.cat([self.path.gather(1, parents[..., None].expand(-1, -1, self.path.shape[2])), own], 2)
        d = path.shape[2]
        alive = nodes >= 1
        n = torch.where(alive, nodes, 1)
        c = self.trie.codebook_size
        ids = torch.where(alive, self.code_offset + (d - 1) * c + self.trie.node_code[n], self.code_offset)
        positions = self.prompts.lengths[:, None] + (d - 1)  # [B, 1]: the prompt length + depth - 1
        return path, ids, positions.expand(b, beams)

    def _mask(self, path: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fast forward's (slots [B, K], visible [B, K, S]) of a step whose beams have the cache slots ``path``
        [B, K, d] (their own slot last; S = the width after the step): each beam sees its request's prompt slots
        and its path, the mask ``tree_mask`` makes of ``_groups(path)``, in three ops."""
        b, beams, _ = path.shape
        keys = torch.arange(self.width + beams, device=path.device)  # [S]
        visible = (keys < self.prompts.lengths[:, None, None]).repeat(1, beams, 1)  # [B, K, S] the prompt slots
        return path[..., -1].contiguous(), visible.scatter_(2, path, True)

    def _groups(self, path: torch.Tensor) -> TreeGroups:
        """Every beam of row r attends [r's prompt slots 0..T_r-1, its path]; rows with equal T_r share a call."""
        b, beams, d = path.shape
        dev = path.device
        if self.fp32:  # split attention: the prompt part shared per request, the path part per beam
            split = [(r, torch.arange(beams, device=dev), path[r], self.lengths[r]) for r in range(b)]
            return TreeGroups(prompt_lengths=[], groups=[], upcast=True, split=split)
        by_length: dict[int, list[int]] = {}
        for r, t in enumerate(self.lengths):
            by_length.setdefault(t, []).append(r)
        groups = []
        for t, rs in by_length.items():
            rows = torch.tensor(rs, device=dev).repeat_interleave(beams)  # [g = len(rs) K]
            qidx = torch.arange(beams, device=dev).repeat(len(rs))
            prompt = torch.arange(t, device=dev)[None].expand(len(rows), t)  # [g, t]
            keys = torch.cat([prompt, path[rows, qidx]], 1)  # [g, t + d]
            groups.append((rows, qidx, keys))
        return TreeGroups(prompt_lengths=[], groups=groups)
