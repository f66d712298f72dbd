"""Distillation data for the recurrent draft head: the served target's beams, hidden states and distributions.

For a training prefix (a user's history before one of their items), the target runs its served beam search
(K beams, the bundle's fused transition prior when it has one). Every final beam and the ground-truth item
give one sequence of L codes; along it the target's tree cache holds, at every depth t = 0..L-1 (t = 0: the
prompt's last token), the final hidden state h_t and the next-code log-probabilities p_t. The head learns to
predict p_{t'} for t' > t from h_t and the codes in between (``training/drafters/head.py``).

Tensors per prefix (P prefixes, S = K + 1 sequences: K beams then the truth, L levels, H hidden, C codes)::

    hidden  [P, S, L - 1, H] float32  h_0..h_{L-2} (the roots a head drafts from)
    lp      [P, S, L, C]     float16  the target's log-probs at positions 0..L-1 (full-vocabulary convention)
    ctx     [P, S, L]        int64    the trie node of each position's context (-1: no such beam)

Stored as one safetensors file (BUNDLE/head-traces/traces.safetensors) with a meta.json naming the target's
fingerprint, so a changed target is detected and the traces are rebuilt.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from recsvc.errors import UserError

VERSION = 1


def trace_batch(target, trie, code_offset: int, prompts, gt_leaves: torch.Tensor, k: int, select,
                prior: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """One batch of prefixes: the target's beam search (fused prior as served), then ONE extra forward over
    the truth's path; returns ``hidden`` / ``lp`` / ``leaf`` for these B prefixes (shapes in the module doc),
    as ordinary tensors (usable in autograd)."""
    got = _trace(target, trie, code_offset, prompts, gt_leaves, k, select, prior)
    return {name: t.clone() for name, t in got.items()}  # out of inference mode


@torch.inference_mode()
def _trace(target, trie, code_offset: int, prompts, gt_leaves: torch.Tensor, k: int, select,
           prior: torch.Tensor | None) -> dict[str, torch.Tensor]:
    from recsvc.engine.search.beam_search import node_logprobs
    from training.drafters.teacher import _search

    leaves, cache = _search(target, trie, code_offset, prompts, k, select, prior)
    every = torch.cat([leaves, gt_leaves[:, None]], 1)  # [B, S]
    ctx, _ = paths(trie, every)  # [B, S, L] depth 0..L-1
    cache.feed(ctx[..., -1])  # the truth's path (beams are cached already)
    b, s, levels = ctx.shape
    lp = node_logprobs(target, cache, ctx.reshape(b, -1)).view(b, s, levels, -1)
    hidden = cache.hidden_at(ctx[..., :-1].reshape(b, -1)).view(b, s, levels - 1, -1)
    return {"hidden": hidden.float(), "lp": lp.to(torch.float16), "leaf": every}


def sample_prefixes(sequences: dict[int, list[int]], max_prefixes: int | None, seed: int) -> list[tuple[int, int]]:
    """(user, t): predict item t of the user's sequence from items [:t]; a seeded sample of at most N."""
    from training.drafters.teacher import training_prefixes

    prefixes = training_prefixes(sequences)
    if max_prefixes is not None and len(prefixes) > max_prefixes:
        prefixes = random.Random(seed).sample(prefixes, max_prefixes)
    return sorted(prefixes, key=lambda p: (p[1], p[0]))  # similar prompt lengths together


def build_traces(bundle, data, k: int = 10, max_prefixes: int | None = 20000, batch_size: int = 32,
                 seed: int = 0, dtype: str = "auto", attention: str = "fp32", force: bool = False,
                 progress: bool = True) -> dict[str, torch.Tensor]:
    """Build (or load) BUNDLE/head-traces for the bundle's current target; returns the tensors."""
    from safetensors.torch import load_file, save_file

    from recsvc.engine.caches.prompts import PromptBatch
    from recsvc.engine.kernels.engine_model import EngineModel
    from recsvc.engine.scoring.prior import prior_log_mass
    from recsvc.engine.search.beam_search import BeamSearch
    from recsvc.priors.mixed import load_prior
    from recsvc_base.progress import progress_bar
    from tokenizer_rqvae.trie import CatalogTrie
    from training.drafters.teacher import model_fingerprint

    out = Path(bundle.root) / "head-traces"
    info = bundle.read()
    periods = "train+valid" if info.get("protocol") == "deploy" else "train"
    cfg = {"version": VERSION, "k": k, "max_prefixes": max_prefixes, "seed": seed, "dtype": dtype,
           "attention": attention, "periods": periods, "target": model_fingerprint(bundle.target_dir),
           "prior": info.get("prior")}
    if not force and (out / "meta.json").is_file() and (out / "traces.safetensors").is_file():
        old = json.loads((out / "meta.json").read_text())
        if {key: old.get(key) for key in cfg} == cfg:
            return load_file(str(out / "traces.safetensors"))
    ids = bundle.load_ids()
    builder = bundle.prompt_builder(ids=ids)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the traces are beam searches: on the GPU when there
    trie = CatalogTrie(ids).to(device)
    off = builder.code_offset
    target = EngineModel.build(bundle.load_target(dtype=dtype, device=device), attention)
    select = BeamSearch(target, trie, off).select
    stored = load_prior(bundle.prior_dir) if bundle.has_prior() else None  # the served (possibly mixed) prior
    weight = stored.settings.weight if stored is not None else 0.0
    sequences = data.sequences(periods)
    prefixes = sample_prefixes(sequences, max_prefixes, seed)
    if not prefixes:
        raise UserError("no training prefixes (every user has fewer than 2 items?)")
    parts: dict[str, list[torch.Tensor]] = {"hidden": [], "lp": [], "leaf": []}
    for b0 in progress_bar(range(0, len(prefixes), batch_size), desc=f"head traces K={k}", unit="batch",
                           enabled=progress, dynamic_ncols=True, mininterval=2.0):
        rows = prefixes[b0:b0 + batch_size]
        hist = [sequences[u][:t] for u, t in rows]
        pb = PromptBatch.from_lists([builder.prompt_ids(h) for h in hist])
        gt = trie.item_path[torch.tensor([ids.index_of(sequences[u][t]) for u, t in rows], device=trie.device), -1]
        prior = (prior_log_mass(trie, torch.from_numpy(stored.probs(hist)).to(trie.device), weight)
                 if stored is not None and weight > 0 else None)
        got = trace_batch(target, trie, off, pb, gt, k, select, prior)
        for name, t in got.items():
            parts[name].append(t.cpu())
    tensors = {name: torch.cat(v) for name, v in parts.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "traces.safetensors"))
    (out / "meta.json").write_text(json.dumps({**cfg, "prefixes": len(prefixes)}, indent=1))
    return tensors


def paths(trie, leaf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[P, S] leaves -> (ctx [P, S, L]: the context node of positions 0..L-1 (depth 0..L-1), codes [P, S, L]: the
    code chosen at each position); -1 where the leaf is -1."""
    anc = trie.ancestors[leaf.clamp(min=0)]  # [P, S, L] depth 1..L
    ctx = torch.cat([torch.zeros_like(anc[..., :1]), anc[..., :-1]], -1)
    ok = (leaf >= 0)[..., None]
    return torch.where(ok, ctx, -1), torch.where(ok, trie.node_code[anc.clamp(min=0)], -1)
