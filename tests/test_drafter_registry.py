"""Drafters by name (recsvc/recommender/drafter_registry.py) on a real tiny bundle: the default a bundle serves,
every kind built over the given trie with the port's capabilities, ``over`` another trie sharing the network,
and a clear UserError for what a kind needs and does not have. Strict decoding with each registry drafter
returns plain beam search's items."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_drafter_fixtures import tiny_bundle
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

from recsvc.bundle.directory import Bundle
from recsvc.data.split import load_split_dir
from recsvc.drafters.head_model import DraftHead, HeadConfig, save_head
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.errors import UserError
from recsvc.priors.transition import PriorSettings, TransitionPrior
from recsvc.recommender.api import RecQuery
from recsvc.recommender.bundle_recommender import BundleRecommender
from recsvc.recommender.drafter_registry import DraftSource, build_drafter, default_drafter
from tokenizer_rqvae.trie import CatalogTrie

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Bundle:
    """tiny_bundle (target, BUNDLE/drafter) + BUNDLE/prior + an untrained head under BUNDLE/heads/alt."""
    b = Bundle.open(tiny_bundle(tmp_path_factory.mktemp("registry")))
    data, ids = load_split_dir(b.resolve_data_dir()), b.load_ids()
    TransitionPrior.fit(data.train.values(), ids.item_ids.tolist(), PriorSettings(weight=0.5)).save(b.prior_dir)
    hidden = b.load_target(dtype="fp32").config.hidden_size
    head = DraftHead(HeadConfig(hidden=hidden, levels=ids.levels, codebook=ids.codebook_size))
    save_head(head, b.head_path("alt"))
    return b


@pytest.fixture(scope="module")
def source(bundle) -> DraftSource:
    ids = bundle.load_ids()
    prompts = bundle.prompt_builder(ids=ids)
    data = load_split_dir(bundle.resolve_data_dir())
    return DraftSource(bundle, EngineModel.build(bundle.load_target(dtype="fp32")), CatalogTrie(ids),
                       prompts.code_offset, "fp32", prior=TransitionPrior.load(bundle.prior_dir),
                       sequences=lambda: data.train.values(), oracle_width=3)


def test_the_default_is_the_head_else_the_llama_drafter_else_none(bundle, tmp_path: Path) -> None:
    assert default_drafter(bundle) == "llama"  # BUNDLE/drafter, no BUNDLE/head
    empty = Bundle.create(tmp_path / "empty")
    assert default_drafter(empty) is None
    save_head(DraftHead(HeadConfig(hidden=8, levels=4, codebook=4)), empty.head_path())
    assert default_drafter(empty) == "head"


@pytest.mark.parametrize("name, kind, samples, own_model, head", [
    ("llama", "llama", True, True, False),
    ("drafter", "llama", True, True, False),  # a name Bundle.drafter_path resolves: BUNDLE/drafter
    ("head:alt", "head", True, False, True),
    ("transition", "transition", False, False, False),
    ("retrieval", "retrieval", False, False, False),
    ("oracle", "oracle", False, False, False),
])
def test_each_name_builds_its_drafter_over_the_trie(source, name, kind, samples, own_model, head) -> None:
    drafter = build_drafter(name, source)
    assert (drafter.name, drafter.samples) == (kind, samples)
    assert (drafter.model is not None, drafter.draft_head is not None) == (own_model, head)
    other = CatalogTrie(source.trie.ids)
    moved = drafter.over(other)
    assert moved.name == kind and moved is not drafter
    assert moved.model is drafter.model and moved.draft_head is drafter.draft_head  # the network is shared
    if kind != "oracle":  # the oracle's trie is its beam search's
        assert drafter.trie is source.trie and moved.trie is other


def test_the_head_is_opened_by_the_transition_drafter_when_there_is_a_prior(source) -> None:
    from dataclasses import replace

    assert build_drafter("head:alt", source).opener.name == "transition"
    assert build_drafter("head:alt", replace(source, head_opener="none")).opener is None
    assert build_drafter("head:alt", replace(source, prior=None)).opener is None
    with pytest.raises(UserError, match="transition opener needs a transition prior"):
        build_drafter("head:alt", replace(source, prior=None, head_opener="transition"))


def test_what_a_kind_needs_and_lacks_is_a_user_error(source) -> None:
    from dataclasses import replace

    cases = [("transition", replace(source, prior=None), "needs a transition prior"),
             ("retrieval", replace(source, sequences=None), "training sequences"),
             ("oracle", replace(source, oracle_width=None), "only benchmarks"),
             ("head", source, "no draft head"),  # BUNDLE/head was never trained
             ("missing", source, "no drafter 'missing'"),
             ("llama:missing", source, "no drafter 'missing' \\(no config.json in .*drafters/missing or missing\\)")]
    for name, src, message in cases:
        with pytest.raises(UserError, match=message):
            build_drafter(name, src)


def test_strict_with_each_served_drafter_returns_the_plain_items(bundle) -> None:
    data = load_split_dir(bundle.resolve_data_dir())
    queries = [RecQuery(history=u.history[-6:], k=4, mode="strict") for u in data.eval_users("valid")[:3]]
    plain = BundleRecommender.from_bundle(bundle.root, dtype="fp32", use_drafter=False).recommend(
        [RecQuery(history=q.history, k=4) for q in queries])
    for name in ("llama", "transition", "head:alt"):
        rec = BundleRecommender.from_bundle(bundle.root, dtype="fp32", drafter_name=name)
        assert rec.drafter is not None and rec.drafter.trie is rec.trie  # one trie for both
        assert [r.item_ids for r in rec.recommend(queries)] == [r.item_ids for r in plain]
