"""KV cache of a batch of requests whose generated tokens form trees over trie nodes.

Every token the engine feeds after the prompt is a node of the catalog trie (a code prefix), and the KV entry
of a token depends only on the prompt and its ancestors. So each request keeps ONE cache row: the prompt's
slots, then the slots of whatever nodes were fed (beams of several steps, a whole draft tree), each token
masked to see the prompt, its ancestors and itself. Beams never copy KV entries; a node fed once is reused by
later steps and rounds (``slot_of_node``), together with its final hidden state (its next-token
distribution); ``compact`` drops the slots of nodes no longer needed.

Node ids are numbered depth-major (root, depth 1, depth 2, ...), so sorting nodes by id puts parents before
children.

Shapes: B requests, S cache slots, q new tokens, N trie nodes, L id length, H hidden size.
"""

from __future__ import annotations

import torch

from recsvc.engine.caches.prefill import Prefill
from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.caches.state_cache import UserStateCache
from recsvc.engine.kernels.attention import TreeGroups
from recsvc.engine.kernels.buckets import Buckets
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.meters.host_reads import uncounted
from recsvc.engine.meters.launches import replayable
from tokenizer_rqvae.trie import CatalogTrie


def _bound_width(nodes: torch.Tensor, levels: int, bound: int | None) -> int:
    """The columns a sync-free ``missing`` returns for [B, m] nodes: ``bound`` (default m * L), at most m * L."""
    most = nodes.shape[1] * levels
    return min(bound, most) if bound is not None else most


def _check(ok, like: torch.Tensor, message: str) -> None:
    """An internal consistency check, run on CPU tensors only: on a GPU reading its result would stall the host
    once per forward (the CPU tests cover the same code)."""
    if like.device.type == "cpu":
        with uncounted():  # not a GPU's read (host_reads)
            assert ok(), message


