"""A bundle turned into a ``Recommender`` (the composition root): its parts (``recsvc.recommender.parts``) and
its settings (``recsvc.recommender.settings``) in, a pipeline of typed stages (``recsvc.recommender.stages``)
out.

``recommend`` is the batch decoded and then the list stages: decoding is the prior's ranking alone
(``stages.prior_only``, a bundle whose prior ranks alone) or, by the target, one engine call per group of
(mode, beam width, list-level rules) (``stages.grouped_decode``: the engine's one entry, the dense head merged
with the beams, or the rules' list-level search), each list's fallback said; an items bundle's item-level
target (``recsvc.timeline``) decodes by ``stages.timeline_decode`` instead (no engine, no drafter: every mode
plain); then the fresh items' tail slots (``stages.fresh_tails``). ``answers`` adds each short list's reason
(``recsvc.recommender.answer``). Timers and counters are the caller's (``RecStats`` holds only counts).

A bundle with a transition prior (BUNDLE/prior, ``recsvc prior fit``) whose weight is > 0 has it fused into
every mode's decoding (``recsvc.engine.scoring.prior``): each query's prior comes from its own history, and returned
scores are then fused scores. ``exclude_history`` adds every query's history items to its exclusions.

Item attributes (BUNDLE/attributes.json, ``recsvc bundle attributes``; re-read when the file changes) let
queries carry rules (``recsvc.rules``, docs/RULES.md): allow / deny filters become dead trie nodes like
exclusions; caps and boosts are decoded by ``RuleSettings.strategy``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TypedDict, Unpack

import numpy as np
import torch

from recsvc.bundle.directory import DEFAULT_BEAM_WIDTH
from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.caches.state_cache import UserStateCache
from recsvc.engine.entry.dispatch import Mode
from recsvc.engine.meters.ledger import NO_LEDGER, Ledger
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.recommender.answer import explained_all, without_decoding
from recsvc.recommender.api import Answer, EngineFacts, RecQuery, RecResult
from recsvc.recommender.parts import BundleParts, PartsChoice, Prior, load_parts
from recsvc.recommender.settings import RecommenderSettings, SpecSettings, read_sampler_for, state_cache_for
from recsvc.recommender.stages.fresh_tails import FreshTails
from recsvc.recommender.stages.grouped_decode import GroupedDecode
from recsvc.recommender.stages.grouping import split_cached
from recsvc.recommender.stages.list_stage import ListStage
from recsvc.recommender.stages.prior_only import PriorOnly
from recsvc.recommender.stages.scope import Scope
from recsvc.recommender.stages.timeline_decode import TimelineDecode
from recsvc.rule_decoding.decode import RuleSettings
from recsvc.rules.catalog import RuleCatalog
from recsvc.rules.greedy import greedy_pick
from recsvc.rules.spec import Rules

__all__ = ["BundleRecommender", "Changes", "RecommenderSettings", "SpecSettings", "state_cache_for"]


class Changes(TypedDict, total=False):
    """What ``BundleRecommender.variant`` may change (a key left out: unchanged)."""

    spec: SpecSettings  # speculation (calibration's choice)
    states: UserStateCache | None  # the user-state cache (None: off)
    prefill_ahead: bool
    prior: Prior | None  # the fused prior (None: none)
    beam_width: int
    rules: RuleSettings
    count_host_reads: int  # every N-th decode's host reads counted (0: off)


class BundleRecommender:
    def __init__(self, parts: BundleParts, settings: RecommenderSettings | None = None) -> None:
        """``parts``: the loaded bundle (``load_parts``); ``settings``: how it serves. Nothing is set on a
        recommender after this: ``variant`` and ``recsvc.recommender.live_catalog.with_catalog`` build new
        ones through here, over the same (or the live catalog's) parts."""
        self.parts = parts
        self.settings = settings = settings or RecommenderSettings()
        # what the recommender's readers (the service, the benches, a live catalog) read of the two; an items
        # bundle has a timeline and no token target (target, prompts and engine None)
        self.target, self.prompts, self.ids, self.trie = parts.target, parts.prompts, parts.ids, parts.trie
        self.timeline = parts.timeline
        self.drafter, self.prior, self.fresh = parts.drafter, parts.prior, parts.fresh
        self.attributes, self.keys = parts.attributes, parts.keys
        self.dense = parts.dense if parts.dense is not None and parts.dense.active else None
        self.popular, self.max_history = list(parts.popular), _max_history(parts)
        self.spec, self.max_k, self.beam_width = settings.spec, settings.max_k, settings.beam_width
        self.exclude_history, self.rule_settings = settings.exclude_history, settings.rules
        self.states, self.ahead, self.read_sampler = settings.states, settings.prefill_ahead, settings.read_sampler
        scope = Scope(parts, settings)
        self._scope = scope
        # once: every search reads the trie on the model's device
        self.engine = (BeamSearch(parts.target, parts.trie, parts.prompts.code_offset)
                       if parts.target is not None and parts.prompts is not None else None)
        self._popular_rows = np.array([parts.ids.index_of(i) for i in parts.popular], dtype=np.int64)  # [n]
        # decoding, then the list stages
        self.prior_ranks = PriorOnly.applies(scope)
        self._timeline = TimelineDecode(scope, parts.timeline) if parts.timeline is not None else None
        self._decode = (PriorOnly(scope) if self.prior_ranks else self._timeline if self._timeline is not None
                        else GroupedDecode(scope, self._engine()))
        self.list_stages: tuple[ListStage, ...] = (FreshTails(scope),)

    @classmethod
    def from_bundle(cls, path: str | Path, dtype: str = "auto", device: str = "cpu",
                    use_drafter: bool = True, attention: str = "fp32",
                    drafter_name: str | None = None, use_prior: bool = True,
                    exclude_history: bool = False, beam_width: int | None = None,
                    attributes: str | Path | None = None, rules: RuleSettings | None = None,
                    use_fresh: bool = True, forward: str = "auto", use_dense: bool = True
                    ) -> BundleRecommender:
        """The bundle's parts (``PartsChoice`` says what each flag loads) served with these settings:
        ``beam_width`` (None: bundle.json "beam_width", else 0 = k), ``exclude_history``, ``rules``."""
        parts = load_parts(path, PartsChoice(dtype, device, attention, forward, drafter_name, use_drafter,
                                             use_prior, exclude_history, attributes, use_fresh=use_fresh,
                                             use_dense=use_dense))
        width = beam_width if beam_width is not None else parts.beam_width
        return cls(parts, RecommenderSettings(exclude_history=exclude_history, beam_width=width,
                                              rules=rules or RuleSettings()))

    def variant(self, **changes: Unpack[Changes]) -> BundleRecommender:
        """A recommender over the same parts (models shared) that differs in the settings given (``Changes``);
        this one is not modified."""
        parts = replace(self.parts, prior=changes["prior"]) if "prior" in changes else self.parts
        s = self.settings
        settings = replace(
            s, spec=changes.get("spec", s.spec), states=changes.get("states", s.states),
            prefill_ahead=changes.get("prefill_ahead", s.prefill_ahead),
            beam_width=changes.get("beam_width", s.beam_width), rules=changes.get("rules", s.rules),
            read_sampler=(read_sampler_for(changes["count_host_reads"]) if "count_host_reads" in changes
                          else s.read_sampler))
        return BundleRecommender(parts, settings)

    # ---- the parts and settings, read ---------------------------------------------------------------------
    @property
    def rule_catalog(self) -> RuleCatalog | None:
        """The item attributes laid over the trie, as the attributes file is now (None: no attributes)."""
        return self._scope.rule_catalog()

    @property
    def prior_weight(self) -> float:
        return self._scope.prior_weight

    def prior_for(self, histories: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """[B, num_nodes] the fused prior of these histories, None when there is none (``Scope.prior_for``)."""
        return self._scope.prior_for(histories)

    def excludes_history(self, query: RecQuery) -> bool:
        """Whether ``query``'s history items are left out: the query's own choice, else the recommender's."""
        return self._scope.excludes_history(query)

    def width_for(self, k: int, mode: Mode) -> int:
        """Beams searched for a request of k items: max(k, B) for plain / strict, k for relaxed."""
        return self._scope.width_for(k, mode)

    def no_speculation(self, width: int) -> str:
        """Why strict speculation does not run at this beam width ("" when it does)."""
        return self._scope.no_speculation(width)

    def served_widths(self, ks: Sequence[int]) -> list[int]:
        """The beam widths that plain and strict requests of these list lengths decode (``width_for``), ascending:
        what speculation is calibrated at. Example: B = 20, ks = (1, 5, 10, 20) -> [20]; B = 0 -> [1, 5, 10, 20]."""
        return sorted({self.width_for(k, "strict") for k in ks})

    def _engine(self) -> BeamSearch:
        """The token target's beam search (an items bundle has none)."""
        if self.engine is None:
            raise RuntimeError("an items bundle has no token target: the item-level target decodes it")
        return self.engine

    @property
    def facts(self) -> EngineFacts:
        """What this engine resolved (precision, beam width, drafter, prior weight, fresh slots, speculation)."""
        dtype = self.target.dtype if self.target is not None else _timeline_dtype(self.parts)
        name = str(dtype).removeprefix("torch.")
        spec = self.spec
        return EngineFacts(precision={"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, name),
                           beam_width=self.beam_width, drafter_loaded=self.drafter is not None,
                           prior_weight=self.prior_weight,
                           fresh_slots=self.fresh.settings.slots if self.fresh is not None else 0,
                           speculation_per_width=dict(spec.per_width) if spec.per_width else None)

    # ---- idle work --------------------------------------------------------------------------------------------
    @property
    def prefill_ahead_enabled(self) -> bool:
        """Whether the server should run ``prefill_ahead`` after writes (``ahead`` set and a state cache on; never
        when the prior ranks alone: no target state is read)."""
        return self.ahead and self.states is not None and not self.prior_ranks

    def prefill_ahead(self, history: Sequence[int]) -> None:
        """Compute and cache the state of ``history``'s next plain request: its prompt and, with a served beam
        width B, every decode step of B beams under this server's exclusions and prior, so that request (any k
        up to B) runs no forward; without one (the width is each request's k) the prompt only. Nothing when it
        is cached already or there is no state cache. Lookups here do not count as hits or misses. An items
        bundle: the item-level target's search of B beams (``TimelineDecode.prefill``; without B its timeline
        state alone)."""
        if self.states is None or not history:
            return
        if self._timeline is not None:
            self._timeline.prefill(history, self.beam_width)
            return
        target, prompts, engine = self.target, self.prompts, self._engine()
        assert target is not None and prompts is not None
        batch = PromptBatch.from_lists([prompts.prompt_ids(history)], target.device)
        with torch.inference_mode():
            if self.beam_width > 0:
                query = RecQuery(history=list(history), k=self.beam_width, mode="plain")
                dead = self._scope.dead(self._scope.excluded([query]))
                engine.search(batch, self.beam_width, dead, self.prior_for([query.history]),
                              states=self.states, count=False)
                return
            from recsvc.engine.caches.prefill import Prefill

            pre = Prefill(target, target.new_cache(), batch, self.states, count=False)
            if not pre.full[0]:
                last = pre.run()
                pre.remember(last, pre.first_logprobs(last, prompts.code_offset, self.trie.codebook_size))

    def warm_up(self) -> float:
        """Run the kinds of forward a server meets (one request and a batch of two; a wide search and K = 1;
        plain and, with a drafter, strict), so that a compiled forward (``--forward compiled``) compiles its graphs
        here rather than in a user's request or in the speculation calibration. No user state is kept. Returns
        the seconds it took."""
        start = time.monotonic()
        cold = self.variant(states=None)  # the same models, without the user-state cache
        history = self.ids.item_ids[:3].tolist()
        modes: list[Mode] = ["plain"] + (["strict"] if self.drafter is not None else [])
        for mode in modes:
            for k in (self.beam_width or DEFAULT_BEAM_WIDTH, 1):  # width 0 (= each request's k): a wide search
                for n in (1, 2):
                    cold.recommend([RecQuery(history=history[: 3 - i], k=k, mode=mode) for i in range(n)])
        return time.monotonic() - start

    # ---- catalog -------------------------------------------------------------------------------------------
    def known_item(self, item_id: int) -> bool:
        return item_id in self.ids

    def semantic_id(self, item_id: int) -> list[str]:
        return self.ids.tokens_of(item_id)

    @property
    def has_item_keys(self) -> bool:
        """Whether the catalog has item keys (BUNDLE/item_keys.json, or keys of live additions)."""
        return self.keys is not None

    def key_of(self, item_id: int) -> str | None:
        return self.keys.key_of(item_id) if self.keys is not None else None

    def item_of_key(self, key: str) -> int | None:
        return self.keys.item_of(key) if self.keys is not None else None

    def popular_items(self, k: int, exclude: Sequence[int] = (), rules: Rules | None = None) -> list[int]:
        """The k most popular items not excluded; with ``rules``, only items the filters allow, capped (boosts do
        not apply: there is no model score to add them to)."""
        catalog = self.rule_catalog if rules is not None and (rules.has_filters or rules.caps) else None
        if catalog is None:
            ex = set(exclude)
            out = []
            for item in self.parts.popular:
                if item not in ex:
                    out.append(item)
                    if len(out) == k:
                        break
            return out
        assert rules is not None
        rows = self._popular_rows[catalog.alive_rows(rules, exclude)[self._popular_rows]]
        picked = greedy_pick(rows, catalog.cap_spec(rules), k)
        return self.ids.item_ids[rows[picked]].tolist()

    # ---- decoding -------------------------------------------------------------------------------------------
    def answer_now(self, query: RecQuery) -> Answer | None:
        """The answer of a query that needs no decoding (no history, nothing left); None: to be decoded."""
        return without_decoding(self, query)

    def answers(self, queries: Sequence[RecQuery]) -> list[Answer]:
        """The queries decoded (``recommend``), each list with why it is short (``recsvc.recommender.answer``)."""
        results = self.recommend(queries)
        return explained_all(self, queries, results)

    def recommend(self, queries: Sequence[RecQuery], ledger: Ledger = NO_LEDGER) -> list[RecResult]:
        """The batch decoded, then every list stage. ``ledger``: phase timers of plain and rule-aware decoding
        (``recsvc.engine.meters.ledger``; benches only)."""
        results = self._decode(queries, ledger)
        for stage in self.list_stages:
            results = stage(queries, results)
        return results

    def _split_cached(self, mode: str, listed: bool, idx: list[int], queries: Sequence[RecQuery]) -> list[list[int]]:
        """How ``stages.grouping.split_cached`` splits a group of this recommender's queries."""
        return split_cached(self._scope, mode, listed, idx, queries)


def _max_history(parts: BundleParts) -> int:
    """History items a request's decoding reads (the last ones): the prompt's window, or the timeline's."""
    if parts.timeline is not None:
        return parts.timeline.config.max_items
    assert parts.prompts is not None
    return parts.prompts.max_history


def _timeline_dtype(parts: BundleParts) -> torch.dtype:
    """The item-level target's parameter dtype (its precision)."""
    assert parts.timeline is not None
    return next(parts.timeline.parameters()).dtype
