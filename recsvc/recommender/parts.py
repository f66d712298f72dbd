"""A bundle's parts, loaded once by one typed loader: the service (``BundleRecommender.from_bundle``), the
benches (``bench.common.load_context``, ``bench.gpu_inputs.load``) and training (``training.drafters.api.load_setup``)
all read a bundle through :func:`load_target` (the target and its catalog) or :func:`load_parts` (everything).

``TargetParts`` is what every reader needs (the ids, the prompt format, the trie on the target's device and the
target as an ``EngineModel``); ``BundleParts`` adds what serving composes around it (the fused prior, the
popularity order, fresh items, the dense head, the attribute source for rules, the drafter and the item keys).
What is loaded is said by a ``PartsChoice``; a part left out, or absent from the bundle, is None.

A bundle's target is of its ``architecture`` (``Bundle.architecture``): "tokens", a LLaMA over code tokens
(``target`` and ``prompts``), or "items", the item-level target (``timeline``: ``recsvc.timeline``, one input per
history item; ``target`` and ``prompts`` are None, and it has no drafter and no dense head).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recsvc.bundle.directory import Bundle
from recsvc.bundle.keys import ItemKeys, read_item_keys
from recsvc.bundle.loading import torch_dtype
from recsvc.bundle.prompt import PromptBuilder
from recsvc.bundle.serving_files import read_popularity
from recsvc.content.dense_head import DenseRetriever, has_dense_head
from recsvc.content.fresh import FreshItems
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.speculation.ports import Drafter
from recsvc.errors import UserError
from recsvc.priors.mixed import MixedPrior, load_prior
from recsvc.priors.transition import TransitionPrior
from recsvc.recommender.drafter_registry import DraftSource, build_drafter, default_drafter
from recsvc.rules.source import AttributeSource
from recsvc.timeline.model import TimelineModel
from recsvc.timeline.serving import load_timeline
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie

Prior = TransitionPrior | MixedPrior


@dataclass(frozen=True)
class PartsChoice:
    """Which of a bundle's parts to load, and how.

    ``attention``: "fp32" (fast on CPUs) or "exact" (bit-identical to transformers' generate); ``forward``: the
    engine forward of the target and a LLaMA drafter (a ``--forward`` value, ``recsvc.engine.kernels.plan.FORWARDS``,
    resolved into each model's ``ForwardPlan``; UserError for a contradiction). ``drafter``: a name of
    ``recsvc.recommender.drafter_registry`` (None: ``default_drafter``); ``use_drafter`` False: none.
    ``use_prior``: fuse BUNDLE/prior (BUNDLE/prior-excl with ``exclude_history``) when present. ``attributes``:
    the item attributes file for rules (None: BUNDLE/attributes.json when present; ``use_rules`` False: none).
    ``use_fresh`` / ``use_dense``: the fresh items' tail slots and the dense head, when the bundle has them."""

    dtype: str = "auto"
    device: str = "cpu"
    attention: str = "fp32"
    forward: str = "auto"
    drafter: str | None = None
    use_drafter: bool = True
    use_prior: bool = True
    exclude_history: bool = False
    attributes: str | Path | None = None
    use_rules: bool = True
    use_fresh: bool = True
    use_dense: bool = True

    @classmethod
    def target_only(cls, dtype: str = "auto", device: str = "cpu", attention: str = "fp32",
                    forward: str = "auto") -> PartsChoice:
        """The target and its catalog alone (the benches' and training's measurements)."""
        return cls(dtype, device, attention, forward, use_drafter=False, use_prior=False, use_rules=False,
                   use_fresh=False, use_dense=False)


@dataclass(frozen=True)
class TargetParts:
    """The target and its catalog: what every reader of a bundle needs. Exactly one of ``target`` (a "tokens"
    bundle) and ``timeline`` (an "items" bundle) is set."""

    bundle: Bundle
    ids: SemanticIds
    prompts: PromptBuilder | None  # None: an items bundle (no tokenizer, no prompts)
    trie: CatalogTrie  # the ids' trie, on the target's device: one for the searches, the drafter and the rules
    target: EngineModel | None  # holds the attention mode and the forward; None: an items bundle
    timeline: TimelineModel | None = None  # the item-level target (an items bundle)


@dataclass(frozen=True)
class BundleParts:
    """Everything a served recommender is composed of (the target's parts as in ``TargetParts``, and what serving
    composes around it); shared, never copied, by its variants."""

    bundle: Bundle
    ids: SemanticIds
    prompts: PromptBuilder | None  # None: an items bundle
    trie: CatalogTrie
    target: EngineModel | None  # None: an items bundle (``timeline`` is its target)
    popular: tuple[int, ...]  # the popularity fallback's order: every item of ``ids`` once
    beam_width: int  # bundle.json's served beam width (0: each request's k)
    prior: Prior | None = None  # the fused prior (ranks alone or fused when its weight is > 0)
    drafter: Drafter | None = None
    fresh: FreshItems | None = None  # fresh items' tail slots
    dense: DenseRetriever | None = None  # the target's dense head, ranked with the beams when active
    attributes: AttributeSource | None = None  # item attributes for rules (None: requests with rules refused)
    timeline: TimelineModel | None = None  # the item-level target (an items bundle; ``target`` is then None)
    # the ids the timeline's per-item table rows follow: the bundle's own (a live catalog's parts keep them while
    # ``ids`` gains the added items; ``recsvc.timeline.search.user_states``' ``table``)
    timeline_ids: SemanticIds | None = None
    keys: ItemKeys | None = None  # item number <-> the team's key (BUNDLE/item_keys.json; None: the bundle has none)

    def __post_init__(self) -> None:
        prior, ids = self.prior, self.ids
        if prior is not None and not np.array_equal(prior.item_ids, ids.item_ids):
            raise UserError(f"the transition prior covers {len(prior.item_ids)} items that are not the catalog's "
                            f"{len(ids.item_ids)}: refit it (`recsvc prior fit`)")


def popular_order(ids: SemanticIds, counts: dict[int, int] | None) -> list[int]:
    """The popularity fallback's order: the most interacted-with items first, ties (and items never seen) by
    item id."""
    items = ids.item_ids  # [n] ascending
    counts = counts or {}
    seen = np.fromiter((counts.get(i, 0) for i in items.tolist()), dtype=np.int64, count=len(items))  # [n]
    return items[np.lexsort((items, -seen))].tolist()  # one C sort (a swap's loader holds the GIL less)


def load_target(path: str | Path | Bundle, choice: PartsChoice) -> TargetParts:
    """The bundle's ids, prompt format, trie and target (``choice``: dtype, device, attention, forward); for an
    items bundle the ids, the trie and the timeline (``choice``: dtype and device; it runs its own forward)."""
    bundle = path if isinstance(path, Bundle) else Bundle.open(path)
    ids = bundle.load_ids()
    if bundle.architecture == "items":
        timeline = load_timeline(bundle.target_dir, torch_dtype(choice.dtype, choice.device), choice.device)
        return TargetParts(bundle, ids, None, CatalogTrie(ids).to(choice.device), None, timeline)
    prompts = bundle.prompt_builder(bundle.load_tokenizer(), ids)
    target = EngineModel.build(bundle.load_target(dtype=choice.dtype, device=choice.device), choice.attention,
                               choice.forward)
    return TargetParts(bundle, ids, prompts, CatalogTrie(ids).to(target.device), target)


def load_parts(path: str | Path | Bundle, choice: PartsChoice) -> BundleParts:
    """Every part ``choice`` asks for that the bundle holds (see ``PartsChoice``)."""
    core = load_target(path, choice)
    bundle, ids = core.bundle, core.ids
    items = core.timeline is not None
    stored: Prior | None = (load_prior(bundle.prior_dir_for(choice.exclude_history))  # read once
                            if bundle.has_prior(choice.exclude_history) else None)
    attr_path = Path(choice.attributes) if choice.attributes is not None else bundle.root / "attributes.json"
    source = (AttributeSource(attr_path, core.trie)
              if choice.use_rules and (choice.attributes is not None or attr_path.is_file()) else None)
    return BundleParts(
        bundle, ids, core.prompts, core.trie, core.target,
        popular=tuple(popular_order(ids, read_popularity(bundle.root))),
        beam_width=int(bundle.read().get("beam_width", 0)),
        prior=stored if choice.use_prior else None,
        drafter=_drafter(core, choice, stored),
        fresh=FreshItems.load(bundle.fresh_dir) if choice.use_fresh and bundle.has_fresh() else None,
        dense=_dense(bundle, ids) if choice.use_dense and not items else None,  # the timeline has no dense head
        attributes=source, timeline=core.timeline, timeline_ids=ids if items else None,
        keys=read_item_keys(bundle.root))


def _dense(bundle: Bundle, ids: SemanticIds) -> DenseRetriever | None:
    """The target's dense head when it has one and `recsvc tune dense` set a blend > 0 (else None: off)."""
    if not has_dense_head(bundle.target_dir):
        return None
    dense = DenseRetriever.load(bundle.target_dir, ids)
    return dense if dense.active else None


def _drafter(core: TargetParts, choice: PartsChoice, prior: Prior | None) -> Drafter | None:
    """The drafter by name over the target's trie (a LLaMA drafter runs the target's forward); an items bundle
    has none (UserError when one is named)."""
    if core.target is None or core.prompts is None:
        if choice.use_drafter and choice.drafter is not None:
            raise UserError(f"--drafter {choice.drafter}: {core.bundle.root} holds an item-level target "
                            "(bundle.json architecture \"items\"), which has no drafter: strict and relaxed "
                            "requests are decoded plainly (serve it without --drafter)")
        return None
    name = (choice.drafter or default_drafter(core.bundle)) if choice.use_drafter else None
    if name is None:
        return None
    drafter = build_drafter(name, DraftSource(core.bundle, core.target, core.trie, core.prompts.code_offset,
                                              choice.dtype, choice.device, prior=prior))
    if drafter.model is not None:
        drafter.model.set_forward(choice.forward)
    return drafter
