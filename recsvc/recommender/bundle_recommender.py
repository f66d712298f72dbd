"""A bundle turned into a ``Recommender`` (the composition root): prompts, exclusions, plain / strict / relaxed
decoding over the engine, item ids.

Queries of one batch are grouped by (mode, k) and each group runs as one batched engine call; results come
back in the queries' order. Timers and counters are the caller's (``RecStats`` holds only counts).

A bundle with a transition prior (BUNDLE/prior, ``recsvc prior fit``) whose weight is > 0 has it fused into
every mode's decoding (``recsvc.engine.prior``): each query's prior comes from its own history, and returned
scores are then fused scores. ``exclude_history`` adds every query's history items to its exclusions.

Item attributes (BUNDLE/attributes.json, ``recsvc bundle attributes``; re-read when the file changes) let
queries carry rules (``recsvc.rules``, docs/RULES.md): allow / deny filters become dead trie nodes like
exclusions; caps and boosts are decoded by ``RuleSettings.strategy``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from recsvc.bundle.directory import DEFAULT_BEAM_WIDTH
from recsvc.bundle.prompt import PromptBuilder
from recsvc.content.dense_head import DenseRetriever
from recsvc.content.fresh import FreshItems
from recsvc.engine.beam_search import BeamSearch
from recsvc.engine.decode import Decoding, Mode, decode
from recsvc.engine.engine_model import EngineModel
from recsvc.engine.host_reads import ReadSampler, sampled_reads
from recsvc.engine.ledger import NO_LEDGER, Ledger
from recsvc.engine.ports import Drafter
from recsvc.engine.prior import prior_log_mass
from recsvc.engine.prompts import PromptBatch
from recsvc.engine.sampling import make_generators
from recsvc.engine.state_cache import UserStateCache
from recsvc.errors import UserError
from recsvc.priors.mixed import MixedPrior
from recsvc.priors.transition import TransitionPrior
from recsvc.recommender.answer import explained_all, without_decoding
from recsvc.recommender.api import Answer, EngineFacts, RecQuery, RecResult, RecStats
from recsvc.recommender.parts import PartsChoice, load_parts
from recsvc.recommender.prior_ranked import prior_ranked, ranks_alone
from recsvc.rule_decoding.decode import RuleSettings, decode_rules
from recsvc.rule_decoding.search import item_ids
from recsvc.rules.catalog import BatchRules, RuleCatalog
from recsvc.rules.greedy import greedy_pick
from recsvc.rules.source import AttributeSource
from recsvc.rules.spec import Rules
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie


@dataclass(frozen=True)
class SpecSettings:
    """Strict speculation's (N, gamma) per beam width: calibrated per width (``per_width``), else fixed."""

    draft_beams: int | None = None  # N; None = the beam width
    gamma: int = 3  # draft depths per round (3 finishes a 4-token id in one round when all are accepted)
    per_width: dict[int, tuple[int, int]] | None = None  # calibrated {beam width: (N, gamma)}; (0, 0): plain
    why_plain: dict[int, str] | None = None  # why per_width holds (0, 0) for a width (default: calibration chose)

    def _tuned(self, width: int) -> int:
        """The calibrated width that serves ``width``: the nearest at or above, else the largest."""
        assert self.per_width
        above = [w for w in sorted(self.per_width) if w >= width]
        return above[0] if above else max(self.per_width)

    def for_width(self, width: int) -> tuple[int, int]:
        """(N, gamma) at this beam width: the calibrated choice (``_tuned``), else the fixed setting."""
        if self.per_width:
            return self.per_width[self._tuned(width)]
        return (self.draft_beams or width, self.gamma)

    def plain_reason(self, width: int) -> str:
        """Why this beam width is not decoded speculatively ("" when it is)."""
        if not self.per_width or self.for_width(width)[0] > 0:
            return ""
        tuned = self._tuned(width)
        return (self.why_plain or {}).get(tuned) or f"calibration: speculation does not pay at beam width {tuned}"