class TreeCache:
    def __init__(self, model: EngineModel, trie: CatalogTrie, code_offset: int, prompts: PromptBatch,
                 states: UserStateCache | None = None) -> None:
        """``states``: the user-state cache (fast forward only): the first feed then runs the prompts that are
        not cached as their own forward (``recsvc.engine.caches.prefill``; none when all are) and stores them."""
        dev = model.device  # the cache and its bookkeeping live on the model's device (moved once, here)
        trie, prompts = trie.to(dev), prompts.to(dev)
        self.model, self.trie, self.code_offset, self.prompts = model, trie, code_offset, prompts
        self.cache = model.new_cache()
        b = len(prompts.lengths)
        self.prompt_slot = torch.zeros(b, 0, dtype=torch.bool, device=dev)  # [B, S] slot holds a prompt token
        self.node_of_slot = torch.zeros(b, 0, dtype=torch.long, device=dev)  # [B, S] (-1: prompt / filler)
        self.slot_of_node = torch.full((b, trie.num_nodes), -1, dtype=torch.long, device=dev)  # [B, N]
        self.hidden = torch.zeros(b, 0, model.hidden_size, dtype=model.dtype, device=dev)  # [B, S, H]
        self.last_prompt_hidden: torch.Tensor | None = None  # [B, H] distribution of the first code
        self.calls = 0  # forward calls for the batch
        self.row_calls = torch.zeros(b, dtype=torch.long, device=dev)  # [B] forward calls with a token of the row
        self.tokens_fed = 0
        self.states = states if model.plan.fast else None
        self.overflow = torch.zeros((), dtype=torch.bool, device=dev)  # a sync-free ``missing`` bound fell short
        # sync-free: the slots' bookkeeping lives in buffers of a host-known capacity, written in place (never
        # grown by torch.cat), so a feed and its forward are one fixed-shape unit (``launches.replayable``)
        self._static = model.plan.sync_free
        self._width = 0  # slots in use (host-known: feeds add their bound's columns)
        self._bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # prompt_slot, node_of_slot, hidden

    @property
    def prefilled(self) -> bool:
        return self.last_prompt_hidden is not None

    @property
    def width(self) -> int:
        return self._width if self._static else int(self.prompt_slot.shape[1])

    def _reserve(self, width: int) -> None:
        """Sync-free: buffers of at least ``width`` slots (a host decision: widths are known there). Grows by
        buckets (``Buckets.widths``, then doubling), copying the used part once; the attributes are views."""
        if self._bufs is not None and self._bufs[0].shape[1] >= width:
            return
        cap = Buckets.fit(Buckets().widths, width) or 2 * width
        b, dev = len(self.prompts.lengths), self.prompts.lengths.device
        bufs = (torch.empty(b, cap, dtype=torch.bool, device=dev), torch.empty(b, cap, dtype=torch.long, device=dev),
                torch.empty(b, cap, self.model.hidden_size, dtype=self.model.dtype, device=dev))
        if self._width:
            for new, old in zip(bufs, (self.prompt_slot, self.node_of_slot, self.hidden), strict=True):
                new[:, :self._width].copy_(old)
        self._bufs = bufs
        self._views()

    def _views(self) -> None:
        assert self._bufs is not None
        w = self._width
        self.prompt_slot, self.node_of_slot, self.hidden = (t[:, :w] for t in self._bufs)

    def _rows(self, like: torch.Tensor) -> torch.Tensor:
        return torch.arange(like.shape[0], device=like.device)[:, None].expand_as(like)

    def tokens_of(self, nodes: torch.Tensor) -> torch.Tensor:
        """[B, q] node ids (-1 = padding) -> token ids: code_offset + (depth - 1) * C + code."""
        n = nodes.clamp(min=1)
        tok = self.code_offset + (self.trie.depth[n] - 1) * self.trie.codebook_size + self.trie.node_code[n]
        return torch.where(nodes >= 1, tok, torch.full_like(tok, self.code_offset))

    def missing(self, nodes: torch.Tensor, bound: int | None = None) -> torch.Tensor:
        """[B, m] nodes -> [B, q] those of them and their ancestors not cached yet, parents first (-1 pad).

        A sync-free model (``ForwardPlan.sync_free``) does not read q: it returns ``bound`` columns (default
        m * L, always enough) and records on the device whether the bound was short (``overflow``).

        Works on the small [B, m * L] candidate tensor (sort, drop repeats and cached nodes), never on a
        [B, num_nodes] table. Example: nodes [[5, 9]] where 9's ancestors are (2, 9), node 2 cached: [[5, 9]]."""
        b = nodes.shape[0]
        big = self.trie.num_nodes
        anc = self.trie.ancestors[nodes.clamp(min=0)]  # [B, m, L]
        anc = torch.where((nodes >= 1)[..., None] & (anc >= 0), anc, big).reshape(b, -1)
        s = torch.sort(anc, dim=1).values  # ascending node id = parents first (ids are depth-major)
        repeat = torch.cat([torch.zeros_like(s[:, :1], dtype=torch.bool), s[:, 1:] == s[:, :-1]], 1)
        cached = self.slot_of_node.gather(1, s.clamp(max=big - 1)) >= 0
        keep = (s < big) & ~repeat & ~cached
        if self.model.plan.sync_free:  # no host read: as many columns as the bound (padding: -1)
            q = min(bound, keep.shape[1]) if bound is not None else keep.shape[1]
            self.overflow |= (keep.sum(1) > q).any()  # read once per request (``unrolled``)
        else:
            q = int(keep.sum(1).max()) if b else 0
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :q]
        return torch.where(keep.gather(1, order), s.gather(1, order), -1)

    def feed(self, nodes: torch.Tensor, bound: int | None = None) -> int:
        """Make sure the given nodes ([B, m], -1 = none) and their ancestors are cached, in ONE forward that also
        runs the prompt on the first call. Returns the number of new tokens per row (0: no call was made).
        ``bound``: at most this many are missing (a sync-free model feeds that many columns, see ``missing``)."""
        if self.states is not None and not self.prefilled:
            self._prefill_states()
        if bound == 0 and self.prefilled and self.model.plan.sync_free:
            return 0  # the caller knows every node is cached (hidden_at checks it on a CPU): nothing to look up
        if self._static:  # the lookup, the bookkeeping and the forward: one fixed-shape unit (a graph on a GPU)
            q = _bound_width(nodes, self.trie.levels, bound) if nodes.numel() else 0
            if self.prefilled and q == 0:
                return 0
            self._reserve(self._width + (0 if self.prefilled else self.prompts.width) + q)
            with replayable(nodes.device):
                new = self.missing(nodes, bound) if nodes.numel() else nodes[:, :0]
                self._forward(new)
            return q
        new = self.missing(nodes, bound) if nodes.numel() else nodes[:, :0]
        if self.prefilled and new.shape[1] == 0:
            return 0
        self._forward(new)
        return int(new.shape[1])

    def _prefill_states(self) -> None:
        """The prompts through the user-state cache: slots 0..T (T: the scratch slot), no node in them."""
        pre = Prefill(self.model, self.cache, self.prompts, self.states)
        last = pre.run()  # [B, H]
        b, w = len(self.prompts.lengths), pre.width
        dev = last.device
        self.calls += pre.calls
        self.row_calls += torch.tensor([0 if f else pre.calls for f in pre.full], dtype=torch.long, device=dev)
        self.prompt_slot = torch.cat([self.prompts.valid, torch.zeros(b, 1, dtype=torch.bool, device=dev)], 1)
        self.node_of_slot = torch.full((b, w), -1, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(b, w, self.model.hidden_size, dtype=self.model.dtype, device=dev)
        if self._static:  # into the static buffers
            self._reserve(w)
            self._width = w
            for buf, t in zip(self._bufs or (), (self.prompt_slot, self.node_of_slot, self.hidden), strict=True):
                buf[:, :w].copy_(t)
            self._views()
        self.last_prompt_hidden = last
        pre.remember(last, None)

    def hidden_at(self, nodes: torch.Tensor) -> torch.Tensor:
        """[B, m] cached nodes (0 = root: the prompt's last token; -1: zeros) -> [B, m, H]."""
        assert self.last_prompt_hidden is not None
        slots = self.slot_of_node.gather(1, nodes.clamp(min=0))
        _check(lambda: not ((nodes >= 1) & (slots < 0)).any(), nodes, "hidden of a node that was never fed")
        h = self.hidden.gather(1, slots.clamp(min=0)[..., None].expand(-1, -1, self.hidden.shape[2]))
        h = torch.where((nodes == 0)[..., None], self.last_prompt_hidden[:, None], h)
        return torch.where((nodes < 0)[..., None], torch.zeros_like(h), h)

    def _forward(self, nodes: torch.Tensor) -> None:
        b, q = nodes.shape
        dev = nodes.device
        s_past = self.width
        first = not self.prefilled
        t = self.prompts.width if first else 0
        valid = nodes >= 1
        n = nodes.clamp(min=0)
        new_slots = s_past + t + torch.arange(q, device=dev)[None].expand(b, q)
        # first, so in-call ancestors resolve; padding tokens rewrite the root's entry (never read: -1) with itself
        # (a scatter, not a boolean-mask index: no host read)
        self.slot_of_node.scatter_(1, n, torch.where(valid, new_slots, self.slot_of_node[:, :1].expand(b, q)))
        anc = self.trie.ancestors[n]  # [B, q, L] ancestors incl. the node itself
        anc_slots = self.slot_of_node.gather(1, anc.clamp(min=0).reshape(b, -1)).reshape(anc.shape)
        need = (anc >= 0) & valid[..., None]
        _check(lambda: not (need & (anc_slots < 0)).any(), nodes, "an ancestor of a fed node is not cached")
        anc_slots = torch.where(need, anc_slots, new_slots[..., None])  # unused -> own slot (always allowed)
        positions = self.prompts.lengths[:, None] + self.trie.depth[n] - 1  # [B, q]: prompt length + depth - 1
        ids = self.tokens_of(nodes)
        prompt_slot = torch.cat([self.prompt_slot, self.prompts.valid if first else self.prompt_slot[:, :0]], 1)
        if first:
            ids = torch.cat([self.prompts.ids, ids], 1)
            positions = torch.cat([self.prompts.positions(), positions], 1)
        if self.model.plan.fast:  # the mask built directly: no host read (the mask ``tree_mask`` makes of _groups)
            slots, visible = self._mask(prompt_slot, anc_slots, valid, s_past, t)
            hidden = self.model.forward_masked(self.cache, ids, positions, slots, visible)  # [B, t + q, H]
        else:
            lengths = self.prompts.lengths.tolist() if first else []  # the prompts' key sets: first call only
            groups = self._groups(prompt_slot, anc_slots, valid, self.trie.depth[n], t, lengths)
            hidden = self.model.forward(self.cache, ids, positions, groups)  # [B, t + q, H]
        self.row_calls += (valid.any(1) | first).long()  # the first call runs every row's prompt
        self._append(hidden, nodes, valid, prompt_slot, first, t)

    def _append(self, hidden: torch.Tensor, nodes: torch.Tensor, valid: torch.Tensor, prompt_slot: torch.Tensor,
                first: bool, t: int) -> None:
        b, q = nodes.shape
        dev = nodes.device
        self.calls += 1
        self.tokens_fed += t + q
        if first:
            self.last_prompt_hidden = hidden[torch.arange(b, device=dev), self.prompts.lengths - 1]
        if self._static:  # written in place: [w, w + t + q) of the buffers (``_reserve`` made room)
            assert self._bufs is not None
            w, new = self._width, t + q
            ps, ns, hs = self._bufs
            ps[:, w:w + t].copy_(prompt_slot[:, w:])
            ps[:, w + t:w + new].fill_(False)
            ns[:, w:w + t].fill_(-1)
            ns[:, w + t:w + new].copy_(torch.where(valid, nodes, -1))
            hs[:, w:w + new].copy_(hidden)
            self._width = w + new
            self._views()
            return
        self.prompt_slot = torch.cat([prompt_slot, torch.zeros(b, q, dtype=torch.bool, device=dev)], 1)
        filler = torch.full((b, t), -1, device=dev, dtype=torch.long)
        self.node_of_slot = torch.cat([self.node_of_slot, filler, torch.where(valid, nodes, -1)], 1)
        self.hidden = torch.cat([self.hidden, hidden], 1)

    def _mask(self, prompt_slot: torch.Tensor, anc_slots: torch.Tensor, valid: torch.Tensor, s_past: int, t: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fast forward's (slots [B, t + q], visible [B, t + q, S]) of a feed, S = s_past + t + q: a first
        call's prompt tokens attend their prompt causally (a padding token: the real prompt tokens and itself),
        a tree token its request's prompt slots, its ancestors and itself (a padding token: itself), as
        ``tree_mask`` builds them from ``_groups``, without reading the device.

        prompt_slot [B, s_past + t], anc_slots [B, q, L] (unused levels: the token's own slot), valid [B, q]."""
        b, q = valid.shape
        width = s_past + t + q
        dev = valid.device
        keys = torch.arange(width, device=dev)
        own = s_past + torch.arange(t + q, device=dev)  # [t + q] the new tokens' slots
        vis_tree = torch.zeros(b, q, width, dtype=torch.bool, device=dev).scatter_(2, anc_slots, True)
        vis_tree |= valid[..., None] & torch.cat([prompt_slot, prompt_slot.new_zeros(b, q)], 1)[:, None, :]
        if t:  # the first call: prompts at slots 0..T_b - 1, causal (``tree_mask``'s prompt part)
            lengths = self.prompts.lengths[:, None, None]
            causal = (keys[None, None] <= own[None, :t, None]) & (keys[None, None] < lengths)
            vis_prompt = causal | (keys[None, None] == own[None, :t, None])  # [B, t, S]
            vis_tree |= (keys[None, None] < lengths)  # tree tokens of the first call: the prompt's real slots
            visible = torch.cat([vis_prompt, vis_tree], 1)
        else:
            visible = vis_tree
        return own[None].expand(b, t + q), visible

    def _groups(self, prompt_slot: torch.Tensor, anc_slots: torch.Tensor, valid: torch.Tensor, depth: torch.Tensor,
                t: int, lengths: list[int]) -> TreeGroups:
        """Exact key sets: node i of row b at depth d attends [b's prompt slots, anc_slots[b, i, :d]], grouped by
        key count (T_b + d) across rows. The grouping reads the device (unique / nonzero: the groups' shapes);
        on CUDA these are the forward's only host synchronisations besides ``missing``'s token count.

        prompt_slot [B, S_past + t], anc_slots [B, q, L], valid / depth [B, q]."""
        n_prompt = prompt_slot.sum(1)  # [B] real prompt tokens per row (in slot order)
        if self.model.fp32:  # split attention: per request, its tokens + their ancestors' slots
            split = []
            for row in range(valid.shape[0]):
                qidx = torch.nonzero(valid[row]).reshape(-1)
                if len(qidx):
                    d = depth[row, qidx]  # [n]
                    levels = torch.arange(anc_slots.shape[2], device=anc_slots.device)[None]
                    anc = torch.where(levels < d[:, None], anc_slots[row, qidx], -1)  # [n, L]
                    split.append((row, t + qidx, anc, int(n_prompt[row])))
            return TreeGroups(prompt_lengths=lengths if t else [], groups=[], upcast=True, split=split)
        count = torch.where(valid, n_prompt[:, None] + depth, -1)  # [B, q] keys per token
        groups = []
        prompt_keys_of: dict[int, torch.Tensor] = {}  # row -> its prompt slots (computed once per row)
        for s, d in torch.unique(torch.stack([count[valid], depth[valid]], 1), dim=0).tolist():
            rows, qidx = torch.nonzero((count == s) & (depth == d), as_tuple=True)  # [g], [g]
            row_list = rows.tolist()
            for r in set(row_list) - prompt_keys_of.keys():
                prompt_keys_of[r] = torch.nonzero(prompt_slot[r]).reshape(-1)
            if len(set(row_list)) == 1:
                prompt_keys = prompt_keys_of[row_list[0]][None].expand(len(row_list), -1)
            else:
                prompt_keys = torch.stack([prompt_keys_of[r] for r in row_list])
            keys = torch.cat([prompt_keys, anc_slots[rows, qidx, :d]], 1)  # [g, S]
            groups.append((rows, t + qidx, keys))
        return TreeGroups(prompt_lengths=lengths if t else [], groups=groups)

    def compact(self, keep_nodes: torch.Tensor, descendants: bool = False) -> None:
        """Keep the prompt and the cached ancestors of ``keep_nodes`` ([B, m], -1 = none, nodes included; a row's
        nodes share one depth); with ``descendants`` also every cached node below them (a drafter's nodes under
        the target's new beams: the next round drafts from those beams and would feed them again). Drop every
        other slot from the KV cache (an explicit gather along the sequence axis). A sync-free model keeps every
        slot instead (a node's keys / values stay valid; the width only grows, by bounded feeds, and reading the
        new width would stall the host)."""
        if self.model.plan.sync_free:
            return
        anc = self.trie.ancestors[keep_nodes.clamp(min=0)]  # [B, m, L]
        anc = torch.where((keep_nodes >= 1)[..., None], anc, torch.full_like(anc, -1)).reshape(len(anc), -1)
        anc_slots = self.slot_of_node.gather(1, anc.clamp(min=0))
        keep = self.prompt_slot.clone()  # [B, S]
        ok = (anc >= 0) & (anc_slots >= 0)
        keep[self._rows(anc)[ok], anc_slots[ok]] = True
        if descendants:
            keep |= self._below(keep_nodes)
        self._gather_slots(keep)

    def _below(self, nodes: torch.Tensor) -> torch.Tensor:
        """[B, m] nodes of one depth d_b per row (-1 none) -> [B, S] slots holding a node strictly below one."""
        d = self.trie.depth[nodes.max(1).values.clamp(min=0)][:, None]  # [B, 1]
        cached = self.node_of_slot.clamp(min=0)  # [B, S]
        level = (d - 1).clamp(min=0).expand_as(cached)
        up = self.trie.ancestors[cached].gather(2, level[..., None])[..., 0]  # [B, S] ancestor at depth d_b
        up = torch.where(d == 0, 0, up)  # below the root: every node
        hit = ((up[..., None] == nodes[:, None, :]) & (nodes[:, None, :] >= 0)).any(-1)
        return hit & (self.node_of_slot >= 1) & (self.trie.depth[cached] > d)

    def _gather_slots(self, keep: torch.Tensor) -> None:
        width = int(keep.sum(1).max())
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :width]  # kept first
        kept = keep.gather(1, order)  # [B, width]; False = filler slot, never attended
        for layer in self.cache.layers:
            idx = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, idx)
            layer.values = layer.values.gather(2, idx)
        self.hidden = self.hidden.gather(1, order[..., None].expand(-1, -1, self.hidden.shape[2]))
        self.prompt_slot = self.prompt_slot.gather(1, order) & kept
        self.node_of_slot = torch.where(kept, self.node_of_slot.gather(1, order), -1)
        self.slot_of_node.fill_(-1)
        has = self.node_of_slot >= 0
        pos = torch.arange(width, device=keep.device)[None].expand_as(self.node_of_slot)
        self.slot_of_node[self._rows(self.node_of_slot)[has], self.node_of_slot[has]] = pos[has]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the given requests (finished ones leave the batch)."""
        for layer in self.cache.layers:
            layer.keys = layer.keys[rows]
            layer.values = layer.values[rows]
        self.prompts = PromptBatch(self.prompts.ids[rows], self.prompts.lengths[rows], self.prompts.valid[rows])
        for name in ("prompt_slot", "node_of_slot", "slot_of_node", "hidden", "row_calls"):
            setattr(self, name, getattr(self, name)[rows])
        if self._bufs is not None:  # sync-free: the static buffers follow the rows
            ps, ns, hs = self._bufs
            self._bufs = (ps[rows], ns[rows], hs[rows])
            self._views()
        if self.last_prompt_hidden is not None:
            self.last_prompt_hidden = self.last_prompt_hidden[rows]
