"""KV cache of a batch of requests whose generated tokens form trees over trie nodes.

Every token the engine feeds after the prompt is a node of the catalog trie (a code prefix), and the KV entry
of a token depends only on the prompt and its ancestors. So each request keeps ONE cache row: the prompt's
slots, then the slots of whatever nodes were fed (beams of several steps, a whole draft tree), each token
masked to see the prompt, its ancestors and itself. Beams never copy KV entries; a node fed once is reused by
later rounds (``slot_of_node``); ``compact`` drops the slots of nodes no longer needed.

Shapes: B requests, S cache slots, q new tokens, N trie nodes, L id length.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from recsvc.engine.forward import new_cache, tree_forward
from recsvc.engine.prompts import PromptBatch
from tokenizer_rqvae.trie import CatalogTrie


class TreeCache:
    def __init__(self, model: PreTrainedModel, trie: CatalogTrie, code_offset: int, prompts: PromptBatch) -> None:
        self.model, self.trie, self.code_offset, self.prompts = model, trie, code_offset, prompts
        self.cache = new_cache(model)
        b = len(prompts.lengths)
        dev = prompts.ids.device
        self.prompt_slot = torch.zeros(b, 0, dtype=torch.bool, device=dev)  # [B, S] slot holds a prompt token
        self.slot_of_node = torch.full((b, trie.num_nodes), -1, dtype=torch.long, device=dev)  # [B, N]
        self.node_of_slot = torch.zeros(b, 0, dtype=torch.long, device=dev)  # [B, S] (-1: prompt / unused)
        self.calls = 0
        self._rows = torch.arange(b, device=dev)

    @property
    def prefilled(self) -> bool:
        return self.prompt_slot.shape[1] > 0

    @property
    def width(self) -> int:
        return int(self.prompt_slot.shape[1])

    def tokens_of(self, nodes: torch.Tensor) -> torch.Tensor:
        """[B, q] node ids (-1 = padding) -> token ids: code_offset + (depth - 1) * C + code."""
        n = nodes.clamp(min=0)
        tok = self.code_offset + (self.trie.depth[n] - 1) * self.trie.codebook_size + self.trie.node_code[n]
        return torch.where(nodes >= 0, tok, torch.full_like(tok, self.code_offset))

    def forward(self, nodes: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Feed the prompt (on the first call) and the given nodes in ONE target call.

        nodes: [B, q] trie nodes not yet in the cache (-1 = padding), parents before children; each node's
        ancestors must be cached or in ``nodes``. Returns (hidden at each prompt's last token [B, H] on the
        first call else None, hidden of the nodes [B, q, H])."""
        b, q = nodes.shape
        s_past = self.width
        first = not self.prefilled
        t = self.prompts.width if first else 0
        s_total = s_past + t + q
        valid = nodes >= 0
        n = nodes.clamp(min=0)
        assert not (valid & (self.slot_of_node.gather(1, n) >= 0)).any(), "node fed twice"
        # slots of the new nodes, registered first so ancestors inside this call are found
        new_slots = s_past + t + torch.arange(q, device=nodes.device)[None].expand(b, q)
        rows = self._rows[:, None].expand(b, q)
        self.slot_of_node[rows[valid], nodes[valid]] = new_slots[valid]
        anc = self.trie.ancestors[n]  # [B, q, L] ancestors incl. the node itself
        anc_slots = self.slot_of_node.gather(1, anc.clamp(min=0).reshape(b, -1)).reshape(anc.shape)
        need = (anc >= 0) & valid[..., None]
        assert not (need & (anc_slots < 0)).any(), "an ancestor of a fed node is not cached"
        anc_slots = torch.where(need, anc_slots, new_slots[..., None])  # unused -> own slot (always allowed)
        attend_nodes = torch.zeros(b, q, s_total, dtype=torch.bool, device=nodes.device)
        attend_nodes.scatter_(2, anc_slots, True)
        attend_nodes.scatter_(2, new_slots[..., None], True)
        prompt_slot = torch.cat([self.prompt_slot, self.prompts.valid if first else self.prompt_slot[:, :0]], 1)
        attend_nodes[:, :, : s_past + t] |= prompt_slot[:, None, :] & valid[..., None]
        positions = self.prompts.lengths[:, None] + self.trie.depth[n] - 1  # [B, q]
        ids = self.tokens_of(nodes)
        if first:
            attend_prompt = torch.zeros(b, t, s_total, dtype=torch.bool, device=nodes.device)
            attend_prompt[:, :, s_past : s_past + t] = self.prompts.prefill_attend()
            ids = torch.cat([self.prompts.ids, ids], 1)
            positions = torch.cat([self.prompts.positions(), positions], 1)
            attend = torch.cat([attend_prompt, attend_nodes], 1)
        else:
            attend = attend_nodes
        hidden = tree_forward(self.model, self.cache, ids, positions, attend)  # [B, t + q, H]
        self.calls += 1
        self.prompt_slot = torch.cat([prompt_slot, torch.zeros(b, q, dtype=torch.bool, device=nodes.device)], 1)
        self.node_of_slot = torch.cat(
            [self.node_of_slot, torch.full((b, t), -1, device=nodes.device, dtype=torch.long), nodes], 1
        )
        if first:
            last = hidden[self._rows, self.prompts.lengths - 1]  # [B, H]
            return last, hidden[:, t:]
        return None, hidden

    def compact(self, keep_nodes: torch.Tensor) -> None:
        """Keep the prompt and the slots of ``keep_nodes`` ([B, m] node ids, -1 = none) with their ancestors;
        drop every other slot from the KV cache (an explicit gather along the sequence axis)."""
        b = keep_nodes.shape[0]
        anc = self.trie.ancestors[keep_nodes.clamp(min=0)]  # [B, m, L]
        anc = torch.where((keep_nodes >= 0)[..., None], anc, torch.full_like(anc, -1)).reshape(b, -1)
        anc_slots = self.slot_of_node.gather(1, anc.clamp(min=0))
        keep = self.prompt_slot.clone()  # [B, S]
        ok = (anc >= 0) & (anc_slots >= 0)
        keep[self._rows[:, None].expand_as(anc)[ok], anc_slots[ok]] = True
        width = int(keep.sum(1).max())
        # kept slots first (stable), then filler slots that stay masked
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :width]  # [B, width]
        kept = keep.gather(1, order)
        for layer in self.cache.layers:
            idx = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, idx)
            layer.values = layer.values.gather(2, idx)
        self.prompt_slot = self.prompt_slot.gather(1, order) & kept
        self.node_of_slot = torch.where(kept, self.node_of_slot.gather(1, order), -1)
        self.slot_of_node.fill_(-1)
        nos = self.node_of_slot
        has = nos >= 0
        pos = torch.arange(width, device=nos.device)[None].expand_as(nos)
        self.slot_of_node[self._rows[:, None].expand_as(nos)[has], nos[has]] = pos[has]
