"""Strict speculation over a sync-free forward as a handful of fixed-shape units, rounds decided on the device.

``speculative_search``'s algorithm (AtSpeed Algorithm 1; see ``recsvc.engine.speculation.strict.speculative``), laid
out so that a GPU launches almost nothing from Python between captured graphs and waits for the device once per request:
- **rounds unrolled**: every round takes at least one depth for each unfinished request (the first replayed depth
  is the target's own step), so L rounds decode L-code ids. The host runs exactly ``levels`` rounds and never asks
  which rows finished: a finished row drafts nothing, feeds nothing and takes no step (its beams, scores and
  counters stay as they are), and rows never leave the batch (no row selection, no key / value copy);
- **each round three units** (``launches.replayable``: one replay each on a CPU count; every one reads nothing
  from the host and has shapes the host knows, so it can be captured as one CUDA graph): the drafter's whole
  proposal (its forwards, log-probs and expansion, every depth), the verification (the tree, the static tree
  cache's lookup and bookkeeping, the target forward) and the replay (the target's beam search over the tree,
  acceptance, counters);
- **one host read** at the end: the per-request target calls and accepted depths, with the closed-tree bound's
  check, as one list.
A round r drafts min(gamma, L - r) depths (host-known: no row is shallower than r at its start) and replays at
most min(gamma + 1, L - r) depths. The price of never asking: once every row has finished, the remaining rounds
still run their units over padding (no target call is counted for them).

Shapes: B requests, Kc the current beams (1 at first, then K), N draft width, H hidden.
"""

from __future__ import annotations

from functools import partial

import torch

from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.kernels.cuda_graphs import FunctionGraphs
from recsvc.engine.meters.launches import replayable
from recsvc.engine.meters.ledger import Ledger
from recsvc.engine.scoring.topk import Selector
from recsvc.engine.speculation.ports import DraftSession, TargetState
from recsvc.engine.speculation.rounds import ActiveBeams


def unrolled_rounds(cache: TreeCache, state: TargetState, beams: ActiveBeams, drafts: DraftSession, width: int,
                    draft_beams: int, gamma: int, select: Selector | None, ledger: Ledger,
                    graphs: FunctionGraphs | None, replay_step, exit_check: int | None = None
                    ) -> tuple[torch.Tensor, ...] | tuple:
    """Runs the request's L rounds over ``cache`` (sync-free target) from ``beams`` (every row at the root).
    ``replay_step``: ``speculative._replay_step`` (target, trie, code offset, width, select, depth, *tensors).
    ``exit_check``: after that many rounds, one read asks whether every row has finished (with the counters, so a
    finished request reads once in all and skips its remaining rounds; else it reads again at the end).
    Returns (leaves [B, K], scores [B, K], target calls [B], accepted depths [B], both again as host lists, the
    prompts' final hidden states [B, H])."""
    model, trie = cache.model, cache.trie
    dev, levels, b = model.device, trie.levels, len(beams.rows)
    closed = drafts.closed_tree
    accepted = torch.zeros(b, dtype=torch.long, device=dev)
    dead, prior = beams.per_row["dead"], beams.per_row["prior"]
    prompt_hidden: torch.Tensor | None = None
    for r in range(levels):
        with ledger.phase("draft"), replayable(dev):
            steps = (levels - beams.depth).clamp(max=gamma)  # [B] 0 for finished rows: nothing drafted
            drafted = drafts.propose(beams.nodes, beams.scores, steps, draft_beams, state, depths=min(gamma,
                                                                                                     levels - r))
        with ledger.phase("verify"), replayable(dev):
            tree = torch.cat([beams.nodes, *drafted], 1)
            cache.feed(torch.where(trie.depth[tree.clamp(min=0)] < levels, tree, -1),  # leaves need no forward
                       bound=tree.shape[1] if closed else None)
            if prompt_hidden is None and cache.last_prompt_hidden is not None:
                prompt_hidden = cache.last_prompt_hidden.clone()  # [B, H] (a captured forward's output is reused)
        with ledger.phase("replay"), replayable(dev):
            running = torch.ones(b, dtype=torch.bool, device=dev)
            for s in range(1, min(gamma + 1, levels - r) + 1):
                go = running & (beams.depth < levels)
                live = torch.where(go[:, None], beams.nodes, -1)  # finished rows take no step
                hidden = cache.hidden_at(live)  # [B, Kc, H]
                draft = drafted[s - 1] if s <= len(drafted) else None  # None: the free depth after all g passed
                step = partial(replay_step, model, trie, cache.code_offset, width, select, s)
                inputs = (hidden, live, beams.scores, dead, prior, go, steps, draft)
                new_nodes, new_scores, ok = (graphs.run(("replay depth", s, width), step, inputs)
                                             if graphs is not None else step(*inputs))
                beams.advance(go, new_nodes, new_scores)
                accepted += ok.long()
                running = ok
            drafts.observe(beams.nodes)
        if r + 1 == exit_check and r + 1 < levels:  # the optional early read: done rows, with the counters
            host = _read(cache, accepted, (beams.depth >= levels).all())
            if host[-1]:
                break
    else:
        host = _read(cache, accepted, None)  # the request's one host read (its last)
    if closed and host[2 * b]:
        raise RuntimeError("a drafter marked closed_tree proposed a node whose parent it did not propose")
    return beams.nodes, beams.scores, cache.row_calls, accepted, host[:b], host[b:2 * b], prompt_hidden


def _read(cache: TreeCache, accepted: torch.Tensor, done: torch.Tensor | None) -> list[int]:
    """One host read: [target calls [B], accepted [B], whether a bounded feed fell short, (every row done)]."""
    flags = [cache.overflow.long()[None]] + ([done.long()[None]] if done is not None else [])
    return torch.cat([cache.row_calls, accepted, *flags]).tolist()
