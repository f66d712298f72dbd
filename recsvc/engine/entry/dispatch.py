"""One decoding entry: :func:`decode` runs a batch in one mode and reports the path that ran.

Every caller that decodes by mode (the recommender, ``recsvc bench speculative``, training's drafter measurements
and validation) goes through here, so the choice between the searches is written once:

- ``plain``: constrained beam search (``BeamSearch.search``), the reference;
- ``strict``: lossless speculation (``speculative_search``) with the drafter's ``DraftSession``; plain beam search
  instead when there is no drafter or N = 0 (speculation does not pay at this width);
- ``relaxed``: sampling speculation (``relaxed_speculative_search``) with the drafter's ``SamplingSession``; the
  target's own sampling beam search (``sampling_beam_search``, reported as ``"sampling"``) when the drafter does not
  sample or N = 0.

The returned :class:`Decoded` carries the :class:`Decoding` of the path that actually ran (with the fallback's
reason), so nobody re-derives it afterwards. ``width`` is the beam width: beams searched (strict, plain) or items
sampled (relaxed), never the number of items a request returns (the caller cuts its first ``k``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.caches.state_cache import UserStateCache
from recsvc.engine.entry.modes import Decoding, Mode
from recsvc.engine.meters.ledger import NO_LEDGER, Ledger
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.search.sampling import make_generators, sampling_beam_search
from recsvc.engine.speculation.ports import Drafter, DraftSession, SamplingSession
from recsvc.engine.speculation.relaxed.keep import DEFAULT_KEEP, Keep
from recsvc.engine.speculation.relaxed.relaxed import relaxed_speculative_search
from recsvc.engine.speculation.strict.speculative import speculative_search


@dataclass(frozen=True)
class Decoded:
    """One batch decoded: the leaves and scores of every row, its counters and the path that ran."""

    leaves: torch.Tensor  # [B, W] trie leaves, best first (-1: fewer valid items); W = width (or top)
    scores: torch.Tensor  # [B, W] sequence scores (beam search: summed log-probs; sampling: sequence log-probs)
    target_calls: list[int]  # [B] target forward calls per row
    accepted: list[int]  # [B] draft depths accepted per row (0 unless speculating)
    draft_calls: int  # drafter forward calls for the batch
    decoding: Decoding  # the path that ran
    # [B, H] the target's final hidden state at each prompt's last token, as its prefill computed it (beam search,
    # plain or strict; None for sampling): the dense head's query reads it instead of running the prompt again
    prompt_hidden: torch.Tensor | None = None


def decode(engine: BeamSearch, drafter: Drafter | None, batch: PromptBatch, histories: Sequence[Sequence[int]],
           mode: Mode, width: int, speculation: tuple[int, int], *, why_plain: str = "",
           dead: torch.Tensor | None = None, prior: torch.Tensor | None = None,
           temperatures: torch.Tensor | None = None, generators: Sequence[torch.Generator] | None = None,
           session: DraftSession | SamplingSession | None = None, top: int | None = None, ledger: Ledger = NO_LEDGER,
           states: UserStateCache | None = None, exit_check: int | None = None, keep: Keep = DEFAULT_KEEP) -> Decoded:
    """Decodes ``batch`` (B prompts, ``histories`` their item histories) in ``mode`` at beam width ``width``.

    ``speculation``: (N, gamma) for this width; N = 0 means "do not speculate" (``why_plain`` says why).
    ``dead`` / ``prior``: [B, num_nodes] exclusions and the fused prior. ``temperatures`` [B] and ``generators``
    (B seeded generators): the sampling modes (default: 1.0, unseeded). ``session``: the mode's draft session
    (strict: ``DraftSession``, relaxed: ``SamplingSession``) made by the caller, e.g. outside its timer; default:
    the drafter's. ``top``: plain search reads only the best
    ``top`` beams (``BeamSearch.search``). ``states``: the user-state cache. ``exit_check``: strict over a sync-free
    forward, one more read after that many rounds ends a finished request early
    (``recsvc.engine.speculation.strict.unrolled``). ``keep``: relaxed, which K of >= K accepted drafts a depth keeps
    (``recsvc.engine.speculation.relaxed.keep``)."""
    b = len(histories)
    n, gamma = speculation
    if mode == "strict":
        why = "no drafter" if drafter is None else (why_plain or "speculation does not pay") if n == 0 else ""
        if not why:
            assert drafter is not None
            drafts = cast(DraftSession, session) if session is not None else drafter.session(batch, histories, dead,
                                                                                             prior)
            spec = speculative_search(engine.model, engine.trie, engine.code_offset, batch, width, drafts, n, gamma,
                                      dead, engine.select, prior, ledger=ledger, states=states,
                                      graphs=engine.step_graphs(), exit_check=exit_check)
            calls, accepted = spec.host_counts or (spec.target_calls.tolist(), spec.accepted.tolist())
            return Decoded(spec.leaves, spec.scores, calls, accepted, spec.draft_calls,
                           Decoding("strict", width, n, gamma), spec.prompt_hidden)
        return _plain(engine, batch, width, dead, prior, top, ledger, states, b, why)
    if mode == "relaxed":
        device = engine.model.device
        temps = temperatures.to(device) if temperatures is not None else torch.ones(b, device=device)
        gens = generators if generators is not None else make_generators([None] * b)
        sampler = drafter if drafter is not None and drafter.samples else None
        if sampler is None or n == 0:  # the target's own sampling beam search
            why = "no drafter that samples" if sampler is None else (why_plain or "speculation does not pay")
            smp = sampling_beam_search(engine.model, engine.trie, engine.code_offset, batch, width, temps, gens,
                                       dead, prior, states=states)
            return Decoded(smp.leaves, smp.logp, [smp.target_calls] * b, [0] * b, 0,
                           Decoding("sampling", width, fallback=why))
        n, gamma = max(n, width), max(gamma, 1)
        samples = (cast(SamplingSession, session) if session is not None
                   else sampler.sampling_session(batch, histories, dead, prior))
        rel = relaxed_speculative_search(engine.model, engine.trie, engine.code_offset, batch, width, samples, n,
                                         gamma, temps, gens, dead, prior, states=states, keep=keep)
        calls, accepted = rel.host_counts or (rel.target_calls.tolist(), rel.accepted.tolist())
        return Decoded(rel.leaves, rel.logp, calls, accepted, rel.draft_calls, Decoding("relaxed", width, n, gamma))
    if mode == "plain":
        return _plain(engine, batch, width, dead, prior, top, ledger, states, b, "")
    raise NotImplementedError(f"decoding mode {mode!r}")


def _plain(engine: BeamSearch, batch: PromptBatch, width: int, dead: torch.Tensor | None,
           prior: torch.Tensor | None, top: int | None, ledger: Ledger, states: UserStateCache | None, b: int,
           fallback: str) -> Decoded:
    out = engine.search(batch, width, dead, prior, ledger, states=states, top=top)
    return Decoded(out.leaves, out.scores, [out.target_calls] * b, [0] * b, 0,
                   Decoding("plain", width, fallback=fallback), out.prompt_hidden)