def state_cache_for(target: EngineModel, budget_bytes: int, version: str = "") -> UserStateCache | None:
    """A user-state cache (``recsvc.engine.state_cache``) of ``budget_bytes`` for this target, None when off (0)
    or when its forward keeps no states (only the fast forward does: fp32 target, "fp32" attention)."""
    return UserStateCache(budget_bytes, version) if budget_bytes > 0 and target.is_fast else None


class BundleRecommender:
    def __init__(
        self,
        target: EngineModel,
        prompts: PromptBuilder,
        ids: SemanticIds,
        drafter: Drafter | None = None,
        popular: Sequence[int] | None = None,
        spec: SpecSettings | None = None,
        max_k: int = 50,
        prior: TransitionPrior | MixedPrior | None = None,
        exclude_history: bool = False,
        beam_width: int = 0,
        attributes: AttributeSource | None = None,
        rules: RuleSettings | None = None,
        fresh: FreshItems | None = None,
        trie: CatalogTrie | None = None,
        states: UserStateCache | None = None,
        prefill_ahead: bool = False,
        dense: DenseRetriever | None = None,
        read_sampler: ReadSampler | None = None,
    ) -> None:
        """``target``: ``EngineModel.build(model, attention)`` (it holds the attention mode; a LLaMA drafter's
        model is built the same way). ``beam_width`` B: plain and strict decoding search B >= k beams and return
        the first k, so the top-k of a request is a prefix of its top-k' for every k <= k' <= B (0: B = k,
        transformers' num_beams = k). ``popular``: the popularity fallback's order, every item of ``ids`` once
        (``popular_order``; None: item id order). ``states``: the user-state cache (``state_cache_for``; None: off);
        ``prefill_ahead``: compute a user's next request after a write, when the server is idle. ``read_sampler``:
        counts the host reads of every N-th decode (None: off). Nothing is set on a recommender after this:
        ``variant`` and ``recsvc.recommender.live_catalog.with_catalog`` build new ones through here."""
        if beam_width < 0:
            raise UserError(f"beam width must be >= 0 (0 = k), got {beam_width}")
        self.target, self.prompts, self.ids = target, prompts, ids
        self.beam_width = beam_width
        if prior is not None and not np.array_equal(prior.item_ids, ids.item_ids):
            raise UserError(f"the transition prior covers {len(prior.item_ids)} items that are not the catalog's "
                            f"{len(ids.item_ids)}: refit it (`recsvc prior fit`)")
        self.prior = prior  # fused when prior.settings.weight > 0
        # the prior answers every request on its own (recsvc tune mix found the fused target worse on validation)
        self.prior_ranks = ranks_alone(prior)
        self.exclude_history = exclude_history
        # once: every search reads it on the model's device (``trie``: the same ids' trie, built by the caller)
        self.trie = trie if trie is not None else CatalogTrie(ids).to(target.device)
        self.engine = BeamSearch(target, self.trie, prompts.code_offset)
        self.drafter = drafter
        self.spec = spec or SpecSettings()
        self.max_k = max_k
        self.max_history = prompts.max_history
        self.popular = list(popular) if popular is not None else ids.item_ids.tolist()  # the fallback's order
        self._popular_rows = np.array([ids.index_of(i) for i in self.popular], dtype=np.int64)  # [n]
        self.attributes = attributes  # item attributes for rules (None: requests with rules are refused)
        self.rule_settings = rules or RuleSettings()
        self.states = states  # the user-state cache (None: off)
        self.ahead = prefill_ahead  # compute a user's next request after a write, when the server is idle
        self.read_sampler = read_sampler  # counts the host reads of every N-th decode (None: off)
        self.fresh = fresh  # fresh items' tail slots (None or 0 slots: off); not applied to requests with rules
        # the target's dense head: its nearest items ranked with the beams (plain and strict requests without
        # rules; off until `recsvc tune dense` set a blend > 0)
        self.dense = dense if dense is not None and dense.active else None

    @property
    def rule_catalog(self) -> RuleCatalog | None:
        """The item attributes laid over the trie, as the attributes file is now (None: no attributes)."""
        return self.attributes.current() if self.attributes is not None else None

    @property
    def sampler(self) -> Drafter | None:
        """Relaxed mode's drafter: the drafter when it samples (``Drafter.samples``), else None."""
        return self.drafter if self.drafter is not None and self.drafter.samples else None

    @classmethod
    def from_bundle(cls, path: str | Path, dtype: str = "auto", device: str = "cpu",
                    use_drafter: bool = True, attention: str = "fp32",
                    drafter_name: str | None = None, use_prior: bool = True,
                    exclude_history: bool = False, beam_width: int | None = None,
                    attributes: str | Path | None = None, rules: RuleSettings | None = None,
                    use_fresh: bool = True, forward: str = "auto", use_dense: bool = True
                    ) -> BundleRecommender:
        """attention: "fp32" (fast on CPUs) or "exact" (bit-identical to transformers' generate); strict
        speculation reproduces plain beam search bit for bit in both. ``drafter_name``: a name of
        ``recsvc.recommender.drafter_registry``: BUNDLE/drafters/NAME (or a model directory) instead of
        BUNDLE/drafter; ``"transition"``: the training-free transition drafter over the fused prior's file;
        ``"head"`` (``"head:NAME"``): the recurrent draft head BUNDLE/head (BUNDLE/heads/NAME) on the target;
        UserError when it is missing. Default (None): BUNDLE/head when the bundle has one, else BUNDLE/drafter
        when it has one (``default_drafter``).
        ``beam_width``: see ``__init__`` (None: bundle.json "beam_width", else 0 = k).
        ``use_prior``: fuse BUNDLE/prior when present (and its weight is > 0). ``exclude_history``: never
        recommend a query's history items (and fuse BUNDLE/prior-excl, the prior tuned for that, when present).
        ``attributes``: the item attributes file for rules (None:
        BUNDLE/attributes.json when present); ``rules``: how caps and boosts are decoded. ``use_fresh``: give
        fresh items the tail slots chosen by ``recsvc tune fresh`` (BUNDLE/fresh) when present. ``forward``: the
        engine forward of the target and a LLaMA drafter ("auto", "fast", "compiled", "lean", "bucketed",
        "graphs"). ``use_dense``: rank the target's dense head's nearest items with the beams
        (``recsvc.content.dense_head``) when it has one."""
        parts = load_parts(path, PartsChoice(dtype, device, attention, forward, drafter_name, use_drafter,
                                             use_prior, exclude_history, attributes, use_fresh=use_fresh,
                                             use_dense=use_dense))
        width = beam_width if beam_width is not None else parts.beam_width
        return cls(parts.target, parts.prompts, parts.ids, parts.drafter, parts.popular, prior=parts.prior,
                   exclude_history=exclude_history, beam_width=width, attributes=parts.attributes, rules=rules,
                   fresh=parts.fresh, trie=parts.trie, dense=parts.dense)

    def variant(self, *, spec: SpecSettings | None = None, states: UserStateCache | None | bool = False,
                prefill_ahead: bool | None = None, prior: TransitionPrior | MixedPrior | None | bool = False,
                beam_width: int | None = None, rules: RuleSettings | None = None,
                count_host_reads: int | None = None) -> BundleRecommender:
        """A recommender that differs from this one in the settings given (the rest, models included, shared):
        speculation (calibration's choice), the user-state cache (``state_cache_for``; None: off), prefill-ahead,
        the fused prior (None: none), the served beam width, the rules' decoding, host-read sampling (every N-th
        decode counted; 0: off). This one is not modified.
        (``False``: unchanged, for the settings that may be None.) Built by the constructor."""
        if states is not False and not isinstance(states, UserStateCache):
            states = None
        if prior is not False and isinstance(prior, bool):
            prior = None
        return BundleRecommender(
            self.target, self.prompts, self.ids, self.drafter, self.popular,
            spec=spec if spec is not None else self.spec, max_k=self.max_k,
            prior=self.prior if prior is False else prior, exclude_history=self.exclude_history,
            beam_width=beam_width if beam_width is not None else self.beam_width, attributes=self.attributes,
            rules=rules if rules is not None else self.rule_settings, fresh=self.fresh, trie=self.trie,
            states=self.states if states is False else states,
            prefill_ahead=prefill_ahead if prefill_ahead is not None else self.ahead, dense=self.dense,
            read_sampler=(self.read_sampler if count_host_reads is None
                          else ReadSampler(count_host_reads) if count_host_reads > 0 else None))

    def served_widths(self, ks: Sequence[int]) -> list[int]:
        """The beam widths that plain and strict requests of these list lengths decode (``width_for``), ascending:
        what speculation is calibrated at. Example: B = 20, ks = (1, 5, 10, 20) -> [20]; B = 0 -> [1, 5, 10, 20]."""
        return sorted({self.width_for(k, "strict") for k in ks})

    @property
    def facts(self) -> EngineFacts:
        """What this engine resolved (precision, beam width, drafter, prior weight, fresh slots, speculation)."""
        name = str(self.target.dtype).removeprefix("torch.")
        return EngineFacts(precision={"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, name),
                           beam_width=self.beam_width, drafter_loaded=self.drafter is not None,
                           prior_weight=self.prior_weight,
                           fresh_slots=self.fresh.settings.slots if self.fresh is not None else 0,
                           speculation_per_width=dict(self.spec.per_width) if self.spec.per_width else None)

    @property
    def prefill_ahead_enabled(self) -> bool:
        """Whether the server should run ``prefill_ahead`` after writes (``ahead`` set and a state cache on; never
        when the prior ranks alone: no target state is read)."""
        return self.ahead and self.states is not None and not self.prior_ranks

    def prefill_ahead(self, history: Sequence[int]) -> None:
        """Compute and cache the state of ``history``'s next plain request: its prompt and, with a served beam
        width B, every decode step of B beams under this server's exclusions and prior, so that request (any k
        up to B) runs no forward; without one (the width is each request's k) the prompt only. Nothing when it
        is cached already or there is no state cache. Lookups here do not count as hits or misses."""
        if self.states is None or not history:
            return
        batch = PromptBatch.from_lists([self.prompts.prompt_ids(history)], self.target.device)
        with torch.inference_mode():
            if self.beam_width > 0:
                query = RecQuery(history=list(history), k=self.beam_width, mode="plain")
                excluded = self._excluded([query])
                dead = self.trie.dead_nodes(excluded) if any(excluded) else None
                self.engine.search(batch, self.beam_width, dead, self.prior_for([query.history]),
                                   states=self.states, count=False)
                return
            from recsvc.engine.prefill import Prefill

            pre = Prefill(self.target, self.target.new_cache(), batch, self.states, count=False)
            if not pre.full[0]:
                last = pre.run()
                pre.remember(last, pre.first_logprobs(last, self.prompts.code_offset, self.trie.codebook_size))

    def warm_up(self) -> float:
        """Run the kinds of forward a server meets (one request and a batch of two; a wide search and K = 1;
        plain and, with a drafter, strict), so that a compiled forward (``--forward compiled``) compiles its graphs
        here rather than in a user's request or in the speculation calibration. No user state is kept. Returns
        the seconds it took."""
        start = time.monotonic()
        cold = self.variant(states=None)  # the same models, without the user-state cache
        history = self.ids.item_ids[:3].tolist()
        modes = ["plain"] + (["strict"] if self.drafter is not None else [])
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

    def popular_items(self, k: int, exclude: Sequence[int] = (), rules: Rules | None = None) -> list[int]:
        """The k most popular items not excluded; with ``rules``, only items the filters allow, capped (boosts do
        not apply: there is no model score to add them to)."""
        catalog = self.rule_catalog if rules is not None and (rules.has_filters or rules.caps) else None
        if catalog is None:
            ex = set(exclude)
            out = []
            for item in self.popular:
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
        """``ledger``: phase timers of plain and rule-aware decoding (``recsvc.engine.ledger``; benches only)."""
        if self.prior_ranks:  # no target decoding: every mode gets the prior's ranking (prior_ranked)
            assert self.prior is not None
            return self._with_fresh(queries, prior_ranked(self.prior, queries, self._excluded(queries), self._catalog))
        results: list[RecResult | None] = [None] * len(queries)
        groups: dict[tuple[Mode, int, bool], list[int]] = {}
        plain_because: dict[int, str] = {}  # strict queries decoded plainly (they share the plain queries' batch)
        for i, q in enumerate(queries):
            mode = q.mode
            width = self.width_for(q.k, mode)
            if mode == "strict" and self.no_speculation(width):
                plain_because[i] = self.no_speculation(width)  # no drafter, or speculation does not pay here
                mode = "plain"
            listed = q.rules is not None and (q.rules.effective(q.k).list_level or (
                self.rule_settings.strategy == "postfilter" and self._filters_remove_items(q.rules)))
            groups.setdefault((mode, width, listed), []).append(i)
        for (mode, width, listed), idx in groups.items():
            for part in self._split_cached(mode, listed, idx, queries):
                batch = [queries[i] for i in part]
                with sampled_reads(self.read_sampler, self.target.device) as reads:
                    out = (self._decode_rules(batch, mode, width, ledger) if listed
                           else self._decode(batch, mode, width, ledger))
                if reads is not None:  # a sampled call: its count on each result's stats
                    out = [replace(r, stats=replace(r.stats, host_reads=reads.total)) for r in out]
                for i, res in zip(part, out, strict=True):
                    results[i] = self._explained(res, queries[i], plain_because.get(i, ""), listed)
        return self._with_fresh(queries, [r for r in results if r is not None])

    def _explained(self, res: RecResult, query: RecQuery, plain_because: str, listed: bool) -> RecResult:
        """``res`` with its decoding's fallback said: why a strict query was decoded plainly (``plain_because``),
        or that caps and boosts were decoded by the rules' list-level search."""
        decoding = res.decoding
        assert decoding is not None
        why = plain_because or decoding.fallback
        if listed and not why and query.mode == "strict" and self.rule_settings.strategy != "postfilter":
            why = f"caps and boosts are decoded by the rules' list-level search ({self.rule_settings.strategy})"
        return replace(res, decoding=replace(decoding, fallback=why)) if why != decoding.fallback else res

    def _with_fresh(self, queries: Sequence[RecQuery], results: list[RecResult]) -> list[RecResult]:
        """The tails of the lists given to fresh items (``FreshItems.merge``); requests with rules are left as
        decoded (fresh items carry no attributes to check them against); as decoded without fresh slots."""
        fresh = self.fresh
        if fresh is None or not fresh.settings.slots:
            return results
        idx = [i for i, q in enumerate(queries) if q.rules is None and q.k > 1]
        if not idx:
            return results
        excluded = self._excluded([queries[i] for i in idx])
        cands = fresh.candidates([queries[i].history for i in idx], fresh.settings.slots, excluded)
        out = list(results)
        for i, cand in zip(idx, cands, strict=True):
            res, sims = results[i], dict(cand)
            items = fresh.merge(res.item_ids, cand, queries[i].k)
            model_scores = dict(zip(res.item_ids, res.scores, strict=True))
            n_fresh = sum(1 for item in items if item in sims and item not in model_scores)
            scores = [model_scores[item] if item in model_scores else sims[item] for item in items]
            out[i] = replace(res, item_ids=items, scores=scores, fresh=n_fresh)
        return out

    def _split_cached(self, mode: str, listed: bool, idx: list[int], queries: Sequence[RecQuery]) -> list[list[int]]:
        """Plain requests whose prompt state is cached run one by one, the others share one batch: a batch that
        mixes them runs every row's decode steps, while alone a cached prompt costs only its decode steps and an
        identical repeat no forward at all. The outputs are the same either way (the fast forward's rows do not
        depend on what shares their forward)."""
        if self.states is None or mode != "plain" or listed or len(idx) == 1:
            return [idx]
        hit: list[int] = []
        rest: list[int] = []
        for i in idx:
            tokens = self.prompts.prompt_ids(queries[i].history)
            entry, n = self.states.lookup(tokens, count=False)
            (hit if entry is not None and n == len(tokens) else rest).append(i)
        return [[i] for i in hit] + ([rest] if rest else [])

    def no_speculation(self, width: int) -> str:
        """Why strict speculation does not run at this beam width ("" when it does)."""
        return "no drafter" if self.drafter is None else self.spec.plain_reason(width)

    def _filters_remove_items(self, rules: Rules) -> bool:
        """Whether the allow / deny lists rule out any catalog item (postfilter applies them after decoding)."""
        return rules.has_filters and not bool(self._catalog().alive_rows(rules, ()).all())

    def width_for(self, k: int, mode: Mode) -> int:
        """Beams searched for a request of k items: max(k, B) for plain / strict (deterministic top-k), k for
        relaxed (a sample has no ranking to keep consistent)."""
        return max(k, self.beam_width) if mode in ("plain", "strict") else k

    @property
    def prior_weight(self) -> float:
        return float(self.prior.settings.weight) if self.prior is not None else 0.0

    def prior_for(self, histories: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """[B, num_nodes] the fused prior of these histories (``prior_log_mass``), None when there is none."""
        if self.prior is None or self.prior_weight <= 0:
            return None
        states = self.states
        if states is None or len(histories) != 1:  # batches: computed together, never kept (rounding may differ)
            return prior_log_mass(self.trie, self.prior.probs(histories), self.prior_weight)  # on the trie's device
        # one history with a user-state cache on: a returning user's row is kept (the very tensor computed for
        # it alone, so cached == computed, bit for bit); keyed by the prior and trie objects themselves (a swap
        # of either, e.g. a live catalog's new trie, misses)
        key = ("prior", self.prior, self.trie, self.prior_weight, tuple(histories[0]))
        row = states.prior(key)
        if row is None:
            row = prior_log_mass(self.trie, self.prior.probs(histories), self.prior_weight)[0]
            states.keep_prior(key, row)
        return row[None]

    def _excluded(self, queries: Sequence[RecQuery]) -> list[list[int]]:
        return [list(q.exclude) + (list(q.history) if self.excludes_history(q) else []) for q in queries]

    def excludes_history(self, query: RecQuery) -> bool:
        """Whether ``query``'s history items are left out: the query's own choice, else the recommender's."""
        return self.exclude_history if query.exclude_history is None else query.exclude_history

    def _catalog(self) -> RuleCatalog:
        catalog = self.rule_catalog  # read once per batch: a refresh swaps it between batches
        if catalog is None:
            raise UserError("rules need item attributes: this server has none (`recsvc bundle attributes`)")
        return catalog

    @staticmethod
    def _compiled(catalog: RuleCatalog, queries: Sequence[RecQuery], excluded: list[list[int]]) -> BatchRules:
        return catalog.compile([(q.rules or Rules()).effective(q.k) for q in queries], excluded)

    def _decode(self, queries: list[RecQuery], mode: Mode, width: int, ledger: Ledger = NO_LEDGER
                ) -> list[RecResult]:
        """Queries of one mode and beam width, decoded by the engine's one entry (``recsvc.engine.decode``)."""
        batch = PromptBatch.from_lists([self.prompts.prompt_ids(q.history) for q in queries], self.target.device)
        excluded = self._excluded(queries)
        if any(q.rules is not None and q.rules.has_filters for q in queries):  # filters: dead nodes, as exclusions
            compiled = self._compiled(self._catalog(), queries, excluded)
            dead, excluded = compiled.dead, compiled.excluded
        else:
            dead = self.trie.dead_nodes(excluded) if any(excluded) else None
        histories = [q.history for q in queries]
        sampling = mode == "relaxed"
        # the dense head's nearest items ranked with every beam of the width (plain and strict, no rules)
        merging = self.dense is not None and mode in ("plain", "strict") and not any(q.rules for q in queries)
        out = decode(self.engine, self.drafter, batch, histories, mode, width, self.spec.for_width(width),
                     why_plain=self.spec.plain_reason(width), dead=dead, prior=self.prior_for(histories),
                     temperatures=(torch.tensor([float(q.temperature) for q in queries], device=self.target.device)
                                   if sampling else None),
                     generators=make_generators([q.seed for q in queries]) if sampling else None,
                     top=None if merging else max(q.k for q in queries),  # the first k of the width are read
                     ledger=ledger, states=self.states)
        if merging:
            return [replace(r, decoding=out.decoding)
                    for r in self._merged(queries, out.leaves, out.scores, excluded, out.target_calls,
                                          out.draft_calls, out.accepted, out.prompt_hidden)]
        return [  # the first k of the width's beams, best first
            replace(self._result(out.leaves[r][: q.k], out.scores[r][: q.k], excluded[r],
                                 RecStats(target_calls=out.target_calls[r], draft_calls=out.draft_calls,
                                          accepted_steps=out.accepted[r], rounds=out.target_calls[r])),
                    decoding=out.decoding)
            for r, q in enumerate(queries)
        ]

    def _merged(self, queries: list[RecQuery], leaves: torch.Tensor, scores: torch.Tensor, excluded: list[list[int]],
                calls: list[int], draft_calls: int, accepted: list[int], prompt_hidden: torch.Tensor | None
                ) -> list[RecResult]:
        """Every beam of the width and the dense head's nearest items, ranked by one score
        (``DenseRetriever.merge``). The head's query reads the prompts' final hidden states [B, H] that the
        decoding's prefill computed (``prompt_hidden``: plain and strict always return them)."""
        assert self.dense is not None and prompt_hidden is not None
        sims = self.dense.similarities(prompt_hidden)  # [B, n]
        out = []
        for r, q in enumerate(queries):
            ok = leaves[r] >= 0
            items = self.trie.leaf_items(leaves[r][ok], excluded[r])
            merged, merged_scores = self.dense.merge(items, scores[r][ok].tolist(), sims[r], self.ids, q.k,
                                                     excluded[r])
            out.append(RecResult(item_ids=merged, scores=merged_scores,
                                 stats=RecStats(target_calls=calls[r], draft_calls=draft_calls,
                                                accepted_steps=accepted[r], rounds=calls[r])))
        return out

    def _decode_rules(self, queries: list[RecQuery], mode: Mode, width: int, ledger: Ledger = NO_LEDGER
                      ) -> list[RecResult]:
        """Queries of one k with caps or boosts (``recsvc.rule_decoding.decode``); k = the queries' own (one group per
        beam width, and a width is one k or the server's beam width)."""
        if mode == "relaxed":
            raise NotImplementedError("caps and boosts in relaxed (sampling) mode")
        k = max(q.k for q in queries)
        batch = PromptBatch.from_lists([self.prompts.prompt_ids(q.history) for q in queries], self.target.device)
        catalog = self._catalog()
        excluded = self._excluded(queries)
        with ledger.phase("compile"):
            compiled = self._compiled(catalog, queries, excluded)
        histories = [q.history for q in queries]
        prior = self.prior_for(histories)
        decoded = [Decoding("plain", width)]  # caps and boosts: the rules' list-level search, plain

        def wide(w: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
            """postfilter: the mode's own decoding of w beams, exclusions as dead nodes, filters applied after"""
            w = max(w, width)
            dead = self.trie.dead_nodes(excluded) if any(excluded) else None
            out = decode(self.engine, self.drafter, batch, histories, mode, w, self.spec.for_width(w),
                         why_plain=self.spec.plain_reason(w), dead=dead, prior=prior, ledger=ledger)
            decoded[0] = out.decoding
            return out.leaves, out.scores, out.target_calls

        head = self.drafter.draft_head if self.drafter is not None else None  # cdsl's look-ahead
        out = decode_rules(self.rule_settings, self.target, catalog, self.prompts.code_offset, batch, k, width,
                           compiled, prior, head, wide, ledger)
        results = []
        for r, (q, items) in enumerate(zip(queries, item_ids(catalog, out.rows), strict=True)):
            scores = out.scores[r][: len(items)][: q.k].tolist()
            stats = RecStats(target_calls=out.target_calls[r], draft_calls=0, accepted_steps=0,
                             rounds=out.target_calls[r])
            results.append(RecResult(item_ids=items[: q.k], scores=scores, stats=stats, decoding=decoded[0]))
        return results

    def _result(self, leaves: torch.Tensor, scores: torch.Tensor, excluded: list[int], stats: RecStats) -> RecResult:
        ok = leaves >= 0
        items = self.trie.leaf_items(leaves[ok], excluded)
        return RecResult(item_ids=items, scores=scores[ok].tolist(), stats=stats)
